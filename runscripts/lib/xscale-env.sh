# shellcheck shell=bash
# xscale's per-rank environment, shared by run.sh and run-profile.sh (sourced, never executed).
#
# Everything here runs once per rank before the trainer starts, on thousands of ranks at once, so
# it uses bash builtins only: no subshells, no external commands on the common path. A forked
# process costs about a millisecond; Python costs tens.
#
# Contract (docs/ARCHITECTURE.md, "runscripts/"): export RANK, WORLD_SIZE, LOCAL_RANK,
# LOCAL_WORLD_SIZE, NODE_RANK, NNODES, MASTER_ADDR, MASTER_PORT for whichever launcher started us;
# every default can be overridden by setting the variable first; every value read from the
# environment is checked, and a bad one is one line on stderr and exit 2, before anything runs.

XS_LIB_DIR=${BASH_SOURCE[0]%/*}
# shellcheck source=runscripts/lib/hostlist.sh
source "$XS_LIB_DIR/hostlist.sh"

XS_PROG=${XS_PROG:-run.sh}
XS_EXPORTED=()   # every name we export, for --print-env
XS_LAUNCHER=none
XS_SITE=generic
XS_GPU_VENDOR=none
XS_PROFILER_DEFAULT='py-spy record -o {dir}/rank{rank}.svg --'

# Errors are one line whatever the bad value holds: newlines and carriage returns in it are shown
# as \n and \r.
xs_die() {
  local message=$*
  message=${message//$'\n'/\\n}
  message=${message//$'\r'/\\r}
  printf '%s: error: %s\n' "$XS_PROG" "$message" >&2
  exit 2
}

xs_warn() {
  printf '%s: warning: %s\n' "$XS_PROG" "$*" >&2
}

# xs_default NAME VALUE: export NAME=VALUE unless the user already set NAME (the user wins).
xs_default() {
  [[ -v $1 ]] || export "$1=$2"
  XS_EXPORTED+=("$1")
}

# ---------------------------------------------------------------------------------------------
# Launchers, as data. One row per launcher, in priority order; a launcher applies when every
# variable of its "detect" column is set. The other columns name the variable holding each value
# ("A,B": the first of A, B that is set; "-": derived below). Slurm needs SLURM_STEP_ID because
# a batch script's own shell also has SLURM_PROCID=0 and must not pass for rank 0 of a step.
# ---------------------------------------------------------------------------------------------
#  launcher  detect                      rank                  local_rank                      world_size                  local_world_size                 node_rank     nnodes
XS_LAUNCHERS=(
  "torchrun  RANK,WORLD_SIZE             RANK                  LOCAL_RANK                      WORLD_SIZE                  LOCAL_WORLD_SIZE                 GROUP_RANK    NNODES"
  "slurm     SLURM_PROCID,SLURM_STEP_ID  SLURM_PROCID          SLURM_LOCALID                   SLURM_NTASKS,SLURM_NPROCS   -                                SLURM_NODEID  SLURM_STEP_NUM_NODES,SLURM_NNODES"
  "pbs       PALS_RANKID                 PALS_RANKID           PALS_LOCAL_RANKID               PMI_SIZE                    PALS_LOCAL_SIZE,PMI_LOCAL_SIZE   PALS_NODEID   -"
  "openmpi   OMPI_COMM_WORLD_RANK        OMPI_COMM_WORLD_RANK  OMPI_COMM_WORLD_LOCAL_RANK      OMPI_COMM_WORLD_SIZE        OMPI_COMM_WORLD_LOCAL_SIZE       -             -"
  "pmi       PMI_RANK                    PMI_RANK              MPI_LOCALRANKID,PMI_LOCAL_RANK  PMI_SIZE                    MPI_LOCALNRANKS,PMI_LOCAL_SIZE   -             -"
)

# xs_split_commas STRING: XS_ITEMS=the comma-separated fields of STRING. Parameter expansion
# only: a here-string costs a temporary file or pipe per call, which adds up on every rank.
xs_split_commas() {
  local rest=$1
  XS_ITEMS=()
  while [[ $rest == *,* ]]; do
    XS_ITEMS+=("${rest%%,*}")
    rest=${rest#*,}
  done
  XS_ITEMS+=("$rest")
}

# xs_first_set OUT "A,B,...": OUT=value of the first of the listed variables that is set (and
# XS_SOURCE_VAR=its name, for error messages). Returns 1 when none is, or the list is "-".
xs_first_set() {
  local name
  printf -v "$1" '%s' ""
  [[ $2 == - ]] && return 1
  xs_split_commas "$2"
  for name in "${XS_ITEMS[@]}"; do
    if [[ -n ${!name:-} ]]; then
      printf -v "$1" '%s' "${!name}"
      XS_SOURCE_VAR=$name
      return 0
    fi
  done
  return 1
}

# True when every variable in the comma-separated list is set and non-empty.
xs_all_set() {
  local name
  xs_split_commas "$1"
  for name in "${XS_ITEMS[@]}"; do
    [[ -n ${!name:-} ]] || return 1
  done
}

# Fill XS_RANK ... XS_NNODES from the first launcher row that applies ("" where the row has no
# variable; xs_derive_layout completes those).
xs_detect_launcher() {
  local row name detect rank local_rank world local_world node nnodes
  XS_RANK=0 XS_LOCAL_RANK=0 XS_WORLD_SIZE=1 XS_LOCAL_WORLD_SIZE=1 XS_NODE_RANK=0 XS_NNODES=1
  XS_LAUNCHER=none
  for row in "${XS_LAUNCHERS[@]}"; do
    # Our own table: split on blanks, no glob characters in it.
    # shellcheck disable=SC2086
    set -- $row
    name=$1 detect=$2 rank=$3 local_rank=$4 world=$5 local_world=$6 node=$7 nnodes=$8
    xs_all_set "$detect" || continue
    XS_LAUNCHER=$name
    xs_read_number XS_RANK "$rank"
    xs_read_number XS_LOCAL_RANK "$local_rank"
    xs_read_number XS_WORLD_SIZE "$world"
    xs_read_number XS_LOCAL_WORLD_SIZE "$local_world"
    xs_read_number XS_NODE_RANK "$node"
    xs_read_number XS_NNODES "$nnodes"
    return 0
  done
}

# xs_read_number OUT VARLIST: OUT=the value, checked to be a whole number, or "" if none is set.
xs_read_number() {
  local value
  if xs_first_set value "$2"; then
    [[ $value =~ ^[0-9]+$ ]] \
      || xs_die "$XS_SOURCE_VAR='$value' is not a whole number (launcher: $XS_LAUNCHER)"
    # Nine digits keep the arithmetic below exact; no launcher numbers a billion ranks.
    ((${#value} <= 9)) || xs_die "$XS_SOURCE_VAR='$value' is out of range (launcher: $XS_LAUNCHER)"
    printf -v "$1" '%d' "$((10#$value))"
  else
    printf -v "$1" '%s' ""
  fi
}

# Slurm gives tasks per node in compressed form, e.g. "8(x2),4": 8 on each of the first two
# nodes, 4 on the third. Return the count for node index $2. Every number is read as decimal
# (10#): bash would take "08" for a bad octal number.
xs_tasks_on_node() {
  local node=$2 group count repeat
  xs_split_commas "$3"
  for group in "${XS_ITEMS[@]}"; do
    if [[ $group =~ ^([0-9]{1,9})\(x([0-9]{1,9})\)$ ]]; then
      count=$((10#${BASH_REMATCH[1]})) repeat=$((10#${BASH_REMATCH[2]}))
    elif [[ $group =~ ^[0-9]{1,9}$ ]]; then
      count=$((10#$group)) repeat=1
    else
      xs_die "cannot read tasks per node '$3'"
    fi
    if (( node < repeat )); then
      printf -v "$1" '%d' "$count"
      return 0
    fi
    node=$((node - repeat))
  done
  xs_die "node $2 is not in tasks per node '$3'"
}

# Complete what the launcher does not say, then check the numbers agree with each other.
xs_derive_layout() {
  local tasks_per_node
  if [[ -z $XS_LOCAL_WORLD_SIZE && $XS_LAUNCHER == slurm ]] \
      && xs_first_set tasks_per_node SLURM_STEP_TASKS_PER_NODE,SLURM_TASKS_PER_NODE; then
    xs_tasks_on_node XS_LOCAL_WORLD_SIZE "${XS_NODE_RANK:-0}" "$tasks_per_node"
  fi
  : "${XS_LOCAL_RANK:=$XS_RANK}" "${XS_LOCAL_WORLD_SIZE:=$XS_WORLD_SIZE}"
  (( XS_LOCAL_WORLD_SIZE > 0 )) || xs_die "local world size is 0 (launcher: $XS_LAUNCHER)"
  # MPI launchers do not number nodes; with the usual block placement, rank / ranks-per-node does.
  : "${XS_NODE_RANK:=$((XS_RANK / XS_LOCAL_WORLD_SIZE))}"
  if [[ -z $XS_NNODES && $XS_LAUNCHER == pbs && -r ${PBS_NODEFILE:-} ]]; then
    xs_count_pbs_nodes XS_NNODES
  fi
  : "${XS_NNODES:=$(((XS_WORLD_SIZE + XS_LOCAL_WORLD_SIZE - 1) / XS_LOCAL_WORLD_SIZE))}"
  (( XS_RANK < XS_WORLD_SIZE )) \
    || xs_die "rank $XS_RANK is not below world size $XS_WORLD_SIZE (launcher: $XS_LAUNCHER)"
  (( XS_LOCAL_RANK < XS_LOCAL_WORLD_SIZE )) \
    || xs_die "local rank $XS_LOCAL_RANK is not below local world size $XS_LOCAL_WORLD_SIZE (launcher: $XS_LAUNCHER)"
}

xs_count_pbs_nodes() {
  local line
  local -A seen=()
  while IFS= read -r line; do
    [[ -n $line ]] && seen[$line]=1
  done <"$PBS_NODEFILE"
  printf -v "$1" '%d' "${#seen[@]}"
}

xs_export_layout() {
  # A launcher's own values are exported as they are (torchrun's included); defaults fill gaps.
  xs_default RANK "$XS_RANK"
  xs_default WORLD_SIZE "$XS_WORLD_SIZE"
  xs_default LOCAL_RANK "$XS_LOCAL_RANK"
  xs_default LOCAL_WORLD_SIZE "$XS_LOCAL_WORLD_SIZE"
  xs_default NODE_RANK "$XS_NODE_RANK"
  xs_default NNODES "$XS_NNODES"
}

# ---------------------------------------------------------------------------------------------
# Rendezvous: MASTER_ADDR and MASTER_PORT
# ---------------------------------------------------------------------------------------------

# MASTER_ADDR is best set by the job script, outside the container; without it, the first host of
# the Slurm node list (parsed here: there are no Slurm tools inside the container) or of PBS's
# node file. A value the user set is checked, not trusted: an empty one (a failed
# `$(scontrol ...)` in the job script) or one with blanks would only fail later, inside torch.
xs_master_addr() {
  if [[ -v MASTER_ADDR ]]; then
    [[ -n $MASTER_ADDR ]] || xs_die "MASTER_ADDR is set but empty; export the first node's name, or unset it"
    [[ $MASTER_ADDR != *[[:space:]]* ]] \
      || xs_die "MASTER_ADDR='$MASTER_ADDR' contains blanks; it must be one host name or address"
    xs_default MASTER_ADDR "$MASTER_ADDR"
    return
  fi
  local list first
  if xs_first_set list SLURM_STEP_NODELIST,SLURM_JOB_NODELIST,SLURM_NODELIST; then
    xs_hostlist_first "$list" || xs_die "$XS_SOURCE_VAR: $XS_HOSTLIST_ERROR"
    first=$XS_FIRST_HOST
  elif [[ -n ${PBS_NODEFILE:-} ]]; then
    [[ -r $PBS_NODEFILE ]] || xs_die "PBS_NODEFILE '$PBS_NODEFILE' is not readable"
    read -r first <"$PBS_NODEFILE" || true
    [[ -n $first ]] || xs_die "PBS_NODEFILE '$PBS_NODEFILE' is empty"
  elif (( XS_WORLD_SIZE == 1 )); then
    first=127.0.0.1
  else
    xs_die "MASTER_ADDR is not set and launcher '$XS_LAUNCHER' does not say which node is first; export MASTER_ADDR in the job script"
  fi
  xs_default MASTER_ADDR "$first"
}

# Launcher variables that name the job (or the MPI application) and are the same on every rank,
# for MPI launches outside a scheduler: PMIx's namespace (Open MPI 5, and any PMIx launcher),
# Open MPI 4's job id, Cray PALS's application id.
XS_JOB_NAME_VARS=PMIX_NAMESPACE,OMPI_MCA_ess_base_jobid,OMPI_MCA_orte_ess_jobid,PALS_APID

# xs_string_hash OUT STRING: OUT=32-bit FNV-1a hash of STRING's characters, in bash arithmetic
# (no process); the same string gives the same number on every rank.
xs_string_hash() {
  local text=$2 code i hash=2166136261
  for ((i = 0; i < ${#text}; i++)); do
    printf -v code '%d' "'${text:i:1}"
    hash=$(( ((hash ^ code) * 16777619) & 0xffffffff ))
  done
  printf -v "$1" '%d' "$hash"
}

# MASTER_PORT = 10000 + (16 * job id + step id mod 16) mod 22768, the same on every rank of a
# step. Consecutive job ids (the usual neighbours on a shared node) and up to 16 concurrent steps
# of one job get distinct ports; the range 10000-32767 stays below Linux's ephemeral ports
# (32768+), so an outgoing connection cannot already hold it. A fixed 29500 makes every second job
# on a node fail with "address already in use". Without a scheduler job id, a hash of the MPI
# launcher's job name stands in for it.
xs_master_port() {
  if [[ -v MASTER_PORT ]]; then
    # Five digits at most before the arithmetic, so that a long number cannot wrap into range.
    if [[ ! $MASTER_PORT =~ ^[0-9]{1,5}$ ]] || (( 10#$MASTER_PORT < 1 || 10#$MASTER_PORT > 65535 )); then
      xs_die "MASTER_PORT='$MASTER_PORT' is not a port number (a whole number from 1 to 65535)"
    fi
    xs_default MASTER_PORT "$MASTER_PORT"
    return
  fi
  local job="" step=0 launch_name
  if [[ -n ${SLURM_JOB_ID:-} ]]; then
    job=$SLURM_JOB_ID step=${SLURM_STEP_ID:-0}
  elif [[ ${PBS_JOBID:-} =~ ^([0-9]+) ]]; then
    job=${BASH_REMATCH[1]}
  elif xs_first_set launch_name "$XS_JOB_NAME_VARS"; then
    xs_string_hash job "$launch_name"
  elif (( XS_WORLD_SIZE == 1 )); then
    job=$$   # a lone process: any port that differs between processes will do
  else
    xs_die "MASTER_PORT is not set and launcher '$XS_LAUNCHER' gives no job id to derive it from; export MASTER_PORT"
  fi
  [[ $job =~ ^[0-9]{1,18}$ ]] || xs_die "job id '$job' is not a number; export MASTER_PORT"
  [[ $step =~ ^[0-9]{1,9}$ ]] || step=0   # "batch"/"extern" steps never host a rendezvous
  xs_default MASTER_PORT "$((10000 + (16 * (10#$job % 22768) + 10#$step % 16) % 22768))"
}

# ---------------------------------------------------------------------------------------------
# Site profile
# ---------------------------------------------------------------------------------------------

# Cheap detection (file tests, variables and small sysfs reads only); XSCALE_SITE always wins.
#   lumi              LUMI's cluster name, or the Cray stack (/opt/cray) with AMD's GPU device
#   nvidia-slingshot  NVIDIA GPUs on a Slingshot (CXI) network: Polaris, Alps, Isambard-AI
#   nvidia            other NVIDIA GPUs (InfiniBand, RoCE)
#   aurora            Intel GPUs under PALS or with Aurora's /opt/aurora software tree
#   generic           anything else
# A PBS/PALS job is not necessarily Aurora: Polaris is PBS + PALS with NVIDIA GPUs, so the GPU
# decides, not the launcher.
xs_detect_site() {
  if [[ -n ${XSCALE_SITE:-} ]]; then
    XS_SITE=$XSCALE_SITE
  elif [[ ${SLURM_CLUSTER_NAME:-} == lumi || ( -d /opt/cray && -e /dev/kfd ) ]]; then
    XS_SITE=lumi
  elif [[ -e /dev/nvidiactl ]]; then
    if xs_has_cxi_nic; then XS_SITE=nvidia-slingshot; else XS_SITE=nvidia; fi
  elif xs_has_intel_gpu && [[ -n ${PALS_APID:-}${PALS_RANKID:-} || -d /opt/aurora ]]; then
    XS_SITE=aurora
  else
    XS_SITE=generic
  fi
  [[ $XS_SITE =~ ^[a-z0-9_-]+$ && -r $XS_LIB_DIR/../sites/$XS_SITE.sh ]] \
    || xs_die "unknown XSCALE_SITE '$XS_SITE' (have: lumi, aurora, nvidia, nvidia-slingshot, generic)"
}

# HPE Slingshot 11 NICs are driven by the cxi driver, which creates /dev/cxiN and /sys/class/cxi.
xs_has_cxi_nic() {
  local device
  [[ -d /sys/class/cxi ]] && return 0
  for device in /dev/cxi[0-9]*; do
    [[ -e $device ]] && return 0
  done
  return 1
}

# True when a DRM device of PCI vendor 0x8086 (Intel) is present. A read of a sysfs file per
# device; the glob and `read` are builtins.
xs_has_intel_gpu() {
  local vendor_file vendor
  for vendor_file in /sys/class/drm/card[0-9]*/device/vendor; do
    [[ -r $vendor_file ]] || continue
    read -r vendor <"$vendor_file" || continue
    [[ $vendor == 0x8086 ]] && return 0
  done
  return 1
}

# xs_rocm_older_than MAJOR MINOR: true when the image's ROCm release is known and older than
# MAJOR.MINOR. The release comes from the one-line file every ROCm installation carries (e.g.
# "6.1.3-122" in ${ROCM_PATH:-/opt/rocm}/.info/version), read with `read`: no process. Unknown
# (no such file, another format) is "not older": the caller then keeps the library's own default.
xs_rocm_older_than() {
  local file=${ROCM_PATH:-/opt/rocm}/.info/version line="" major minor
  [[ -r $file ]] || return 1
  read -r line <"$file" || true
  [[ $line =~ ^([0-9]{1,4})\.([0-9]{1,4}) ]] || return 1
  major=$((10#${BASH_REMATCH[1]})) minor=$((10#${BASH_REMATCH[2]}))
  (( major < $1 || (major == $1 && minor < $2) ))
}

xs_load_site() {
  # shellcheck source=/dev/null  # one of runscripts/sites/*.sh, chosen at run time
  source "$XS_LIB_DIR/../sites/$XS_SITE.sh"
}

# ---------------------------------------------------------------------------------------------
# Node-local caches
# ---------------------------------------------------------------------------------------------

# One directory per user, job, step and node in node-local /tmp: MIOpen's database, DeepSpeed's
# JIT builds and Triton's kernels then never hit Lustre (whose locking breaks them) and never
# collide with another job or user on a shared node. Every rank creates it (mkdir is atomic, so
# no rank waits and nothing is deleted) and refuses a path it does not own or that is a symlink:
# /tmp is world-writable and a planted link would redirect our files.
xs_setup_cache() {
  local root=${XSCALE_CACHE_ROOT:-/tmp} user=${USER:-uid$UID}
  local job=${SLURM_JOB_ID:-${PBS_JOBID:-pid$PPID}} step=${SLURM_STEP_ID:-0}
  local node=${SLURMD_NODENAME:-${HOSTNAME:-node$XS_NODE_RANK}}
  xs_default XSCALE_CACHE_DIR "$root/xscale-$user-$job.$step-$node"
  local dir=$XSCALE_CACHE_DIR
  if [[ ! -e $dir && ! -L $dir ]]; then
    # One mkdir for the directory and the subdirectories the site profiles point at (MIOpen's
    # database directory must exist); a rank racing us to it only makes the first one fail.
    mkdir -m 0700 -- "$dir" "$dir/miopen" 2>/dev/null || [[ -e $dir ]] \
      || xs_die "cannot create cache directory '$dir' (is ${dir%/*} writable?)"
  fi
  [[ ! -L $dir ]] || xs_die "cache directory '$dir' is a symlink; refusing to use it"
  [[ -d $dir ]] || xs_die "cache path '$dir' is not a directory"
  [[ -O $dir ]] || xs_die "cache directory '$dir' belongs to another user; refusing to use it"
  [[ -w $dir ]] || xs_die "cache directory '$dir' is not writable"
  xs_default TORCH_EXTENSIONS_DIR "$dir/torch-extensions"
  xs_default TRITON_CACHE_DIR "$dir/triton"
}

# ---------------------------------------------------------------------------------------------
# CPU threads and GPU visibility
# ---------------------------------------------------------------------------------------------

# Count the CPUs in this process's affinity mask (what --cpu-bind gave the rank): one OpenMP
# thread per CPU we may run on, instead of one per CPU of the node fighting over a few.
xs_affinity_cpus() {
  local line list="" item cpus=0
  local -a status
  # mapfile reads the file in blocks; `while read` would read it one byte per system call.
  mapfile -t status </proc/self/status
  for line in "${status[@]}"; do
    [[ $line == Cpus_allowed_list:* ]] && list=${line#*:} && break
  done
  xs_split_commas "${list//[[:space:]]/}"
  for item in "${XS_ITEMS[@]}"; do
    if [[ $item =~ ^([0-9]+)-([0-9]+)$ ]]; then
      cpus=$((cpus + BASH_REMATCH[2] - BASH_REMATCH[1] + 1))
    elif [[ $item =~ ^[0-9]+$ ]]; then
      cpus=$((cpus + 1))
    fi
  done
  printf -v "$1" '%d' "$((cpus > 0 ? cpus : 1))"
}

xs_threads() {
  [[ -v OMP_NUM_THREADS ]] && { xs_default OMP_NUM_THREADS "$OMP_NUM_THREADS"; return; }
  local cpu_count
  xs_affinity_cpus cpu_count
  xs_default OMP_NUM_THREADS "$cpu_count"
}

# XSCALE_GPU_BIND=local gives each rank its own slice of the node's GPUs. Skipped when the
# scheduler already did it (--gpus-per-task, --gpu-bind): then fewer GPUs are visible than there
# are ranks on the node.
xs_bind_gpus() {
  local mode=${XSCALE_GPU_BIND:-none}
  case $mode in
    none) return 0 ;;
    local) ;;
    *) xs_die "XSCALE_GPU_BIND='$mode' is not one of: none, local" ;;
  esac
  case $XS_GPU_VENDOR in
    amd)
      xs_bind_gpu_var ROCR_VISIBLE_DEVICES
      ((XS_GPUS_NARROWED)) && xs_relative_hip_devices
      ;;
    intel) xs_bind_gpu_var ZE_AFFINITY_MASK ;;
    *) xs_bind_gpu_var CUDA_VISIBLE_DEVICES ;;
  esac
  return 0
}

# Narrow NAME (a comma-separated device list, or 0..LOCAL_WORLD_SIZE-1 when unset) to this rank's
# share; XS_GPUS_NARROWED says whether it did.
xs_bind_gpu_var() {
  local name=$1 per_rank first i
  local -a devices=() mine=()
  XS_GPUS_NARROWED=0
  if [[ -n ${!name:-} ]]; then
    xs_split_commas "${!name}"
    devices=("${XS_ITEMS[@]}")
  else
    for ((i = 0; i < XS_LOCAL_WORLD_SIZE; i++)); do devices+=("$i"); done
  fi
  ((${#devices[@]} >= XS_LOCAL_WORLD_SIZE && ${#devices[@]} > 1)) || return 0
  per_rank=$((${#devices[@]} / XS_LOCAL_WORLD_SIZE))
  first=$((XS_LOCAL_RANK * per_rank))
  mine=("${devices[@]:first:per_rank}")
  local IFS=,
  export "$name=${mine[*]}"
  XS_EXPORTED+=("$name")
  XS_GPUS_NARROWED=1
}

# HIP numbers devices after ROCR's filter, so the rank's devices are HIP's 0..k-1.
xs_relative_hip_devices() {
  [[ -v HIP_VISIBLE_DEVICES ]] && return 0
  local -a ids=()
  local i
  xs_split_commas "$ROCR_VISIBLE_DEVICES"
  for ((i = 0; i < ${#XS_ITEMS[@]}; i++)); do ids+=("$i"); done
  local IFS=,
  xs_default HIP_VISIBLE_DEVICES "${ids[*]}"
}

# ---------------------------------------------------------------------------------------------
# Failure handling, debugging and logs
# ---------------------------------------------------------------------------------------------

xs_failure_defaults() {
  # A rank that dies must not leave the others blocked in a collective forever: NCCL/RCCL's
  # watchdog then aborts the communicator and the process, and Slurm's --kill-on-bad-exit ends
  # the step. ROCm's torch drives RCCL through the same ProcessGroupNCCL, so the same variable
  # serves both. Only the TORCH_ name: torch >= 2.2 still reads the old NCCL_ASYNC_ERROR_HANDLING
  # but then warns on every rank that it is deprecated (c10d's getCvar*, see
  # torch/csrc/distributed/c10d/Utils.hpp upstream; the warning is in torch 2.14.1's
  # libtorch_cuda.so), and every image xscale builds on ships torch >= 2.2 (constraints.txt).
  xs_default TORCH_NCCL_ASYNC_ERROR_HANDLING 1
  xs_default XSCALE_TIMEOUT_S 600
  # torch's flight recorder: a ring buffer of each process group's last collectives, with their
  # sequence numbers, so that a collective that times out names the rank that never joined it
  # (python/xscale/flight.py; docs/FAILURES.md). 2000 entries, as PyTorch's flight recorder
  # tutorial recommends; its cost, measured with tests/bench/flight_recorder.py, is in
  # docs/FAILURES.md. With the step supervisor's XSCALE_FR_DIR, NCCL's and RCCL's watchdog
  # writes it there when a collective times out, as xscale's trainers do on gloo.
  xs_default TORCH_FR_BUFFER_SIZE 2000
  if [[ -n ${XSCALE_FR_DIR:-} ]]; then
    xs_default TORCH_NCCL_DUMP_ON_TIMEOUT 1
    xs_default TORCH_FR_DUMP_TEMP_FILE "$XSCALE_FR_DIR/rank"
  fi
  # NCCL_PROXY_DUMP_SIGNAL=N has NCCL install its own handler for signal N (a dump of its proxy
  # state; NCCL's environment variable documentation). Signal 10, SIGUSR1 on Linux, is the
  # time-limit warning xscale's jobs ask for (--signal=B:USR1@...): NCCL would take it from the
  # trainer, which would then never save before the limit.
  [[ ${NCCL_PROXY_DUMP_SIGNAL:-} != 10 ]] \
    || xs_die "NCCL_PROXY_DUMP_SIGNAL=10 is SIGUSR1, the time-limit warning the trainers stop on; the two must differ (use 12, SIGUSR2, for NCCL's dump)"
}

xs_debug() {
  local wants_log_dir=${XSCALE_LOG_DIR:+1}
  [[ ${XSCALE_DEBUG:-0} == 1 ]] && wants_log_dir=1
  [[ -n $wants_log_dir ]] || return 0
  xs_default XSCALE_LOG_DIR "$PWD/xscale-logs"
  [[ -d $XSCALE_LOG_DIR ]] || mkdir -p -- "$XSCALE_LOG_DIR" 2>/dev/null \
    || xs_die "cannot create XSCALE_LOG_DIR '$XSCALE_LOG_DIR'"
  [[ -w $XSCALE_LOG_DIR ]] || xs_die "XSCALE_LOG_DIR '$XSCALE_LOG_DIR' is not writable"
  [[ ${XSCALE_DEBUG:-0} == 1 ]] || return 0
  # One file per rank: NCCL's INFO output on stdout slows training and interleaves unreadably.
  xs_default NCCL_DEBUG INFO
  xs_default NCCL_DEBUG_SUBSYS INIT,COLL
  xs_default NCCL_DEBUG_FILE "$XSCALE_LOG_DIR/nccl-rank$XS_RANK.%h.%p.log"
}

xs_announce() {
  if ((XS_RANK == 0)); then
    printf 'xscale: launcher=%s site=%s world=%s nodes=%s master=%s:%s\n' "$XS_LAUNCHER" \
      "$XS_SITE" "$XS_WORLD_SIZE" "$XS_NNODES" "$MASTER_ADDR" "$MASTER_PORT" >&2
  fi
  if [[ ${XSCALE_VERBOSE:-0} == 1 ]]; then
    local line cpus=""
    local -a status
    mapfile -t status </proc/self/status
    for line in "${status[@]}"; do [[ $line == Cpus_allowed_list:* ]] && cpus=${line#*:}; done
    printf 'xscale: rank=%s local_rank=%s node=%s cpus=%s gpus=%s\n' "$XS_RANK" "$XS_LOCAL_RANK" \
      "${SLURMD_NODENAME:-$HOSTNAME}" "${cpus//[[:space:]]/}" \
      "${ROCR_VISIBLE_DEVICES:-${CUDA_VISIBLE_DEVICES:-${ZE_AFFINITY_MASK:-all}}}" >&2
  fi
}

# ---------------------------------------------------------------------------------------------
# Network interfaces
# ---------------------------------------------------------------------------------------------

# A socket interface list that names nothing on this node (a typo, hsn0 on a node without
# Slingshot, a container that hides the host's network) surfaces only at the first collective:
# gloo stops with "Unable to find address for" and NCCL/RCCL with "no socket interface found", on
# every rank, without saying which node. Check here, where it costs a few file tests (sysfs lists
# the interfaces of the network the rank runs in). Skipped where /sys/class/net is absent.
xs_check_socket_interfaces() {
  [[ -d /sys/class/net ]] || return 0
  local item
  if [[ -n ${GLOO_SOCKET_IFNAME:-} ]]; then
    # gloo opens one device per name: every name must exist.
    xs_split_commas "$GLOO_SOCKET_IFNAME"
    for item in "${XS_ITEMS[@]}"; do
      [[ -e /sys/class/net/$item ]] \
        || xs_die "GLOO_SOCKET_IFNAME='$GLOO_SOCKET_IFNAME': no interface '$item' on $(xs_node_name) (have: $(xs_interfaces))"
    done
  fi
  # NCCL reads prefixes ("hsn" matches hsn0..3; "=hsn0" one exact name) and uses every match, so
  # one match is enough. An exclusion list ("^lo,docker") cannot name a missing interface.
  [[ -n ${NCCL_SOCKET_IFNAME:-} && $NCCL_SOCKET_IFNAME != ^* ]] || return 0
  local -a matches
  xs_split_commas "$NCCL_SOCKET_IFNAME"
  for item in "${XS_ITEMS[@]}"; do
    if [[ $item == =* ]]; then
      [[ -e /sys/class/net/${item#=} ]] && return 0
    else
      matches=(/sys/class/net/"$item"*)
      [[ -e ${matches[0]} ]] && return 0
    fi
  done
  xs_die "NCCL_SOCKET_IFNAME='$NCCL_SOCKET_IFNAME' matches no interface on $(xs_node_name) (have: $(xs_interfaces))"
}

# Only on the error path above: command substitutions fork.
xs_node_name() { printf '%s\n' "${SLURMD_NODENAME:-${HOSTNAME:-this node}}"; }
xs_interfaces() {
  local -a names=(/sys/class/net/*)
  names=("${names[@]#/sys/class/net/}")
  printf '%s\n' "${names[*]}"
}

# ---------------------------------------------------------------------------------------------
# The container's Python
# ---------------------------------------------------------------------------------------------

# LUMI's AMD images define WITH_CONDA ("source .../activate pytorch") and expect it to run before
# python; the EasyBuild images put a venv under /user-software. Both come from the image, never
# from the user's arguments, and run in this shell (no eval: split into words, run as a command).
xs_activate_container_python() {
  local venv
  for venv in /user-software/venv/*/bin; do
    [[ -x $venv/python && :$PATH: != *":$venv:"* ]] && export PATH="$venv:$PATH"
    break
  done
  [[ -n ${WITH_CONDA:-} ]] || return 0
  local -a words
  read -r -a words <<<"$WITH_CONDA"
  ((${#words[@]})) || return 0
  # Activation scripts read unset variables; relax -u only for them.
  set +u
  "${words[@]}" >/dev/null || xs_die "WITH_CONDA ('$WITH_CONDA') failed"
  set -u
}

# ---------------------------------------------------------------------------------------------
# Arguments: byte-exact, except $NAME / ${NAME} of an exported variable, expanded per rank
# ---------------------------------------------------------------------------------------------

# LUMI's workshop scripts pass '--rank \$SLURM_PROCID' so that each rank sees its own number; we
# expand exactly that form and nothing else: ${X:-y}, $(...), $1, a lone $ and names not exported
# stay as typed.
xs_expand_args() {
  XS_ARGS=()
  local arg
  if [[ ${XSCALE_EXPAND_ARGS:-1} == 0 ]]; then
    XS_ARGS=("$@")
    return 0
  fi
  for arg in "$@"; do
    [[ $arg == *'$'* ]] && xs_expand_one arg
    XS_ARGS+=("$arg")
  done
}

xs_expand_one() {
  local rest=${!1} out="" name
  local re_braced='^\{([A-Za-z_][A-Za-z0-9_]*)\}(.*)$' re_plain='^([A-Za-z_][A-Za-z0-9_]*)(.*)$'
  while [[ $rest == *'$'* ]]; do
    out+=${rest%%'$'*}
    rest=${rest#*'$'}
    if [[ $rest =~ $re_braced || $rest =~ $re_plain ]]; then
      name=${BASH_REMATCH[1]}
      if [[ -v $name && ${!name@a} == *x* ]]; then
        out+=${!name}
        rest=${BASH_REMATCH[2]}
        continue
      fi
    fi
    out+='$'
  done
  printf -v "$1" '%s' "$out$rest"
}

# ---------------------------------------------------------------------------------------------
# Everything, in order
# ---------------------------------------------------------------------------------------------

xs_setup_environment() {
  xs_detect_launcher
  xs_derive_layout
  xs_export_layout
  xs_master_addr
  xs_master_port
  xs_detect_site
  xs_setup_cache
  xs_threads
  xs_failure_defaults
  xs_load_site
  xs_bind_gpus
  xs_debug
  xs_default XSCALE_SITE "$XS_SITE"
  xs_default XSCALE_LAUNCHER "$XS_LAUNCHER"
}

xs_print_env() {
  local name
  local -A printed=()
  local -a lines=()
  for name in "${XS_EXPORTED[@]}"; do
    [[ -n ${printed[$name]:-} ]] && continue
    printed[$name]=1
    lines+=("$name=${!name}")
  done
  printf '%s\n' "${lines[@]}" | LC_ALL=C sort
}

# ---------------------------------------------------------------------------------------------
# Profiling one rank (run-profile.sh)
# ---------------------------------------------------------------------------------------------

# PROFILE_RANKS: "all", "last", or comma-separated ranks and ranges ("14", "0,8-15"). Sets
# XS_PROFILE_THIS_RANK=1 when this rank is selected. A malformed value stops every rank before
# anything runs; a rank beyond the world is only worth a warning (from rank 0, once).
xs_select_profile_rank() {
  local spec=${PROFILE_RANKS:-0} item lo hi beyond=""
  XS_PROFILE_THIS_RANK=0
  case $spec in
    all) XS_PROFILE_THIS_RANK=1; return 0 ;;
    last) ((XS_RANK == XS_WORLD_SIZE - 1)) && XS_PROFILE_THIS_RANK=1; return 0 ;;
  esac
  [[ $spec =~ ^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$ ]] \
    || xs_die "PROFILE_RANKS='$spec' is malformed (expected e.g. 0, 14, 0,8-15, all, last)"
  xs_split_commas "$spec"
  for item in "${XS_ITEMS[@]}"; do
    lo=$((10#${item%-*})) hi=$((10#${item#*-}))
    ((lo <= hi)) || xs_die "PROFILE_RANKS='$spec': range $item runs backwards"
    ((XS_RANK >= lo && XS_RANK <= hi)) && XS_PROFILE_THIS_RANK=1
    ((hi >= XS_WORLD_SIZE)) && beyond+=" $item"
  done
  if [[ -n $beyond ]] && ((XS_RANK == 0)); then
    xs_warn "PROFILE_RANKS names ranks beyond WORLD_SIZE=$XS_WORLD_SIZE:$beyond"
  fi
  return 0
}

# The profiler command for this rank: PROFILER (or the site's default) with {rank} and {dir}
# filled in, split into words (no eval: a template is data, not shell code).
xs_profiler_words() {
  local template=${PROFILER:-$XS_PROFILER_DEFAULT}
  template=${template//\{rank\}/$XS_RANK}
  template=${template//\{dir\}/$PROFILE_DIR}
  read -r -a XS_PROFILER_WORDS <<<"$template"
  ((${#XS_PROFILER_WORDS[@]})) || xs_die "PROFILER is empty"
}

# Every rank, not only the profiled ones, checks that the profiler is installed in the image
# (after the image's Python environment is active, since that may put it on PATH): then a missing
# one stops the whole job with one line before any rank starts training, instead of bash's
# "exec: NAME: not found" (exit 127) from one rank while the others wait for it. `type -P` is
# a builtin PATH search.
xs_check_profiler() {
  local tool=${XS_PROFILER_WORDS[0]}
  if [[ $tool == */* ]]; then
    [[ -x $tool && ! -d $tool ]] && return 0
  elif type -P -- "$tool" >/dev/null; then
    return 0
  fi
  xs_die "profiler '$tool' is not installed in this image (not on PATH); install it, or choose another with PROFILER='CMD ... {dir} {rank}'"
}

xs_setup_profiling() {
  xs_select_profile_rank
  # 32 steps, as LUMI's AI workshop profiles (docs/ARCHITECTURE.md, sources); trainers skip the
  # first 10 so start-up and autotuning stay out of the trace.
  xs_default PROFILE_STEP_START 10
  xs_default PROFILE_STEPS 32
  [[ $PROFILE_STEP_START =~ ^[0-9]+$ ]] || xs_die "PROFILE_STEP_START='$PROFILE_STEP_START' is not a whole number"
  [[ $PROFILE_STEPS =~ ^[0-9]+$ ]] || xs_die "PROFILE_STEPS='$PROFILE_STEPS' is not a whole number"
  xs_default PROFILE_DIR "$PWD/profile-${SLURM_JOB_ID:-${PBS_JOBID:-$XS_RANK.$$}}"
  xs_profiler_words
  ((XS_PROFILE_THIS_RANK)) || return 0
  xs_default XSCALE_PROFILED 1
  mkdir -p -- "$PROFILE_DIR/rank$XS_RANK" 2>/dev/null \
    || xs_die "cannot create PROFILE_DIR '$PROFILE_DIR'"
}

# ---------------------------------------------------------------------------------------------
# Start-up phases (docs/STARTUP.md): the trainer reports how long each rank took from the
# step's launch to run.sh (XSCALE_LAUNCH_T, set by jobs/lib/supervisor.py), through run.sh, to
# the exec. Two reads of bash's clock, no fork. Always overwritten, never xs_default: a value
# inherited from an outer run.sh would be another process's time. Not in --print-env, whose
# output must not change from one run to the next. EPOCHREALTIME is empty before bash 5; the
# trainer then reports these phases as unknown.
# ---------------------------------------------------------------------------------------------
xs_export_startup_times() {
  export XSCALE_T_RUNSH=${XS_T_RUNSH:-}
  export XSCALE_T_EXEC=${EPOCHREALTIME:-}
}

# ---------------------------------------------------------------------------------------------
# The entrypoints' shared main. MODE is "plain" (run.sh) or "profile" (run-profile.sh); each
# entrypoint defines its own usage().
# ---------------------------------------------------------------------------------------------
xs_main() {
  local mode=$1 print_env=0
  shift
  case ${1:-} in
    -h | --help) usage; exit 0 ;;
    --print-env) print_env=1; shift ;;
    --) shift ;;
  esac
  xs_setup_environment
  [[ $mode == profile ]] && xs_setup_profiling
  if ((print_env)); then
    xs_print_env
    exit 0
  fi
  (($#)) || xs_die "no command given (usage: $XS_PROG CMD [ARGS...]; see --help)"
  xs_check_socket_interfaces
  xs_activate_container_python
  [[ $mode == profile ]] && xs_check_profiler
  xs_announce
  xs_expand_args "$@"
  xs_export_startup_times
  if [[ $mode == profile ]] && ((XS_PROFILE_THIS_RANK)); then
    exec "${XS_PROFILER_WORDS[@]}" "${XS_ARGS[@]}"
  fi
  exec "${XS_ARGS[@]}"
}

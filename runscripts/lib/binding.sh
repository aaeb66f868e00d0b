# shellcheck shell=bash
# What this rank may use of its node: OMP_NUM_THREADS, its share of the CPUs it may run on, and
# with XSCALE_GPU_BIND=local its share of the node's GPUs. Reads the layout (layout.sh) and the
# site's GPU vendor (site.sh).
#
# Sourced by run.sh, run-profile.sh and doctor, after common.sh.

# xs_count_cpus OUT LIST: OUT=how many CPUs a kernel CPU list ("0-3,8,10-11") names.
xs_count_cpus() {
  local item cpus=0
  xs_split_commas "${2//[[:space:]]/}"
  for item in "${XS_ITEMS[@]}"; do
    if [[ $item =~ ^([0-9]+)-([0-9]+)$ ]]; then
      cpus=$((cpus + BASH_REMATCH[2] - BASH_REMATCH[1] + 1))
    elif [[ $item =~ ^[0-9]+$ ]]; then
      cpus=$((cpus + 1))
    fi
  done
  printf -v "$1" '%d' "$cpus"
}

# xs_affinity_cpus OUT: the CPUs in this process's affinity mask (what --cpu-bind gave the rank).
xs_affinity_cpus() {
  local line list=""
  local -a status
  # mapfile reads the file in blocks; `while read` would read it one byte per system call.
  mapfile -t status </proc/self/status
  for line in "${status[@]}"; do
    [[ $line == Cpus_allowed_list:* ]] && list=${line#*:} && break
  done
  xs_count_cpus "$1" "$list"
}

# xs_node_cpus OUT: the CPUs this node gives the job: Slurm's count, else every online CPU.
xs_node_cpus() {
  local online=""
  if [[ ${SLURM_CPUS_ON_NODE:-} =~ ^[0-9]{1,6}$ ]]; then
    printf -v "$1" '%d' "$((10#$SLURM_CPUS_ON_NODE))"
    return
  fi
  read -r online </sys/devices/system/cpu/online 2>/dev/null || true
  xs_count_cpus "$1" "$online"
}

# One OpenMP (and torch intra-op) thread per CPU that is this rank's own. Ranks each bound to
# their own CPUs (--cpu-bind=mask_cpu, mpiexec --cpu-bind) own their whole mask; with
# --cpu-bind=none every rank's mask is the whole node, and one thread per CPU in every rank
# oversubscribes it LOCAL_WORLD_SIZE times over (a resnet18 step 4-5x slower on the test bed), so
# a mask that covers the node is divided among the node's ranks. `srun -c N` says it directly.
xs_threads() {
  local mask node share
  if [[ -v OMP_NUM_THREADS ]]; then
    xs_default OMP_NUM_THREADS "$OMP_NUM_THREADS"
    xs_note "OMP_NUM_THREADS=$OMP_NUM_THREADS: set before run.sh"
    return
  fi
  xs_affinity_cpus mask
  (( mask > 0 )) || mask=1
  if [[ $XS_LAUNCHER == slurm && ${SLURM_CPUS_PER_TASK:-} =~ ^[0-9]{1,6}$ ]] \
      && (( 10#$SLURM_CPUS_PER_TASK > 0 )); then
    share=$(( 10#$SLURM_CPUS_PER_TASK < mask ? 10#$SLURM_CPUS_PER_TASK : mask ))
    xs_note "OMP_NUM_THREADS=$share: SLURM_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK (affinity mask: $mask CPUs)"
  else
    xs_node_cpus node
    if (( XS_LOCAL_WORLD_SIZE > 1 && node > 0 && mask >= node )); then
      share=$(( node / XS_LOCAL_WORLD_SIZE > 0 ? node / XS_LOCAL_WORLD_SIZE : 1 ))
      xs_note "OMP_NUM_THREADS=$share: every rank's affinity mask is the node's $node CPUs, shared by its $XS_LOCAL_WORLD_SIZE ranks"
    else
      share=$mask
      xs_note "OMP_NUM_THREADS=$share: this rank's own affinity mask ($mask of the node's $node CPUs)"
    fi
  fi
  xs_default OMP_NUM_THREADS "$share"
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

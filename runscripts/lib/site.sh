# shellcheck shell=bash
# The site: which profile (runscripts/sites/SITE.sh) this node gets and its defaults, the
# settings every site gets (NCCL/RCCL failure handling, torch's flight recorder, debug logs), the
# node-local cache directory the profiles point MIOpen, torch extensions and Triton at, and the
# check that the network interfaces the settings name exist on this node. Sets XS_SITE and, through
# the profile, XS_GPU_VENDOR (binding.sh) and XS_PROFILER_DEFAULT (profiling.sh).
#
# Sourced by run.sh, run-profile.sh and doctor, after common.sh and layout.sh.

XS_SITE=generic
# shellcheck disable=SC2034  # the profile sets it; binding.sh and doctor read it
XS_GPU_VENDOR=none

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

# True when any GPU's device file is present: AMD's /dev/kfd, NVIDIA's /dev/nvidiactl, or a DRM
# render node (AMD and Intel). compgen is a builtin: no process.
xs_has_gpu_device() {
  [[ -e /dev/kfd || -e /dev/nvidiactl ]] || compgen -G '/dev/dri/renderD*' >/dev/null
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
# Every site: failure handling, debugging and logs
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
  # (python/xscale/observe/flight.py; docs/FAILURES.md). 2000 entries, as PyTorch's flight recorder
  # tutorial recommends; its cost, measured with tests/bench/flight_recorder.py, is in
  # docs/FAILURES.md. With the supervisor's XSCALE_FR_DIR, NCCL's and RCCL's watchdog
  # writes it there when a collective times out, as xscale's trainers do on gloo.
  xs_default TORCH_FR_BUFFER_SIZE 2000
  if [[ -n ${XSCALE_FR_DIR:-} ]]; then
    xs_default TORCH_NCCL_DUMP_ON_TIMEOUT 1
    xs_default TORCH_FR_DUMP_TEMP_FILE "$XSCALE_FR_DIR/rank"  # + N: xscale.shared.contract.RECORD_PREFIX
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

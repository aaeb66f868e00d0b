# shellcheck shell=bash
# What this rank may use of its node: OMP_NUM_THREADS from the CPUs in its affinity mask (what
# --cpu-bind gave it), and with XSCALE_GPU_BIND=local its share of the node's GPUs. Reads the
# layout (layout.sh) and the site's GPU vendor (site.sh).
#
# Sourced by run.sh, run-profile.sh and doctor, after common.sh.

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

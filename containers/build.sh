#!/usr/bin/env bash
# Build xscale's container images (`make sif`). Runs on a build host: a LUMI login node, or any
# machine with Singularity or Apptainer; the images land in build/ (or OUT_DIR).
set -euo pipefail

readonly PROG=build.sh
REPO=$(cd "${BASH_SOURCE[0]%/*}/.." && pwd -P)
readonly REPO
readonly LUMI_BASE=/appl/local/containers/sif-images/lumi-pytorch-rocm-6.2.4-python-3.12-pytorch-v2.7.1.sif
readonly COTAINR_BASE_DEFAULT=/appl/local/containers/sif-images/lumi-rocm-rocm-6.2.4.sif

usage() {
  cat <<'EOF'
Usage: containers/build.sh [--help] [TARGET...]

Builds xscale's images into build/ (OUT_DIR overrides), from the repository root:
  lumi     containers/lumi-pytorch.def   -> xscale-lumi.sif     (LUMI PyTorch ROCm base)
  nvidia   containers/nvidia-pytorch.def -> xscale-nvidia.sif   (NGC PyTorch base)
  cotainr  containers/lumi-cotainr.yml   -> xscale-cotainr.sif  (cotainr, on LUMI)
Default target: lumi where the LUMI base image exists, nvidia elsewhere.

The builder is singularity, else apptainer (BUILDER overrides). As root it builds directly;
otherwise, if proot is on PATH (LUMI: module load LUMI systools) SingularityCE builds through it,
since LUMI allows neither fakeroot nor user namespaces; else --fakeroot. BUILD_FLAGS replaces
that choice. COTAINR_BASE sets cotainr's --base-image.
Errors (no builder, unknown target): one line on stderr, exit status 2.
EOF
}

die() {
  printf '%s: error: %s\n' "$PROG" "$*" >&2
  exit 2
}

# The first real Singularity/Apptainer on PATH. xscale's test shim (tests/shim/singularity) can
# only `exec`, so it does not count.
find_builder() {
  local candidate version
  if [[ -n ${BUILDER:-} ]]; then
    command -v "$BUILDER" >/dev/null || die "BUILDER '$BUILDER' is not on PATH"
    printf '%s\n' "$BUILDER"
    return 0
  fi
  for candidate in singularity apptainer; do
    command -v "$candidate" >/dev/null || continue
    version=$("$candidate" --version 2>/dev/null) || continue
    [[ $version == *shim* ]] && continue
    printf '%s\n' "$candidate"
    return 0
  done
  return 1
}

# How an unprivileged user may build here (see usage).
build_flags() {
  if [[ -n ${BUILD_FLAGS+set} ]]; then
    printf '%s\n' "$BUILD_FLAGS"
  elif ((EUID == 0)) || command -v proot >/dev/null; then
    printf '\n'
  else
    printf '%s\n' --fakeroot
  fi
}

build_def() {
  local builder=$1 def=$2 image=$3 flags
  local -a flag_words
  flags=$(build_flags)
  read -r -a flag_words <<<"$flags"
  local -a command=("$builder" build "${flag_words[@]}" "$image" "$def")
  printf '%s: running: %s\n' "$PROG" "${command[*]}" >&2
  "${command[@]}"
}

build_cotainr() {
  local image=$1
  command -v cotainr >/dev/null \
    || die "cotainr is not on PATH (on LUMI: module load LUMI CrayEnv cotainr)"
  cotainr build "$image" --base-image="${COTAINR_BASE:-$COTAINR_BASE_DEFAULT}" \
    --conda-env=containers/lumi-cotainr.yml --accept-licenses
}

main() {
  local target builder="" out_dir
  local -a targets=()
  while (($#)); do
    case $1 in
      -h | --help) usage; exit 0 ;;
      lumi | nvidia | cotainr) targets+=("$1"); shift ;;
      *) die "unknown target '$1' (have: lumi, nvidia, cotainr)" ;;
    esac
  done
  if ((${#targets[@]} == 0)); then
    if [[ -r $LUMI_BASE ]]; then targets=(lumi); else targets=(nvidia); fi
  fi
  for target in "${targets[@]}"; do
    if [[ $target != cotainr && -z $builder ]]; then
      builder=$(find_builder) || die "neither singularity nor apptainer is installed;" \
        "build on LUMI or a machine with Apptainer (see containers/README.md)"
    fi
  done
  out_dir=${OUT_DIR:-$REPO/build}
  mkdir -p -- "$out_dir"
  # %files sources (python, runscripts) are relative to the directory the build runs in.
  cd "$REPO"
  for target in "${targets[@]}"; do
    case $target in
      lumi) build_def "$builder" containers/lumi-pytorch.def "$out_dir/xscale-lumi.sif" ;;
      nvidia) build_def "$builder" containers/nvidia-pytorch.def "$out_dir/xscale-nvidia.sif" ;;
      cotainr) build_cotainr "$out_dir/xscale-cotainr.sif" ;;
    esac
  done
}

main "$@"

# shellcheck shell=bash
# Checks a batch script runs on the host before `srun singularity exec`: the image exists, and
# every input path the trainer will open is visible inside the container at the same path. A
# missing SIF or a data directory outside the binds otherwise surfaces minutes later as one
# Python traceback per rank; here it is one line and exit 2, and srun never starts. In a job
# script:
#
#   source "$XSCALE_ROOT/jobs/lib/container-paths.sh"
#   xs_require_sif                       # SIF is set and readable
#   xs_require_visible DATA "$BINDS"     # DATA exists and the container sees it
#   xs_require_host_file DATA_TAR        # a file read on the host, outside the container
#
# What the container sees: the bind list given with -B (comma-separated SRC[:DST[:OPTS]]; only
# entries that keep the path, SRC == DST, count), SINGULARITY_BIND / APPTAINER_BIND, and what
# Singularity/Apptainer bind by default: $HOME, /tmp, /var/tmp and the current directory
# (SingularityCE and Apptainer user guides, "Bind Paths and Mounts", system-defined bind paths).
# On LUMI, /scratch/<project>, /project/<project> and /flash/<project> are symbolic links into
# /pfs/lustre*, so both the link and where it leads must be bound (LUMI's AI workshop binds
# /pfs,/scratch,/projappl,/project,/flash,/appl for that reason:
# Lumi-supercomputer/Getting_Started_with_AI_workshop,
# bonus_material/pytorch_cotainr_container_basics/train_multi_node_ddp_torchrun.sh).
# Runs on the host, once per job, so it may fork (realpath).

xs_job_die() {
  printf 'xscale: error: %s\n' "$*" >&2
  exit 2
}

# SIF must name a readable image. There is deliberately no default: the images under
# /appl/local/containers/sif-images are replaced or removed when LUMI deems them obsolete (LUMI
# Software Library, PyTorch), and a LUMI container module (module load PyTorch/...) exports SIF.
xs_require_sif() {
  [[ -n ${SIF:-} ]] || xs_job_die "SIF is not set: export SIF=/path/to/image.sif" \
    "(e.g. after 'module load PyTorch/...' on LUMI, or an image from containers/)"
  [[ -f $SIF && -r $SIF ]] || xs_job_die "SIF='$SIF' is not a readable image file; export SIF=..."
}

# xs_require_host_file NAME: the variable NAME names a readable file on this host (an input read
# outside the container, such as a tarball unpacked by tar on each node).
xs_require_host_file() {
  local name=$1 path
  path=${!name:-}
  [[ -n $path ]] || xs_job_die "$name is not set: export $name=/path/to/it"
  [[ -f $path && -r $path ]] || xs_job_die "$name='$path' is not a readable file"
}

# XS_VISIBLE_ROOTS: the directories the container sees at their host path (see above).
xs_visible_roots() {
  local binds=$1 entry src dst resolved
  local -a entries
  XS_VISIBLE_ROOTS=("${HOME:-/nonexistent}" /tmp /var/tmp "$PWD")
  IFS=, read -r -a entries <<<"$binds,${SINGULARITY_BIND:-},${APPTAINER_BIND:-}"
  for entry in "${entries[@]}"; do
    [[ -n $entry ]] || continue
    src=${entry%%:*}
    dst=${entry#*:}
    dst=${dst%%:*}
    [[ $entry == *:* ]] || dst=$src
    [[ $src == "$dst" ]] || continue
    XS_VISIBLE_ROOTS+=("$src")
    # A bound symbolic link shows its target's contents, so paths below the target count too.
    if resolved=$(realpath -e -- "$src" 2>/dev/null) && [[ $resolved != "$src" ]]; then
      XS_VISIBLE_ROOTS+=("$resolved")
    fi
  done
}

# True when PATH is ROOT or below it, for one of XS_VISIBLE_ROOTS.
xs_under_visible_root() {
  local path=$1 root
  for root in "${XS_VISIBLE_ROOTS[@]}"; do
    root=${root%/}
    [[ -z $root || $path == "$root" || $path == "$root"/* ]] && return 0
  done
  return 1
}

# xs_require_visible NAME BINDS: the path in variable NAME exists on this host, and both the path
# as written and the place its symbolic links lead to are inside the container's view.
xs_require_visible() {
  local name=$1 binds=$2 path resolved
  path=${!name:-}
  [[ -n $path ]] || xs_job_die "$name is not set: export $name=/path/to/it"
  [[ $path == /* ]] || path=$PWD/$path
  [[ -e $path ]] || xs_job_die "$name='$path' does not exist"
  resolved=$(realpath -e -- "$path") || xs_job_die "$name='$path' cannot be resolved"
  xs_visible_roots "$binds"
  if ! xs_under_visible_root "$path" || ! xs_under_visible_root "$resolved"; then
    xs_job_die "$name='$path' (on disk: $resolved) is not visible inside the container;" \
      "add its file system to BINDS (now: $binds)"
  fi
}

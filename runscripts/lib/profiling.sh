# shellcheck shell=bash
# Profiling (run-profile.sh only): which ranks PROFILE_RANKS selects, the profiler command from
# PROFILER or the site's default with {rank} and {dir} filled in, the check that it is installed,
# and the step window exported for the trainer.
#
# Sourced by run-profile.sh, after the files run.sh sources; xs_main calls it in "profile" mode.

# The generic site's; each site profile sets its own (runscripts/sites/README.md).
XS_PROFILER_DEFAULT='py-spy record -o {dir}/rank{rank}.svg --'

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
# filled in, split into words (no eval: a template is data, not shell code). PROFILER=torch: no
# command (no words); the trainer's torch.profiler records the window itself.
xs_profiler_words() {
  local template=${PROFILER:-$XS_PROFILER_DEFAULT}
  XS_PROFILER_WORDS=()
  [[ $template == torch ]] && return 0
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
  ((${#XS_PROFILER_WORDS[@]})) || return 0  # torch.profiler: part of torch
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
  if ((${#XS_PROFILER_WORDS[@]})); then
    xs_default XSCALE_PROFILED 1
  else
    xs_default XSCALE_TORCH_PROFILER 1
  fi
  mkdir -p -- "$PROFILE_DIR/rank$XS_RANK" 2>/dev/null \
    || xs_die "cannot create PROFILE_DIR '$PROFILE_DIR'"
}

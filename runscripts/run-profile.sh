#!/usr/bin/env bash
# run.sh plus a profiler in front of the command on the ranks in PROFILE_RANKS (default 0):
#   srun singularity exec $SIF /runscripts/run-profile.sh python train.py ...
# Profiling every rank of a large job drowns the file system and skews the run; training is
# usually balanced, so one rank tells the story. The other ranks exec the command plainly.
set -euo pipefail
# Start-up phases (docs/STARTUP.md): when this rank's run.sh began, before anything else; a
# builtin read of the clock, exported with the exec's time just before the exec.
XS_T_RUNSH=${EPOCHREALTIME:-}

XS_PROG=run-profile.sh
# run.sh's lib/ files, and profiling.sh.
# shellcheck source=runscripts/lib/common.sh
source "${BASH_SOURCE[0]%/*}/lib/common.sh"
# shellcheck source=runscripts/lib/layout.sh
source "$XS_LIB_DIR/layout.sh"
# shellcheck source=runscripts/lib/rendezvous.sh
source "$XS_LIB_DIR/rendezvous.sh"
# shellcheck source=runscripts/lib/site.sh
source "$XS_LIB_DIR/site.sh"
# shellcheck source=runscripts/lib/binding.sh
source "$XS_LIB_DIR/binding.sh"
# shellcheck source=runscripts/lib/args.sh
source "$XS_LIB_DIR/args.sh"
# shellcheck source=runscripts/lib/profiling.sh
source "$XS_LIB_DIR/profiling.sh"
# shellcheck source=runscripts/lib/entrypoint.sh
source "$XS_LIB_DIR/entrypoint.sh"

usage() {
  cat <<'EOF_USAGE'
Usage: run-profile.sh [--print-env | --help] CMD [ARGS...]

Everything run.sh does (see run.sh --help), and on the selected ranks CMD runs under a profiler.

  PROFILE_RANKS   ranks to profile: 14 | 0,8-15 | all | last (default 0). Malformed: exit 2.
  PROFILER        command template with {rank} and {dir}; every rank checks that it is
                  installed in the image (exit 2 if not) before any rank starts. Site defaults:
                    lumi     rocprof --hip-trace --stats -o {dir}/rank{rank}/results.csv
                    nvidia, nvidia-slingshot   nsys profile -t cuda,nvtx -o {dir}/rank{rank}
                    aurora   unitrace --chrome-device-logging --chrome-ccl-logging ...
                    generic  py-spy record -o {dir}/rank{rank}.svg --
                  PROFILER=torch: no command; the trainer's torch.profiler records the step
                  window into {dir}/rank{rank} and prints its summary at the end of the run
  PROFILE_DIR     where profiles go (default ./profile-JOBID); {dir}/rank{rank} is created
  PROFILE_STEP_START, PROFILE_STEPS   exported for the trainer: which steps to record (10, 32)
  XSCALE_PROFILED=1   exported on profiled ranks only, so the trainer can mark the window
                      (XSCALE_TORCH_PROFILER=1 instead with PROFILER=torch)
  After the run: xscale report --profile PROFILE_DIR  (summaries, and what opens each file)
EOF_USAGE
}

xs_main profile "$@"

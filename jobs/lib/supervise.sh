# shellcheck shell=bash
# The batch shell's side of the supervisor (jobs/lib/supervisor.py), for Slurm job scripts.
# The site preludes source it (jobs/lib/lumi.sh, local.sh); a script of your own can too:
#
#   #SBATCH --signal=B:USR1@300     # USR1 to the batch shell 300 s before the time limit
#   #SBATCH --requeue               # the job may go back to the queue
#   #SBATCH --no-kill               # a failed node ends the step, not the batch script
#   #SBATCH --open-mode=append      # and its next run appends to the same output file
#   source "$XSCALE_ROOT/jobs/lib/supervise.sh"
#   requeueable_step srun --label --kill-on-bad-exit=1 ... /runscripts/run.sh python train.py ...
#
# (the site preludes build their line from its parts instead: requeueable_launch, below).
#
# The decisions are supervisor.py's: the step's log, the time-limit requeue, the failure report,
# the nodes to blame and the retry without them (docs/FAILURES.md). This file holds what only the
# batch shell can do. `B:` signals the batch shell alone, and scancel's TERM reaches it too, so it
# writes each stop signal where the supervisor reads it, then passes the signal on to the running
# step. Source this file before any other step (staging, a cache restore): a warning that comes
# during one is held (bash runs a trap once the foreground command returns) and the training
# step does not start at all. The requeue the supervisor decided happens when the script exits,
# after any clean-up (xs_at_exit below).

XS_SUPERVISOR=${BASH_SOURCE[0]%/*}/supervisor.py
# The supervisor reads its settings from the environment (docs/FAILURES.md, "Settings").
export XSCALE_RETRY XSCALE_MAX_RETRIES XSCALE_MAX_REQUEUES XSCALE_BLAME XSCALE_RECORDS_DIR \
  XSCALE_SPARES XSCALE_MAX_RESTARTS XSCALE_LIVE_RECOVERY XSCALE_HEARTBEAT_S
XS_LAUNCH_PID=""     # the supervisor running the step, while it runs
XS_SUPERVISED=""   # set once the supervisor has a decision to carry out when the script exits
XS_AT_EXIT=()      # clean-up functions, run as the script exits, before the requeue
if ! XS_STOP_FILE=$(mktemp "${TMPDIR:-/tmp}/xscale-stop.XXXXXX"); then
  printf 'xscale: error: cannot create a file in %s (TMPDIR)\n' "${TMPDIR:-/tmp}" >&2
  exit 2
fi

xs_supervisor() {
  python3 "$XS_SUPERVISOR" --stop-file "$XS_STOP_FILE" "$@"
}

# `return 0`, never a bare `return`: in a trap that returns the status the interrupted command
# had (138 for a `wait` that USR1 cut short), and under `set -e` that ends the script.
xs_on_stop() {
  printf '%s\n' "$1" >>"$XS_STOP_FILE"
  if [[ -n $XS_LAUNCH_PID ]] && kill -s "$1" "$XS_LAUNCH_PID" 2>/dev/null; then
    return 0
  fi
  printf 'xscale: SIG%s received while no training step runs: none will start\n' "$1" >&2
}
trap 'xs_on_stop USR1' USR1
trap 'xs_on_stop TERM' TERM

# requeueable_launch IMAGE BINDS ENTRYPOINT SRUN_OPTION... -- CMD [ARGS...]: the training launch,
# built by the supervisor from these parts (jobs/lib/launch_line.py): srun with the options, then
# ENTRYPOINT (/runscripts/run.sh) in IMAGE with BINDS, then CMD. Spare nodes and restarts move it
# by changing its parts; the site preludes' xs_*_train call it.
requeueable_launch() {
  local -a parts=(--image "$1" --bind "$2" --entrypoint "$3")
  shift 3
  while (($#)) && [[ $1 != -- ]]; do parts+=("--srun-option=$1"); shift; done
  xs_supervised_run "${parts[@]}" "$@"
}

# requeueable_step CMD [ARGS...]: CMD (a script's own srun line, given whole) run as it is under
# the supervisor, with the same stop, requeue and report; it cannot be moved to spare nodes.
requeueable_step() {
  xs_supervised_run -- "$@"
}

# xs_supervised_run ARGS...: supervisor.py launch ARGS, returning the launch's exit status;
# a setting that is wrong stops the script first, one line and exit 2. The supervisor starts
# with the stop signals ignored, until it has its own handlers: one that comes meanwhile is in
# the stop file, which it reads once the step is launched. Its status is read from its records,
# not from `wait`: a wait interrupted by a trap just as the step ends returns 128+N, and the next
# one of bash 5.2 sometimes returns -1 (1 run in 5, tests/bats/supervise.bats).
xs_supervised_run() {
  xs_supervisor check || exit 2
  XS_SUPERVISED=1
  (
    trap '' USR1 TERM
    exec python3 "$XS_SUPERVISOR" --stop-file "$XS_STOP_FILE" launch "$@"
  ) &
  XS_LAUNCH_PID=$!
  while kill -0 "$XS_LAUNCH_PID" 2>/dev/null; do
    wait "$XS_LAUNCH_PID" || true
  done
  XS_LAUNCH_PID=""
  xs_supervisor judge
}

# xs_retry_without NODES|@FILE WHY: requeue the job without NODES (a Slurm hostlist, or the one in
# FILE) when the script exits, as a failed step that blames them is (XSCALE_RETRY=1, at most
# XSCALE_MAX_RETRIES times): the doctor's exclude list and the nodes where staging failed.
xs_retry_without() {
  xs_supervisor retry-without "$1" "$2" || exit 2
  XS_SUPERVISED=1
}

# xs_at_exit FUNCTION...: clean-up to run as the script exits, in order, before the requeue;
# XS_EXIT_STATUS is then the script's exit status (a cache worth keeping only after a good run).
xs_at_exit() {
  XS_AT_EXIT+=("$@")
}

# Requeueing signals every process of the job and kills them after KillWait: the supervisor's
# last call, and the scontrol it runs, ignore TERM, and so does this shell from then on (the TERM
# that ends a script whose job was requeued is no news).
xs_on_exit() {
  # shellcheck disable=SC2034 # read by the xs_at_exit functions
  XS_EXIT_STATUS=$?
  local cleanup
  for cleanup in "${XS_AT_EXIT[@]}"; do
    "$cleanup" || true
  done
  trap '' TERM USR1
  if [[ -n $XS_SUPERVISED ]]; then
    xs_supervisor finish || true
  fi
  rm -f -- "$XS_STOP_FILE"
}
trap xs_on_exit EXIT

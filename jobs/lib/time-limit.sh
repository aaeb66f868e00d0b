# shellcheck shell=bash
# Time limit -> checkpoint -> requeue, for Slurm batch scripts (it runs on the host, where
# scontrol exists, not in the container). In a job script:
#
#   #SBATCH --signal=B:USR1@300     # USR1 to the batch shell 300 s before the time limit
#   #SBATCH --requeue               # the job may go back to the queue
#   #SBATCH --open-mode=append      # and its next run appends to the same output file
#   source "$XSCALE_ROOT/jobs/lib/time-limit.sh"
#   requeueable_step srun --kill-on-bad-exit=1 ... /runscripts/run.sh python train.py ...
#
# `B:` signals only the batch shell, so this shell must pass the signal on: requeueable_step runs
# the step in the background and forwards USR1 (the time-limit warning) and TERM (scancel,
# preemption) to srun, which forwards them to every rank. xscale's trainers then finish the
# current step, write a checkpoint and exit 0. After a clean stop on USR1 the job is requeued
# when the script exits (so that any clean-up after the step still runs), and the next run
# resumes from the newest checkpoint in the same output directory. A stop on TERM is not
# requeued: scancel means stop, and Slurm requeues preempted jobs itself.
#
# Allow for the time a checkpoint takes when choosing @SECONDS; Slurm may also send the signal
# up to a minute early. A --time shorter than @SECONDS plus a minute gets the warning as the job
# starts: each run would stop at once and requeue itself again, so requeueing stops after
# XSCALE_MAX_REQUEUES runs (default 20; Slurm counts them in SLURM_RESTART_COUNT).

XS_STOP_SIGNAL=""

# Pass a stop signal on to the running step (a trap handler: runs when the signal arrives).
xs_forward_stop() {
  local signal=$1 pid=$2
  XS_STOP_SIGNAL=$signal
  printf 'xscale: SIG%s received: the ranks save a checkpoint after this step and exit\n' \
    "$signal" >&2
  kill -s "$signal" "$pid" 2>/dev/null || true
}

xs_requeue() {
  local done_runs=${SLURM_RESTART_COUNT:-0} most=${XSCALE_MAX_REQUEUES:-20}
  if ((done_runs >= most)); then
    printf '%s: job %s was requeued %s times already (XSCALE_MAX_REQUEUES=%s); %s\n' \
      'xscale: stopped before the time limit, not requeueing' "$SLURM_JOB_ID" "$done_runs" \
      "$most" 'is --time longer than the --signal warning?' >&2
    return
  fi
  printf 'xscale: stopped before the time limit; requeueing job %s to resume\n' \
    "$SLURM_JOB_ID" >&2
  scontrol requeue "$SLURM_JOB_ID"
}

# requeueable_step CMD [ARGS...]: run CMD (the srun line), returning its exit status.
requeueable_step() {
  if [[ ! ${XSCALE_MAX_REQUEUES:-20} =~ ^[0-9]+$ ]]; then
    printf "xscale: error: XSCALE_MAX_REQUEUES='%s' is not a whole number\n" \
      "$XSCALE_MAX_REQUEUES" >&2
    exit 2
  fi
  "$@" &
  local pid=$! status=0
  # shellcheck disable=SC2064  # the pid is fixed now, on purpose
  trap "xs_forward_stop USR1 $pid" USR1
  # shellcheck disable=SC2064
  trap "xs_forward_stop TERM $pid" TERM
  # `wait` returns early whenever a trapped signal arrives: wait until the step has really ended.
  while true; do
    wait "$pid" && status=0 || status=$?
    kill -0 "$pid" 2>/dev/null || break
  done
  # A late warning (during clean-up after the step) must not kill this shell: ignore it.
  trap '' USR1
  trap - TERM
  if [[ $XS_STOP_SIGNAL == USR1 ]] && ((status == 0)); then
    trap xs_requeue EXIT
  fi
  return "$status"
}

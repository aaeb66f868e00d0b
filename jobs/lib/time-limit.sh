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
# preemption) to srun, which forwards them to every rank. Source this file before any other step
# (staging, a cache restore): its traps then hold a warning that comes early, and the training
# step does not start at all. xscale's trainers then finish the
# current step, write a checkpoint and exit 0. After a clean stop on USR1 the job is requeued
# when the script exits (so that any clean-up after the step still runs), and the next run
# resumes from the newest checkpoint in the same output directory. A stop on TERM is not
# requeued: scancel means stop, and Slurm requeues preempted jobs itself.
#
# Allow for the time a checkpoint takes when choosing @SECONDS; Slurm may also send the signal
# up to a minute early. A --time shorter than @SECONDS plus a minute gets the warning as the job
# starts: each run would stop at once and requeue itself again, so requeueing stops after
# XSCALE_MAX_REQUEUES runs (default 20; Slurm counts them in SLURM_RESTART_COUNT).

XS_STOP_SIGNAL=""  # the stop signal received so far, if any
XS_STEP_PID=""     # the running requeueable step

# The traps are set as this file is sourced, before any step: a warning that arrives during an
# earlier step (staging, a cache restore) is held until that step ends (bash runs a trap once
# the foreground command returns) instead of killing the batch shell, whose default action for
# USR1 is to exit. With a step running, the signal is passed on to it.
xs_on_stop() {
  local signal=$1
  XS_STOP_SIGNAL=$signal
  if [[ -n $XS_STEP_PID ]] && kill -0 "$XS_STEP_PID" 2>/dev/null; then
    printf 'xscale: SIG%s received: the ranks save a checkpoint after this step and exit\n' \
      "$signal" >&2
    kill -s "$signal" "$XS_STEP_PID" 2>/dev/null || true
  else
    printf 'xscale: SIG%s received while no training step runs: none will start\n' "$signal" >&2
  fi
}
trap 'xs_on_stop USR1' USR1
trap 'xs_on_stop TERM' TERM

# The job to requeue: an array task is requeued by its own id (ARRAY_TASK), not the array's.
xs_requeue_id() {
  if [[ -n ${SLURM_ARRAY_JOB_ID:-} && -n ${SLURM_ARRAY_TASK_ID:-} ]]; then
    printf '%s_%s\n' "$SLURM_ARRAY_JOB_ID" "$SLURM_ARRAY_TASK_ID"
  else
    printf '%s\n' "$SLURM_JOB_ID"
  fi
}

xs_requeue() {
  local done_runs=${SLURM_RESTART_COUNT:-0} most=${XSCALE_MAX_REQUEUES:-20} job
  job=$(xs_requeue_id)
  if ((done_runs >= most)); then
    printf '%s: job %s was requeued %s times already (XSCALE_MAX_REQUEUES=%s); %s\n' \
      'xscale: stopped before the time limit, not requeueing' "$job" "$done_runs" \
      "$most" 'is --time longer than the --signal warning?' >&2
    return
  fi
  printf 'xscale: stopped before the time limit; requeueing job %s to resume\n' "$job" >&2
  scontrol requeue "$job"
}

# requeueable_step CMD [ARGS...]: run CMD (the srun line), returning its exit status. Not started
# when a stop signal came earlier: USR1 then requeues the job, TERM returns 143.
requeueable_step() {
  if [[ ! ${XSCALE_MAX_REQUEUES:-20} =~ ^[0-9]+$ ]]; then
    printf "xscale: error: XSCALE_MAX_REQUEUES='%s' is not a whole number\n" \
      "$XSCALE_MAX_REQUEUES" >&2
    exit 2
  fi
  if [[ -z $XS_STOP_SIGNAL ]]; then
    xs_run_step "$@"
  else
    printf 'xscale: not starting the step: SIG%s came before it\n' "$XS_STOP_SIGNAL" >&2
    XS_STEP_STATUS=0
    [[ $XS_STOP_SIGNAL == TERM ]] && XS_STEP_STATUS=143
  fi
  if [[ $XS_STOP_SIGNAL == USR1 ]] && ((XS_STEP_STATUS == 0)); then
    trap xs_requeue EXIT
  fi
  return "$XS_STEP_STATUS"
}

# Run the step in the background so that the traps run while it does; XS_STEP_STATUS=its exit
# status. The step gets XSCALE_LAUNCH_T, the wall-clock time it was launched at (srun passes the
# environment on to every rank), for the trainers' start-up phases (docs/STARTUP.md); only this
# step's environment holds it, so a later srun typed by hand reports its launch as unknown
# rather than this step's. Not `wait` in a loop: a `wait` interrupted by a trap just as the step exits returns
# 128+N, and the next `wait` of bash 5.2 then sometimes returns -1 instead of the step's status
# (1 run in 5 here, tests/bats/time-limit.bats). Polling lets each trap run between two short
# sleeps, and the one `wait` at the end finds the step already gone.
xs_run_step() {
  XSCALE_LAUNCH_T=${EPOCHREALTIME:-} "$@" &
  XS_STEP_PID=$!
  while kill -0 "$XS_STEP_PID" 2>/dev/null; do
    sleep 0.2
  done
  XS_STEP_STATUS=0
  wait "$XS_STEP_PID" || XS_STEP_STATUS=$?
  XS_STEP_PID=""
}

# shellcheck shell=bash
# Time limit -> checkpoint -> requeue, and failed step -> report -> retry without the bad node,
# for Slurm batch scripts (it runs on the host, where scontrol exists, not in the container). In
# a job script:
#
#   #SBATCH --signal=B:USR1@300     # USR1 to the batch shell 300 s before the time limit
#   #SBATCH --requeue               # the job may go back to the queue
#   #SBATCH --no-kill               # a failed node ends the step, not the batch script
#   #SBATCH --open-mode=append      # and its next run appends to the same output file
#   XSCALE_RETRY=1 XSCALE_BLAME="slurm lumi"   # retry without nodes that LUMI's patterns blame
#   source "$XSCALE_ROOT/jobs/lib/time-limit.sh"
#   requeueable_step srun --label --kill-on-bad-exit=1 ... /runscripts/run.sh python train.py ...
#
# Time limit. `B:` signals only the batch shell, so this shell must pass the signal on:
# requeueable_step runs the step in the background and forwards USR1 (the time-limit warning) and
# TERM (scancel, preemption) to srun, which forwards them to every rank. Source this file before
# any other step (staging, a cache restore): its traps then hold a warning that comes early, and
# the training step does not start at all. xscale's trainers then finish the current step, write
# a checkpoint and exit 0. After a clean stop on USR1 the job is requeued when the script exits
# (so that any clean-up after the step still runs), and the next run resumes from the newest
# checkpoint in the same output directory; a step whose rank 0 reports that it finished its
# training (XSCALE_SUMMARY with "stopped_early": false) is not requeued, even if the warning
# came as it ended. A stop on TERM is not requeued: scancel means stop, and Slurm requeues
# preempted jobs itself.
#
# Allow for the time a checkpoint takes when choosing @SECONDS; Slurm may also send the signal
# up to a minute early. A --time shorter than @SECONDS plus a minute gets the warning as the job
# starts: each run would stop at once and requeue itself again, so requeueing stops after
# XSCALE_MAX_REQUEUES runs (default 20; Slurm counts them in SLURM_RESTART_COUNT).
#
# Failures. The step's output (with srun --label, each rank's lines carry its rank) is copied to
# XSCALE_RECORDS_DIR (default SUBMIT_DIR/xscale-records/JOB) as it is printed. When the step
# fails, failure_report.py prints the first failure (rank, node, status, last lines), the
# knock-on ones, and the nodes to blame: those that Slurm lost or set down during the step, and
# those a bad-node pattern of XSCALE_BLAME's files (jobs/lib/blame/NAME.patterns) names. With
# XSCALE_RETRY=1 the job is then requeued without the blamed nodes, at most XSCALE_MAX_RETRIES
# times (default 3; the history is in XSCALE_RECORDS_DIR/retries), and its next run resumes from
# the checkpoint. A failure that blames no node is not retried: a bug must not loop.
# docs/FAILURES.md has the whole story.

XS_STOP_SIGNAL=""  # the stop signal received so far, if any
XS_REQUEUED=""     # set once this script has requeued its job
XS_STEP_PID=""     # the running requeueable step

# The traps are set as this file is sourced, before any step: a warning that arrives during an
# earlier step (staging, a cache restore) is held until that step ends (bash runs a trap once
# the foreground command returns) instead of killing the batch shell, whose default action for
# USR1 is to exit. With a step running, the signal is passed on to it.
xs_on_stop() {
  local signal=$1
  # The TERM that ends the batch script of a job this script requeued is no news.
  [[ -n $XS_REQUEUED ]] && return
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

XS_LIB_JOBS=${BASH_SOURCE[0]%/*}
XS_STEP_COUNT=0    # requeueable steps run so far in this run of the job
XS_RETRY_EXCLUDE=""

# requeueable_step CMD [ARGS...]: run CMD (the srun line), returning its exit status. Not started
# when a stop signal came earlier: USR1 then requeues the job, TERM returns 143. A failed step is
# reported, and retried without the nodes it blames when XSCALE_RETRY=1.
requeueable_step() {
  xs_check_settings
  xs_next_step_log
  local log=$XS_STEP_LOG
  if [[ -z $XS_STOP_SIGNAL ]]; then
    xs_run_step "$log" "$@"
  else
    printf 'xscale: not starting the step: SIG%s came before it\n' "$XS_STOP_SIGNAL" >&2
    XS_STEP_STATUS=0
    [[ $XS_STOP_SIGNAL == TERM ]] && XS_STEP_STATUS=143
  fi
  if [[ $XS_STOP_SIGNAL == USR1 ]] && ((XS_STEP_STATUS == 0)); then
    if xs_training_finished "$log"; then
      printf 'xscale: the step had finished its training when SIGUSR1 came: no requeue\n' >&2
    else
      trap xs_requeue EXIT
    fi
  elif ((XS_STEP_STATUS != 0)) && [[ $XS_STOP_SIGNAL != TERM ]]; then
    xs_report_failure "$log"
  fi
  return "$XS_STEP_STATUS"
}

# Every setting is checked before the first step: one line and exit 2, not a surprise after an
# hour of training.
xs_check_settings() {
  local name
  for name in XSCALE_MAX_REQUEUES XSCALE_MAX_RETRIES; do
    if [[ -v $name && ! ${!name} =~ ^[0-9]+$ ]]; then
      printf "xscale: error: %s='%s' is not a whole number\n" "$name" "${!name}" >&2
      exit 2
    fi
  done
  if [[ ! ${XSCALE_RETRY:-0} =~ ^[01]$ ]]; then
    printf "xscale: error: XSCALE_RETRY='%s' must be 0 or 1\n" "$XSCALE_RETRY" >&2
    exit 2
  fi
  xs_blame_files
  if ((${#XS_BLAME_FILES[@]})); then
    python3 "$XS_LIB_JOBS/failure_report.py" --check-patterns "${XS_BLAME_FILES[@]}" || exit 2
  fi
}

# XS_BLAME_FILES=the pattern files XSCALE_BLAME names (default "slurm": any site's). A word
# with a slash is a path; any other is jobs/lib/blame/WORD.patterns.
xs_blame_files() {
  local word
  XS_BLAME_FILES=()
  for word in ${XSCALE_BLAME-slurm}; do
    if [[ $word == */* ]]; then
      XS_BLAME_FILES+=("$word")
    else
      XS_BLAME_FILES+=("$XS_LIB_JOBS/blame/$word.patterns")
    fi
  done
}

# The job to requeue: an array task is requeued by its own id (ARRAY_TASK), not the array's.
xs_requeue_id() {
  if [[ -n ${SLURM_ARRAY_JOB_ID:-} && -n ${SLURM_ARRAY_TASK_ID:-} ]]; then
    printf '%s_%s\n' "$SLURM_ARRAY_JOB_ID" "$SLURM_ARRAY_TASK_ID"
  else
    printf '%s\n' "$SLURM_JOB_ID"
  fi
}

# Where this job keeps its step logs and retry history: the same directory in every run, so the
# next run knows how often it was retried. XS_STEP_LOG=the next step's log file.
xs_next_step_log() {
  xs_records_dir
  XS_STEP_COUNT=$((XS_STEP_COUNT + 1))
  XS_STEP_LOG=$XSCALE_RECORDS_DIR/run${SLURM_RESTART_COUNT:-0}-step$XS_STEP_COUNT.log
}

xs_records_dir() {
  : "${XSCALE_RECORDS_DIR:=${SLURM_SUBMIT_DIR:-$PWD}/xscale-records/$(xs_requeue_id)}"
  if ! mkdir -p "$XSCALE_RECORDS_DIR" 2>/dev/null || [[ ! -w $XSCALE_RECORDS_DIR ]]; then
    printf 'xscale: error: XSCALE_RECORDS_DIR %s cannot be created or written\n' \
      "$XSCALE_RECORDS_DIR" >&2
    exit 2
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
  XS_REQUEUED=1
  scontrol requeue "$job"
}

# A step that ran its training to the end says so in rank 0's summary line.
xs_training_finished() {
  grep -Eq '^ *0: XSCALE_SUMMARY .*"stopped_early": false' "$1" 2>/dev/null
}

# Run the step in the background so that the traps run while it does; XS_STEP_STATUS=its exit
# status. Its output goes to the job's output as before and, through a tee that ignores the stop
# signals (they are for the ranks), to LOG. The step gets XSCALE_LAUNCH_T, the wall-clock time it
# was launched at (srun passes the environment on to every rank), for the trainers' start-up
# phases (docs/STARTUP.md); only this step's environment holds it, so a later srun typed by hand
# reports its launch as unknown rather than this step's. Not `wait` in a loop: a `wait`
# interrupted by a trap just as the step exits returns 128+N, and the next `wait` of bash 5.2
# then sometimes returns -1 instead of the step's status (1 run in 5 here,
# tests/bats/time-limit.bats). Polling lets each trap run between two short sleeps, and the one
# `wait` at the end finds the step already gone.
xs_run_step() {
  local log=$1 copy tee_pid
  shift
  exec {copy}> >(trap '' USR1 TERM INT; exec tee --output-error=warn -a "$log")
  tee_pid=$!
  XSCALE_LAUNCH_T=${EPOCHREALTIME:-} "$@" >&"$copy" 2>&1 &
  XS_STEP_PID=$!
  # A signal that came between the launch and the line above found no step to pass it on to.
  if [[ -n $XS_STOP_SIGNAL ]]; then
    kill -s "$XS_STOP_SIGNAL" "$XS_STEP_PID" 2>/dev/null || true
  fi
  exec {copy}>&-
  while kill -0 "$XS_STEP_PID" 2>/dev/null; do
    sleep 0.2
  done
  XS_STEP_STATUS=0
  wait "$XS_STEP_PID" || XS_STEP_STATUS=$?
  XS_STEP_PID=""
  # tee ends once the step's last output is written, unless a process the step left behind
  # still holds the pipe: then the log may miss that process's lines, not the step's.
  local polls=0
  while kill -0 "$tee_pid" 2>/dev/null && ((polls++ < 100)); do
    sleep 0.05
  done
}

# ---- failures ---------------------------------------------------------------------------------

# The report of a failed step, then a retry without the nodes it blames (if any, and if asked).
xs_report_failure() {
  local log=$1 states="$1.node-states" blamed="$1.blamed"
  printf 'xscale: the step failed with exit status %s; what srun saw:\n' "$XS_STEP_STATUS" >&2
  # Nodes Slurm lost or set down while the step ran (with --no-kill the job outlives them).
  sinfo --noheader --Node --nodes="${SLURM_JOB_NODELIST:-}" --format='%N %T' >"$states" 2>/dev/null \
    || : >"$states"
  xs_blame_files
  python3 "$XS_LIB_JOBS/failure_report.py" --log "$log" --nodes "${SLURM_JOB_NODELIST:-}" \
    --tasks-per-node "${SLURM_TASKS_PER_NODE:-}" --node-states "$states" \
    --patterns "${XS_BLAME_FILES[@]}" --blame-file "$blamed" >&2 || return 0
  local nodes=""
  [[ -r $blamed ]] && read -r nodes <"$blamed"
  [[ -n $nodes ]] && xs_retry_without "$nodes" "the failure above"
  return 0
}

# xs_retry_without NODES WHY: requeue the job without NODES (a Slurm hostlist) when it ends, if
# XSCALE_RETRY=1 and fewer than XSCALE_MAX_RETRIES retries were made. Also the way the preflight
# doctor's exclude list comes back (jobs/lumi/smoke.sbatch).
xs_retry_without() {
  local nodes=$1 why=$2 job retries=0 most=${XSCALE_MAX_RETRIES:-3} history
  job=$(xs_requeue_id)
  xs_records_dir
  history=$XSCALE_RECORDS_DIR/retries
  if [[ ${XSCALE_RETRY:-0} != 1 ]]; then
    printf 'xscale: to run again without %s: sbatch --exclude=%s ... (XSCALE_RETRY=1 does it)\n' \
      "$nodes" "$nodes" >&2
    return 0
  fi
  [[ -f $history ]] && retries=$(grep -c . "$history")
  if ((retries >= most)); then
    printf 'xscale: not retrying job %s without %s: %s retries already (XSCALE_MAX_RETRIES=%s)\n' \
      "$job" "$nodes" "$retries" "$most" >&2
    return 0
  fi
  printf '%s run %s: excluded %s after %s\n' "$(date '+%FT%T')" "${SLURM_RESTART_COUNT:-0}" \
    "$nodes" "$why" >>"$history"
  printf 'xscale: retry %s of %s: requeueing job %s without %s when this script ends\n' \
    "$((retries + 1))" "$most" "$job" "$nodes" >&2
  XS_RETRY_EXCLUDE=$nodes
  trap xs_requeue_without EXIT
}

# Slurm changes ExcNodeList only while a job is pending ("Job is no longer pending execution"),
# so the job is requeued first, then updated; Slurm holds a requeued job back (BeginTime) for
# longer than the update takes. Not `requeuehold` then `release`: requeueing sends TERM, then
# after KillWait SIGKILL, to every process of the job, and an update that waits for the failed
# step to finish can outlast KillWait (seen on the test bed, KillWait=5): a job whose `release`
# never ran would stay held, while one whose update was lost only runs again with the nodes
# Slurm still allows. The calls ignore TERM so that scontrol is not killed before its reply.
# Nodes excluded by earlier retries stay excluded.
xs_requeue_without() {
  local job excluded
  job=$(xs_requeue_id)
  excluded=$(scontrol show job "$job" 2>/dev/null | grep -o 'ExcNodeList=[^ ]*' || true)
  excluded=${excluded#ExcNodeList=}
  [[ $excluded == "(null)" ]] && excluded=""
  XS_REQUEUED=1
  (
    trap '' TERM
    scontrol requeue "$job" &&
      scontrol update JobId="$job" ExcNodeList="${excluded:+$excluded,}$XS_RETRY_EXCLUDE"
  )
}

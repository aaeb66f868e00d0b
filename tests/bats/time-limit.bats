#!/usr/bin/env bats
# jobs/lib/time-limit.sh's decisions, with `scontrol` replaced by a recorder. The real
# signal -> checkpoint -> requeue -> resume path runs on the virtual cluster
# (tests/test_failures.py::test_time_limit_stops_saves_requeues_and_resumes).

setup() {
  REPO=$(cd "$BATS_TEST_DIRNAME/../.." && pwd -P)
  WORK=$(mktemp -d)
  mkdir "$WORK/bin"
  printf '#!/bin/bash\necho "$*" >>"%s/scontrol.calls"\n' "$WORK" >"$WORK/bin/scontrol"
  chmod +x "$WORK/bin/scontrol"
  export PATH=$WORK/bin:$PATH SLURM_JOB_ID=42
}

teardown() {
  rm -rf "$WORK"
}

# A batch script whose step asks for the time-limit warning itself: it sends USR1 to the batch
# shell (its parent), then exits 0 once the shell has forwarded the signal back to it.
warned_job() {
  cat >"$WORK/job.sh" <<JOB
set -euo pipefail  # as in the templates
source "$REPO/jobs/lib/time-limit.sh"
requeueable_step bash -c 'trap "exit \${STEP_STATUS:-0}" USR1; kill -USR1 \$PPID; sleep 60 & wait'
echo "after the step"
JOB
  run bash "$WORK/job.sh"
}

@test "the warning reaches the step, and a clean stop requeues the job after the script's end" {
  warned_job
  [ "$status" -eq 0 ]
  [[ $output == *"SIGUSR1 received"* ]]
  [[ $output == *"after the step"*"requeueing job 42"* ]]
  [ "$(cat "$WORK/scontrol.calls")" = "requeue 42" ]
}

@test "a step that fails after the warning is not requeued, and its status is the script's" {
  STEP_STATUS=3 warned_job
  [ "$status" -eq 3 ]
  [ ! -e "$WORK/scontrol.calls" ]
}

@test "a step that ends without a warning is not requeued" {
  run bash -c "source '$REPO/jobs/lib/time-limit.sh'; requeueable_step true"
  [ "$status" -eq 0 ]
  [ ! -e "$WORK/scontrol.calls" ]
}

@test "requeueing stops after XSCALE_MAX_REQUEUES runs" {
  SLURM_RESTART_COUNT=3 XSCALE_MAX_REQUEUES=3 warned_job
  [ "$status" -eq 0 ]
  [[ $output == *"not requeueing: job 42 was requeued 3 times already"* ]]
  [ ! -e "$WORK/scontrol.calls" ]
}

@test "a malformed XSCALE_MAX_REQUEUES stops before the step runs" {
  XSCALE_MAX_REQUEUES='1+x' run bash -c \
    "source '$REPO/jobs/lib/time-limit.sh'; requeueable_step touch '$WORK/ran'"
  [ "$status" -eq 2 ]
  [ "$output" = "xscale: error: XSCALE_MAX_REQUEUES='1+x' is not a whole number" ]
  [ ! -e "$WORK/ran" ]
}

@test "a warning during an earlier step is held: the training step does not start, the job requeues" {
  cat >"$WORK/job.sh" <<JOB
set -euo pipefail
source "$REPO/jobs/lib/time-limit.sh"
bash -c 'kill -USR1 \$PPID'  # a staging step, during which the warning comes
echo "staging done"
requeueable_step touch "$WORK/trained"
echo "after the step"
JOB
  run bash "$WORK/job.sh"
  [ "$status" -eq 0 ]
  [[ $output == *"staging done"*"not starting the step: SIGUSR1 came before it"*"after the step"* ]]
  [ ! -e "$WORK/trained" ]
  [ "$(cat "$WORK/scontrol.calls")" = "requeue 42" ]
}

@test "a warning that arrives just as the step exits: its real status, and a requeue" {
  # The step (which, like srun's ranks, handles USR1) signals the shell and exits 0 at once, so
  # the warning and the step's end race. Repeated: bash's own wait got this wrong 1 run in 5.
  cat >"$WORK/job.sh" <<JOB
set -euo pipefail
source "$REPO/jobs/lib/time-limit.sh"
requeueable_step bash -c "trap '' USR1; kill -USR1 \$\$; exit 0"
echo "step status \$?"
JOB
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    rm -f "$WORK/scontrol.calls"
    run bash "$WORK/job.sh"
    [ "$status" -eq 0 ]
    [[ $output == *"step status 0"* ]]
    [ "$(cat "$WORK/scontrol.calls")" = "requeue 42" ]
  done
}

@test "an array task requeues itself, not the whole array" {
  SLURM_ARRAY_JOB_ID=40 SLURM_ARRAY_TASK_ID=3 warned_job
  [ "$status" -eq 0 ]
  [ "$(cat "$WORK/scontrol.calls")" = "requeue 40_3" ]
}

@test "the step gets its launch time, and only the step: a later command does not" {
  cat >"$WORK/job.sh" <<JOB
set -euo pipefail
source "$REPO/jobs/lib/time-limit.sh"
before=\$EPOCHREALTIME
requeueable_step bash -c 'printf "%s\n" "\$XSCALE_LAUNCH_T" >"$WORK/launch"'
after=\$EPOCHREALTIME
printf '%s %s\n' "\$before" "\$after" >"$WORK/window"
printf 'later: %s\n' "\${XSCALE_LAUNCH_T:-unset}"
JOB
  run bash "$WORK/job.sh"
  [ "$status" -eq 0 ]
  [ "$output" = "later: unset" ]
  read -r launch <"$WORK/launch"
  read -r before after <"$WORK/window"
  # Compare as microseconds: bash has no floating point.
  [ "${before/[.,]/}" -le "${launch/[.,]/}" ]
  [ "${launch/[.,]/}" -le "${after/[.,]/}" ]
}

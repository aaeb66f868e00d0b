#!/usr/bin/env bats
# jobs/lib/supervise.sh's and supervisor.py's decisions, with `scontrol` replaced by a recorder and `sinfo` by a
# node-state table. The real signal -> checkpoint -> requeue -> resume path and the real
# failure -> blame -> retry path run on the virtual cluster (tests/test_failures.py).

setup() {
  REPO=$(cd "$BATS_TEST_DIRNAME/../.." && pwd -P)
  WORK=$(mktemp -d)
  mkdir "$WORK/bin"
  printf '#!/bin/bash\necho "$*" >>"%s/scontrol.calls"\n' "$WORK" >"$WORK/bin/scontrol"
  printf '#!/bin/bash\ncat "%s/node-states" 2>/dev/null || true\n' "$WORK" >"$WORK/bin/sinfo"
  chmod +x "$WORK/bin/scontrol" "$WORK/bin/sinfo"
  export PATH=$WORK/bin:$PATH SLURM_JOB_ID=42 XSCALE_RECORDS_DIR=$WORK/records \
    SLURM_JOB_NODELIST='nid[001-002]' SLURM_TASKS_PER_NODE='2(x2)'
}

teardown() {
  rm -rf "$WORK"
}

# A batch script whose step asks for the time-limit warning itself: it sends USR1 to the batch
# shell (its parent), then exits 0 once the shell has forwarded the signal back to it. It ends its
# sleep too: bats would wait for a process left holding its output.
warned_job() {
  cat >"$WORK/job.sh" <<JOB
set -euo pipefail  # as in the templates
source "$REPO/jobs/lib/supervise.sh"
requeueable_step bash -c 'trap "kill %1; exit \${STEP_STATUS:-0}" USR1; kill -USR1 \$PPID; sleep 60 & wait'
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
  run bash -c "source '$REPO/jobs/lib/supervise.sh'; requeueable_step true"
  [ "$status" -eq 0 ]
  [ ! -e "$WORK/scontrol.calls" ]
}

@test "requeueing stops after XSCALE_MAX_REQUEUES runs" {
  SLURM_RESTART_COUNT=3 XSCALE_MAX_REQUEUES=3 warned_job
  [ "$status" -eq 0 ]
  [[ $output == *"not requeueing: job 42 was requeued 3 times already"* ]]
  [ ! -e "$WORK/scontrol.calls" ]
}

@test "a malformed live recovery setting stops before the step runs" {
  local setting expected
  for setting in XSCALE_HEARTBEAT_S=abc XSCALE_HEARTBEAT_S=0 XSCALE_LIVE_RECOVERY=maybe; do
    run env "$setting" bash -c \
      "source '$REPO/jobs/lib/supervise.sh'; requeueable_step touch '$WORK/ran'"
    [ "$status" -eq 2 ]
    expected="is not a positive number of seconds"
    [[ $setting == XSCALE_LIVE_RECOVERY=* ]] && expected="is neither 0 nor 1"
    [ "$output" = "xscale: error: ${setting%%=*}='${setting#*=}' $expected" ]
    [ ! -e "$WORK/ran" ]
  done
}

@test "a malformed count of requeues, spares or restarts stops before the step runs" {
  local setting
  for setting in XSCALE_MAX_REQUEUES='1+x' XSCALE_SPARES=two XSCALE_MAX_RESTARTS=-1; do
    run env "$setting" bash -c \
      "source '$REPO/jobs/lib/supervise.sh'; requeueable_step touch '$WORK/ran'"
    [ "$status" -eq 2 ]
    [ "$output" = "xscale: error: ${setting%%=*}='${setting#*=}' must be a whole number of at least 0" ]
    [ ! -e "$WORK/ran" ]
  done
}

@test "a floor of nodes that is no number, or more than the launch's nodes, stops before the step runs" {
  local setting
  for setting in XSCALE_MIN_NODES=two XSCALE_MIN_NODES=0; do
    run env "$setting" bash -c \
      "source '$REPO/jobs/lib/supervise.sh'; requeueable_step touch '$WORK/ran'"
    [ "$status" -eq 2 ]
    [ "$output" = "xscale: error: XSCALE_MIN_NODES='${setting#*=}' must be a whole number of at least 1" ]
  done
  run env XSCALE_MIN_NODES=4 XSCALE_SPARES=1 SLURM_JOB_NODELIST='nid[001-004]' \
    SLURM_TASKS_PER_NODE='2(x4)' bash -c \
    "source '$REPO/jobs/lib/supervise.sh'; requeueable_step touch '$WORK/ran'"
  [ "$status" -eq 2 ]
  [ "$output" = "xscale: error: XSCALE_MIN_NODES=4 is more than the 3 nodes the launch trains on (XSCALE_SPARES=1 of the job's 4 wait)" ]
  [ ! -e "$WORK/ran" ]
}

@test "a warning during an earlier step is held: the training step does not start, the job requeues" {
  cat >"$WORK/job.sh" <<JOB
set -euo pipefail
source "$REPO/jobs/lib/supervise.sh"
bash -c 'kill -USR1 \$PPID'  # a staging step, during which the warning comes
echo "staging done"
requeueable_step touch "$WORK/trained"
echo "after the step"
JOB
  run bash "$WORK/job.sh"
  [ "$status" -eq 0 ]
  [[ $output == *"staging done"*"not starting the launch: SIGUSR1 came before it"*"after the step"* ]]
  [ ! -e "$WORK/trained" ]
  [ "$(cat "$WORK/scontrol.calls")" = "requeue 42" ]
}

@test "a warning that arrives just as the step exits: its real status, and a requeue" {
  # The step (which, like srun's ranks, handles USR1) signals the shell and exits 0 at once, so
  # the warning and the step's end race. Repeated: bash's own wait got this wrong 1 run in 5.
  cat >"$WORK/job.sh" <<JOB
set -euo pipefail
source "$REPO/jobs/lib/supervise.sh"
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

@test "a step that finished its training when the warning came is not requeued" {
  cat >"$WORK/job.sh" <<JOB
set -euo pipefail
source "$REPO/jobs/lib/supervise.sh"
requeueable_step bash -c "trap '' USR1; kill -USR1 \$\$; echo '{\"event\": \"end\", \"step\": 60, \"time\": 0, \"stopped\": false}' >>\"\\\$XSCALE_PROGRESS\""
JOB
  run bash "$WORK/job.sh"
  [ "$status" -eq 0 ]
  [[ $output == *"had finished its training when SIGUSR1 came: no requeue"* ]]
  [ ! -e "$WORK/scontrol.calls" ]
}

# A failed step as srun --label prints it: rank 1 says LINE, then srun reports its exit and the
# knock-on kill of the others.
failed_job() {
  cat >"$WORK/job.sh" <<JOB
set -euo pipefail
source "$REPO/jobs/lib/supervise.sh"
requeueable_step bash -c 'printf "0: step 10\n1: %s\n" "\$1"
  printf "srun: error: nid001: task 1: Exited with exit code 1\nsrun: error: nid001: task 0: Killed\n" >&2
  exit 1' step "$1"
JOB
  run bash "$WORK/job.sh"
}

HW_EXCEPTION='HW Exception by GPU node-4 (Agent handle: 0x1ebc04e0) reason :GPU Hang'

@test "a step that a bad-node pattern blames is reported and requeued without that node" {
  XSCALE_RETRY=1 XSCALE_BLAME="slurm lumi" failed_job "$HW_EXCEPTION"
  [ "$status" -eq 1 ]
  [[ $output == *"first failure: rank 1 on nid001: exited with exit code 1"* ]]
  [[ $output == *"knock-on: 1 rank ended after it: rank 0 on nid001: killed"* ]]
  [[ $output == *"blame: nid001: lumi.patterns [lumi-hsa-hw-exception] (rank 1)"* ]]
  [[ $output == *"retry 1 of 3: requeueing job 42 without nid001"* ]]
  [ "$(cat "$WORK/scontrol.calls")" = "show job 42
requeue 42
update JobId=42 ExcNodeList=nid001" ]
  grep -q "attempt 0: excluded nid001" "$WORK/records/retries"
}

@test "a node Slurm set down during the step is blamed without any pattern" {
  printf 'nid001 allocated\nnid002 down*\n' >"$WORK/node-states"
  XSCALE_RETRY=1 failed_job "RuntimeError: Connection closed by peer"
  [ "$status" -eq 1 ]
  [[ $output == *"blame: nid002: Slurm set the node down* while the job ran"* ]]
  grep -qx "update JobId=42 ExcNodeList=nid002" "$WORK/scontrol.calls"
}

@test "a failure that blames no node is reported but not retried" {
  XSCALE_RETRY=1 failed_job "ZeroDivisionError: division by zero"
  [ "$status" -eq 1 ]
  [[ $output == *"first failure: rank 1 on nid001"*"1: ZeroDivisionError"* ]]
  [[ $output == *"blame: no node"* ]]
  [ ! -e "$WORK/scontrol.calls" ]
}

@test "retries stop at XSCALE_MAX_RETRIES, and without XSCALE_RETRY the report says how to" {
  mkdir -p "$WORK/records"
  printf 'attempt 0: excluded nid003\nattempt 1: excluded nid004\n' >"$WORK/records/retries"
  XSCALE_RETRY=1 XSCALE_MAX_RETRIES=2 XSCALE_BLAME=lumi failed_job "$HW_EXCEPTION"
  [[ $output == *"not retrying job 42 without nid001: 2 retries already (XSCALE_MAX_RETRIES=2)"* ]]
  [ ! -e "$WORK/scontrol.calls" ]
  XSCALE_BLAME=lumi failed_job "$HW_EXCEPTION"
  [[ $output == *"to run again without nid001: sbatch --exclude=nid001"* ]]
  [ ! -e "$WORK/scontrol.calls" ]
}

@test "bad retry settings and pattern files stop the job before its step, in one line" {
  local setting
  printf '[broken\n' >"$WORK/broken.patterns"
  for setting in XSCALE_MAX_RETRIES=x3 XSCALE_RETRY=yes "XSCALE_BLAME=$WORK/broken.patterns"; do
    run env "$setting" bash -c \
      "set -euo pipefail; source '$REPO/jobs/lib/supervise.sh'; requeueable_step touch '$WORK/ran'"
    [ "$status" -eq 2 ]
    [ "${#lines[@]}" -eq 1 ]
    [[ $output == "xscale: error: "* ]]
    [ ! -e "$WORK/ran" ]
  done
}

@test "the step gets its launch time, and only the step: a later command does not" {
  cat >"$WORK/job.sh" <<JOB
set -euo pipefail
source "$REPO/jobs/lib/supervise.sh"
before=\$EPOCHREALTIME
requeueable_step bash -c 'printf "%s\n" "\$XSCALE_LAUNCH_T" >"$WORK/launch"'
after=\$EPOCHREALTIME
printf '%s %s\n' "\$before" "\$after" >"$WORK/window"
printf 'later: %s\n' "\${XSCALE_LAUNCH_T:-unset}"
JOB
  run bash "$WORK/job.sh"
  [ "$status" -eq 0 ]
  [ "${lines[0]}" = "later: unset" ]
  # As the script ends: what the supervisor saw of a step that noted no progress.
  [[ ${lines[1]} == "xscale: goodput: unknown, the training noted no progress: "*", 1 launch, 0 failed, 0 restarted, 0 requeued" ]]
  read -r launch <"$WORK/launch"
  read -r before after <"$WORK/window"
  # Compare as microseconds: bash has no floating point.
  [ "${before/[.,]/}" -le "${launch/[.,]/}" ]
  [ "${launch/[.,]/}" -le "${after/[.,]/}" ]
}

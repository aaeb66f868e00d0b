#!/usr/bin/env bash
# Live recovery, run to the end, again and again (docs/FAILURES.md, "Live recovery"): the LUMI
# MNIST template on the four virtual nodes with XSCALE_SPARES=1 (3 x 2 ranks train, one node
# waits), MAX_STEPS=40, a checkpoint every 4 steps, and the node of ranks 2-3 crashed
# (tests/cluster/fault.sh crash) at a moment named by rank 0's progress notes. One line a run:
# the job's end state, whether a recovery happened and the step training went on at, the
# summary's steps, and the report's first line where the launch failed.
#   [TRAINER_ARGS='--grad-accum-steps 2'] bash tests/bench/live_recovery.sh [RUNS [MOMENT...]]
# TRAINER_ARGS: more of mnist_ddp.py's options, split at spaces (two micro-batches per step
# put the crash in the middle of a step half the time).
# MOMENT: checkpoint:8 (right after the checkpoint at step 8: the default), checkpoint:20 (just
# before the vote at step 20), interval:30 (in the last interval), end (in the evaluation after
# the training). Needs the cluster up and root (the fault helper).
set -euo pipefail

REPO=$(cd "${BASH_SOURCE[0]%/*}/../.." && pwd -P)
readonly REPO WORK=$REPO/build/bench-live-recovery
PYTHON=$REPO/.venv/bin/python

# submit NAME DATA: the job's id.
submit() {
  local name=$1 data=$2 trainer_args
  read -ra trainer_args <<< "${TRAINER_ARGS:-}"
  rm -rf -- "${WORK:?}/$name" && mkdir -p -- "$WORK/$name"
  PATH=$REPO/tests/shim:$REPO/.venv/bin:$PATH SIF=$WORK/xscale-test.sif DATA=$data \
    BINDS="$REPO,$REPO/runscripts:/runscripts,$WORK" MAX_STEPS=40 USE_GPU=0 \
    DIST_BACKEND=gloo CPU_MASKS=0x1,0x2 OUTPUT_DIR=$WORK/$name/out XSCALE_SPARES=1 \
    XSCALE_RETRY=1 sbatch --parsable -o "$WORK/$name/job.out" --partition=debug \
      --account=xscale-test --nodes=4 --ntasks-per-node=2 --gpus-per-node=4 \
      --time=00:15:00 "$REPO/jobs/lumi/mnist.sbatch" --checkpoint-every 4 --epochs 100000 \
      "${trainer_args[@]}"
}

# shellcheck source=tests/bench/jobs.sh
source "$REPO/tests/bench/jobs.sh"

# noted PROGRESS MOMENT: whether rank 0 noted MOMENT (EVENT:STEP, or EVENT) in PROGRESS.
noted() {
  local event=${2%%:*} step=${2#*:}
  [[ $step == "$2" ]] && step=""
  [[ -e $1 ]] && grep -q "\"event\": \"$event\", \"step\": ${step:-[0-9]*}[,}]" "$1"
}

# run NAME MOMENT: one job, one crash at MOMENT, one line. The crash in the evaluation needs
# one long enough to be hit: 60,000 test images (about 4 s on the bed) instead of 512.
run() {
  local name=$1 moment=$2 job crashed data=$WORK/mnist
  [[ $moment == end ]] && data=$WORK/mnist-long-evaluation
  job=$(submit "$name" "$data")
  wait_until 240 "start of job $job" running "$job"
  crashed=$(scontrol show hostnames "$(squeue -h -j "$job" -o %N)" | sed -n 2p)
  if wait_until 240 "$moment in job $job" noted \
      "$WORK/$name/out/xscale-records/attempt0-launch1.progress" "$moment"; then
    bash "$REPO/tests/cluster/fault.sh" crash "$crashed" >/dev/null
  fi
  wait_until 600 "end of job $job" ended "$job" || scancel "$job"
  bash "$REPO/tests/cluster/fault.sh" heal "$crashed" >/dev/null
  "$PYTHON" - "$WORK/$name/job.out" "$name" "$moment" "$job" <<'EOF'
import json, re, subprocess, sys

text, name, moment, job = open(sys.argv[1]).read(), sys.argv[2], sys.argv[3], sys.argv[4]
state = re.search(r"JobState=(\S+)", subprocess.run(
    ["scontrol", "show", "job", job], capture_output=True, text=True).stdout)
went_on = re.findall(r"training goes on at step (\d+)", text)
formed = re.findall(r"the group re-formed ([\d.]+) s after", text)
summaries = [json.loads(line.split("XSCALE_SUMMARY ", 1)[1]) for line in text.splitlines()
             if "XSCALE_SUMMARY " in line]
failed = [line for line in text.splitlines() if re.match(r"xscale: (the training finished|"
                                                         r"the launch failed|live recovery: not)",
                                                         line)]
print(f"{name} ({moment}): {state.group(1) if state else '?'}; "
      f"live recovery: {'at step ' + went_on[0] if went_on else 'none'}"
      + (f" (re-formed {formed[0]} s after the failure was noticed)" if formed else "") + "; "
      f"steps {summaries[-1]['steps'] if summaries else '-'}"
      + (f"; {failed[0]}" if failed else ""))
EOF
}

main() {
  local runs=${1:-10} moment index
  shift || true
  (($#)) || set -- checkpoint:8
  mkdir -p -- "$WORK"
  touch -- "$WORK/xscale-test.sif"  # the shim ignores the image, but SIF must name a file
  [[ -d $WORK/mnist ]] || "$PYTHON" "$REPO/tests/fixtures/mnist_idx.py" "$WORK/mnist" >/dev/null
  [[ -d $WORK/mnist-long-evaluation ]] || "$PYTHON" "$REPO/tests/fixtures/mnist_idx.py" \
    --test 60000 "$WORK/mnist-long-evaluation" >/dev/null
  for moment in "$@"; do
    for ((index = 1; index <= runs; index++)); do
      run "run$index-${moment/:/-}" "$moment"
    done
  done
}

main "$@"

#!/usr/bin/env bash
# How long a crashed node costs, on the virtual cluster (docs/GOODPUT.md): jobs/local/mnist.sbatch
# training on 3 nodes x 2 ranks, one node crashed (tests/cluster/fault.sh crash) right after the
# first checkpoint; once with a spare (XSCALE_SPARES=1 on 4 nodes: the step restarts in the same
# allocation), once without (3 nodes: the job is requeued without the node and waits Slurm's
# hold, not shortened). One line each: the crash to Slurm's verdict (the step's end), to the
# relaunch, to the resumed step's first step; then the job's goodput line. Needs the cluster up
# (`make bench` starts it) and root (the fault helper).
#   bash tests/bench/recovery.sh
set -euo pipefail

REPO=$(cd "${BASH_SOURCE[0]%/*}/../.." && pwd -P)
readonly REPO WORK=$REPO/build/bench-recovery
PYTHON=$REPO/.venv/bin/python

# submit NAME NODES SPARES: the job's id.
submit() {
  local name=$1 nodes=$2 spares=$3
  rm -rf -- "${WORK:?}/$name" && mkdir -p -- "$WORK/$name"
  PATH=$REPO/tests/shim:$REPO/.venv/bin:$PATH SIF=$WORK/xscale-test.sif DATA=$WORK/mnist \
    BINDS="$REPO,$REPO/runscripts:/runscripts,$WORK" MAX_STEPS=300 EPOCHS=100 \
    CHECKPOINT_EVERY=10 OMP_NUM_THREADS=1 OUTPUT_DIR=$WORK/$name/out XSCALE_SPARES=$spares \
    XSCALE_RETRY=1 sbatch --parsable -o "$WORK/$name/job.out" --partition=debug \
      --account=xscale-test --nodes="$nodes" --ntasks-per-node=2 --gpus-per-node=4 \
      --time=00:15:00 --no-kill --requeue --open-mode=append "$REPO/jobs/local/mnist.sbatch"
}

# shellcheck source=tests/bench/jobs.sh
source "$REPO/tests/bench/jobs.sh"

# measure NAME NODES SPARES: one crash, and the line that tells its cost.
measure() {
  local name=$1 job crashed crashed_at
  job=$(submit "$@")
  wait_until 240 "start of job $job" running "$job" || exit 1
  crashed=$(scontrol show hostnames "$(squeue -h -j "$job" -o %N)" | sed -n 2p)
  wait_until 240 "checkpoint in job $job" test -e "$WORK/$name/out/ckpt-000010.pt" || exit 1
  crashed_at=$EPOCHREALTIME
  bash "$REPO/tests/cluster/fault.sh" crash "$crashed" >/dev/null
  wait_until 600 "end of job $job" ended "$job" || exit 1
  bash "$REPO/tests/cluster/fault.sh" heal "$crashed" >/dev/null
  "$PYTHON" - "$WORK/$name" "${crashed_at/,/.}" "$name" <<'EOF'
import json, sys
from pathlib import Path

work, crashed_at, name = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
records = work / "out" / "xscale-records"
steps = [step for run in sorted(records.glob("run*.json"))
         for step in json.loads(run.read_text())["steps"]]
failed, resumed = steps[0], steps[1]
progress = Path(resumed["log"][:-len(".log")] + ".progress").read_text().splitlines()
first = next(json.loads(line)["time"] for line in progress
             if json.loads(line)["event"] == "first_step")
goodput = [line for line in (work / "job.out").read_text().splitlines()
           if line.startswith("xscale: goodput:")][-1]
print(f"{name}: crash -> Slurm's verdict {failed['ended'] - crashed_at:.1f} s -> relaunch "
      f"{resumed['launched'] - failed['ended']:.1f} s -> first step "
      f"{first - resumed['launched']:.1f} s: {first - crashed_at:.1f} s in all\n  {goodput}")
EOF
}

main() {
  mkdir -p -- "$WORK"
  touch -- "$WORK/xscale-test.sif"  # the shim ignores the image, but SIF must name a file
  [[ -d $WORK/mnist ]] || "$PYTHON" "$REPO/tests/fixtures/mnist_idx.py" "$WORK/mnist" >/dev/null
  measure spare 4 1
  measure requeue 3 0
}

main "$@"

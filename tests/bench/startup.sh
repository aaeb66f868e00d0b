#!/usr/bin/env bash
# The start-up phases (docs/STARTUP.md) on the virtual cluster at 1, 2 and 4 nodes x 2 ranks:
# jobs/local/mnist.sbatch, RUNS times per size, each run's phase table as `xscale report` prints
# it and one line per run for the calibration table. Needs the cluster up (`make bench` starts
# it).
#   bash tests/bench/startup.sh [NODES...]      (default: 1 2 4; RUNS=3, MAX_STEPS=3)
set -euo pipefail

REPO=$(cd "${BASH_SOURCE[0]%/*}/../.." && pwd -P)
readonly REPO RUNS=${RUNS:-3} STEPS=${MAX_STEPS:-3}
readonly WORK=$REPO/build/bench-startup
PYTHON=$REPO/.venv/bin/python

# One job at NODES x 2 ranks, waited for; prints its output file's path.
run_job() {
  local nodes=$1 run=$2 output
  output=$WORK/mnist-N$nodes-run$run.out
  # A fresh output directory: a checkpoint left by an earlier run would resume at the last step
  # and take none, and a run without a step has no first-step phase.
  rm -rf -- "$output" "$WORK/output-N$nodes-run$run"
  PATH=$REPO/tests/shim:$REPO/.venv/bin:$PATH SIF=$WORK/xscale-test.sif DATA=$WORK/mnist \
    BINDS="$REPO,$REPO/runscripts:/runscripts,$WORK" MAX_STEPS=$STEPS \
    OUTPUT_DIR=$WORK/output-N$nodes-run$run \
    sbatch --wait --quiet -o "$output" --partition=debug --account=xscale-test \
      --nodes="$nodes" --ntasks-per-node=2 --gpus-per-node=4 --time=00:10:00 \
      "$REPO/jobs/local/mnist.sbatch" >/dev/null \
    || { echo "startup bench: error: the job at $nodes nodes failed; see $output" >&2; exit 1; }
  printf '%s\n' "$output"
}

main() {
  local nodes run output
  local -a sizes=("$@")
  ((${#sizes[@]})) || sizes=(1 2 4)
  mkdir -p -- "$WORK"
  touch -- "$WORK/xscale-test.sif"  # the shim ignores the image, but SIF must name a file
  [[ -d $WORK/mnist ]] || "$PYTHON" "$REPO/tests/fixtures/mnist_idx.py" "$WORK/mnist" >/dev/null
  for nodes in "${sizes[@]}"; do
    for ((run = 1; run <= RUNS; run++)); do
      output=$(run_job "$nodes" "$run")
      echo "== $nodes nodes x 2 ranks, run $run: $output"
      "$REPO/.venv/bin/xscale" report "$output" | sed -n '/start-up/,$p'
    done
  done
}

main "$@"

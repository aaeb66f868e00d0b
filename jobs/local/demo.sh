#!/usr/bin/env bash
# `make demo`: train the MNIST smoke test on the virtual cluster, 2 nodes x 2 ranks, through the
# singularity shim and runscripts/run.sh, then print a readable summary of the run.
# Expects `make setup cluster-up` to have run (the Makefile does that first).
set -euo pipefail

REPO=$(cd "${BASH_SOURCE[0]%/*}/../.." && pwd -P)
readonly REPO DEMO_DIR=$REPO/build/demo
cd "$REPO"
# The job inherits this PATH: the shim stands in for singularity, the venv for the image's python.
export PATH="$REPO/tests/shim:$REPO/.venv/bin:$PATH"

mkdir -p "$DEMO_DIR"
if [[ ! -e $DEMO_DIR/mnist/train-images-idx3-ubyte ]]; then
  python tests/fixtures/mnist_idx.py "$DEMO_DIR/mnist" >/dev/null
fi

# Said before the figures, so that nobody reads the accuracy as MNIST's.
cat <<'NOTE'
xscale demo: the data is synthetic: MNIST's file format, but ten fixed blocky patterns, shifted
  and noisy (tests/fixtures/mnist_idx.py), because the test bed downloads nothing. A small CNN
  learns them within tens of steps, so the accuracy comes out near 1.000.
NOTE
# The state of job $1 (PENDING, RUNNING, COMPLETED, ...), from slurmctld.
job_state() {
  local info
  info=$(scontrol show job -o "$1")
  info=${info#*JobState=}
  printf '%s\n' "${info%% *}"
}

printf 'xscale demo: submitting jobs/local/mnist.sbatch (2 nodes x 2 ranks) ...\n'
job_id=$(sbatch --parsable --output="$DEMO_DIR/mnist-%j.out" \
  --export=ALL,DATA="$DEMO_DIR/mnist" jobs/local/mnist.sbatch)
# Polled, not `sbatch --wait`: its back-off (2, 8, then 32 s between polls) would keep this
# 20 s job waiting for 42 s.
while [[ $(job_state "$job_id") =~ ^(PENDING|CONFIGURING|RUNNING|COMPLETING|REQUEUED)$ ]]; do
  sleep 0.5
done
state=$(job_state "$job_id")
if [[ $state != COMPLETED ]]; then
  printf 'demo: error: job %s ended %s; its output is in %s\n' "$job_id" "$state" "$DEMO_DIR" >&2
  tail -n 20 "$DEMO_DIR/mnist-$job_id.out" >&2 || true
  exit 1
fi
printf 'xscale demo: job %s finished; output in %s\n' "$job_id" "$DEMO_DIR/mnist-$job_id.out"
# --png: the start-up phases as a picture too, one row per node, beside the output.
xscale report --png "$DEMO_DIR/mnist-$job_id.out"

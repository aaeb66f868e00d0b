#!/usr/bin/env bash
# Threads when ranks share a node's CPUs (srun --cpu-bind=none): run.sh's OMP_NUM_THREADS (the
# node's CPUs divided among its ranks, or SLURM_CPUS_PER_TASK) against every rank taking the
# whole node (OMP_NUM_THREADS=<the node's CPUs>, what run.sh chose before), on the virtual
# cluster, 2 nodes x 2 ranks:
#   - imagenet.py, resnet18 on 64 px images: seconds per step, from its XSCALE_SUMMARY;
#   - jobs/local/mnist.sbatch (what `make demo` submits): the job's wall time.
# Needs the cluster up (`make bench` starts it).   bash tests/bench/threads.sh   (STEPS=12)
set -euo pipefail

REPO=$(cd "${BASH_SOURCE[0]%/*}/../.." && pwd -P)
readonly REPO STEPS=${STEPS:-12} BATCH=16 WORK=$REPO/build/bench-threads
PY=$REPO/.venv/bin/python
export PATH=$REPO/tests/shim:$REPO/.venv/bin:$PATH

# One imagenet run on 2 nodes x 2 ranks; prints "THREADS SECONDS_PER_STEP" (global batch over
# the summary's samples/s, measured after the warm-up steps).
imagenet_step() {
  local log=$WORK/imagenet-$1.log line
  shift
  (cd "$REPO" && env "$@" srun -N2 -n4 --cpu-bind=none singularity exec xscale-test.sif \
    /runscripts/run.sh python -u python/imagenet.py -a resnet18 --image-size 64 -b "$BATCH" \
    -j 1 --epochs 1000 --max-steps "$STEPS" --dist-backend gloo "$WORK/images") >"$log" 2>&1 \
    || { echo "threads bench: error: imagenet failed; see $log" >&2; exit 1; }
  line=$(grep -o 'XSCALE_SUMMARY {.*}' "$log" | tail -n 1)
  "$PY" -c 'import json,sys; s=json.loads(sys.argv[1]); print(4 * int(sys.argv[2]) / s["samples_per_s"])' \
    "${line#XSCALE_SUMMARY }" "$BATCH"
}

# The local template's job, waited for; prints its wall time in seconds.
template_job() {
  local log=$WORK/mnist-$1.out start
  shift
  rm -rf -- "$WORK/mnist-out"
  start=$EPOCHREALTIME
  (cd "$REPO" && env "$@" SIF=xscale-test.sif DATA="$WORK/mnist" OUTPUT_DIR="$WORK/mnist-out" \
    sbatch --wait --quiet -o "$log" --partition=debug --account=xscale-test \
    jobs/local/mnist.sbatch) >/dev/null \
    || { echo "threads bench: error: the template's job failed; see $log" >&2; exit 1; }
  awk "BEGIN {printf \"%.1f\", $EPOCHREALTIME - $start}"
}

main() {
  mkdir -p -- "$WORK"
  [[ -d $WORK/images ]] || "$PY" "$REPO/tests/fixtures/imagefolder.py" "$WORK/images" >/dev/null
  [[ -d $WORK/mnist ]] || "$PY" "$REPO/tests/fixtures/mnist_idx.py" "$WORK/mnist" >/dev/null
  local shared node_wide node
  node=$(sinfo -h -o %c | head -n 1)  # CPUs per node
  shared=$(imagenet_step share)
  node_wide=$(imagenet_step node OMP_NUM_THREADS="$node")
  printf 'imagenet resnet18 64px, 2 nodes x 2 ranks, --cpu-bind=none: %.2f s/step with run.sh'"'"'s share, %.2f s/step with %s threads a rank (the whole node, run.sh before)\n' \
    "$shared" "$node_wide" "$node"
  printf 'jobs/local/mnist.sbatch, 2 nodes x 2 ranks: %s s with run.sh'"'"'s share, %s s with %s threads a rank\n' \
    "$(template_job share)" "$(template_job node OMP_NUM_THREADS="$node")" "$node"
}

main "$@"

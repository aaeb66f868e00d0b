#!/usr/bin/env bash
# Training throughput of mnist_ddp.py, imagenet.py and imagenet_deepspeed.py in their tiny CPU
# configurations (tests/fixtures/ data), one process each, no launcher: one line per trainer
# with the samples/s its XSCALE_SUMMARY reports (measured after the first steps' warm-up, so
# start-up, data loading set-up and evaluation are left out).
set -euo pipefail

REPO=$(cd "${BASH_SOURCE[0]%/*}/../.." && pwd -P)
readonly REPO STEPS=${STEPS:-40} PY=${PY:-$REPO/.venv/bin/python}
# DeepSpeed JIT-builds an op on first use. Builds started outside run.sh and inside it (the
# tests) have been seen to rebuild each other's, so the benchmark keeps its own cache.
: "${TORCH_EXTENSIONS_DIR:=$REPO/build/torch-extensions-bench}"
export TORCH_EXTENSIONS_DIR OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} DS_ACCELERATOR=cpu

# Run one trainer; print its line, or say why not and fail.
bench() {
  local label=$1 log=$2 line
  shift 2
  if ! "$PY" "$@" --max-steps "$STEPS" >"$log" 2>&1; then
    echo "bench: error: $label failed; last lines:" >&2
    tail -n 5 "$log" >&2
    return 1
  fi
  line=$(grep -o 'XSCALE_SUMMARY {.*}' "$log" | tail -n 1) ||
    { echo "bench: error: $label printed no XSCALE_SUMMARY line" >&2; return 1; }
  "$PY" - "$label" "${line#XSCALE_SUMMARY }" <<'PYEOF'
import json
import sys

label, s = sys.argv[1], json.loads(sys.argv[2])
print(f"{label}: {s['samples_per_s']:,.0f} samples/s over {s['steps']} steps "
      f"(loss {s['loss_first']:.2f} -> {s['loss_last']:.2f})")
PYEOF
}

main() {
  local work
  work=$(mktemp -d)
  # shellcheck disable=SC2064  # expand now: remove this very directory
  trap "rm -rf '$work'" EXIT
  "$PY" "$REPO/tests/fixtures/mnist_idx.py" "$work/mnist" >/dev/null
  "$PY" "$REPO/tests/fixtures/imagefolder.py" "$work/images" >/dev/null
  mkdir -p "$TORCH_EXTENSIONS_DIR"

  bench "mnist_ddp tiny CPU, 1 process, batch 64" "$work/mnist.log" \
    "$REPO/python/mnist_ddp.py" --data "$work/mnist" --batch-size 64 --epochs 1000
  bench "imagenet resnet18 32px CPU, 1 process, batch 32" "$work/imagenet.log" \
    "$REPO/python/imagenet.py" -a resnet18 --image-size 32 -b 32 -j 0 --lr 0.01 \
    --epochs 1000 "$work/images"
  bench "imagenet_deepspeed resnet18 32px CPU ZeRO-1, 1 process, batch 32" "$work/ds.log" \
    "$REPO/python/imagenet_deepspeed.py" --deepspeed \
    --deepspeed_config "$REPO/python/configs/ds_cpu_z1.json" -a resnet18 --image-size 32 \
    -b 32 -j 0 --epochs 1000 "$work/images"
}

main "$@"

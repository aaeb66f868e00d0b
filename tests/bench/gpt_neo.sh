#!/usr/bin/env bash
# Training throughput of gpt_neo_imdb.py on the tiny offline GPT-neo (tests/fixtures/), one process
# on CPU, no launcher: tokens/s over STEPS steps as the trainer's XSCALE_SUMMARY reports it (tokens
# summed over ranks, divided by the train() time, so model loading and evaluation are left out).
set -euo pipefail

REPO=$(cd "${BASH_SOURCE[0]%/*}/../.." && pwd -P)
readonly REPO STEPS=${STEPS:-60} PY=${PY:-$REPO/.venv/bin/python}

main() {
  local work log line
  work=$(mktemp -d)
  # shellcheck disable=SC2064  # expand now: remove this very directory
  trap "rm -rf '$work'" EXIT
  "$PY" "$REPO/tests/fixtures/tiny_gpt_neo.py" "$work/tiny" >/dev/null 2>&1 ||
    { echo "bench: error: building the tiny fixture failed" >&2; exit 1; }
  log=$work/train.log
  if ! HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$PY" "$REPO/python/gpt_neo_imdb.py" \
      --pretrained-model "$work/tiny/model" --dataset "$work/tiny/imdb" \
      --output-path "$work/out" --logging-path "$work/logs" --no-resume \
      --max-steps "$STEPS" --save-steps "$STEPS" --eval-steps "$STEPS" --logging-steps 10 \
      --batch-size 16 --max-length 64 --learning-rate 1e-3 --num-workers 0 --sample-reviews 0 >"$log" 2>&1; then
    echo "bench: error: gpt_neo_imdb.py failed; last lines:" >&2
    tail -n 5 "$log" >&2
    exit 1
  fi
  line=$(grep -o 'XSCALE_SUMMARY {.*}' "$log" | tail -n 1) ||
    { echo "bench: error: no XSCALE_SUMMARY line" >&2; exit 1; }
  "$PY" - "${line#XSCALE_SUMMARY }" "$STEPS" <<'EOF'
import json
import sys

s = json.loads(sys.argv[1])
print(f"gpt_neo_imdb tiny CPU, 1 process, batch 16: {s['tokens_per_s']:,.0f} tokens/s "
      f"over {sys.argv[2]} steps (loss {s['loss_first']:.2f} -> {s['loss_last']:.2f})")
EOF
}

main "$@"

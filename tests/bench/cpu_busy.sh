#!/usr/bin/env bash
# How busy the machine's cores were while COMMAND ran: its wall time, and the CPU seconds all
# cores spent busy and idle, from /proc/stat's first line before and after. A test whose busy
# seconds come near wall x cores is CPU-bound: running more beside it will not make it faster
# (docs/TESTBED.md, "What a test costs here").
#   bash tests/bench/cpu_busy.sh .venv/bin/python -m pytest -q tests/test_jobs.py -k mnist
set -euo pipefail

if (($# == 0)); then
  printf 'usage: %s COMMAND [ARG...]\n' "${0##*/}" >&2
  exit 2
fi

# Busy and idle jiffies so far: user, nice, system, irq, softirq, steal; idle, iowait.
jiffies() {
  local _ user nice system idle iowait irq softirq steal
  read -r _ user nice system idle iowait irq softirq steal _ </proc/stat
  printf '%s %s\n' $((user + nice + system + irq + softirq + steal)) $((idle + iowait))
}

read -r busy0 idle0 < <(jiffies)
start=$(date +%s.%N)
status=0
"$@" || status=$?
end=$(date +%s.%N)
read -r busy1 idle1 < <(jiffies)
hz=$(getconf CLK_TCK)
awk -v w="$end" -v s="$start" -v b=$((busy1 - busy0)) -v i=$((idle1 - idle0)) -v hz="$hz" \
  -v n="$(nproc)" 'BEGIN {
    printf "cpu_busy: wall %.1f s; busy %.1f CPU-s, idle %.1f CPU-s: %.0f%% of %d cores\n",
      w - s, b / hz, i / hz, 100 * b / (b + i), n }' >&2
exit "$status"

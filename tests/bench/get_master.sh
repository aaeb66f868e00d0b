#!/usr/bin/env bash
# Benchmark get-master on a 10,000-node hostlist written two ways: contiguous,
# nid[000001-010000], and fragmented, every other node (5,000 elements in one bracket).
# Times `get-master LIST` (a process, as a job script calls it), `get-master --all LIST`, and
# xs_hostlist_first in-process (what run.sh pays on every rank); prints the median of RUNS runs.
#   tests/bench/get_master.sh [RUNS]      (default 30)
# Goal: the first-host path within 10 ms per call. Needs bash 5 (EPOCHREALTIME).
set -euo pipefail

REPO=$(cd "${BASH_SOURCE[0]%/*}/../.." && pwd)
GET_MASTER=$REPO/runscripts/get-master
RUNS=${1:-30}
GOAL_MS=10

die() {
  printf 'get_master.sh: error: %s\n' "$1" >&2
  exit 2
}

# Microseconds since the epoch; the locale's decimal separator dropped, whatever it is.
now_us() {
  NOW_US=${EPOCHREALTIME//[!0-9]/}
}

# Sets MEDIAN_US from the microsecond figures in DURATIONS.
median_of_durations() {
  local sorted
  sorted=$(printf '%s\n' "${DURATIONS[@]}" | sort -n)
  mapfile -t DURATIONS <<<"$sorted"
  MEDIAN_US=${DURATIONS[${#DURATIONS[@]} / 2]}
}

# LABEL COMMAND...: run COMMAND RUNS times (output discarded) and print the median.
time_command() {
  local label=$1 start i
  shift
  DURATIONS=()
  for ((i = 0; i < RUNS; i++)); do
    now_us
    start=$NOW_US
    "$@" >/dev/null
    now_us
    DURATIONS+=($((NOW_US - start)))
  done
  median_of_durations
  report "$label"
}

report() {
  printf '%s: median %d.%02d ms (%d runs)\n' "$1" $((MEDIAN_US / 1000)) $((MEDIAN_US % 1000 / 10)) "$RUNS"
}

build_lists() {
  local i number
  CONTIGUOUS='nid[000001-010000]'
  FRAGMENTED='nid['
  for ((i = 1; i <= 10000; i += 2)); do
    printf -v number '%06d' "$i"
    FRAGMENTED+=$number,
  done
  FRAGMENTED=${FRAGMENTED%,}]
}

# The answers first: a fast wrong answer is no result.
check_answers() {
  local first count
  first=$("$GET_MASTER" "$CONTIGUOUS")
  [[ $first == nid000001 ]] || die "contiguous first host: got '$first'"
  first=$("$GET_MASTER" "$FRAGMENTED")
  [[ $first == nid000001 ]] || die "fragmented first host: got '$first'"
  count=$("$GET_MASTER" --all "$CONTIGUOUS" | wc -l)
  ((count == 10000)) || die "contiguous --all: $count hosts, not 10000"
  count=$("$GET_MASTER" --all "$FRAGMENTED" | wc -l)
  ((count == 5000)) || die "fragmented --all: $count hosts, not 5000"
}

time_in_process() {
  local label=$1 list=$2 start i
  DURATIONS=()
  for ((i = 0; i < RUNS; i++)); do
    now_us
    start=$NOW_US
    xs_hostlist_first "$list" || die "$XS_HOSTLIST_ERROR"
    now_us
    DURATIONS+=($((NOW_US - start)))
  done
  median_of_durations
  report "$label"
}

main() {
  [[ -n ${EPOCHREALTIME:-} ]] || die "needs bash 5 or newer (EPOCHREALTIME)"
  ((RUNS >= 1)) || die "RUNS must be a positive number"
  build_lists
  check_answers
  # shellcheck source=runscripts/lib/hostlist.sh disable=SC1091 # linted on its own by make lint
  source "$REPO/runscripts/lib/hostlist.sh"

  local name list slowest_first_us=0
  # A pyenv shim in front of python3 adds ~70 ms to every --all call; say which one ran.
  printf 'python3 used by --all: %s\n' "$(command -v python3 || echo none)"
  # What any bash script costs to start here: the floor under the get-master figures.
  time_command "bash startup alone (empty script), for reference" bash /dev/null
  for name in contiguous fragmented; do
    if [[ $name == contiguous ]]; then list=$CONTIGUOUS; else list=$FRAGMENTED; fi
    time_command "get-master first host, 10000 nodes $name" "$GET_MASTER" "$list"
    if ((MEDIAN_US > slowest_first_us)); then slowest_first_us=$MEDIAN_US; fi
    time_command "get-master --all, 10000 nodes $name" "$GET_MASTER" --all "$list"
    time_in_process "xs_hostlist_first in-process, 10000 nodes $name" "$list"
  done
  if ((slowest_first_us <= GOAL_MS * 1000)); then
    printf 'first-host goal (<= %d ms per get-master call): met\n' "$GOAL_MS"
  else
    printf 'first-host goal (<= %d ms per get-master call): NOT met\n' "$GOAL_MS"
  fi
}

main "$@"

#!/usr/bin/env bash
# What run.sh adds to each rank's start: median wall time of `run.sh /bin/true` minus that of
# `/bin/true` alone, both started from this shell, over RUNS runs each, with the variables of a
# real srun task (tests/data/) so the Slurm path (hostlist, port, cache) is the one measured.
set -euo pipefail

REPO=$(cd "${BASH_SOURCE[0]%/*}/../.." && pwd -P)
readonly REPO RUNS=${RUNS:-50}

# Median of the microsecond counts on stdin, printed in ms.
median_ms() {
  sort -n | awk '{v[NR]=$1} END {m=(NR%2)?v[(NR+1)/2]:(v[NR/2]+v[NR/2+1])/2; printf "%.2f", m/1000}'
}

# Wall time of each of RUNS runs of the command, in microseconds, one per line. A failing command
# stops the benchmark: timing an error path would flatter run.sh.
time_runs() {
  local i start end
  for ((i = 0; i < RUNS; i++)); do
    start=${EPOCHREALTIME/./}
    "$@" >/dev/null || { echo "bench: error: '$*' failed" >&2; exit 1; }
    end=${EPOCHREALTIME/./}
    echo $((end - start))
  done
}

main() {
  local cache
  cache=$(mktemp -d)
  # shellcheck disable=SC2064  # expand now: remove this very directory
  trap "rm -rf '$cache'" EXIT
  while IFS= read -r line; do
    [[ $line == \#* || -z $line ]] || export "${line?}"
  done <"$REPO/tests/data/slurm-srun-N2-n4-rank3.env"
  export XSCALE_CACHE_ROOT=$cache XSCALE_SITE=lumi
  # This machine has no hsn0..3: point the LUMI profile's interface check at one it has, so the
  # lookup (one glob, as hsn0 on a LUMI node) is measured instead of its error.
  export NCCL_SOCKET_IFNAME=lo
  local base with
  base=$(time_runs /bin/true | median_ms)
  "$REPO/runscripts/run.sh" /bin/true   # fails loudly here, before timing, if misconfigured
  with=$(time_runs "$REPO/runscripts/run.sh" /bin/true | median_ms)
  printf 'run.sh overhead per rank: median %s ms (run.sh /bin/true %s ms, /bin/true %s ms; %d runs each)\n' \
    "$(awk "BEGIN{printf \"%.2f\", $with - $base}")" "$with" "$base" "$RUNS"
}

main "$@"

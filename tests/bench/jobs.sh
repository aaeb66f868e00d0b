# shellcheck shell=bash
# What the benchmarks that run jobs on the virtual cluster share (tests/bench/recovery.sh,
# tests/bench/live_recovery.sh): a bounded wait, and a job's state from squeue.

# wait_until SECONDS WHAT COMMAND...: poll COMMAND until it holds; status 1, with a line saying
# which WHAT never came, after SECONDS.
wait_until() {
  local deadline=$((SECONDS + $1)) what=$2
  shift 2
  until "$@"; do
    ((SECONDS < deadline)) || { echo "${0##*/}: error: no $what" >&2; return 1; }
    sleep 0.1
  done
}

running() { [[ $(squeue -h -j "$1" -o %T 2>/dev/null) == RUNNING ]]; }
ended() { [[ -z $(squeue -h -j "$1" -o %T 2>/dev/null) ]]; }

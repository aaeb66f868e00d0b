#!/usr/bin/env bash
# Stop the daemons that cluster-up.sh started, and only those: each one is found through the pid
# file cluster-up.sh left in $XSCALE_CLUSTER_STATE, never by process name.
set -euo pipefail

readonly STATE=${XSCALE_CLUSTER_STATE:-/run/xscale-cluster}
readonly STOP_TIMEOUT_S=15

say() { printf 'cluster-down: %s\n' "$*" >&2; }

# Send TERM, then wait (bounded) for the process to go; KILL if it will not.
stop_pidfile() {
  local pidfile=$1 pid deadline
  [[ -s $pidfile ]] || return 0
  read -r pid <"$pidfile"
  if [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    deadline=$((SECONDS + STOP_TIMEOUT_S))
    while kill -0 "$pid" 2>/dev/null && (( SECONDS < deadline )); do sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      say "pid $pid ($pidfile) ignored TERM; killing"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  rm -f "$pidfile"
}

main() {
  [[ -d $STATE ]] || { say "nothing to stop ($STATE does not exist)"; exit 0; }
  local pidfile
  # slurmd before slurmctld, munged last: each daemon outlives the ones that talk to it.
  for pidfile in "$STATE"/slurmd-*.pid "$STATE/slurmctld.pid" "$STATE/munged.pid"; do
    [[ -e $pidfile ]] && stop_pidfile "$pidfile"
  done
  say "stopped"
}

main "$@"

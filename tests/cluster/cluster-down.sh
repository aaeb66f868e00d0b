#!/usr/bin/env bash
# Undo cluster-up.sh, and only what it made: the daemons it started (found through their pid
# files, never by name), every process still inside a node's namespace, the namespaces, veth
# pairs and bridge, the nodes' /tmp mounts, its /etc/hosts lines and the fake GPU devices it
# created. Safe to run when nothing is up.
set -euo pipefail

readonly XSC_PROG=cluster-down
# shellcheck source=tests/cluster/lib.sh
source "${BASH_SOURCE[0]%/*}/lib.sh"
readonly STOP_TIMEOUT_S=15

# Send TERM, then wait (bounded) for the processes to go; KILL what will not.
stop_pids() {
  local pid deadline
  (( $# )) || return 0
  kill -TERM "$@" 2>/dev/null || true
  deadline=$((SECONDS + STOP_TIMEOUT_S))
  for pid in "$@"; do
    while kill -0 "$pid" 2>/dev/null && (( SECONDS < deadline )); do sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      xsc_say "pid $pid ignored TERM; killing"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
}

stop_pidfile() {
  local pidfile=$1 pid
  [[ -s $pidfile ]] || { rm -f "$pidfile"; return 0; }
  read -r pid <"$pidfile"
  [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null && stop_pids "$pid"
  rm -f "$pidfile"
}

# Job steps and ranks a stopped slurmd leaves behind still hold the node's namespaces.
stop_node_processes() {
  local node=$1
  local -a pids
  [[ -e /run/netns/$node ]] || return 0
  mapfile -t pids < <(ip netns pids "$node" 2>/dev/null)
  stop_pids "${pids[@]}"
}

remove_node() {
  local node=$1 dir
  dir=$(xsc_node_dir "$node")
  stop_node_processes "$node"
  xsc_end_slow_reads "$node"
  [[ -e /run/netns/$node ]] && ip netns del "$node"
  # Deleting one end of a veth pair deletes both; the namespace's end went with it already.
  ip link del "$(xsc_host_link "$node")" 2>/dev/null || true
  if [[ -d $dir ]]; then
    mountpoint -q "$dir/tmp" && umount "$dir/tmp"
    rm -f "$dir/checkout"
    rmdir "$dir/tmp" "$dir/host-tmp" "$dir/cgroup" "$dir" 2>/dev/null || true
  fi
}

remove_made_devices() {
  local device
  [[ -s $XSC_STATE/made-devices ]] || return 0
  while IFS= read -r device; do
    [[ $device == /dev/fakegpu[0-9] && -c $device ]] && rm -f "$device"
  done <"$XSC_STATE/made-devices"
  rm -f "$XSC_STATE/made-devices"
}

main() {
  local node
  (( EUID == 0 )) || xsc_die "the virtual cluster is root's; run cluster-down as root"
  # fault.sh's throttlers first; slurmd before slurmctld, munged last: each daemon outlives
  # the ones that talk to it.
  for node in "${XSC_NODES[@]}"; do
    stop_pidfile "$(xsc_slow_pidfile "$node")"
    stop_pidfile "$(xsc_slurmd_pidfile "$node")"
  done
  stop_pidfile "$XSC_STATE/slurmctld.pid"
  stop_pidfile "$XSC_STATE/munged.pid"
  for node in "${XSC_NODES[@]}"; do
    remove_node "$node"
  done
  ip link show "$XSC_BRIDGE" >/dev/null 2>&1 && ip link del "$XSC_BRIDGE"
  xsc_remove_hosts_lines " $XSC_HOSTS_TAG\$"
  remove_made_devices
  rm -f "$XSC_STATE/munged.log" "$XSC_STATE/munged.seed"
  rmdir "$XSC_STATE/nodes" "$XSC_STATE" 2>/dev/null || true
  xsc_say "stopped"
}

main "$@"

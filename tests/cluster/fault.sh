#!/usr/bin/env bash
# Inject (and undo) the faults a real partition has, on one virtual node of the test bed.
# `heal` undoes every one of them; cluster-down.sh removes whatever is left.
set -euo pipefail

readonly XSC_PROG=fault
# shellcheck source=tests/cluster/lib.sh
source "${BASH_SOURCE[0]%/*}/lib.sh"
readonly HEAL_TIMEOUT_S=${XSCALE_CLUSTER_TIMEOUT_S:-60}
readonly FILLER=.xscale-fault-fill

usage() {
  cat <<'EOF'
Usage: tests/cluster/fault.sh VERB NODE [ARGS]

  link-down NODE       take NODE's hsn0 down: a network partition (the node's ranks and its
                       slurmd become unreachable; Slurm sets the node DOWN after SlurmdTimeout)
  link-up NODE         bring hsn0 back
  throttle-link NODE RATE
                       limit what NODE sends through hsn0 to RATE (tc's token bucket, e.g.
                       20mbit): a slow or congested link that drops nothing, until heal
  fill-tmp NODE        fill NODE's /tmp (a tmpfs) to the last byte
  free-tmp NODE        remove what fill-tmp wrote
  kill-slurmd NODE     SIGKILL NODE's slurmd; its running tasks live on, as after a daemon crash
  crash NODE           SIGKILL every process on NODE (slurmd, job steps, ranks): a node failure
  freeze NODE          SIGSTOP every process on NODE (slurmd, job steps, ranks): a node that
                       hangs and says nothing (no connection closes); heal reboots it
  start-slurmd NODE    start NODE's slurmd again (after kill-slurmd or crash)
  slow NODE [PERCENT]  stop NODE's processes (its slurmd spared) PERCENT% of every 2 ms, default
                       60, until heal: a node that slows every step down and never fails
  slow-reads NODE DIR RATE
                       on NODE only, reads of the files under DIR come at RATE bytes per second
                       (e.g. 256k, 2M), page cache or not: a slow file system client, until heal
  corrupt-snapshots NODE
                       flip a byte in every peer snapshot NODE's ranks hold in memory (their
                       own and their partner's), NODE stopped meanwhile: a memory fault that
                       the snapshots' CRC-32 must catch
  drain NODE REASON    drain NODE with REASON, as an administrator would
  heal [NODE...]       undo all of the above on the nodes (default: every node), resume them and
                       wait until they are idle (with XSC_IN_SERVICE=1: idle or running a job,
                       as when a pending job takes a healed node at once)
  status               one line per node: hsn0, /tmp use, slurmd, Slurm state, hsn0's rate,
                       the directories whose reads are slowed

Nodes: nid001 nid002 nid003 nid004. Needs root and a running cluster (cluster-up.sh).
EOF
}

need_node() {
  [[ -n ${1:-} ]] || xsc_die "which node? (usage: fault.sh --help)"
  xsc_node_index "$1" >/dev/null
  [[ -e /run/netns/$1 ]] || xsc_die "node $1 is not up (run tests/cluster/cluster-up.sh)"
}

fill_tmp() {
  local tmp free
  tmp=$(xsc_node_dir "$1")/tmp
  free=$(df --output=avail -B1 "$tmp" | tail -n 1)
  (( free > 0 )) || return 0
  fallocate -l "$free" "$tmp/$FILLER.$RANDOM"
}

free_tmp() {
  local tmp
  tmp=$(xsc_node_dir "$1")/tmp
  rm -f "$tmp/$FILLER".*
}

# throttle_link NODE RATE: a token-bucket filter (tc-tbf(8)) on the node's side of hsn0. Its
# queue holds 100 ms at RATE, so a sender waits for the link rather than losing packets (a
# netem-style loss is not in every kernel, and a collective over a lossy link only retransmits).
throttle_link() {
  [[ ${2:-} =~ ^[1-9][0-9]*(kbit|mbit|gbit)$ ]] ||
    xsc_die "throttle-link: RATE must be a number with kbit, mbit or gbit, not '${2:-}'"
  tc -n "$1" qdisc replace dev hsn0 root tbf rate "$2" burst 32kbit latency 100ms
}

unthrottle_link() {
  tc -n "$1" qdisc del dev hsn0 root 2>/dev/null || true
}

# slow_reads NODE DIR RATE: tests/cluster/slow_reads.py mounted over DIR in the mount namespace of
# NODE's slurmd, which its job steps (and the container shim's binds) inherit; the other nodes
# and the host keep reading DIR directly. Returns once the mount is there.
slow_reads() {
  local node=$1 dir=${2:-} rate=${3:-} slurmd bytes pid
  [[ -d $dir ]] || xsc_die "slow-reads: DIR must be a directory, not '$dir'"
  [[ $rate =~ ^([1-9][0-9]*)([kM]?)$ ]] ||
    xsc_die "slow-reads: RATE must be bytes per second, a number with k or M or neither, not '$rate'"
  case ${BASH_REMATCH[2]} in
    k) bytes=$((BASH_REMATCH[1] * 1024)) ;;
    M) bytes=$((BASH_REMATCH[1] * 1024 * 1024)) ;;
    *) bytes=${BASH_REMATCH[1]} ;;
  esac
  xsc_alive "$(xsc_slurmd_pidfile "$node")" || xsc_die "$node's slurmd is not running"
  read -r slurmd <"$(xsc_slurmd_pidfile "$node")"
  dir=$(realpath "$dir")
  nsenter --target "$slurmd" --mount -- setsid "$XSC_CHECKOUT/.venv/bin/python" \
    "$XSC_DIR/slow_reads.py" "$dir" "$bytes" </dev/null >/dev/null 2>&1 &
  pid=$!
  printf '%s %s\n' "$pid" "$dir" >>"$(xsc_slow_reads_file "$node")"
  until nsenter --target "$slurmd" --mount -- mountpoint -q "$dir"; do
    kill -0 "$pid" 2>/dev/null || xsc_die "slow-reads: the FUSE mount on $node failed (libfuse2 and fusepy installed? make setup)"
    sleep 0.1
  done
}

kill_slurmd() {
  local pidfile pid
  pidfile=$(xsc_slurmd_pidfile "$1")
  xsc_alive "$pidfile" || xsc_die "$1's slurmd is not running"
  read -r pid <"$pidfile"
  kill -KILL "$pid"
}

# SIGKILL every process in NODE's network namespace, all at once as a node fails: each is stopped
# first, then killed. Killed one by one, on two busy cores, a rank outlived its node-mate by
# milliseconds: long enough to answer the coordinator's ABORT, which then took it for a
# survivor on a lost node ("a process failed, not its node") and gave up live recovery.
crash() {
  local -a pids
  mapfile -t pids < <(ip netns pids "$1")
  (( ${#pids[@]} )) || return 0
  kill -STOP "${pids[@]}" 2>/dev/null
  kill -KILL "${pids[@]}" 2>/dev/null
  return 0
}

# SIGSTOP every process in NODE's network namespace, and note it: heal reboots a frozen node (its
# processes killed, its slurmd started afresh), as a site reboots a hung one. A daemon merely
# continued after minutes stopped came back half-healthy on the bed: the next job there failed.
freeze() {
  local -a pids
  mapfile -t pids < <(ip netns pids "$1")
  (( ${#pids[@]} )) && kill -STOP "${pids[@]}" 2>/dev/null
  : >"$(xsc_node_dir "$1")/frozen"
}

unfreeze() {
  local marker
  marker="$(xsc_node_dir "$1")/frozen"
  [[ -e $marker ]] || return 0
  crash "$1"
  # Until they are gone, reaped too: heal starts slurmd only where none runs, and a dying one
  # still counts.
  local waited=0
  while [[ -n $(ip netns pids "$1") ]] || xsc_alive "$(xsc_slurmd_pidfile "$1")"; do
    (( waited++ < 100 )) || break
    sleep 0.1
  done
  rm -f "$marker"
}

# Every process of NODE stopped while tests/cluster/corrupt_snapshots.py rewrites their memory, so
# that no snapshot is being written meanwhile; continued after.
corrupt_snapshots() {
  local -a pids
  mapfile -t pids < <(ip netns pids "$1")
  (( ${#pids[@]} )) || xsc_die "corrupt-snapshots: $1 runs no process"
  kill -STOP "${pids[@]}" 2>/dev/null
  python3 "${BASH_SOURCE[0]%/*}/corrupt_snapshots.py" "${pids[@]}" || true
  kill -CONT "${pids[@]}" 2>/dev/null
  return 0
}

# slow NODE PERCENT: tests/cluster/throttle.py, detached, its pid in the node's directory.
slow() {
  local node=$1 percent=${2:-60} slurmd=""
  if [[ ! $percent =~ ^[0-9]{1,2}$ ]] || (( percent < 1 || percent > 95 )); then
    xsc_die "slow: PERCENT must be a whole number from 1 to 95, not '$percent'"
  fi
  unslow "$node"
  [[ -s $(xsc_slurmd_pidfile "$node") ]] && read -r slurmd <"$(xsc_slurmd_pidfile "$node")"
  setsid python3 "${BASH_SOURCE[0]%/*}/throttle.py" "$node" "$percent" "$slurmd" \
    </dev/null >/dev/null 2>&1 &
  printf '%s\n' "$!" >"$(xsc_slow_pidfile "$node")"
}

# SIGCONT to every process of NODE: a process the throttler stopped and did not continue as it
# ended (a DataLoader worker, once) would hang its rank for good, its job with it.
continue_all() {
  local -a pids
  mapfile -t pids < <(ip netns pids "$1")
  (( ${#pids[@]} )) && kill -CONT "${pids[@]}" 2>/dev/null
  return 0
}

# Stop the throttler; it continues whatever it had stopped as it ends.
unslow() {
  local pidfile pid
  pidfile=$(xsc_slow_pidfile "$1")
  [[ -s $pidfile ]] || return 0
  read -r pid <"$pidfile"
  kill -TERM "$pid" 2>/dev/null || true
  rm -f "$pidfile"
}

heal() {
  local node
  (( $# )) || set -- "${XSC_NODES[@]}"
  for node in "$@"; do
    need_node "$node"
    unfreeze "$node"
    unslow "$node"
    continue_all "$node"
    xsc_end_slow_reads "$node"
    unthrottle_link "$node"
    ip -n "$node" link set hsn0 up
    free_tmp "$node"
    xsc_start_slurmd "$node"
    scontrol update "nodename=$node" state=resume >/dev/null 2>&1 || true
  done
  xsc_wait_idle "$HEAL_TIMEOUT_S" "$@"
}

status() {
  local node link rate tmp_use daemon state slowed
  for node in "${XSC_NODES[@]}"; do
    link=$(ip -n "$node" -br link show hsn0 2>/dev/null | awk '{print $2}') || link=absent
    rate=$(tc -n "$node" qdisc show dev hsn0 2>/dev/null |
      awk '$2 == "tbf" { for (i = 1; i < NF; i++) if ($i == "rate") print $(i + 1) }')
    tmp_use=$(df --output=pcent "$(xsc_node_dir "$node")/tmp" 2>/dev/null | tail -n 1) || tmp_use='?'
    xsc_alive "$(xsc_slurmd_pidfile "$node")" && daemon=running || daemon=dead
    state=$(sinfo -h -n "$node" -o '%t' 2>/dev/null | head -n 1) || state='?'
    slowed=$(awk '{ printf "%s%s", sep, $2; sep = "," }' "$(xsc_slow_reads_file "$node")" 2>/dev/null) || slowed=''
    printf '%s hsn0=%s tmp=%s slurmd=%s state=%s rate=%s slow-reads=%s\n' "$node" \
      "${link:-absent}" "${tmp_use// /}" "$daemon" "${state:-?}" "${rate:-unlimited}" \
      "${slowed:-none}"
  done
}

main() {
  local verb=${1:-}
  case $verb in
    -h | --help) usage; exit 0 ;;
    "") xsc_die "no verb (usage: fault.sh --help)" ;;
  esac
  (( EUID == 0 )) || xsc_die "fault injection needs root"
  shift
  case $verb in
    link-down) need_node "${1:-}"; ip -n "$1" link set hsn0 down ;;
    link-up) need_node "${1:-}"; ip -n "$1" link set hsn0 up ;;
    throttle-link) need_node "${1:-}"; throttle_link "$1" "${2:-}" ;;
    fill-tmp) need_node "${1:-}"; fill_tmp "$1" ;;
    free-tmp) need_node "${1:-}"; free_tmp "$1" ;;
    kill-slurmd) need_node "${1:-}"; kill_slurmd "$1" ;;
    crash) need_node "${1:-}"; crash "$1" ;;
    freeze) need_node "${1:-}"; freeze "$1" ;;
    corrupt-snapshots) need_node "${1:-}"; corrupt_snapshots "$1" ;;
    start-slurmd) need_node "${1:-}"; xsc_start_slurmd "$1" ;;
    slow) need_node "${1:-}"; slow "$1" "${2:-60}" ;;
    slow-reads) need_node "${1:-}"; slow_reads "$1" "${2:-}" "${3:-}" ;;
    drain)
      need_node "${1:-}"
      [[ -n ${2:-} ]] || xsc_die "drain needs a reason (fault.sh drain NODE REASON)"
      scontrol update "nodename=$1" state=drain "reason=$2"
      ;;
    heal) heal "$@" ;;
    status) status ;;
    *) xsc_die "unknown verb '$verb' (usage: fault.sh --help)" ;;
  esac
}

main "$@"

# shellcheck shell=bash
# The virtual cluster's layout and the steps shared by cluster-up.sh, cluster-down.sh and
# fault.sh (sourced, never executed). docs/TESTBED.md describes the test bed as a whole.
#
# Each node is a set of Linux namespaces on this one machine: its own network (a veth pair whose
# inside end is called hsn0, like a LUMI node's first Slingshot NIC), its own mount table (a
# private /tmp and /dev/shm) and its own host name. Everything else (the repository, /home, /var)
# is shared, as Lustre is on a real cluster. slurmctld and munged run on the host.

# shellcheck disable=SC2034  # the constants are read by the scripts that source this file

readonly XSC_NODES=(nid001 nid002 nid003 nid004)
readonly XSC_STATE=${XSCALE_CLUSTER_STATE:-/run/xscale-cluster}
# A /24 that only this machine's namespaces use; the host's end (the bridge) is .1.
readonly XSC_SUBNET=${XSCALE_CLUSTER_SUBNET:-10.77.0}
readonly XSC_BRIDGE=xsbr0
readonly XSC_BRIDGE_ADDR=$XSC_SUBNET.1
# Size of each node's /tmp (a tmpfs, which takes memory only for what is written to it): room for
# the doctor's default free-space floor (1 GB) and for staging the test venv's torch with what a
# DDP rank imports along (2.3 GB, triton included; packed and unpacked side by side, 4.7 GB:
# tests/bench/shared_opens.sh), as a LUMI-G node's RAM-backed /tmp has. fill-tmp writes all of
# it, for as long as a test holds the fault.
readonly XSC_TMP_SIZE=${XSCALE_CLUSTER_TMP_SIZE:-6g}
# Lines we add to /etc/hosts end with this tag, so cluster-down removes exactly those.
readonly XSC_HOSTS_TAG='# xscale-cluster'
readonly XSC_CONF_DIR=/etc/slurm

xsc_die() { printf '%s: error: %s\n' "$XSC_PROG" "$*" >&2; exit 2; }
xsc_say() { printf '%s: %s\n' "$XSC_PROG" "$*" >&2; }

# xsc_node_index NODE: the node's position (1-based) in XSC_NODES, or exit 2 for an unknown name.
xsc_node_index() {
  local i
  for i in "${!XSC_NODES[@]}"; do
    [[ ${XSC_NODES[i]} == "$1" ]] && { printf '%d\n' "$((i + 1))"; return 0; }
  done
  xsc_die "unknown node '$1' (have: ${XSC_NODES[*]})"
}

# nid001 is .11, nid002 .12, ...: readable in `ip addr` output and far from the bridge's .1.
xsc_node_addr() {
  local index
  index=$(xsc_node_index "$1")
  printf '%s.%d\n' "$XSC_SUBNET" "$((10 + index))"
}

xsc_node_dir() { printf '%s/nodes/%s\n' "$XSC_STATE" "$1"; }

# The pid file of fault.sh's throttler of a slowed node (fault.sh slow).
xsc_slow_pidfile() { printf '%s/slow.pid\n' "$(xsc_node_dir "$1")"; }

# fault.sh slow-reads' mounts on a node: one "PID DIR" line each (the FUSE process, the directory
# it covers in the node's mount namespace).
xsc_slow_reads_file() { printf '%s/slow-reads\n' "$(xsc_node_dir "$1")"; }

# Undo fault.sh slow-reads on NODE: unmount each directory inside its FUSE process's mount
# namespace (the node's, or what is left of it after a crash), which ends that process.
xsc_end_slow_reads() {
  local file pid dir
  file=$(xsc_slow_reads_file "$1")
  [[ -s $file ]] || return 0
  while read -r pid dir; do
    kill -0 "$pid" 2>/dev/null || continue
    nsenter --target "$pid" --mount -- umount "$dir" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  done <"$file"
  rm -f "$file"
}

# The host's end of the node's veth pair (at most 15 characters: a kernel limit).
xsc_host_link() { printf 'xs-%s\n' "$1"; }

# True when the pid file names a live process.
xsc_alive() {
  local pidfile=$1 pid
  [[ -s $pidfile ]] || return 1
  read -r pid <"$pidfile"
  [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null
}

# Remove the /etc/hosts lines that match the extended regex, rewriting the file in place: in a
# container /etc/hosts is often a bind mount, which `sed -i` (a rename) cannot replace.
xsc_remove_hosts_lines() {
  local kept
  kept=$(grep -vE -- "$1" /etc/hosts || true)
  printf '%s\n' "$kept" >/etc/hosts
}

xsc_slurmd_pidfile() { printf '%s/slurmd-%s.pid\n' "$XSC_STATE" "$1"; }

# Start NODE's slurmd inside the node's network namespace, in a new mount and UTS namespace that
# node-boot.sh fills in (private /tmp, hostname) before it becomes slurmd. nsenter rather than
# `ip netns exec`: the latter remounts /sys, and slurmd then fails with "No filesystem mounted
# on /sys/fs/cgroup".
xsc_start_slurmd() {
  local node=$1
  xsc_alive "$(xsc_slurmd_pidfile "$node")" && return 0
  mkdir -p "/var/spool/slurmd/$node"
  # The checkout stays visible on the node even when it was cloned into /tmp: it plays the
  # shared file system. Recorded, so that cluster-up run from another checkout can tell.
  xsc_checkout_id >"$(xsc_node_dir "$node")/checkout"
  XSCALE_CLUSTER_SHARED=$XSC_CHECKOUT nsenter --net="/run/netns/$node" -- \
    unshare --mount --uts --propagation private -- \
    bash "$XSC_DIR/node-boot.sh" "$node" "$(xsc_node_dir "$node")"
}

# The checkout's path and inode: a checkout deleted and cloned again at the same path is another
# directory, which a node started for the old one cannot see through its bind.
xsc_checkout_id() { stat -c '%n %d:%i' "$XSC_CHECKOUT"; }

# True when sinfo shows every named node idle.
# Whether every named node is in one of STATES (sinfo's short names, e.g. "idle alloc").
xsc_all_in() {
  local wanted=" $1 " states node
  shift
  states=" $(sinfo -h -N -o '%N=%t' 2>/dev/null | tr '\n' ' ')"
  for node in "$@"; do
    [[ $states =~ \ $node=([a-z]+)\  && $wanted == *" ${BASH_REMATCH[1]} "* ]] || return 1
  done
}

xsc_all_idle() {
  xsc_all_in idle "$@"
}

# Wait (bounded) until every named node is idle (or, with XSC_IN_SERVICE=1, in service: idle
# or running a job, e.g. a pending job that took a healed node at once); this polls a real
# state, not a timed sleep.
xsc_wait_idle() {
  local timeout_s=$1 deadline states=idle
  shift
  [[ ${XSC_IN_SERVICE:-0} == 1 ]] && states="idle alloc mix"
  deadline=$((SECONDS + timeout_s))
  until xsc_all_in "$states" "$@"; do
    (( SECONDS < deadline )) || xsc_die "nodes $* not idle after ${timeout_s}s" \
      "(sinfo: $(sinfo -h -N -o '%N=%t' 2>/dev/null | tr '\n' ' ')); see /var/log/slurm/"
    sleep 0.2
  done
}

XSC_DIR=$(cd "${BASH_SOURCE[0]%/*}" && pwd -P)
XSC_CHECKOUT=${XSC_DIR%/tests/cluster}

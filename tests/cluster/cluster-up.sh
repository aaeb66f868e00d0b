#!/usr/bin/env bash
# Start the virtual Slurm cluster the tests and `make demo` run on: four nodes (nid001-nid004)
# that behave like separate machines, each with 2 CPUs and 4 fake GPUs, and slurmctld + munged
# on this host. docs/TESTBED.md explains the layout, how to add a node and how to inject faults.
# Idempotent: what an earlier call made and still runs is left alone. Needs root.
set -euo pipefail

readonly XSC_PROG=cluster-up
# shellcheck source=tests/cluster/lib.sh
source "${BASH_SOURCE[0]%/*}/lib.sh"
readonly READY_TIMEOUT_S=${XSCALE_CLUSTER_TIMEOUT_S:-60}

usage() {
  cat <<'EOF'
Usage: tests/cluster/cluster-up.sh

Starts munged and slurmctld on this machine and one slurmd per virtual node (nid001-nid004),
each in its own network namespace (interface hsn0, address 10.77.0.11-14 on bridge xsbr0 at
10.77.0.1), mount namespace (private /tmp and /dev/shm) and UTS namespace (hostname = node
name). Writes /etc/slurm/slurm.conf and gres.conf, adds the node names to /etc/hosts and waits
until sinfo shows every node idle. Safe to run again; cluster-down.sh undoes all of it.

Environment: XSCALE_CLUSTER_STATE (pid files, node /tmp mounts; default /run/xscale-cluster),
XSCALE_CLUSTER_SUBNET (first three octets, default 10.77.0), XSCALE_CLUSTER_TMP_SIZE (each
node's /tmp, default 6g), XSCALE_CLUSTER_TIMEOUT_S (wait for idle nodes, default 60).
EOF
}

check_tools() {
  (( EUID == 0 )) || xsc_die "the virtual cluster needs root (namespaces, slurmd and munged)"
  local tool
  for tool in ip nsenter unshare mount munged slurmctld slurmd sinfo srun scontrol; do
    command -v "$tool" >/dev/null || xsc_die "$tool not found: run 'make setup' first"
  done
  unshare --net --mount --uts -- true 2>/dev/null \
    || xsc_die "this kernel refuses network/mount/UTS namespaces, which the virtual nodes need"
}

# ---- network: one bridge on the host, one namespace per node with hsn0 on that bridge ----------

make_bridge() {
  ip link show "$XSC_BRIDGE" >/dev/null 2>&1 || ip link add "$XSC_BRIDGE" type bridge
  ip addr replace "$XSC_BRIDGE_ADDR/24" dev "$XSC_BRIDGE"
  ip link set "$XSC_BRIDGE" up
}

make_node_network() {
  local node=$1 host_link addr
  host_link=$(xsc_host_link "$node")
  addr=$(xsc_node_addr "$node")
  [[ -e /run/netns/$node ]] || ip netns add "$node"
  if ! ip link show "$host_link" >/dev/null 2>&1; then
    ip link add "$host_link" type veth peer name hsn0 netns "$node"
  fi
  ip link set "$host_link" master "$XSC_BRIDGE" up
  ip -n "$node" addr replace "$addr/24" dev hsn0
  ip -n "$node" link set hsn0 up
  ip -n "$node" link set lo up
}

# ---- node-local storage: a tmpfs per node, mounted on the host and bound at /tmp in the node ---

make_node_storage() {
  local dir
  dir=$(xsc_node_dir "$1")
  mkdir -p "$dir/tmp" "$dir/host-tmp" "$dir/cgroup"
  # Mounted already (cluster-up run again): the size is set again, so a changed one takes effect
  # without a cluster-down, and the files on it stay.
  if mountpoint -q "$dir/tmp"; then
    mount -o "remount,size=$XSC_TMP_SIZE" "$dir/tmp"
  else
    mount -t tmpfs -o "mode=1777,size=$XSC_TMP_SIZE" tmpfs "$dir/tmp"
  fi
}

# Node names resolve to their hsn0 addresses everywhere (host and nodes share /etc/hosts), as
# MASTER_ADDR=nid001 must on a real cluster. Also drop the single-network test bed's line.
write_hosts() {
  local node line
  xsc_remove_hosts_lines '^127\.0\.0\.1 nid001 nid002$'
  for node in "${XSC_NODES[@]}"; do
    line="$(xsc_node_addr "$node") $node $XSC_HOSTS_TAG"
    grep -qxF "$line" /etc/hosts || printf '%s\n' "$line" >>/etc/hosts
  done
}

# Character devices Slurm's gres plugin can "assign"; they behave like /dev/null. Recorded, so
# cluster-down removes only the ones made here.
make_fake_gpus() {
  local i
  for i in 0 1 2 3; do
    [[ -e /dev/fakegpu$i ]] && continue
    mknod "/dev/fakegpu$i" c 1 3
    printf '/dev/fakegpu%d\n' "$i" >>"$XSC_STATE/made-devices"
  done
}

write_config() {
  local host node nodes_lines=""
  host=$(hostname -s)
  for node in "${XSC_NODES[@]}"; do
    nodes_lines+="NodeName=$node NodeAddr=$(xsc_node_addr "$node") CPUs=2 Gres=gpu:4 State=UNKNOWN"$'\n'
  done
  mkdir -p "$XSC_CONF_DIR" /var/spool/slurmctld /var/log/slurm
  cat >"$XSC_CONF_DIR/slurm.conf.new" <<EOF
# Written by xscale tests/cluster/cluster-up.sh: four virtual nodes, each in its own network,
# mount and UTS namespace on this machine (docs/TESTBED.md).
ClusterName=xscale
# slurmctld only starts under its own host name; the nodes reach it at the bridge's address.
SlurmctldHost=$host($XSC_BRIDGE_ADDR)
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmctldPidFile=$XSC_STATE/slurmctld.pid
SlurmdPidFile=$XSC_STATE/slurmd-%n.pid
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
# Each node has its own network namespace, so all share the default slurmd port. The nodes'
# CPUs and GPUs come from this file, not from the (shared) hardware.
SlurmdParameters=config_overrides
# A node that stops answering (slurmd killed, hsn0 down) is DOWN in about 18 s, not 5 minutes,
# so a job on it ends with "Node failure" in seconds; a restarted slurmd brings it back. Both
# count: slurmctld pings every SlurmdTimeout/3 s, and a ping to a dead node fails only after
# MessageTimeout (measured: 37 s from a crash to DOWN with 10 and 10, 28 s with 5 and 10).
SlurmdTimeout=5
MessageTimeout=5
ReturnToService=2
# No cgroups here: track processes by parentage; task/affinity makes --cpu-bind masks real.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SchedulerType=sched/backfill
# A job that becomes eligible without an event (a requeued job's BeginTime passing) waits for
# the next periodic pass: 60 s (main loop) or 30 s (backfill) by default, idle time on a
# four-node bed where a pass costs microseconds.
SchedulerParameters=sched_interval=2,bf_interval=1
# No slurmdbd: keep finished jobs visible to 'scontrol show job' for an hour instead.
MinJobAge=3600
JobCompType=jobcomp/filetxt
JobCompLoc=/var/log/slurm/jobcomp.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
# Allow 'scontrol requeue' of batch jobs (failure-handling tests).
JobRequeue=1
KillWait=5
${nodes_lines}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  printf 'NodeName=%s Name=gpu File=/dev/fakegpu[0-3]\n' "${XSC_NODES[@]}" >"$XSC_CONF_DIR/gres.conf"
  mv "$XSC_CONF_DIR/slurm.conf.new" "$XSC_CONF_DIR/slurm.conf"
}

start_munge() {
  xsc_alive "$XSC_STATE/munged.pid" && return 0
  # A munged we did not start (e.g. the distribution's service) is fine to share: its socket is
  # a file, which every node sees.
  if [[ -S /run/munge/munge.socket.2 ]] && munge -n </dev/null >/dev/null 2>&1; then
    return 0
  fi
  mkdir -p /run/munge
  [[ -s /etc/munge/munge.key ]] || xsc_die "/etc/munge/munge.key is missing (reinstall munge)"
  # munged refuses to run as root unless forced; root is the only user this test bed has.
  munged --force --pid-file="$XSC_STATE/munged.pid" --log-file="$XSC_STATE/munged.log" \
    --seed-file="$XSC_STATE/munged.seed"
}

# Nodes left down or drained by an earlier run (or a fault a test did not undo) come back now
# rather than after a timeout.
resume_nodes() {
  local node state
  for node in "${XSC_NODES[@]}"; do
    state=$(sinfo -h -n "$node" -o '%t' 2>/dev/null) || continue
    case $state in
      *down* | *drain* | *fail*) scontrol update "nodename=$node" state=resume >/dev/null 2>&1 || true ;;
    esac
  done
}

# A node cannot see a checkout under the host's /tmp unless it was started for it (its /tmp is
# its own): stop its slurmd so that it starts again for this checkout. Running jobs keep going.
# A checkout anywhere else is already visible on every node.
stop_slurmd_of_other_checkout() {
  local node=$1 pidfile recorded="" pid deadline
  [[ $XSC_CHECKOUT == /tmp/?* ]] || return 0
  pidfile=$(xsc_slurmd_pidfile "$node")
  xsc_alive "$pidfile" || return 0
  read -r recorded 2>/dev/null <"$(xsc_node_dir "$node")/checkout" || true
  [[ $recorded == "$(xsc_checkout_id)" ]] && return 0
  xsc_say "$node served ${recorded:-another checkout}; restarting its slurmd for $XSC_CHECKOUT"
  read -r pid <"$pidfile"
  kill -TERM "$pid" 2>/dev/null || true
  deadline=$((SECONDS + 15))
  while kill -0 "$pid" 2>/dev/null; do
    (( SECONDS < deadline )) || xsc_die "$node's slurmd (pid $pid) did not stop"
    sleep 0.1
  done
}

main() {
  [[ ${1:-} == -h || ${1:-} == --help ]] && { usage; exit 0; }
  check_tools
  mkdir -p "$XSC_STATE"
  local node
  make_bridge
  for node in "${XSC_NODES[@]}"; do
    make_node_network "$node"
    make_node_storage "$node"
  done
  write_hosts
  make_fake_gpus
  # Rewriting slurm.conf under running daemons would change their view: only write when down.
  xsc_alive "$XSC_STATE/slurmctld.pid" || write_config
  start_munge
  xsc_alive "$XSC_STATE/slurmctld.pid" || slurmctld
  for node in "${XSC_NODES[@]}"; do
    stop_slurmd_of_other_checkout "$node"
    xsc_start_slurmd "$node"
  done
  resume_nodes
  xsc_wait_idle "$READY_TIMEOUT_S" "${XSC_NODES[@]}"
  xsc_say "ready: ${XSC_NODES[*]} idle (bridge $XSC_BRIDGE at $XSC_BRIDGE_ADDR)"
}

main "$@"

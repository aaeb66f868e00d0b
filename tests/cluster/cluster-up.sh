#!/usr/bin/env bash
# Start the virtual Slurm cluster the tests and `make demo` run on: munge, slurmctld and two slurmd
# daemons (nid001, nid002) on this one machine, each node with 2 CPUs and 4 fake GPUs.
# Idempotent: daemons already running from an earlier call are left alone. Needs root.
# Every daemon we start leaves a pid file under $XSCALE_CLUSTER_STATE; cluster-down.sh stops
# exactly those and nothing else.
set -euo pipefail

readonly NODES=(nid001 nid002)
readonly STATE=${XSCALE_CLUSTER_STATE:-/run/xscale-cluster}
readonly CONF_DIR=/etc/slurm
readonly READY_TIMEOUT_S=${XSCALE_CLUSTER_TIMEOUT_S:-60}

die() { printf 'cluster-up: error: %s\n' "$*" >&2; exit 2; }
say() { printf 'cluster-up: %s\n' "$*" >&2; }

usage() {
  cat <<'EOF'
Usage: tests/cluster/cluster-up.sh

Starts munged, slurmctld and slurmd -N nid001 / -N nid002 on this machine (root only), writes
/etc/slurm/slurm.conf and gres.conf, adds nid001/nid002 to /etc/hosts, creates /dev/fakegpu0-3,
and waits until sinfo shows both nodes idle. Safe to run again. Stop with cluster-down.sh.
Environment: XSCALE_CLUSTER_STATE (pid files, default /run/xscale-cluster),
XSCALE_CLUSTER_TIMEOUT_S (how long to wait for the nodes, default 60).
EOF
}

# True when the pid file names a live process (so a second cluster-up leaves it running).
alive() {
  local pidfile=$1 pid
  [[ -s $pidfile ]] || return 1
  read -r pid <"$pidfile"
  [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null
}

check_tools() {
  (( EUID == 0 )) || die "the virtual cluster needs root (slurmd and munged run as root here)"
  local tool
  for tool in munged slurmctld slurmd sinfo srun; do
    command -v "$tool" >/dev/null || die "$tool not found: run 'make setup' first"
  done
}

write_hosts() {
  # MASTER_ADDR=nid001 must resolve inside every rank, as it does on a real cluster.
  grep -qE '^127\.0\.0\.1[[:space:]].*\bnid001\b' /etc/hosts \
    || printf '127.0.0.1 %s\n' "${NODES[*]}" >>/etc/hosts
}

make_fake_gpus() {
  # Character devices that Slurm's gres plugin can "assign"; they behave like /dev/null.
  local i
  for i in 0 1 2 3; do
    [[ -e /dev/fakegpu$i ]] || mknod "/dev/fakegpu$i" c 1 3
  done
}

write_config() {
  local host
  host=$(hostname -s)
  mkdir -p "$CONF_DIR" /var/spool/slurmctld /var/log/slurm
  cat >"$CONF_DIR/slurm.conf.new" <<EOF
# Written by xscale tests/cluster/cluster-up.sh: two virtual nodes on one machine.
ClusterName=xscale
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
# No cgroups here: track processes by parentage; task/affinity makes --cpu-bind masks real.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SchedulerType=sched/backfill
ReturnToService=2
# No slurmdbd: keep finished jobs visible to 'scontrol show job' for an hour instead.
MinJobAge=3600
JobCompType=jobcomp/filetxt
JobCompLoc=/var/log/slurm/jobcomp.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
# Allow 'scontrol requeue' of batch jobs (failure-handling tests).
JobRequeue=1
KillWait=5
NodeName=nid[001-002] NodeHostname=$host NodeAddr=127.0.0.1 Port=[6821-6822] CPUs=2 Gres=gpu:4 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  printf 'NodeName=nid[001-002] Name=gpu File=/dev/fakegpu[0-3]\n' >"$CONF_DIR/gres.conf"
  mv "$CONF_DIR/slurm.conf.new" "$CONF_DIR/slurm.conf"
}

start_munge() {
  alive "$STATE/munged.pid" && return 0
  # A munged we did not start (e.g. the distribution's service) is fine to share.
  if [[ -S /run/munge/munge.socket.2 ]] && munge -n </dev/null >/dev/null 2>&1; then
    return 0
  fi
  mkdir -p /run/munge
  [[ -s /etc/munge/munge.key ]] || die "/etc/munge/munge.key is missing (reinstall munge)"
  # munged refuses to run as root unless forced; root is the only user this test bed has.
  # Its log and seed live with our pid files so it checks no distribution-owned paths.
  munged --force --pid-file="$STATE/munged.pid" --log-file="$STATE/munged.log" \
    --seed-file="$STATE/munged.seed"
}

start_slurm() {
  alive "$STATE/slurmctld.pid" || slurmctld
  local node
  for node in "${NODES[@]}"; do
    mkdir -p "/var/spool/slurmd/$node"
    alive "$STATE/slurmd-$node.pid" || slurmd -N "$node"
  done
}

# Wait (bounded) until both nodes report idle; this polls a real state, it is not a timed sleep.
wait_until_idle() {
  local deadline=$((SECONDS + READY_TIMEOUT_S)) states
  while (( SECONDS < deadline )); do
    states=$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u | tr '\n' ' ')
    if [[ $states == *"nid001 idle"* && $states == *"nid002 idle"* ]]; then
      say "ready: $states"
      return 0
    fi
    # Nodes left down/drained by an earlier run come back without waiting for a timeout.
    if [[ $states == *"down"* || $states == *"drain"* ]]; then
      scontrol update 'nodename=nid[001-002]' state=resume >/dev/null 2>&1 || true
    fi
    sleep 0.2
  done
  die "nodes not idle after ${READY_TIMEOUT_S}s (sinfo: ${states:-nothing}); see /var/log/slurm/"
}

main() {
  [[ ${1:-} == -h || ${1:-} == --help ]] && { usage; exit 0; }
  check_tools
  mkdir -p "$STATE"
  write_hosts
  make_fake_gpus
  # Rewriting slurm.conf under running daemons would change their view: only write when down.
  alive "$STATE/slurmctld.pid" || write_config
  start_munge
  start_slurm
  wait_until_idle
}

main "$@"

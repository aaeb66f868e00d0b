#!/usr/bin/env bash
# Turn a fresh mount + UTS namespace (made by tests/cluster/lib.sh's xsc_start_slurmd) into one
# virtual node, then become its slurmd. Everything slurmd starts (job steps, the batch script,
# the ranks) inherits what is set here.
#
#   node-boot.sh NODE NODE_DIR
#
# NODE_DIR/tmp is the node's /tmp: a tmpfs that cluster-up.sh mounted on the host, so the node's
# files survive a slurmd restart and the tests can look into any node's /tmp from the host.
set -euo pipefail

readonly NODE=$1 NODE_DIR=$2
# The checkout the cluster serves. It plays shared storage, so when it was cloned under the
# host's /tmp it must stay visible on the node.
readonly SHARED=${XSCALE_CLUSTER_SHARED:-}

# A sysfs of the node's own network namespace, so /sys/class/net lists lo and hsn0 as it lists a
# real node's NICs (the host's sysfs would show the host's). The cgroup mounts below /sys go over
# to the new one: slurmd stops with "No filesystem mounted on /sys/fs/cgroup" without them.
mount --rbind /sys/fs/cgroup "$NODE_DIR/cgroup"
mount -t sysfs sysfs /sys
mount --rbind "$NODE_DIR/cgroup" /sys/fs/cgroup
umount --recursive --lazy "$NODE_DIR/cgroup"

# Keep a handle on the host's /tmp before the node's own covers it.
mount --bind /tmp "$NODE_DIR/host-tmp"
mount --bind "$NODE_DIR/tmp" /tmp
mount -t tmpfs -o mode=1777,size=256m tmpfs /dev/shm

if [[ $SHARED == /tmp/?* ]]; then
  mkdir -p "$SHARED"
  mount --bind "$NODE_DIR/host-tmp/${SHARED#/tmp/}" "$SHARED"
fi

hostname "$NODE"
exec slurmd -N "$NODE"

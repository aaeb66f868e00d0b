#!/usr/bin/env bash
# Install the Debian packages xscale's tests and demo need, when running as root and any is
# missing. Without root it only reports what is missing: the Python parts still work, and the
# cluster tests then skip (or fail under CI=true).
set -euo pipefail

# iproute2: the virtual nodes' network namespaces, veth pairs and bridge (tests/cluster/).
# strace: tests/bench/shared_opens.sh counts the files each rank opens on shared storage.
# libfuse2: fault.sh slow-reads mounts a slow view of a data directory on one node (fusepy).
readonly PACKAGES=(slurm-wlm munge bubblewrap shellcheck bats iproute2 strace libfuse2)

missing=()
for pkg in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
done
((${#missing[@]})) || exit 0

if ((EUID != 0)); then
  printf 'install-system-packages: warning: not root; missing: %s\n' "${missing[*]}" >&2
  exit 0
fi
printf 'install-system-packages: installing %s\n' "${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq "${missing[@]}" >/dev/null

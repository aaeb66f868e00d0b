#!/usr/bin/env bash
# Shared-storage opens per job, without and with jobs/lib/stage: how many times files and
# directories under a Python environment on shared storage are opened while 1, 2 and 4 nodes x
# 2 ranks import torch and take one DDP step (tests/bench/ddp_step.py). A count, not a time: the
# virtual cluster's noise (2 CPUs for every node) does not blur it.
#
# The environment is the real one: the test venv's distributions that a DDP rank imports (torch,
# triton, numpy, sympy, ...: 2.3 GB), linked into build/ (shared by every node, as Lustre is) by
# tests/bench/torch_env.py.
#   without: PYTHONPATH is the shared site-packages; every rank opens every module itself.
#   with:    jobs/lib/stage --name env copies it to every node first; PYTHONPATH is the node-local
#            copy. Counted: the staging's own opens under the shared tree (packing it once, on the
#            batch host) plus the ranks' (none, if they import only the node-local copy).
# Staging needs twice the environment in each node's /tmp (the pack and its unpacked copy) and
# that much memory per node on the test bed, where /tmp is a tmpfs: the jobs run one at a time.
# Counted with strace (open/openat/openat2 that succeeded, every process and thread): per
# process, so the nodes' separate mount namespaces change nothing, and no event is merged away
# as inotify merges identical events.
set -euo pipefail

REPO=$(cd "${BASH_SOURCE[0]%/*}/../.." && pwd -P)
readonly REPO NODE_COUNTS=${NODE_COUNTS:-"1 2 4"}
readonly WORK=$REPO/build/bench-shared-opens
readonly SHARED_ENV=$WORK/shared-env
readonly PYTHON=$REPO/.venv/bin/python

die() {
  printf 'shared_opens: error: %s\n' "$*" >&2
  exit 1
}

# SHARED_ENV/site-packages: what a DDP rank imports from the venv, as hard links.
build_env() {
  (cd "$REPO/tests/bench" && "$PYTHON" torch_env.py "$SHARED_ENV")
}

# The batch script: both runs in one allocation of N nodes.
write_job() {
  cat >"$WORK/job.sh" <<'JOB'
#!/bin/bash
set -euo pipefail
# strace's options: every open of every process and thread, one file per process.
# -y: the path of the returned descriptor, absolute even when the call named a relative path (tar
# packing the environment opens ./site-packages/... after a chdir).
TRACE=(strace -f -ff -qq -y --seccomp-bpf -e trace=open,openat,openat2 -o)
ranks() {  # ranks TRACE_DIR SITE_PACKAGES
  mkdir -p -- "$1"
  PYTHONPATH=$2 srun --kill-on-bad-exit=1 "${TRACE[@]}" "$1/trace" \
    "$REPO/runscripts/run.sh" "$PYTHON" -u "$REPO/tests/bench/ddp_step.py"
}
out=$OUT/$SLURM_JOB_NUM_NODES
ranks "$out/without" "$SHARED_ENV/site-packages"
mkdir -p -- "$out/stage"
"${TRACE[@]}" "$out/stage/trace" "$REPO/jobs/lib/stage" --name env "$SHARED_ENV" >"$out/staged-path"
ranks "$out/with" "$(cat "$out/staged-path")/site-packages"
"$REPO/jobs/lib/stage" --clean
JOB
}

# Successful opens under PREFIX in the trace files below DIR: calls that returned a descriptor
# (strace -y writes "= 5</abs/path>"; a failed call returns "-1 ENOENT ...") for PREFIX or below.
count_opens() {
  local dir=$1 prefix=$2
  [[ -d $dir ]] || { echo 0; return; }
  find "$dir" -type f -name 'trace*' -exec cat -- {} + |
    sed -n 's/.*) = [0-9][0-9]*\(<.*\)$/\1/p' |
    grep -cF -e "<$prefix/" -e "<$prefix>" || true
}

# Whether the machine has the memory for N nodes' staged copies: on the test bed each node's /tmp
# is a tmpfs, and staging holds the pack and its unpacked copy there at once.
fits_in_memory() {
  local nodes=$1 env_kb available_kb
  env_kb=$(du -sk -- "$SHARED_ENV" | cut -f1)
  available_kb=$(awk '/^MemAvailable:/ {print $2}' /proc/meminfo)
  (( nodes * 2 * env_kb + 2 * 1024 * 1024 < available_kb )) && return 0
  printf 'shared_opens: %s nodes skipped: staging needs %d GB of node /tmp (memory here), %d GB is free\n' \
    "$nodes" $((nodes * 2 * env_kb / 1000000)) $((available_kb / 1000000)) >&2
  return 1
}

# One job at a time, so that each node's /tmp holds one staged copy of the environment at once.
run_jobs() {
  local nodes
  for nodes in $NODE_COUNTS; do
    fits_in_memory "$nodes" || continue
    sbatch --wait --quiet --partition=debug --nodes="$nodes" --ntasks-per-node=2 \
      --time=00:20:00 --output="$WORK/job-$nodes.out" \
      --export="ALL,REPO=$REPO,PYTHON=$PYTHON,SHARED_ENV=$SHARED_ENV,OUT=$WORK/traces" \
      "$WORK/job.sh" || die "the $nodes-node benchmark job failed: see $WORK/job-$nodes.out"
  done
}

print_table() {
  local nodes without with staging
  printf 'Opens under the shared environment (%s), per job:\n' "$1"
  printf '%-6s %-6s %10s %10s %18s\n' nodes ranks without with "(with: staging)"
  for nodes in $NODE_COUNTS; do
    local dir=$WORK/traces/$nodes
    [[ -d $dir ]] || continue  # skipped for memory
    without=$(count_opens "$dir/without" "$SHARED_ENV")
    staging=$(count_opens "$dir/stage" "$SHARED_ENV")
    with=$((staging + $(count_opens "$dir/with" "$SHARED_ENV")))
    printf '%-6s %-6s %10s %10s %18s\n' "$nodes" $((nodes * 2)) "$without" "$with" "$staging"
  done
  printf 'without: PYTHONPATH on shared storage; with: jobs/lib/stage first, PYTHONPATH node-local.\n'
  printf '(with: staging): packing the tree once on the batch host; the pack (one file) is then\n'
  printf 'read by sha256sum, tar -t and sbcast, once per job whatever the node count.\n'
}

main() {
  command -v strace >/dev/null || die "strace is not installed (make setup installs it)"
  { command -v sbatch && sinfo -h; } >/dev/null 2>&1 ||
    die "the virtual cluster is not up: make cluster-up (root)"
  rm -rf -- "$WORK/traces"
  mkdir -p -- "$WORK"
  local built
  built=$(build_env)
  write_job
  run_jobs
  print_table "$built"
}

main "$@"

#!/usr/bin/env bash
# Shared-storage opens per job, without and with jobs/lib/stage: how many times files and
# directories under a Python environment on shared storage are opened while 1, 2 and 4 nodes x
# 2 ranks import it, import torch and take one DDP step (tests/bench/ddp_step.py). A count, not a
# time: the virtual cluster's noise (2 CPUs for every node) does not blur it.
#
# The environment: ENV_MODULES small modules in packages of 50 (xs_bench_env), byte-compiled,
# built under build/ (shared by every node, as Lustre is). The real torch (1.2 GB here) does not
# fit a test node's 512 MiB /tmp, so it is not staged; its own opens are counted too, as what an
# unstaged torch costs.
#   without: PYTHONPATH is the shared site-packages; every rank opens every module itself.
#   with:    jobs/lib/stage --name env copies it to every node first; PYTHONPATH is the node-local
#            copy. Counted: the staging's own opens under the shared tree (packing it once, on the
#            batch host) plus the ranks' (none, if they import only the node-local copy).
# Counted with strace (open/openat/openat2 that succeeded, every process and thread): per
# process, so the nodes' separate mount namespaces change nothing, and no event is merged away
# as inotify merges identical events.
set -euo pipefail

REPO=$(cd "${BASH_SOURCE[0]%/*}/../.." && pwd -P)
readonly REPO ENV_MODULES=${ENV_MODULES:-1000} NODE_COUNTS=${NODE_COUNTS:-"1 2 4"}
readonly WORK=$REPO/build/bench-shared-opens
readonly SHARED_ENV=$WORK/shared-env
readonly PYTHON=$REPO/.venv/bin/python

die() {
  printf 'shared_opens: error: %s\n' "$*" >&2
  exit 1
}

# SHARED_ENV/site-packages/xs_bench_env: packages of 50 modules each, imported by the top one.
build_env() {
  local site=$SHARED_ENV/site-packages/xs_bench_env package module i
  rm -rf -- "$SHARED_ENV"
  mkdir -p -- "$site"
  : >"$site/__init__.py"
  for ((i = 0; i < ENV_MODULES; i++)); do
    package=p$((i / 50))
    module=m$((i % 50))
    if [[ ! -d $site/$package ]]; then
      mkdir -- "$site/$package"
      : >"$site/$package/__init__.py"
      printf 'from . import %s\n' "$package" >>"$site/__init__.py"
    fi
    printf 'VALUE = %d\n' "$i" >"$site/$package/$module.py"
    printf 'from . import %s\n' "$module" >>"$site/$package/__init__.py"
  done
  # As pip leaves a venv: byte-compiled, so that an import opens the .pyc, not the source too.
  "$PYTHON" -m compileall -q "$SHARED_ENV/site-packages" >/dev/null
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

run_jobs() {
  local nodes pids=()
  for nodes in $NODE_COUNTS; do
    sbatch --wait --quiet --partition=debug --nodes="$nodes" --ntasks-per-node=2 \
      --time=00:20:00 --output="$WORK/job-$nodes.out" \
      --export="ALL,REPO=$REPO,PYTHON=$PYTHON,SHARED_ENV=$SHARED_ENV,OUT=$WORK/traces" \
      "$WORK/job.sh" &
    pids+=($!)
  done
  local pid failed=0
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  ((failed == 0)) || die "a benchmark job failed: see $WORK/job-*.out"
}

print_table() {
  local nodes torch_dir without with staging torch_without
  torch_dir=$("$PYTHON" -c 'import os, torch; print(os.path.realpath(os.path.dirname(torch.__file__)))')
  printf 'Opens under the shared environment (%d modules in %d packages), per job:\n' \
    "$ENV_MODULES" $(((ENV_MODULES + 49) / 50))
  printf '%-6s %-6s %10s %10s %18s %14s\n' nodes ranks without with "(with: staging)" \
    "torch's own"
  for nodes in $NODE_COUNTS; do
    local dir=$WORK/traces/$nodes
    without=$(count_opens "$dir/without" "$SHARED_ENV")
    staging=$(count_opens "$dir/stage" "$SHARED_ENV")
    with=$((staging + $(count_opens "$dir/with" "$SHARED_ENV")))
    torch_without=$(count_opens "$dir/without" "$torch_dir")
    printf '%-6s %-6s %10s %10s %18s %14s\n' "$nodes" $((nodes * 2)) "$without" "$with" \
      "$staging" "$torch_without"
  done
  printf 'without: PYTHONPATH on shared storage; with: jobs/lib/stage first, PYTHONPATH node-local.\n'
  printf '(with: staging): packing the tree once on the batch host; the pack (one file) is then\n'
  printf 'read by sha256sum, tar -t and sbcast, once per job whatever the node count.\n'
  printf "torch's own: opens under %s in the run without staging (not staged: too big here).\n" \
    "$torch_dir"
}

main() {
  command -v strace >/dev/null || die "strace is not installed (make setup installs it)"
  { command -v sbatch && sinfo -h; } >/dev/null 2>&1 ||
    die "the virtual cluster is not up: make cluster-up (root)"
  rm -rf -- "$WORK/traces"
  mkdir -p -- "$WORK"
  build_env
  write_job
  run_jobs
  print_table
}

main "$@"

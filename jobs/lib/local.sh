# shellcheck shell=bash
# The prelude of the templates in jobs/local/: LUMI's path on the virtual Slurm cluster that
# `make demo` and the tests start (tests/cluster/, docs/TESTBED.md), minus GPUs. The tests'
# `singularity` shim stands in for the container (it ignores the image), gloo for RCCL.
#   source "${XSCALE_ROOT:=$SLURM_SUBMIT_DIR}/jobs/lib/local.sh"
#   xs_local_train python -u "$XSCALE_ROOT/python/mnist_ddp.py" ...
[[ -z ${XS_LOCAL_PRELUDE:-} ]] || return 0
XS_LOCAL_PRELUDE=1
: "${SIF:=xscale-test.sif}"  # ignored by the shim; on LUMI a real image (jobs/lib/lumi.sh)
: "${BINDS:=$XSCALE_ROOT}"   # the -B list; on LUMI also the host's network stack and /pfs
: "${RUNSCRIPT:=run.sh}"     # the per-rank entrypoint; run-profile.sh profiles PROFILE_RANKS only

# ---- rendezvous: computed here, outside the container, where Slurm's tools exist --------------
# No `| head -n 1`: with pipefail, scontrol killed by SIGPIPE on a long node list fails the job.
NODE_NAMES=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
MASTER_ADDR=${NODE_NAMES%%$'\n'*}
export MASTER_ADDR

# ---- time limit or failure -> checkpoint -> requeue (jobs/lib/supervise.sh, docs/FAILURES.md) ---
# At Slurm's USR1 warning the ranks save a checkpoint, and the job requeues itself to resume. A
# failed step is reported; XSCALE_RETRY=1 requeues the job without the nodes it blames.
# shellcheck source=jobs/lib/supervise.sh
source "$XSCALE_ROOT/jobs/lib/supervise.sh"

# xs_local_train CMD [ARGS...]: the training step, CMD under RUNSCRIPT on every rank; its logs in
# OUTPUT_DIR/xscale-records. --kill-on-bad-exit=1: a rank that dies ends the step instead of
# leaving the others hanging (under live recovery the supervisor's coordinator decides instead,
# docs/FAILURES.md). --cpu-bind=none: a virtual node's 2 cores are shared by its ranks.
xs_local_train() {
  : "${XSCALE_RECORDS_DIR:=$OUTPUT_DIR/xscale-records}"
  requeueable_launch "$SIF" "$BINDS" "/runscripts/$RUNSCRIPT" \
    --label --kill-on-bad-exit=1 --cpu-bind=none -- "$@"
}

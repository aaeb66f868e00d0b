# shellcheck shell=bash
# The LUMI prelude: what every template in jobs/lumi/ does before its own parameters, once. It
# binds what RCCL and the file systems need into the container, computes the CPU masks and the
# rendezvous address outside it (where Slurm's tools are), checks the image and sets up the step
# supervisor; every value can be overridden from the environment. A template:
#   source "${XSCALE_ROOT:=$SLURM_SUBMIT_DIR}/jobs/lib/lumi.sh"   # the checkout, seen by every node
#   ...its parameters and its trainer's arguments...
#   xs_lumi_train python -u "$XSCALE_ROOT/python/mnist_ddp.py" "${TRAIN_ARGS[@]}" "$@"
[[ -z ${XS_LUMI_PRELUDE:-} ]] || return 0  # a template that builds on another sources it twice
XS_LUMI_PRELUDE=1
# The checkout, bound at its own path: the doctor imports $XSCALE_ROOT/python in any image.
export XSCALE_ROOT

# ---- the image (required) ---------------------------------------------------------------------
# A LUMI container module exports SIF (module load LUMI PyTorch/...), or give a path, e.g. the AI
# workshop's /appl/local/containers/sif-images/lumi-pytorch-rocm-6.2.4-python-3.12-pytorch-v2.7.1.sif
# LUMI retires its shared images (LUMI Software Library, PyTorch), so no default points at one.
: "${SIF:=}"
: "${RUNSCRIPT:=run.sh}"  # the per-rank entrypoint; run-profile.sh profiles PROFILE_RANKS only

# ---- container binds ----------------------------------------------------------------------------
# Across nodes, RCCL reaches Slingshot through the host's libfabric and CXI stack: Slurm's spool,
# /opt/cray, libcxi and libjansson (on one node it needs none of them). The file systems:
# /scratch, /project, /projappl and /flash hold links into /pfs, so all of them and /pfs are
# bound, and /appl for LUMI's shared data. Both lists are what LUMI's AI workshop binds (its
# singularity-CPEbits and singularity-userfilesystems modules: Lumi-supercomputer/
# Getting_Started_with_AI_workshop, bonus_material/pytorch_cotainr_container_basics/
# train_multi_node_ddp_torchrun.sh). The checkout keeps its own path inside; runscripts/ goes to
# /runscripts, so any image works without a rebuild.
: "${HOST_STACK_BINDS:=/var/spool/slurmd,/opt/cray,/usr/lib64/libcxi.so.1,/usr/lib64/libjansson.so.4}"
: "${FILE_SYSTEM_BINDS:=/pfs,/scratch,/projappl,/project,/flash,/appl}"
if [[ -z ${BINDS:-} ]]; then
  BINDS=$FILE_SYSTEM_BINDS,$XSCALE_ROOT,$XSCALE_ROOT/runscripts:/runscripts
  if ((${SLURM_JOB_NUM_NODES:-1} > 1)); then BINDS=$HOST_STACK_BINDS,$BINDS; fi
fi

# ---- CPU binding: each rank on the 7 cores of the CCD wired to its GCD -------------------------
# GCD 0 is closest to CCD 6, GCD 1 to CCD 7, then CCDs 2,3,0,1,4,5; the first core of each CCD
# belongs to the system. A rank on the wrong CCD pays a cross-die hop for every batch it copies
# to its GCD. jobs/lib/cpu-masks prints the list LUMI documents (see its --help).
if [[ -z ${CPU_MASKS:-} ]]; then
  CPU_MASKS=$("$XSCALE_ROOT/jobs/lib/cpu-masks" lumi) || exit 2
fi

# ---- checks on the host: one line and exit 2 before srun, not a traceback from every rank -------
# shellcheck source=jobs/lib/container-paths.sh
source "$XSCALE_ROOT/jobs/lib/container-paths.sh"
xs_require_sif

# ---- rendezvous: computed here, outside the container, where Slurm's tools exist --------------
# Always recomputed: a MASTER_ADDR left in the submitting shell (an earlier salloc) would point
# every rank at a node this job does not have (the supervisor moves it with the step). No `head`:
# with pipefail, scontrol killed by SIGPIPE (thousands of nodes) would fail the job.
NODE_NAMES=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
MASTER_ADDR=${NODE_NAMES%%$'\n'*}
export MASTER_ADDR

# ---- time limit or failure -> checkpoint -> requeue (jobs/lib/supervise.sh, docs/FAILURES.md) ---
# At Slurm's USR1 warning the ranks save a checkpoint and the job requeues itself. A failed step
# is reported and relaunched without the nodes it blames, on XSCALE_SPARES idle nodes of the
# job, else requeued without them (XSCALE_RETRY=1).
: "${XSCALE_RETRY:=1}" "${XSCALE_BLAME:=slurm lumi}" "${XSCALE_SPARES:=0}"
# shellcheck source=jobs/lib/supervise.sh
source "$XSCALE_ROOT/jobs/lib/supervise.sh"

# xs_lumi_train CMD [ARGS...]: the training step, CMD under RUNSCRIPT in the image on every rank,
# each on its GCD's cores; its logs in OUTPUT_DIR/xscale-records. --kill-on-bad-exit=1: a rank
# that dies ends the step, not left hanging in a collective until the time limit (under live
# recovery the supervisor's coordinator decides instead, docs/FAILURES.md).
xs_lumi_train() {
  : "${XSCALE_RECORDS_DIR:=$OUTPUT_DIR/xscale-records}"
  requeueable_launch "$SIF" "$BINDS" "/runscripts/$RUNSCRIPT" \
    --label --kill-on-bad-exit=1 --cpu-bind=mask_cpu:"$CPU_MASKS" -- "$@"
}

# xs_lumi_run [SRUN OPTIONS...] -- CMD [ARGS...]: another step in the image, unsupervised.
xs_lumi_run() {
  local -a options=()
  while [[ $1 != -- ]]; do options+=("$1"); shift; done
  srun --kill-on-bad-exit=1 "${options[@]}" singularity exec -B "$BINDS" "$SIF" "${@:2}"
}

# xs_lumi_inputs [--if-set] NAME...: each path must exist, inside the binds (--if-set: if set).
xs_lumi_inputs() {
  local name if_set=""
  if [[ $1 == --if-set ]]; then if_set=1; shift; fi
  for name in "$@"; do
    if [[ -z $if_set || -n ${!name:-} ]]; then xs_require_visible "$name" "$BINDS"; fi
  done
}

# xs_args_if_set ARRAY OPTION VALUE...: each OPTION VALUE pair whose VALUE is set (empty: the
# trainer's default) is appended to ARRAY.
xs_args_if_set() {
  local -n xs_array=$1
  shift
  while (($# >= 2)); do
    if [[ -n $2 ]]; then xs_array+=("$1" "$2"); fi
    shift 2
  done
}

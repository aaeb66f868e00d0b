# shellcheck shell=bash
# The Aurora prelude (PBS, PALS's mpiexec, no container: PyTorch is ALCF's frameworks module),
# after ALCF's "AI frameworks at scale" tutorial (argonne-lcf/GettingStarted,
# AI_frameworks/ai_at_scale.md). Every value can be overridden from the environment, or with
# qsub -v NAME=VALUE. A template, once PBS has started it in the checkout:
#   source "${XSCALE_ROOT:=$PWD}/jobs/lib/aurora.sh"
#   xs_aurora_train python -u "$XSCALE_ROOT/python/mnist_ddp.py" "${TRAIN_ARGS[@]}"
[[ -z ${XS_AURORA_PRELUDE:-} ]] || return 0
XS_AURORA_PRELUDE=1
: "${RANKS_PER_NODE:=12}"             # one rank per GPU tile (6 Intel GPUs x 2 tiles)
: "${FRAMEWORKS_MODULE:=frameworks}"  # ALCF's PyTorch + IPEX + oneCCL; empty: load none
: "${DIST_BACKEND:=}"                 # empty: xccl (or ccl), the trainer's choice on XPUs
# A directory of Python packages on Lustre, e.g. made with `pip install --target DIR ...`, and
# how the ranks reach it: copper (ALCF's service) or stage, where Copper is not loaded
# (jobs/lib/stage copies it once per node into /tmp). Empty: the frameworks module's only.
: "${LUS_CONDA_PATH:=}" "${PACKAGE_CACHE:=copper}"
: "${COPPER_LOG_DIR:=$XSCALE_ROOT/copper-logs/${PBS_JOBID%%.*}}"   # Copper's logs, per job
# PALS's health-check period and RPC timeout in seconds, longer for many nodes (ALCF oneCCL page,
# application-dependent list); read by mpiexec.
export PALS_PING_PERIOD=${PALS_PING_PERIOD:-240} PALS_RPC_TIMEOUT=${PALS_RPC_TIMEOUT:-240}

# ---- CPU binding: four cores per rank, next to its tile ---------------------------------------
# An Aurora node has two 52-core sockets; cores 0 and 52 serve the OS. GPUs 0-2 (tiles 0-5) hang
# off socket 0 and GPUs 3-5 (tiles 6-11) off socket 1, so ranks 0-5 get cores on the first socket
# and ranks 6-11 on the second. Four cores per rank for the DataLoader and the framework: the list
# ALCF recommends for training with all 12 tiles ("PyTorch on Aurora", CPU bindings); the
# one-core list 4:9:14:19:20:25:56:61:66:71:74:79 is for import benchmarks and oneCCL tests.
: "${CPU_BIND_LIST:=4-7:8-11:12-15:16-19:20-23:24-27:56-59:60-63:64-67:68-71:72-75:76-79}"

# ---- software: the frameworks module, and the user's packages through Copper or staged --------
# Lmod's functions read unset variables: -u is relaxed around them only.
load_module() {
  set +u
  module load "$@"
  set -u
}
if [[ -n $FRAMEWORKS_MODULE ]]; then load_module "$FRAMEWORKS_MODULE"; fi
# Thousands of ranks importing the same files from Lustre take minutes (17 at 8192 nodes in ALCF's
# table). Copper serves them from one node's read through the compute network: each rank imports
# from the /tmp/$USER/copper/ mirror of the Lustre path instead; it is started with a log
# directory and stopped when this script exits (ALCF, "Copper": launch_copper.sh, stop_copper.sh).
# Without Copper, jobs/lib/stage packs the directory once, and one process per node (mpiexec
# --ppn 1) unpacks the pack into the node's /tmp: PBS has no sbcast, so each node reads the one
# tar from Lustre, which is still one large file per node instead of every file per rank.
case $PACKAGE_CACHE in
  copper | stage) ;;
  *) printf 'xscale: error: PACKAGE_CACHE=%s: use copper or stage\n' "$PACKAGE_CACHE" >&2; exit 2 ;;
esac
stop_copper() { stop_copper.sh -d "$COPPER_LOG_DIR" || true; }
clean_staged() { "$XSCALE_ROOT/jobs/lib/stage" --clean || true; }
if [[ -n $LUS_CONDA_PATH && $PACKAGE_CACHE == stage ]]; then
  trap clean_staged EXIT  # /tmp is the node's memory: the copies go however the script exits
  STAGED_PACKAGES=$("$XSCALE_ROOT/jobs/lib/stage" --name user-packages "$LUS_CONDA_PATH") || exit 1
  export PYTHONPATH=$STAGED_PACKAGES${PYTHONPATH:+:$PYTHONPATH}
elif [[ -n $LUS_CONDA_PATH ]]; then
  load_module copper
  mkdir -p -- "$COPPER_LOG_DIR"
  launch_copper.sh -d "$COPPER_LOG_DIR"
  trap stop_copper EXIT
  export PYTHONPATH=/tmp/$USER/copper/${LUS_CONDA_PATH#/}${PYTHONPATH:+:$PYTHONPATH}
fi
# ALCF's oneCCL settings for training unset MPICH's collective-selection tuning files (oneCCL
# page, tuning list); oneCCL runs its collectives over this MPICH.
unset MPIR_CVAR_CH4_POSIX_COLL_SELECTION_TUNING_JSON_FILE
unset MPIR_CVAR_CH4_COLL_SELECTION_TUNING_JSON_FILE MPIR_CVAR_COLL_SELECTION_TUNING_JSON_FILE

# ---- layout and rendezvous: computed here, from PBS's node file -------------------------------
# One line per node (place=scatter); the first node hosts rank 0. MASTER_ADDR is its name on the
# high-speed network, as ALCF's DDP example forms it (short host name + HSN_DOMAIN, "PyTorch on
# Aurora"; empty HSN_DOMAIN: the node file's name as it is). Always recomputed: a MASTER_ADDR
# left in the submitting shell would point every rank at a node this job does not have.
: "${HSN_DOMAIN=hsn.cm.aurora.alcf.anl.gov}"  # `=`, not `:=`: an empty one is a choice
NNODES=$(wc -l <"$PBS_NODEFILE")
read -r MASTER_ADDR <"$PBS_NODEFILE"
if [[ -n $HSN_DOMAIN ]]; then MASTER_ADDR=${MASTER_ADDR%%.*}.$HSN_DOMAIN; fi
# The aurora site profile of run.sh sets oneCCL's transport and affinity for 12 ranks per node;
# a backend named here wins over the trainer's choice (XSCALE_BACKEND, read on every rank).
export MASTER_ADDR XSCALE_SITE=aurora
if [[ -n $DIST_BACKEND ]]; then export XSCALE_BACKEND=$DIST_BACKEND; fi

# xs_aurora_train CMD [ARGS...]: CMD under run.sh on every tile of the job. --genvall hands this
# environment (PYTHONPATH, MASTER_ADDR, XSCALE_SITE) to every rank, with XSCALE_LAUNCH_T, the
# launch time the trainer's start-up phases count from (docs/STARTUP.md).
xs_aurora_train() {
  XSCALE_LAUNCH_T=$EPOCHREALTIME mpiexec -n "$((NNODES * RANKS_PER_NODE))" \
    --ppn "$RANKS_PER_NODE" --cpu-bind="list:$CPU_BIND_LIST" --genvall \
    "$XSCALE_ROOT/runscripts/run.sh" "$@"
}

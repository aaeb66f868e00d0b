#!/usr/bin/env bash
# Per-rank entrypoint, run inside the container by every rank:
#   srun singularity exec $SIF /runscripts/run.sh python train.py ...
# Exports the rank layout, rendezvous and site environment, then exec's the command, which keeps
# this PID so Slurm's signals reach it. The logic lives in lib/, one file per concern (shared
# with run-profile.sh and doctor); this file is only the command line.
set -euo pipefail
# Start-up phases (docs/STARTUP.md): when this rank's run.sh began, before anything else; a
# builtin read of the clock, exported with the exec's time just before the exec.
XS_T_RUNSH=${EPOCHREALTIME:-}

XS_PROG=run.sh
# Only the lib/ files run.sh calls, in this order (each says what it owns): bash parses every
# line it sources, on every rank.
# shellcheck source=runscripts/lib/common.sh
source "${BASH_SOURCE[0]%/*}/lib/common.sh"
# shellcheck source=runscripts/lib/layout.sh
source "$XS_LIB_DIR/layout.sh"
# shellcheck source=runscripts/lib/rendezvous.sh
source "$XS_LIB_DIR/rendezvous.sh"
# shellcheck source=runscripts/lib/site.sh
source "$XS_LIB_DIR/site.sh"
# shellcheck source=runscripts/lib/binding.sh
source "$XS_LIB_DIR/binding.sh"
# shellcheck source=runscripts/lib/args.sh
source "$XS_LIB_DIR/args.sh"
# shellcheck source=runscripts/lib/entrypoint.sh
source "$XS_LIB_DIR/entrypoint.sh"

usage() {
  cat <<'EOF'
Usage: run.sh [--print-env | --help] CMD [ARGS...]

Exports the distributed-training environment for this rank, then exec's CMD with ARGS. ARGS pass
byte-exact, except that $NAME and ${NAME} naming an exported variable are replaced by its value
for this rank (so '--rank \$SLURM_PROCID' works); every other $ form stays as written.

  --print-env   print KEY=VALUE for every variable run.sh exports (sorted) and exit
  --help        this text

Launchers (first match wins): torchrun (TORCHELASTIC_RUN_ID set), Slurm (srun task), PBS/PALS
(Aurora mpiexec), Open MPI (mpirun), MPICH/Cray PMI, RANK and WORLD_SIZE set by hand; otherwise
one process, rank 0 of 1.

Exported (each kept if already set):
  RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE NODE_RANK NNODES
                      this rank's place, read from the launcher's own variables. One set before
                      run.sh must agree with the launcher (a job script's stale WORLD_SIZE would
                      hang the rendezvous): otherwise an error naming both values
  MASTER_ADDR         first host of SLURM_STEP_NODELIST / SLURM_JOB_NODELIST / SLURM_NODELIST, or
                      the first line of PBS_NODEFILE; 127.0.0.1 for one process. Best set by the
                      job script outside the container.
  MASTER_PORT         10000 + (16*job_id + step_id%16) % 22768: equal on all ranks, different for
                      neighbouring jobs and concurrent steps sharing a node. Without a Slurm or
                      PBS job id, job_id is a hash of the MPI launcher's PMIX_NAMESPACE,
                      OMPI_MCA_ess_base_jobid or PALS_APID. A MASTER_PORT you set must be 1-65535.
  XSCALE_CACHE_DIR    node-local cache, /tmp/xscale-USER-JOB.STEP-NODE (mode 0700; a symlink or a
                      directory of another user is refused). XSCALE_CACHE_ROOT replaces /tmp.
  TORCH_EXTENSIONS_DIR, TRITON_CACHE_DIR   inside XSCALE_CACHE_DIR (JIT builds off Lustre)
  OMP_NUM_THREADS     this rank's share of the CPUs it may run on: SLURM_CPUS_PER_TASK (srun -c),
                      else its affinity mask (--cpu-bind), divided among the node's ranks when
                      every rank's mask is the whole node (--cpu-bind=none); --print-env says
                      which, in a '# ' line
  TORCH_NCCL_ASYNC_ERROR_HANDLING=1, XSCALE_TIMEOUT_S=600
                      a dead rank fails the job instead of hanging it (NCCL and RCCL). The old
                      name NCCL_ASYNC_ERROR_HANDLING is not exported: torch >= 2.2 warns about it
                      on every rank; export it yourself for an image with an older torch.
  TORCH_FR_BUFFER_SIZE=2000   torch's flight recorder: the last collectives, numbered, so that a
                      timeout names the rank that never joined (docs/FAILURES.md); with
                      XSCALE_FR_DIR (the supervisor's), TORCH_NCCL_DUMP_ON_TIMEOUT=1 and
                      TORCH_FR_DUMP_TEMP_FILE=XSCALE_FR_DIR/rank
  XSCALE_SITE, XSCALE_LAUNCHER   what was detected
  XSCALE_T_RUNSH, XSCALE_T_EXEC  wall-clock times (s since 1970) of run.sh's start and of the exec,
                      always overwritten and not in --print-env: the trainer reports the start-up
                      phases from them and XSCALE_LAUNCH_T (set by jobs/lib/supervisor.py)
  plus the site profile's variables (runscripts/sites/SITE.sh; see its README).

Settings read:
  XSCALE_SITE=lumi|aurora|nvidia|nvidia-slingshot|generic
                      site profile (default: detected from the node's devices; see
                      runscripts/sites/README.md)
  XSCALE_GPU_BIND=none|local   local: narrow ROCR/CUDA_VISIBLE_DEVICES or ZE_AFFINITY_MASK to this
                      rank's GPUs, unless the scheduler already did (default none: every rank sees
                      the node's GPUs and picks LOCAL_RANK)
  XSCALE_DEBUG=1      NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,COLL, one NCCL_DEBUG_FILE per rank in
                      XSCALE_LOG_DIR (default ./xscale-logs)
  XSCALE_VERBOSE=1    every rank prints its rank, node, CPU list and visible GPUs on stderr
  XSCALE_EXPAND_ARGS=0   pass ARGS without $NAME expansion
  WITH_CONDA          set by LUMI's AMD images: run before CMD so python is the image's

Errors are one line on stderr and exit status 2; nothing is run.
EOF
}

xs_main plain "$@"

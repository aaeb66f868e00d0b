#!/bin/bash
# A batch job that runs a user's own training script (not one of xscale's trainers) through the
# virtual cluster's prelude, as a user would after copying jobs/local/mnist.sbatch:
#   OUTPUT_DIR=... sbatch tests/programs/own-script-job.sh SCRIPT [ARGS...]
# Its own rendezvous, `--dist-url tcp://FIRST_NODE:PORT`, goes last, with a port derived from
# the job id (pytorch/examples' way; a fixed one would collide between jobs). Used by
# tests/test_own_scripts.py.
#SBATCH --job-name=xscale-own-script
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --time=00:05:00
#SBATCH --signal=B:USR1@60
#SBATCH --requeue
#SBATCH --open-mode=append
set -euo pipefail
source "${XSCALE_ROOT:=$SLURM_SUBMIT_DIR}/jobs/lib/local.sh"
: "${OUTPUT_DIR:?set OUTPUT_DIR, where the job keeps its records}"
xs_local_train python -u "$@" --dist-url "tcp://$MASTER_ADDR:$((40000 + SLURM_JOB_ID % 20000))"

#!/usr/bin/env bash
# `make bench`: every benchmark in tests/bench/, one after the other, each under a heading.
# Figures only: nothing here passes or fails on a time (tests never assert wall-clock times).
set -euo pipefail

BENCH_DIR=$(cd "${BASH_SOURCE[0]%/*}" && pwd -P)
# get-master --all runs python3 from PATH; a pyenv or conda shim in front of the system's would be
# timed instead of get-master itself (login nodes and images call /usr/bin/python3).
export PATH=/usr/bin:$PATH

run() {
  printf '\n== %s\n' "$1"
  bash "$BENCH_DIR/$1"
}

run run_sh.sh         # what run.sh adds to each rank's start
run threads.sh        # ranks sharing a node's CPUs: run.sh's thread share vs the whole node
run get_master.sh     # first host and --all on a 10,000-node list
run trainers_cv.sh    # mnist_ddp, imagenet, imagenet_deepspeed: samples/s on CPU
run gpt_neo.sh        # gpt_neo_imdb: tokens/s on CPU
run shared_opens.sh   # shared-storage opens per job, 1/2/4 nodes, without and with jobs/lib/stage
run startup.sh        # start-up phases (launch .. first step) at 1, 2 and 4 nodes
run recovery.sh       # a crashed node: restart on a spare vs requeue, crash to first step
printf '\n== %s\n' live_recovery.sh  # a crashed node replaced live, three runs to their end
bash "$BENCH_DIR/live_recovery.sh" 3
printf '\n== %s\n' culprits.py  # a hang to its report, a straggler named, healthy runs quiet
"$BENCH_DIR/../../.venv/bin/python" "$BENCH_DIR/culprits.py"
printf '\n== %s\n' flight_recorder.py  # torch's flight recorder on and off, per collective
"$BENCH_DIR/../../.venv/bin/python" "$BENCH_DIR/flight_recorder.py"
printf '\n== %s\n' checkpoint.py  # what a save holds training up, sync vs async
"$BENCH_DIR/../../.venv/bin/python" "$BENCH_DIR/checkpoint.py"
printf '\n== %s\n' snapshots.py  # a peer snapshot's stall and memory, resnet50 under FSDP2
"$BENCH_DIR/../../.venv/bin/python" "$BENCH_DIR/snapshots.py"
printf '\n== %s\n' steptime.py  # the step-time breakdown's cost per DDP step
"$BENCH_DIR/../../.venv/bin/python" "$BENCH_DIR/steptime.py"
printf '\n== %s\n' flop_count.py  # counting one step's FLOPs for the MFU, once per run
"$BENCH_DIR/../../.venv/bin/python" "$BENCH_DIR/flop_count.py"

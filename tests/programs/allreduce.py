"""The smallest real DDP check: every rank joins a gloo group from run.sh's variables alone,
all-reduces rank+1, and prints what it saw as one `XSCALE_CHECK {json}` line.

`--announce FILE --hold-until FILE` keep the group (and so MASTER_PORT) open until another job
has announced itself: two jobs on one node then provably ran at the same time.
"""

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def hold(announce: Path | None, until: Path | None, timeout_s: float = 120) -> None:
    """Announce that our rendezvous is up, then wait (bounded) for the other job's announcement."""
    if announce:
        announce.write_text(os.environ["MASTER_PORT"])
    deadline = time.monotonic() + timeout_s
    while until and not until.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"allreduce: error: {until} did not appear within {timeout_s}s")
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--announce", type=Path)
    parser.add_argument("--hold-until", type=Path)
    args, _ = parser.parse_known_args()
    dist.init_process_group("gloo")  # env:// from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([rank + 1.0])
    dist.all_reduce(value)
    record = {
        "rank": rank,
        "world_size": world,
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "node_rank": int(os.environ["NODE_RANK"]),
        "nnodes": int(os.environ["NNODES"]),
        "node": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
        "sum": value.item(),
        "expected": world * (world + 1) / 2,
        "omp_threads": os.environ.get("OMP_NUM_THREADS"),
        "profiled": os.environ.get("XSCALE_PROFILED") == "1",
        "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        "argv": sys.argv[1:],
        "cache_dir": os.environ.get("XSCALE_CACHE_DIR"),
    }
    print("XSCALE_CHECK " + json.dumps(record), flush=True)
    if rank == 0:
        hold(args.announce, args.hold_until)
    dist.barrier()
    dist.destroy_process_group()
    # gloo can abort at interpreter exit after a finished run (pytorch/pytorch issue 190489;
    # docs/ARCHITECTURE.md): leave at once.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

"""The smallest real DDP check: every rank joins a gloo group from run.sh's variables alone,
all-reduces rank+1, and prints what it saw as one `XSCALE_CHECK {json}` line."""

import json
import os
import socket
import sys

import torch
import torch.distributed as dist


def main() -> None:
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
    }
    print("XSCALE_CHECK " + json.dumps(record), flush=True)
    dist.destroy_process_group()
    # gloo can abort at interpreter exit after a finished run (see DESIGN.md): leave at once.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

"""A trainer's life in one process: its gloo group (one rank, on 127.0.0.1 at the port argv[1]),
a collective, then a failure that reads like a collective's timeout. A group the script or its
framework joined (Hugging Face's Trainer does) registers the flight record as xscale takes its
context (runtime.joined).

tests/test_flight.py runs it with and without a supervisor's XSCALE_FR_DIR, and reads the flight
record it leaves.
"""

import sys

import torch
import torch.distributed as dist
from xscale import lifecycle, runtime


def main():
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0,
                            world_size=1)
    runtime.joined(torch.device("cpu"))
    dist.all_reduce(torch.ones(2))
    raise RuntimeError("Timed out waiting 10000ms for recv operation to complete")


lifecycle.run_and_exit(main, prog="trainer")

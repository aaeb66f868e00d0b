"""One rank of tests/bench/shared_opens.sh: import torch (from the environment on shared storage,
or its staged copy: whichever PYTHONPATH names first), join a gloo group from run.sh's variables
and take one DistributedDataParallel step."""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def one_step() -> None:
    """A forward, a backward whose gradient all-reduce every rank joins, an optimizer step."""
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optimizer.step()


def main() -> None:
    dist.init_process_group("gloo")
    one_step()
    if dist.get_rank() == 0:
        print(f"ddp_step: {dist.get_world_size()} ranks, torch from {torch.__file__}")
    dist.destroy_process_group()
    sys.stdout.flush()
    # gloo can abort at interpreter exit after a finished run (pytorch/pytorch issue 190489).
    os._exit(0)


if __name__ == "__main__":
    main()

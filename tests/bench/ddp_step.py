"""One rank of tests/bench/shared_opens.sh: import the benchmark's package tree (the environment
on shared storage, or its staged copy: whichever PYTHONPATH names), import torch, join a gloo group
from run.sh's variables and take one DistributedDataParallel step."""

import os
import sys

import torch
import torch.distributed as dist
import xs_bench_env  # noqa: F401  the counted environment: its import opens every module
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    dist.init_process_group("gloo")
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()  # the gradient all-reduce: every rank took part
    optimizer.step()
    if dist.get_rank() == 0:
        print(f"ddp_step: {dist.get_world_size()} ranks, env from {xs_bench_env.__file__}")
    dist.destroy_process_group()
    sys.stdout.flush()
    # gloo can abort at interpreter exit after a finished run (pytorch/pytorch issue 190489).
    os._exit(0)


if __name__ == "__main__":
    main()

"""own_ddp.py with xscale: the same script plus the lines docs/YOUR-SCRIPT.md shows for a plain
PyTorch loop, the short form (tests/test_own_scripts.py checks that they are the only
difference). For them it stops and saves at Slurm's warning, resumes where it stopped, names a
straggler, writes the summary, notes its progress for the goodput ledger, and outlives a lost
node when the job has a spare.
"""

import argparse
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import xscale
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="plain DDP on random regression data")
    parser.add_argument("--dist-url", default="env://", help="init_method of the process group")
    parser.add_argument("--dist-backend", default="gloo")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=1)
    return parser.parse_args()


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, features: torch.Tensor,
               target: torch.Tensor) -> torch.Tensor:
    loss = nn.functional.mse_loss(model(features), target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss


def main() -> None:
    args = parse_args()
    ctx = xscale.start(backend=args.dist_backend, init_method=args.dist_url)
    rank, world_size = ctx.rank, ctx.world_size
    torch.manual_seed(0)
    inputs = torch.randn(1024, 16)
    data = TensorDataset(inputs, inputs @ torch.randn(16, 1))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = xscale.prepare(model, optimizer, loader, epochs=args.epochs)
    losses = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for features, target in loader:
            loss = train_step(model, optimizer, features, target)
            losses.append(loss.item())
    print("RESULT " + json.dumps({
        "rank": rank, "world_size": world_size, "node": socket.gethostname(),
        "omp_threads": os.environ.get("OMP_NUM_THREADS"), "torch_threads": torch.get_num_threads(),
        "loss_first": losses[0], "loss_last": losses[-1]}), flush=True)
    # gloo's worker thread can abort the interpreter's shutdown (exit 134, pytorch#190489):
    # leave the group, flush, and exit before it runs.
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

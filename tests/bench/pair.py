"""Two gloo ranks of a benchmark on this machine: each round a fresh pair of processes, the
benchmark's own file run again with --rank and --port. For tests/bench/flight_recorder.py and
tests/bench/steptime.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rank0_output(script: str, *args: str, quiet: bool = True, **env: str) -> str:
    """Run SCRIPT as ranks 0 and 1 (one thread each, ENV added) and return rank 0's stdout;
    their stderr is dropped unless not QUIET."""
    port = free_port()
    environ = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    procs = [subprocess.Popen([sys.executable, script, "--rank", str(rank), "--port", str(port),
                               *args], env=environ, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL if quiet else None, text=True)
             for rank in range(2)]
    out = procs[0].communicate(timeout=600)[0]
    procs[1].wait(timeout=600)
    return out


def timed_ddp_steps(steps: int, warmup: int, batch_norm: bool = False,
                    watch=None, after_step=None) -> list[float]:
    """The seconds of each of STEPS DDP steps of MNIST's model (batch 32) after WARMUP ones, in
    the process group already joined. batch_norm: with a BatchNorm layer, whose buffers DDP
    broadcasts as each forward starts; watch(model) before the first step, after_step() inside
    each step's time."""
    import time

    import torch
    from torch import nn

    norm = [nn.BatchNorm1d(128)] if batch_norm else []
    model = nn.parallel.DistributedDataParallel(nn.Sequential(
        nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(9216, 128), *norm, nn.ReLU(), nn.Linear(128, 10)))
    if watch is not None:
        watch(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch, labels = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    times = []
    for index in range(warmup + steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(batch), labels).backward()
        optimizer.step()
        if after_step is not None:
            after_step()
        if index >= warmup:
            times.append(time.perf_counter() - start)
    return times

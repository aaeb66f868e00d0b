"""The machine-readable lines every trainer prints, for tests, benchmarks and xscale.report.

Every rank: `XSCALE_RANK {json}` (rank, local_rank, node, steps, param_digest, ...): replicas
that are really replicas have the same digest, which is the cheapest proof that gradients were
reduced and nothing diverged. Rank 0, as its last line: `XSCALE_SUMMARY {json}`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import sys
import time
from typing import Any

import torch
from torch import nn

from xscale import signals
from xscale.dist import DistContext
from xscale.progress import TrainLog
from xscale.throughput import Throughput

RANK_TAG = "XSCALE_RANK"
SUMMARY_TAG = "XSCALE_SUMMARY"


def node_name() -> str:
    """Slurm's name for this node (nid001234 on LUMI), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP or a DeepSpeed engine (both keep it in `.module`)."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def param_digest(model: nn.Module) -> str:
    """sha256 over every parameter's name, dtype, shape and bytes, in name order.

    Parameters only: BatchNorm's running statistics are buffers that each rank updates from
    its own batches, so they legitimately differ between replicas.
    """
    digest = hashlib.sha256()
    for name, param in sorted(unwrap(model).named_parameters(), key=lambda item: item[0]):
        tensor = param.detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _plain(value: Any) -> Any:
    """JSON-safe: tensors become numbers, NaN/inf become null (strict JSON has neither)."""
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def line(tag: str, fields: dict[str, Any]) -> str:
    return f"{tag} {json.dumps(_plain(fields), sort_keys=False)}"


def rank_record(**fields: Any) -> None:
    """Print this rank's `XSCALE_RANK {json}` line (every rank calls this)."""
    print(line(RANK_TAG, fields), flush=True)


def emit(**fields: Any) -> None:
    """Print `XSCALE_SUMMARY {json}` (rank 0 calls this, last). At least: trainer, world_size,
    nodes, steps, start_step, samples_per_s or tokens_per_s, loss_first, loss_last, seconds."""
    sys.stderr.flush()
    print(line(SUMMARY_TAG, fields), flush=True)


def report(ctx: DistContext, model: nn.Module, *, trainer: str, step: int, started: float,
           log: TrainLog, meter: Throughput, stopped: bool, **fields: Any) -> None:
    """The end of a training run, on every rank (the rates are reduced: a collective).

    Every rank prints its XSCALE_RANK line; rank 0 then prints the XSCALE_SUMMARY line with what
    every trainer reports (place, steps, rates, losses, times, why it stopped) and `fields`, the
    trainer's own. `started` is the time.perf_counter() the run began at.
    """
    rates = meter.reduced()
    rank_record(rank=ctx.rank, local_rank=ctx.local_rank, node=node_name(), steps=step,
                param_digest=param_digest(model))
    if ctx.is_main:
        emit(trainer=trainer, world_size=ctx.world_size, nodes=ctx.nnodes, steps=step,
             start_step=log.start_step, samples_per_s=rates["samples_per_s"],
             samples_per_s_per_rank=rates["samples_per_s_per_rank"],
             loss_first=log.loss_first, loss_last=log.loss_last,
             seconds=time.perf_counter() - started, train_seconds=meter.local().seconds,
             device=ctx.device.type, backend=ctx.backend, stopped_early=stopped,
             signal=signals.signal_name(signals.received()), **fields)

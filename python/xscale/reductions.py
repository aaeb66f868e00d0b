"""Sums over ranks: the one way a number becomes the job's.

Ranks may see different numbers of samples (the last evaluation shard is short), so a mean is
always sum-over-ranks / count-over-ranks, never the average of per-rank averages. Running sums
stay on the device: no host sync per step. Small records (each rank's node, its start-up
phases) go to rank 0 once, at the end of a run or before it starts.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from xscale.dist import collective_device
from xscale.recovery import link as links


def all_reduce_sums(values: Mapping[str, float | torch.Tensor]) -> dict[str, Any]:
    """Sum each named value over all ranks (one all_reduce, in float64): a number, or a 1-D
    tensor summed element by element and returned as a list (a world-size vector that each rank
    fills at its own index comes back with every rank's value).

    Every rank must pass the same names and sizes: they are reduced in sorted order.
    """
    names = sorted(values)
    device = collective_device()
    parts = [torch.as_tensor(values[name], dtype=torch.float64).detach().to(device)
             for name in names]
    packed = torch.cat([part.reshape(-1) for part in parts]) if parts else torch.zeros(0)
    if names and dist.is_initialized() and dist.get_world_size() > 1:
        # With live recovery a lost peer ends the wait at once (xscale.recovery.link.GroupBroken).
        links.wait(dist.all_reduce(packed, op=dist.ReduceOp.SUM, async_op=True))
    flat, sums, offset = packed.tolist(), {}, 0
    for name, part in zip(names, parts, strict=True):
        size = part.numel()
        sums[name] = flat[offset] if part.dim() == 0 else flat[offset:offset + size]
        offset += size
    return sums


class SumMeter:
    """Running sums kept on the device (no host sync per step), reduced across ranks on demand."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}

    def add(self, **values: float | torch.Tensor) -> None:
        for name, value in values.items():
            value = torch.as_tensor(value).detach().to(torch.float64)
            current = self._sums.get(name)
            if current is None:
                self._sums[name] = value
            elif value.device == current.device or value.device.type == "cpu":
                self._sums[name] = current + value.to(current.device)
            else:  # keep accumulating where the step's tensors live (the GPU)
                self._sums[name] = current.to(value.device) + value

    def reduce(self, **extra: float) -> dict[str, float]:
        """Sums over all ranks, with `extra` values in the same all_reduce (a collective: every
        rank calls it with the same names)."""
        return all_reduce_sums({**self._sums, **extra})

    def reset(self) -> None:
        self._sums.clear()

    def __bool__(self) -> bool:
        return bool(self._sums)


def mean(sums: Mapping[str, float], total: str, count: str) -> float:
    """sums[total] / sums[count], NaN when nothing was counted."""
    return sums[total] / sums[count] if sums[count] else float("nan")


def all_reduce_max(values: list[int]) -> list[int]:
    """Each of VALUES at its largest over all ranks (one all_reduce; every rank passes as
    many), ended at once by a lost peer under live recovery as all_reduce_sums is."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    packed = torch.tensor(values, dtype=torch.int64, device=collective_device())
    links.wait(dist.all_reduce(packed, op=dist.ReduceOp.MAX, async_op=True))
    return [int(value) for value in packed.tolist()]


def all_gather_objects(value: Any) -> list[Any]:
    """Every rank's VALUE (picklable), in rank order, on every rank: torch's all_gather_object
    as two tensor all-gathers (the sizes, then the padded bytes) whose waits a lost peer ends
    at once under live recovery (xscale.recovery.link.GroupBroken), where all_gather_object
    raises gloo's error in the caller's lines or waits out the timeout."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    device, world = collective_device(), dist.get_world_size()
    mine = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    size = torch.tensor([mine.numel()], dtype=torch.int64, device=device)
    links.wait(dist.all_gather(sizes, size, async_op=True))
    lengths = [int(length) for length in torch.cat(sizes).tolist()]
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    padded[:mine.numel()] = mine
    parts = [torch.empty(max(lengths), dtype=torch.uint8, device=device) for _ in range(world)]
    links.wait(dist.all_gather(parts, padded.to(device), async_op=True))
    return [pickle.loads(part[:length].cpu().numpy().tobytes())
            for part, length in zip(parts, lengths, strict=True)]


def gather_to_rank0(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order, on rank 0; an empty list elsewhere (a collective;
    one process: [value]). For small records at the end of a run, once. Gathered to rank 0
    only: an all-gather would send every rank all N records, N^2 of them on a large job."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    is_rank0 = dist.get_rank() == 0
    gathered: list[Any] | None = [None] * dist.get_world_size() if is_rank0 else None
    dist.gather_object(value, gathered, dst=0)
    return gathered or []

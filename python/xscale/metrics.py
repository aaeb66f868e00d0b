"""Numbers that describe the whole job, not one rank: sums and counts reduced across ranks.

Ranks may see different numbers of samples (the last evaluation shard is short), so a mean is
always sum-over-ranks / count-over-ranks, never the average of per-rank averages.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch import nn

from xscale.dist import collective_device


def all_reduce_sums(values: Mapping[str, float | torch.Tensor]) -> dict[str, float]:
    """Sum each named value over all ranks (one all_reduce, in float64).

    Every rank must pass the same names: they are reduced in sorted order.
    """
    names = sorted(values)
    device = collective_device()
    packed = torch.stack([torch.as_tensor(values[name], dtype=torch.float64).detach().to(device)
                          .reshape(()) for name in names]) if names else torch.zeros(0)
    if names and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
    return dict(zip(names, packed.tolist(), strict=True))


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

    def reduce(self) -> dict[str, float]:
        """Sums over all ranks (a collective: every rank calls it with the same names)."""
        return all_reduce_sums(self._sums)

    def reset(self) -> None:
        self._sums.clear()

    def __bool__(self) -> bool:
        return bool(self._sums)


def mean(sums: Mapping[str, float], total: str, count: str) -> float:
    """sums[total] / sums[count], NaN when nothing was counted."""
    return sums[total] / sums[count] if sums[count] else float("nan")


def evaluate_classifier(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    autocast: AbstractContextManager | None = None,
) -> dict[str, float]:
    """Mean cross-entropy loss and top-1 accuracy over every rank's share of the data set.

    Returns loss, accuracy and samples (the total over ranks), identical on every rank.
    """
    was_training = model.training
    model.eval()
    meter = SumMeter()
    meter.add(loss_sum=0.0, correct=0.0, samples=0.0)  # a rank with an empty shard still reduces
    with torch.no_grad():
        for inputs, targets in batches:
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            with autocast or nullcontext():
                logits = model(inputs)
            loss = nn.functional.cross_entropy(logits.float(), targets, reduction="sum")
            correct = (logits.argmax(dim=1) == targets).sum()
            meter.add(loss_sum=loss, correct=correct, samples=targets.numel())
    model.train(was_training)
    sums = meter.reduce()
    return {
        "loss": mean(sums, "loss_sum", "samples"),
        "accuracy": mean(sums, "correct", "samples"),
        "samples": int(sums["samples"]),
    }

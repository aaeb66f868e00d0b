"""Run accounting: numbers for the whole job, what a person watches, and the lines a run leaves.

- Sums reduced across ranks. Ranks may see different numbers of samples (the last evaluation
  shard is short), so a mean is always sum-over-ranks / count-over-ranks, never the average of
  per-rank averages. Running sums stay on the device: no host sync per step.
- Throughput, per rank and summed over ranks. The first steps pay for one-off work (kernel
  search, DataLoader workers starting, lazy allocations), so the clock for the rate starts after
  `warmup_steps`. GPU work is asynchronous: the clock reads synchronise the device, only there.
- TrainLog: the loss reduced every `log_every` steps, a tqdm bar and TensorBoard, on rank 0.
- The machine-readable lines, for tests, benchmarks and xscale.report. Every rank:
  `XSCALE_RANK {json}` (rank, local_rank, node, steps, param_digest, startup): replicas that are
  really replicas have the same digest, the cheapest proof that gradients were reduced; startup
  holds the rank's start-up phases in seconds (xscale.startup). Rank 0, as its
  last line: `XSCALE_SUMMARY {json}` with SUMMARY_FIELDS first, the trainer's own after them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import sys
import time
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from xscale.dist import collective_device

RANK_TAG = "XSCALE_RANK"
SUMMARY_TAG = "XSCALE_SUMMARY"
# Every trainer's XSCALE_SUMMARY has these, in this order (a value may be null: tokens_per_s
# where a trainer counts no tokens, losses of a run that took no step, checkpoint when this run
# wrote none). One schema, so that report, bench and tests read any trainer alike.
SUMMARY_FIELDS = (
    "trainer", "world_size", "nodes", "device", "backend",
    "start_step", "steps", "batch_size", "global_batch_size", "accumulation",
    "samples_per_s", "samples_per_s_per_rank", "tokens_per_s",
    "loss_first", "loss_last", "seconds", "train_seconds",
    "stopped_early", "signal", "checkpoint", "checkpoint_stall_s", "checkpoints_saved",
    "startup", "straggler",
)


# ---- sums over ranks -----------------------------------------------------------------------


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
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
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


# ---- throughput ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Rates:
    samples_per_s: float
    tokens_per_s: float
    seconds: float
    steps: int


class Throughput:
    """Call start() before the first step and step(samples, tokens) after each one."""

    def __init__(self, device: torch.device, warmup_steps: int = 1) -> None:
        self.device = device
        self.warmup_steps = warmup_steps
        self.steps = 0
        self._samples = [0, 0]  # (all steps, steps after warm-up)
        self._tokens = [0, 0]
        self._started: float | None = None
        self._warm: float | None = None
        self._stopped: float | None = None

    def _now(self) -> float:
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        self._started = self._now()

    def step(self, samples: int, tokens: float = 0) -> None:
        if self._started is None:
            self.start()
        self.steps += 1
        self._samples[0] += samples
        self._tokens[0] += tokens
        if self._warm is not None:
            self._samples[1] += samples
            self._tokens[1] += tokens
        elif self.steps == self.warmup_steps:
            self._warm = self._now()

    def stop(self) -> None:
        self._stopped = self._now()

    def local(self) -> Rates:
        """This rank's rates (stop() first, or they run to now)."""
        if self._started is None:
            return Rates(0.0, 0.0, 0.0, 0)
        end = self._stopped if self._stopped is not None else self._now()
        measured = self._warm is not None and self._samples[1] > 0
        begin = self._warm if measured else self._started
        samples = self._samples[1] if measured else self._samples[0]
        tokens = self._tokens[1] if measured else self._tokens[0]
        seconds = max(end - begin, 1e-9)
        return Rates(samples / seconds, tokens / seconds, end - self._started, self.steps)

    def reduced(self) -> dict[str, float]:
        """The rates summed over ranks and per rank (mean): a collective, every rank calls it."""
        mine = self.local()
        sums = all_reduce_sums({"samples_per_s": mine.samples_per_s,
                                "tokens_per_s": mine.tokens_per_s, "ranks": 1.0})
        ranks = sums["ranks"]
        return {
            "samples_per_s": sums["samples_per_s"],
            "samples_per_s_per_rank": sums["samples_per_s"] / ranks,
            "tokens_per_s": sums["tokens_per_s"],
            "tokens_per_s_per_rank": sums["tokens_per_s"] / ranks,
        }


# ---- what a person watches -----------------------------------------------------------------


class TrainLog:
    """The job's mean loss every `log_every` steps (and after the first), a tqdm bar and
    TensorBoard scalars from rank 0. Per-step losses stay on the device; each flush is one small
    all_reduce, which also carries whatever the caller adds (the stop flag)."""

    def __init__(self, *, is_main: bool, start_step: int, total_steps: int | None,
                 log_every: int = 10, tensorboard_dir: Path | None = None,
                 desc: str = "train") -> None:
        self.is_main = is_main
        self.start_step = start_step
        self.step_count = start_step
        self.log_every = max(log_every, 1)
        self.loss_first: float | None = None
        self.loss_last: float | None = None
        self._window = SumMeter()
        self._bar = tqdm(total=total_steps, initial=start_step, desc=desc, unit="step",
                         disable=not is_main, file=sys.stderr, dynamic_ncols=True,
                         mininterval=1.0)
        self._writer: Any = None
        if is_main and tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # rank 0 only: a slow import

            self._writer = SummaryWriter(log_dir=str(tensorboard_dir))

    def add(self, step: int, loss: torch.Tensor, samples: int) -> None:
        """One micro-batch's loss (this rank's mean over `samples`); `step`: steps done."""
        self.step_count = step
        self._window.add(loss_sum=loss.detach().float() * samples, samples=samples)

    def advance(self) -> None:
        self._bar.update(1)

    def due(self, step: int) -> bool:
        """Whether the loss is reduced after `step` (the same answer on every rank)."""
        done = step - self.start_step
        return done == 1 or done % self.log_every == 0

    def flush(self, **extra: float) -> dict[str, float]:
        """Reduce the losses since the last flush and `extra` (a collective); the reduced
        extras."""
        sums = self._window.reduce(samples=0.0, loss_sum=0.0, **extra) if not self._window \
            else self._window.reduce(**extra)
        self._window.reset()
        if sums["samples"]:
            loss = sums["loss_sum"] / sums["samples"]
            if self.loss_first is None:
                self.loss_first = loss
            self.loss_last = loss
            self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            self.scalar("train/loss", loss)
        return {name: sums[name] for name in extra}

    def scalar(self, name: str, value: float, step: int | None = None) -> None:
        if self._writer is not None:
            self._writer.add_scalar(name, value, self.step_count if step is None else step)

    def message(self, text: str) -> None:
        """A line on rank 0 that does not tear the progress bar."""
        if self.is_main:
            self._bar.write(text, file=sys.stderr)

    def close(self) -> None:
        self._bar.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None


# ---- the lines a run leaves ----------------------------------------------------------------


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
    """JSON-safe: tensors become numbers, paths strings, NaN/inf null (strict JSON has neither)."""
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def line(tag: str, fields: dict[str, Any]) -> str:
    return f"{tag} {json.dumps(_plain(fields), sort_keys=False)}"


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


def rank_record(**fields: Any) -> None:
    """Print this rank's `XSCALE_RANK {json}` line (every rank calls this)."""
    print(line(RANK_TAG, fields), flush=True)


def emit(**fields: Any) -> None:
    """Print `XSCALE_SUMMARY {json}` (rank 0, last)."""
    sys.stderr.flush()
    print(line(SUMMARY_TAG, fields), flush=True)


def summary_fields(common: Mapping[str, Any], own: Mapping[str, Any]) -> dict[str, Any]:
    """SUMMARY_FIELDS in their order, then the trainer's own; a missing common field is a bug
    in xscale, not the user's, so it fails loudly."""
    missing = [name for name in SUMMARY_FIELDS if name not in common]
    if missing:
        raise KeyError(f"XSCALE_SUMMARY lacks {missing}")
    clash = sorted(set(own) & set(SUMMARY_FIELDS))
    if clash:
        raise KeyError(f"trainer fields {clash} would overwrite XSCALE_SUMMARY's own")
    return {**{name: common[name] for name in SUMMARY_FIELDS}, **own}

"""Where the step time goes: data, compute, communication, checkpoints, and what to do about it.

Every rank splits its steps after the warm-up into what it waited for and what it did, per step:

- data: waiting for the next batch (the loader, the file system under it);
- compute: DDP's forward and backward compute times, less the forward's buffer broadcast;
- communication: DDP's gradient communication that the backward did not hide (its
  communication time less its overlap with the backward compute), and the broadcast of the
  module's buffers (BatchNorm statistics) from rank 0 that DDP does as each forward starts;
  both include waiting for slower ranks;
- checkpoint: the time saves held training up;
- other: the rest of the step (the optimizer step, the loss log, Python, evaluations run
  between steps).

Nothing is timed twice: the loop already times its batch waits (the straggler watch) and its
checkpoint stalls (the goodput ledger), and DDP times its forward, backward and communication
itself, on the device, for a sample of its iterations (one in SAMPLE_EVERY here, one in 100 by
default); the clock reads DDP's latest sample every SAMPLE_EVERY steps. DDP counts its buffer
broadcast as forward compute, so the clock times it apart (BufferSync): a rank that waits there
for a slow peer would otherwise look compute-bound. A model without DDP has no communication
times: with one rank there is none; with several (a DeepSpeed engine) it is left inside
compute, and the summary says communication null.

The run is as fast as its slowest part allows, and a rank's exposed communication includes its
wait for the others; the verdict is therefore read from the rank that waited least in
communication, the one the others wait for, and names the largest of data, compute,
communication and checkpoint, with its advice (docs/STEPTIME.md).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from xscale.observe.bounds import SHARES, bound_of, verdict
from xscale.observe.spans import Spans
from xscale.observe.utilisation import Utilisation
from xscale.observe.warmup import WarmUp

# DDP times one iteration in this many (its own default is 100); the clock reads it as often.
SAMPLE_EVERY = 10
CPU = torch.device("cpu")


@dataclass(frozen=True)
class Breakdown:
    """One rank's mean step, in seconds: the whole step and its parts (communication None
    where it was not measured, inside compute then)."""

    seconds: float
    data: float
    compute: float
    communication: float | None
    checkpoint: float
    other: float

    def shares(self) -> dict[str, float | None]:
        """Each part as a share of the step."""
        whole = max(self.seconds, 1e-12)
        return {name: None if getattr(self, name) is None else getattr(self, name) / whole
                for name in SHARES}

    def bound(self) -> str:
        """The part that limits the step: the largest of BOUNDS."""
        return bound_of(self.shares())


class BufferSync:
    """The time from DDP's forward start to its module's (the buffer broadcast), summed over
    training forwards once `counting` (xscale.observe.spans: the broadcast runs on the device's
    stream; its events are read once done, never waited for but at the end)."""

    def __init__(self, ddp: nn.Module, device: torch.device) -> None:
        self.seconds = 0.0
        self.counting = False
        self._spans = Spans(device)
        self._started: float | torch.Event | None = None
        ddp.register_forward_pre_hook(self._ddp_starts)
        ddp.module.register_forward_pre_hook(self._module_starts)

    def _ddp_starts(self, module: nn.Module, args: Any) -> None:
        if self.counting and module.training:
            self._started = self._spans.mark()

    def _module_starts(self, module: nn.Module, args: Any) -> None:
        if self._started is not None:
            self._spans.add(self._started, self._spans.mark())
            self._started = None

    def restart(self) -> None:
        """Count from here: the spans before (the warm-up's) are dropped."""
        self._spans.take(wait=True)
        self.seconds, self.counting = 0.0, True

    def total(self, wait: bool = False) -> float:
        """The seconds so far: the spans done by now, or every one with `wait`."""
        self.seconds += self._spans.take(wait)
        return self.seconds


class StepClock:
    """One rank's clock over its steps: call step() after each optimizer step, and book the
    waits for data and checkpoints as they happen. The warm-up is left out: the steps up to
    `warmup_steps` (kernel search, workers starting) and those that compiled after them
    (xscale.observe.warmup). `now`: the clock read (a test's own)."""

    def __init__(self, warmup_steps: int = 1, world_size: int = 1,
                 device: torch.device = CPU,
                 now: Callable[[], float] = time.perf_counter) -> None:
        self.world_size, self.now, self.device = world_size, now, device
        self.warm_up = WarmUp(warmup_steps)
        self.steps = 0
        self._measured = 0  # steps since the measurement started
        self._ddp: Any = None
        self._buffer_sync: BufferSync | None = None
        self._from_iteration: int | None = None
        self._samples: list[tuple[float, float]] = []  # (compute, exposed communication)
        self._data = self._checkpoint = 0.0
        self._started: float | None = None
        self._last: tuple[float, float, float] | None = None  # (when, data, checkpoint)

    def watch(self, model: nn.Module) -> None:
        """Read DDP's own timing of MODEL, if it is DDP-wrapped; one sample in SAMPLE_EVERY
        iterations from here on (once per model: Trainer's train() may be called again)."""
        if isinstance(model, nn.parallel.DistributedDataParallel) and model is not self._ddp:
            self._ddp = model
            model._set_ddp_runtime_logging_sample_rate(SAMPLE_EVERY)
            # Only where DDP broadcasts buffers: without any the span would be DDP's own
            # bookkeeping, and a busy host's preemption there would pass for communication.
            self._buffer_sync = BufferSync(model, self.device) \
                if model.will_sync_module_buffers() else None

    def waited_for_data(self, seconds: float) -> None:
        self._data += seconds

    def waited_for_checkpoint(self, seconds: float) -> None:
        self._checkpoint += seconds

    def step(self) -> None:
        self.steps += 1
        now = self.now()
        if self.warm_up.step():
            self._start(now)
        elif self._started is not None:
            self._measured += 1
        if self._started is None:
            return
        self._last = (now, self._data, self._checkpoint)
        if self._ddp is not None and self.steps % SAMPLE_EVERY == 0:
            self._sample()
            if self._buffer_sync is not None:
                self._buffer_sync.total()  # read the events done, so that few are kept

    def _start(self, now: float) -> None:
        """Measure from NOW on: what was booked before (the warm-up's waits, DDP's samples,
        buffer broadcasts) counts for nothing."""
        self._started, self._data, self._checkpoint, self._measured = now, 0.0, 0.0, 0
        self._from_iteration = self._ddp_iteration()
        self._samples.clear()
        if self._buffer_sync is not None:
            self._buffer_sync.restart()

    def _ddp_iteration(self) -> int | None:
        return None if self._ddp is None else self._ddp._get_ddp_logging_data().get("iteration")

    def _sample(self) -> None:
        """DDP's latest timed iteration (nanoseconds), once, if it came after the warm-up."""
        logged = self._ddp._get_ddp_logging_data()
        iteration = logged.get("iteration")
        if iteration is None or "backward_comm_time" not in logged or (
                self._from_iteration is not None and iteration <= self._from_iteration):
            return
        self._from_iteration = iteration
        compute = logged["forward_compute_time"] + logged["backward_compute_time"]
        exposed = logged["backward_comm_time"] - logged["backward_compute_comm_overlap_time"]
        self._samples.append((compute / 1e9, max(exposed, 0) / 1e9))

    def breakdown(self) -> Breakdown | None:
        """The mean step after the warm-up; None before a step after it."""
        if self._started is None or self._last is None or not self._measured:
            return None
        if self._ddp is not None:
            self._sample()  # a run shorter than SAMPLE_EVERY steps has DDP's early samples
        ended, data, stalled = self._last
        steps = self._measured
        seconds = (ended - self._started) / steps
        data, stalled = data / steps, stalled / steps
        rest = max(seconds - data - stalled, 0.0)
        if self._samples:
            broadcast = 0.0 if self._buffer_sync is None \
                else self._buffer_sync.total(wait=True) / steps
            compute = statistics.mean(sample[0] for sample in self._samples) - broadcast
            compute = min(max(compute, 0.0), rest)
            communication = statistics.mean(sample[1] for sample in self._samples) + broadcast
            communication = min(communication, rest - compute)
            other = rest - compute - communication
        else:
            compute, other = rest, 0.0
            communication = 0.0 if self.world_size == 1 else None
        return Breakdown(seconds, data, compute, communication, stalled, other)


@dataclass(frozen=True)
class StepTime:
    """The run's step time in its summary: the mean `seconds` per step and the `shares` of the
    rank the verdict comes from, the `bound`; that `rank` and each share's lowest and highest
    over the ranks (`spread`) in the summary file only."""

    seconds: float
    shares: dict[str, float | None]
    rank: int
    bound: str
    spread: dict[str, dict[str, float | int]]

    def field(self) -> dict[str, Any]:
        """The summary's step_time field."""
        return {"seconds": float(f"{self.seconds:.4g}"),
                **{name: None if share is None else round(share, 3)
                   for name, share in self.shares.items()}}

    def ranks(self) -> dict[str, Any]:
        """The summary file's step_time_ranks field."""
        return {"rank": self.rank, "spread": self.spread}

    def verdict(self, utilisation: Utilisation | None = None) -> str:
        """The line a person reads at the end of the run, with the MFU where it was measured."""
        return verdict(self.seconds, self.shares, f"rank {self.rank}", utilisation)


def summarise(breakdowns: list[tuple[int, Breakdown | None]]) -> StepTime | None:
    """The run's step time from every rank's breakdown (rank, breakdown), on rank 0: the view
    of the rank that waited least in communication; None before any rank timed a step."""
    measured = [(rank, breakdown) for rank, breakdown in breakdowns if breakdown is not None]
    if not measured:
        return None
    rank, chosen = min(measured, key=lambda item: (item[1].communication or 0.0, item[0]))
    return StepTime(chosen.seconds, chosen.shares(), rank, chosen.bound(), _spread(measured))


def _spread(measured: list[tuple[int, Breakdown]]) -> dict[str, dict[str, float | int]]:
    spread = {}
    for name in SHARES:
        shares = [(breakdown.shares()[name], rank) for rank, breakdown in measured
                  if breakdown.shares()[name] is not None]
        if shares:
            (low, low_rank), (high, high_rank) = min(shares), max(shares)
            spread[name] = {"min": round(low, 3), "min_rank": low_rank,
                            "max": round(high, 3), "max_rank": high_rank}
    return spread

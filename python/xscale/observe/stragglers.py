"""Stragglers: the rank that makes every step as slow as itself, named while the run goes on.

In a synchronous step every rank waits for the slowest one in the gradient all-reduce, so the
step time is the same everywhere and names nobody. What differs is each rank's own work: the
wait for its batch and its forward pass, which no collective enters (DDP's gradient all-reduce
runs inside the backward, where a fast rank waits for a slow one; its buffer broadcast comes
before the inner module's forward starts). Every rank times those, on its device without a host
sync of its own (events on a GPU, read at the log interval, when the loss reduction synchronises
anyway; the clock on a CPU), and sends its seconds per step at its own index of a world-size
vector, inside the all-reduce the runtime already does at each log interval: no collective of its
own. Rank 0 compares each rank's work over the last `intervals` intervals with the median
rank's, and names a rank at `factor` times the median or more, once:

    xscale: straggler: rank 3 on nid002: 2.6x the median rank's work per step over the last 30 steps

The factor, 2 by default (XSCALE_STRAGGLER_FACTOR), stays clear of what healthy ranks differ by
where they share cores (up to 1.6x over 30 steps on the test bed, four ranks on two cores; ranks
that each have their own GPU or node should differ far less, not measured here) and flags a rank
that halves the pace of every step at its compute-bound part; on a quiet machine a lower one
(1.3) catches milder stragglers. Three intervals together (XSCALE_STRAGGLER_INTERVALS) keep one
interval's hiccup (a checkpoint, a page-cache miss) from naming anyone; the first interval, one
step of warm-up, is not counted. Short steps need more: a rank is named only once it has lost
MIN_EXCESS_S more than the median rank, over the newest intervals or, while it stays that slow,
over older ones too. A rank descheduled for 100 ms is twice the median of 30 steps of 3 ms (a
healthy 2 x 2 run with 11 ms steps named four different ranks at 2.0-2.4x before), while a
slowed node on the test bed loses 0.8 s an interval. After a live recovery every rank starts
afresh, the next interval a warm-up: a replacement's first steps (its workers starting, its
first forward) are no sign of a slow node. The summary's `straggler` field holds the slowest
rank of the whole run, its node and its factor. A median needs a healthy majority: with half
the ranks on one slow node of two, nobody is twice the median, and the summary's factor still
shows the imbalance.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from xscale.dist import sharded_units, unwrap
from xscale.observe.spans import Spans
from xscale.reductions import gather_to_rank0
from xscale.shared import settings as xscale_settings  # this module's settings() keeps its name
from xscale.shared.contract import node_name

FACTOR_ENV, INTERVALS_ENV = "XSCALE_STRAGGLER_FACTOR", "XSCALE_STRAGGLER_INTERVALS"
# The least a rank must lose against the median rank to be named: more than a scheduler's
# hiccup where ranks share cores (tens to a few hundred ms), less than what a slowed node loses
# in one interval on the test bed (0.8-1.1 s of 10 steps of a tiny model).
MIN_EXCESS_S = 0.5
HISTORY = 100  # intervals kept for a rank slow by the factor but short of MIN_EXCESS_S
DEFAULT_FACTOR = xscale_settings.setting(FACTOR_ENV).default
DEFAULT_INTERVALS = xscale_settings.setting(INTERVALS_ENV).default


def settings(environ: dict[str, str] | None = None) -> tuple[float, int]:
    """(factor, intervals) from the environment; a bad value is a UserError, before training."""
    return (xscale_settings.value(FACTOR_ENV, environ),
            xscale_settings.value(INTERVALS_ENV, environ))


class WorkClock:
    """This rank's own work: time waiting for batches (add_wait) and the training forward passes
    of the model's inner module (hooks), summed until take().

    A sharded model's forward (FSDP2) is collective too: each unit first gathers its weights
    from every rank, and a fast rank waits there for a slow one. Those waits are timed apart,
    from a hook before FSDP's own pre-forward to one after it, and left out. The model's own
    gather is already outside: FSDP's pre-forward hook runs before the clock's."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self._waits = 0.0
        self._forwards, self._gathers = Spans(device), Spans(device)
        self._started: float | torch.Event | None = None
        self._gathering: float | torch.Event | None = None
        inner = unwrap(model)
        inner.register_forward_pre_hook(self._forward_starts)
        inner.register_forward_hook(self._forward_ends)
        for unit in sharded_units(inner):
            unit.register_forward_pre_hook(self._gather_starts, prepend=True)
            unit.register_forward_pre_hook(self._gather_ends)

    def add_wait(self, seconds: float) -> None:
        self._waits += seconds

    def _forward_starts(self, module: nn.Module, args: Any) -> None:
        if module.training:  # an evaluation is not a step
            self._started = self._forwards.mark()

    def _forward_ends(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._started is not None:
            self._forwards.add(self._started, self._forwards.mark())
            self._started = None

    def _gather_starts(self, module: nn.Module, args: Any) -> None:
        if self._started is not None:  # inside a training forward
            self._gathering = self._gathers.mark()

    def _gather_ends(self, module: nn.Module, args: Any) -> None:
        if self._gathering is not None:
            self._gathers.add(self._gathering, self._gathers.mark())
            self._gathering = None

    def take(self) -> float:
        """The seconds of own work since the last take(). On a device: its forward passes less
        their gathers, once the last one is done (one wait per log interval, for work long
        finished by then)."""
        waits, self._waits = self._waits, 0.0
        return waits + max(0.0, self._forwards.take() - self._gathers.take())


def print_now(text: str) -> None:
    """Print TEXT at once: the line is read while the job runs, and stdout is a pipe there."""
    print(text, flush=True)


class StragglerWatch:
    """One per rank; rank 0 says which rank straggles. `nodes`: rank -> node, on rank 0."""

    def __init__(self, clock: WorkClock, rank: int, world_size: int, nodes: list[str],
                 factor: float, intervals: int,
                 say: Callable[[str], None] = print_now) -> None:
        self.clock, self.rank, self.world_size, self.nodes = clock, rank, world_size, nodes
        self.factor, self.intervals, self.say = factor, intervals, say
        self._steps_since = 0
        self._observed = 0
        self._history: list[tuple[int, list[float]]] = []  # (steps, seconds per rank), rank 0
        self._named: set[int] = set()
        self._totals = [0.0] * world_size
        self.micro_batches = 1  # per step on this rank (more after the world shrank)

    def step(self) -> None:
        self._steps_since += 1

    def contribution(self) -> torch.Tensor:
        """This rank's seconds of own work per step since the last interval, at its index."""
        per_step = self.clock.take() / max(self._steps_since, 1) / self.micro_batches
        vector = torch.zeros(self.world_size, dtype=torch.float64)
        vector[self.rank] = per_step
        return vector

    def observe(self, per_step: list[float]) -> None:
        """Every rank's seconds per step over the interval just reduced; rank 0 says who
        straggles (_slow_ranks)."""
        steps, self._steps_since = self._steps_since, 0
        self._observed += 1
        if self._observed == 1 or steps == 0:  # the first interval is the warm-up
            return
        seconds = [value * steps for value in per_step]
        self._totals = [total + value for total, value in zip(self._totals, seconds, strict=True)]
        if self.rank != 0:
            return
        self._history = (self._history + [(steps, seconds)])[-HISTORY:]
        for rank, factor, over_steps in self._slow_ranks():
            self._named.add(rank)
            self.say(f"xscale: straggler: rank {rank} on {self.node(rank)}: {factor:.1f}x the "
                     f"median rank's work per step over the last {over_steps} steps")

    def _slow_ranks(self) -> list[tuple[int, float, int]]:
        """(rank, factor, steps) of each rank not named yet whose work over the newest
        `intervals` intervals is `factor` times the median rank's or more, so that one
        interval's hiccup weighs a third at most, and MIN_EXCESS_S more. A rank slow enough but
        short of that excess is judged over older intervals too, for as long as it stays slow
        enough: a hiccup's factor fades in a longer window, a slow node's loss grows."""
        found: list[tuple[int, float, int]] = []
        spent, steps = [0.0] * self.world_size, 0
        suspects: list[int] | None = None  # None: every rank
        for count, (interval_steps, seconds) in enumerate(reversed(self._history), 1):
            spent = [total + value for total, value in zip(spent, seconds, strict=True)]
            steps += interval_steps
            if count < self.intervals:
                continue
            median = statistics.median(spent)
            if median <= 0:
                break
            candidates = range(self.world_size) if suspects is None else suspects
            suspects = []
            for rank in candidates:
                if rank in self._named or spent[rank] < self.factor * median:
                    continue
                if spent[rank] - median >= MIN_EXCESS_S:
                    found.append((rank, spent[rank] / median, steps))
                else:
                    suspects.append(rank)
            if not suspects:
                break
        return found

    def restart(self, nodes: list[str], rank: int | None = None, world_size: int | None = None,
                micro_batches: int = 1) -> None:
        """After a live recovery: the ranks' nodes now (rank 0's list), and a new account whose
        first interval is a warm-up, on every rank alike. In a smaller world, this rank's new
        RANK and the WORLD_SIZE, and its MICRO_BATCHES per step: ranks dealt more of a step's
        batch than others are judged by their work per micro-batch."""
        self.nodes = nodes
        if world_size is not None and world_size != self.world_size:
            self.rank, self.world_size = rank, world_size
            self._totals, self._named = [0.0] * world_size, set()
        self.micro_batches = micro_batches
        self.clock.take()
        self._steps_since = self._observed = 0
        self._history = []

    def node(self, rank: int) -> str:
        return self.nodes[rank] if rank < len(self.nodes) else "?"

    def summary(self) -> dict[str, Any] | None:
        """The slowest rank of the run (after the warm-up), its node and factor; None before a
        second interval."""
        median = statistics.median(self._totals)
        if median <= 0:
            return None
        slowest = max(range(self.world_size), key=lambda rank: self._totals[rank])
        return {"rank": slowest, "node": self.node(slowest),
                "factor": round(self._totals[slowest] / median, 2)}


def watch(model: nn.Module, device: torch.device, rank: int, world_size: int,
          say: Callable[[str], None] = print_now, gather: bool = True) -> StragglerWatch:
    """A watch over this rank's own work (a collective: every rank calls it, to give rank 0 the
    ranks' nodes). GATHER False: not yet, no collective; restart() gives them later (a
    replacement whose survivors are not there yet)."""
    factor, intervals = settings()
    nodes = gather_to_rank0(node_name()) if gather else []
    return StragglerWatch(WorkClock(model, device), rank, world_size, nodes, factor, intervals,
                          say)

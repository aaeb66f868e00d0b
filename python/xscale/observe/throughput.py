"""Throughput, per rank and summed over ranks.

The first steps pay for one-off work (kernel search, DataLoader workers starting, lazy
allocations), and a compiled model's first steps compile it: the clock for the rate starts after
`warmup_steps` and the steps that compiled after them (xscale.observe.warmup). GPU work is
asynchronous: the clock reads synchronise the device, only there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from xscale.observe.warmup import WarmUp
from xscale.reductions import all_reduce_sums


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
        self.warm_up = WarmUp(warmup_steps)
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
        if self.warm_up.step():  # counted from this step's end (xscale.observe.warmup)
            self._warm = self._now()
            self._samples[1] = self._tokens[1] = 0
        elif self._warm is not None:
            self._samples[1] += samples
            self._tokens[1] += tokens

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
        }

"""Time spans of a rank's work, where the work runs: the host clock on a CPU, device events
(CUDA/HIP, XPU) elsewhere, so that timing adds no host synchronisation. A span's events are read
when taken, once done; `take(wait=True)` waits for the last one (work long finished by then,
at a log interval or the run's end). Used by the straggler watch (forward passes) and the step
time's buffer broadcast (xscale.observe.stragglers, xscale.observe.steptime)."""

from __future__ import annotations

import time

import torch


class Spans:
    def __init__(self, device: torch.device) -> None:
        self.on_device = device.type != "cpu"
        self.device = device
        self._seconds = 0.0
        self._pending: list[tuple[torch.Event, torch.Event]] = []

    def mark(self) -> float | torch.Event:
        """Now, on the clock the work runs on: a span's start or end."""
        if not self.on_device:
            return time.perf_counter()
        event = torch.Event(device=self.device, enable_timing=True)
        event.record()
        return event

    def add(self, started: float | torch.Event, ended: float | torch.Event) -> None:
        if self.on_device:
            self._pending.append((started, ended))
        else:
            self._seconds += ended - started

    def take(self, wait: bool = True) -> float:
        """The seconds of the spans since the last take(): every one with `wait`, else those
        the device has done (the rest count at a later take)."""
        if wait and self._pending:
            self._pending[-1][1].synchronize()
        while self._pending and self._pending[0][1].query():
            started, ended = self._pending.pop(0)
            self._seconds += started.elapsed_time(ended) / 1000
        seconds, self._seconds = self._seconds, 0.0
        return seconds

"""Rank 0's progress, noted for the step supervisor's goodput ledger (jobs/lib/goodput.py).

The supervisor gives each training step a file, XSCALE_PROGRESS; rank 0 appends one JSON line
per event, with the step reached and the wall-clock time (time.time(), the clock the supervisor
reads too):

    {"event": "first_step", "step": 41, "time": ...}       start-up ends
    {"event": "interval", "step": 50, "time": ...}         every log interval
    {"event": "checkpoint", "step": 60, "time": ..., "stall_s": 0.61}   training blocked that long
    {"event": "end", "step": 100, "time": ...}             training is over (evaluation follows)

From these the ledger tells productive training from start-up, checkpoint stalls and the work a
failure threw away: the steps after the last checkpoint, which the resumed run does again. A
line a log interval on one rank is all it costs. Without XSCALE_PROGRESS (no supervisor, or not
rank 0) nothing is written.
"""

from __future__ import annotations

import json
import time

from xscale import settings

ENV = "XSCALE_PROGRESS"


class Progress:
    def __init__(self, is_main: bool) -> None:
        self.path = settings.value(ENV) if is_main else None

    def note(self, event: str, step: int, **fields: float) -> None:
        if self.path is None:
            return
        line = json.dumps({"event": event, "step": step, "time": time.time(), **fields})
        try:
            with open(self.path, "a") as handle:
                handle.write(line + "\n")
        except OSError as error:  # the ledger loses a line; the training goes on
            print(f"xscale: warning: progress not noted in {self.path}: {error}", flush=True)
            self.path = None

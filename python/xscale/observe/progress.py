"""Rank 0's progress, noted for the supervisor (jobs/lib/goodput.py, jobs/lib/supervisor.py).

The supervisor gives each launch a file, XSCALE_PROGRESS; rank 0 appends one JSON line per event
(xscale.shared.contract names them: the first step, each log interval, each checkpoint with the time
it held training up, the end and whether a stop signal ended it), with the step reached and the
wall-clock time (time.time(), the clock the supervisor reads too). From these the goodput ledger
tells productive training from start-up, checkpoint stalls and the work a failure threw away, and
the supervisor whether a warning that came as training ended needs a requeue. A line a log interval
on one rank is all it costs. Without XSCALE_PROGRESS (no supervisor, or not rank 0) nothing is
written.
"""

from __future__ import annotations

from xscale.shared import contract, settings


class Progress:
    """Rank 0's notes into XSCALE_PROGRESS (xscale.shared.contract names the events)."""

    def __init__(self, is_main: bool) -> None:
        self.path = settings.value(contract.PROGRESS_VAR) if is_main else None

    def note(self, event: str, step: int, **fields: float | bool) -> None:
        if self.path is None:
            return
        line = contract.progress_line(event, step, **fields)
        try:
            with open(self.path, "a") as handle:
                handle.write(line + "\n")
        except OSError as error:  # the ledger loses a line; the training goes on
            print(f"xscale: warning: progress not noted in {self.path}: {error}", flush=True)
            self.path = None

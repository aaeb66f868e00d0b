"""Stopping at a step boundary when Slurm says time is up (SIGUSR1 via --signal) or the job is
cancelled or preempted (SIGTERM).

The handler only sets a flag: a handler runs between two bytecodes of whatever the main thread
was doing (maybe inside a collective), so doing real work there is unsafe. The trainer asks
should_stop() once per step; it all-reduces the flag with MAX so that every rank stops after the
same step, even if the signal reached only some of them. Then the trainer saves a checkpoint
and exits 0, and a requeued job resumes from it.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

from xscale.dist import collective_device

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

_received: int | None = None
_installed = False


def _handler(signum: int, frame: FrameType | None) -> None:
    global _received
    _received = signum


def install(signums: tuple[int, ...] = STOP_SIGNALS) -> None:
    """Catch the stop signals (idempotent; only the main thread may install handlers)."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    for signum in signums:
        signal.signal(signum, _handler)
    _installed = True


def received() -> int | None:
    """The signal this process received (None if none): local, no communication."""
    return _received


def request_stop(signum: int = signal.SIGUSR1) -> None:
    """Behave as if `signum` had arrived (tests, or a trainer's own stopping rule)."""
    global _received
    _received = signum


def reset() -> None:
    global _received
    _received = None


def should_stop() -> bool:
    """True on every rank when any rank received a stop signal (a collective: all ranks call it
    at the same step). Installs the handlers on first use if the trainer has not."""
    install()
    flag = torch.tensor([0 if _received is None else 1], dtype=torch.int32,
                        device=collective_device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def signal_name(signum: int | None) -> str | None:
    return None if signum is None else signal.Signals(signum).name


def stop_message(prog: str, step: int, saved: object | None) -> str:
    """The line a trainer prints after stopping on a signal (rank 0: it may not have received
    the signal itself)."""
    name = signal_name(_received) or "a signal to another rank"
    where = saved if saved is not None else "none (no --output-dir)"
    return f"{prog}: stopped by {name} at step {step}; checkpoint {where}"

"""A trainer's life as a process: user errors, the stop signals, its children, and its exit.

The bottom of the package: it imports nothing from xscale but xscale.shared.settings (standard
library only, where UserError lives), so every other module can raise a UserError or ask whether a
stop signal came.

- User errors. A traceback tells a user on rank 713 of a 1024-rank job nothing they can act on,
  and it is printed 1024 times; one line per rank, `PROG: error: ...`, exit status 2, is what
  `grep error:` finds.
- Stop signals. Slurm warns before the time limit with SIGUSR1 (`--signal=B:USR1@300`) and
  cancels or preempts with SIGTERM. The handler only sets a flag: it runs between two bytecodes
  of whatever the main thread was doing (maybe inside a collective), so real work there is
  unsafe. When the ranks agree to stop is xscale.runtime's business.
- Children. Slurm signals every process of the step, DataLoader workers and multiprocessing's
  resource tracker included. A worker dies of SIGUSR1's default action ("DataLoader worker
  (pid N) is killed by signal: User defined signal 1") and the tracker prints KeyError
  tracebacks at exit. Both are started with SIGUSR1 blocked: a blocked signal stays blocked
  across fork and exec for the child's whole life, from its first instruction, where a handler
  installed later (worker_init_fn) leaves the seconds of a spawned worker's start-up exposed.
- Exit. With torch 2.14 and gloo, about one finished run in four aborted at interpreter exit
  ("terminate called without an active exception", status 134): gloo's worker thread releases
  a Python tensor while the interpreter shuts down (pytorch issue #190489), with or without
  destroy_process_group() and a barrier before it. Slurm then marks a finished job FAILED. So a
  trainer leaves through os._exit() right after the process group is gone and output is flushed.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing import context as mp_context
from types import FrameType
from typing import NoReturn

import torch
import torch.distributed as dist

from xscale.shared.settings import UserError

USAGE_ERROR = 2  # argparse's and run.sh's exit status for a bad command line or setting
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
# Only the warning is kept from children: SIGTERM is how multiprocessing ends workers at exit.
CHILD_SHIELD = {signal.SIGUSR1}


# ---- user errors ---------------------------------------------------------------------------


def error_line(prog: str, message: str) -> str:
    return f"{prog}: error: {message}"


_failure_hooks: list[Callable[[BaseException], None]] = []


def on_failure(hook: Callable[[BaseException], None], first: bool = False) -> None:
    """Have `hook(error)` run when an exception other than a UserError ends the trainer, before
    its traceback (xscale.observe.flight's record of a failed collective); FIRST: before the
    hooks already there."""
    if hook not in _failure_hooks:
        _failure_hooks.insert(0 if first else len(_failure_hooks), hook)


_exit_hooks: list[Callable[[], None]] = []


def on_exit(hook: Callable[[], None]) -> None:
    """Have `hook()` run as the process leaves through exit_cleanly (whose os._exit skips
    atexit): live recovery's goodbye to the supervisor."""
    if hook not in _exit_hooks:
        _exit_hooks.append(hook)


def run(main: Callable[[], int | None], prog: str) -> int:
    """Call `main()` and return its exit status; a UserError becomes one line on stderr and 2.

    argparse's own exits (--help, a bad option) come back as their status too, so the caller
    that owns the process exit sees every ending the same way.
    """
    try:
        code = main()
    except UserError as error:
        print(error_line(prog, str(error)), file=sys.stderr, flush=True)
        return USAGE_ERROR
    except SystemExit as exiting:
        return exit_status(exiting.code)
    except Exception as error:
        for hook in _failure_hooks:
            hook(error)
        raise
    return 0 if code is None else int(code)


def exit_status(code: object) -> int:
    """SystemExit's code as a process status: None is 0, an int itself, a message is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr, flush=True)
    return 1


def run_and_exit(main: Callable[[], int | None], prog: str | None = None) -> NoReturn:
    """A script's `if __name__ == "__main__":` line: call `main()`; a UserError (a bad path, a
    bad setting) becomes one line `PROG: error: ...` and exit status 2; then leave cleanly: the
    other ranks waited for after success, the process group destroyed, DataLoader workers ended,
    output flushed, and os._exit, before gloo's shutdown can abort the exit (status 134).
    PROG: the script's file name unless given."""
    exit_cleanly(run(main, prog or os.path.basename(sys.argv[0])))


# ---- stop signals --------------------------------------------------------------------------

_received: int | None = None
_installed = False


def _handler(signum: int, frame: FrameType | None) -> None:
    global _received
    _received = signum


def install_stop_handlers(signums: tuple[int, ...] = STOP_SIGNALS) -> None:
    """Catch the stop signals (idempotent; only the main thread may install handlers).

    Early, before the model loads: Slurm's warning during a long start-up would kill the
    process otherwise.
    """
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    for signum in signums:
        signal.signal(signum, _handler)
    _installed = True


def stop_received() -> int | None:
    """The stop signal this process received (None if none): local, no communication."""
    return _received


def request_stop(signum: int = signal.SIGUSR1) -> None:
    """Behave as if `signum` had arrived (tests, or a trainer's own stopping rule)."""
    global _received
    _received = signum


def reset_stop() -> None:
    global _received
    _received = None


def signal_name(signum: int | None) -> str | None:
    return None if signum is None else signal.Signals(signum).name


# ---- children started with the warning signal blocked ---------------------------------------


@contextmanager
def signals_blocked(signums: set[int] = CHILD_SHIELD) -> Iterator[None]:
    """Block `signums` in this thread only, for the block: what a child started here inherits.

    The other threads still take the signal, so the trainer's own handler keeps working.
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signums)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def shield_resource_tracker() -> None:
    """Start multiprocessing's resource tracker (spawned workers use it) shielded."""
    from multiprocessing import resource_tracker

    with signals_blocked():
        resource_tracker.ensure_running()


class _ShieldedForkProcess(mp_context.ForkProcess):
    def start(self) -> None:
        with signals_blocked():
            super().start()


# What a trainer script imports, and a spawned worker imports again: the fork server imports
# those this process has, once, and its forks (the workers) find them imported when they run the
# script's top level. "__main__", multiprocessing's own way to preload the script, does nothing
# on CPython 3.11: forkserver.ensure_running passes the script's path on under "main_path",
# and spawn names it "init_main_from_path".
PRELOADABLE = ("torch", "numpy", "torchvision", "transformers", "datasets", "accelerate",
               "deepspeed", "xscale")


def start_fork_server() -> None:
    """multiprocessing's fork server for this process, started once under CHILD_SHIELD (a
    fork of it inherits the blocked signal) with the PRELOADABLE packages this process has
    imported: a fresh interpreter, so its forks hold none of this process's GPU runtime or
    threads."""
    from multiprocessing import forkserver

    forkserver.set_forkserver_preload(
        ["__main__", *(name for name in PRELOADABLE if name in sys.modules)])
    with signals_blocked():
        forkserver.ensure_running()


class _ShieldedForkServerProcess(mp_context.ForkServerProcess):
    def start(self) -> None:
        start_fork_server()  # where it is running already: nothing
        super().start()


class ShieldedForkServerContext(mp_context.ForkServerContext):
    """multiprocessing's forkserver, its server started shielded (start_fork_server)."""

    Process = _ShieldedForkServerProcess


class ShieldedForkContext(mp_context.ForkContext):
    """multiprocessing's fork, with children started under CHILD_SHIELD."""

    Process = _ShieldedForkProcess


def worker_context(spawn: bool) -> multiprocessing.context.BaseContext:
    """A DataLoader `multiprocessing_context` whose workers never see Slurm's warning.

    spawn: the workers must not be forks of this process. On GPUs forking a process whose
    ROCm/CUDA runtime already runs threads can leave a worker hanging on a lock held by a
    thread the child does not have (pytorch/pytorch#119845; the LUMI workshop's
    `set_start_method('spawn')`). They are forks of a fork server instead, started here, ahead
    of them: spawned workers each import the script's packages again (13 s of gpt_neo_imdb.py's
    first step with two workers here, likely most of its 26-29 s first step on an H200), a fork
    server once, while the trainer goes on. Fork otherwise: the cheap start.
    """
    if spawn:
        shield_resource_tracker()  # the workers' queues and locks register with it
        start_fork_server()
        return ShieldedForkServerContext()
    return ShieldedForkContext()


# ---- exit ----------------------------------------------------------------------------------


def close_process_group(code: int) -> int:
    """Wait for the other ranks (only after success), then tear the group down; the status to
    exit with.

    After a failure the other ranks may never arrive at a barrier: waiting for them would turn
    one rank's error into a hang until the collective timeout.
    """
    if not dist.is_initialized():
        return code
    try:
        if code == 0:
            if dist.get_backend() == "nccl":
                # NCCL's barrier on this rank's own GPU, not GPU 0 of every rank.
                dist.barrier(device_ids=[torch.accelerator.current_device_index()])
            else:
                dist.barrier()
        dist.destroy_process_group()
    except Exception as error:  # leaving anyway: say why, and do not report success
        print(f"xscale: error: process group teardown failed: {error}", file=sys.stderr)
        return code or 1
    return code


def flush_output() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # a closed pipe: nothing left to say to it


def end_children() -> None:
    """What multiprocessing does at a normal exit, which os._exit skips: end the DataLoader
    workers and release their queues' semaphores (without it the resource tracker reports them
    as leaked). multiprocessing registers exactly this function with atexit."""
    from multiprocessing import util

    try:
        util._exit_function()
    except Exception as error:  # leaving anyway
        print(f"xscale: warning: ending child processes: {error}", file=sys.stderr)


def exit_cleanly(code: int = 0) -> NoReturn:
    """Barrier, destroy_process_group(), end the workers, flush stdout/stderr, os._exit(code)."""
    code = close_process_group(code)
    for hook in _exit_hooks:
        hook()
    end_children()
    flush_output()
    os._exit(code)

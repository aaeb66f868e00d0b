"""How a loop saves, behind one interface (Saver): rank 0's `ckpt-STEP.pt`, every rank's
`ckpt-STEP.dcp`, or a save function that writes before it returns (a script's own, a DeepSpeed
engine's).

The write runs in the background (XSCALE_CHECKPOINT_MODE=async, the default): training stops
only while the state is copied to host memory (pinned, from a GPU), and the next save, or the
end of the run, waits for the write before it. `sync` writes on the training thread.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from xscale.checkpoints import every_rank
from xscale.checkpoints.contents import host_copies, training_state
from xscale.checkpoints.files import checkpoint_path, prune, publish_directory, save
from xscale.checkpoints.generators import rng_state
from xscale.dist import is_sharded, unwrap
from xscale.shared import settings


def checkpoint_mode(env: Mapping[str, str] = os.environ) -> str:
    """XSCALE_CHECKPOINT_MODE: async (the default) or sync; anything else is a UserError."""
    return settings.value("XSCALE_CHECKPOINT_MODE", env)


def checkpoint_writers(env: Mapping[str, str] = os.environ) -> str:
    """XSCALE_CHECKPOINT_WRITERS: rank0 (the default) or all; anything else is a UserError."""
    return settings.value("XSCALE_CHECKPOINT_WRITERS", env)


def writers_for(model: nn.Module, env: Mapping[str, str] = os.environ) -> str:
    """Who writes MODEL's checkpoints: XSCALE_CHECKPOINT_WRITERS, but every rank for a sharded
    model (FSDP2), whatever the setting: rank 0 holds only its own shard of it."""
    return "all" if is_sharded(model) else checkpoint_writers(env)


class Saver(Protocol):
    """How a loop saves, whichever format: `saver(step, epoch)` saves STEP (or starts its
    background write) and returns where it goes; `wait()` returns once it is published;
    `last_write_s` is how long the last background write took (0: written in the call)."""

    def __call__(self, step: int, epoch: int) -> object: ...

    def wait(self) -> None: ...

    def regroup(self) -> None:
        """After a live recovery, on every rank at the same point (the replacement makes its
        saver there): what the saver agreed on with the broken group, agreed on again."""

    @property
    def last_write_s(self) -> float: ...


class ForegroundSaver:
    """A save function that has written when it returns (a script's own `save=`, a DeepSpeed
    engine's), as a Saver."""

    last_write_s = 0.0

    def __init__(self, save: Callable[[int, int], object]) -> None:
        self.save = save

    def __call__(self, step: int, epoch: int) -> object:
        return self.save(step, epoch)

    def wait(self) -> None:
        """Nothing is written in the background."""

    def regroup(self) -> None:
        """Nothing agreed on: the save function's own collectives use the group there is."""


class BackgroundWriter:
    """One write at a time on a thread of its own. The run's end waits for it (Loop.finish); a
    run that fails leaves through os._exit (xscale.lifecycle) and its write with it, unpublished:
    the next run resumes from the checkpoint before."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_write_s = 0.0

    def start(self, write: Callable[[], object]) -> None:
        self.wait()

        def run() -> None:
            started = time.perf_counter()
            try:
                write()
            except BaseException as error:  # raised again on the training thread, by wait()
                self._error = error
            self.last_write_s = time.perf_counter() - started

        self._thread = threading.Thread(target=run, name="xscale-checkpoint-writer")
        self._thread.start()

    def wait(self) -> None:
        """Until the write under way is published; its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


class TrainingSaver:
    """save(step, epoch) for xscale.runtime.Loop: every rank gathers (the RNG states), rank 0
    writes, in the background unless XSCALE_CHECKPOINT_MODE=sync; wait() until it is written."""

    def __init__(self, output_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scaler: torch.amp.GradScaler | None, *, is_main: bool, keep: int,
                 mode: str, extra: dict[str, Any], scheduler: Any = None) -> None:
        self.output_dir, self.model = output_dir, model
        self.optimizer, self.scaler, self.scheduler = optimizer, scaler, scheduler
        self.is_main, self.keep, self.mode, self.extra = is_main, keep, mode, extra
        self.writer = BackgroundWriter()

    def __call__(self, step: int, epoch: int) -> Path:
        if self.is_main:
            self.writer.wait()  # one copy of the state in host memory at a time
        state = training_state(self.model, self.optimizer, step, epoch, self.scaler,
                               scheduler=self.scheduler, **self.extra)
        if self.is_main and self.mode == "sync":
            save(self.output_dir, step, state, keep=self.keep)
            self.writer.last_write_s = 0.0
        elif self.is_main:
            copy = host_copies(state)
            if torch.accelerator.is_available():
                torch.accelerator.synchronize()  # the pinned copies are complete
            self.writer.start(lambda: save(self.output_dir, step, copy, keep=self.keep))
        return checkpoint_path(self.output_dir, step)

    def wait(self) -> None:
        self.writer.wait()

    def regroup(self) -> None:
        """Nothing agreed on: the generators' gather uses the group there is."""

    @property
    def last_write_s(self) -> float:
        """How long the last background write took, on rank 0 to its publication (0 in sync
        mode; with rank 0 writing alone, 0 on the other ranks)."""
        return self.writer.last_write_s


class EveryRankSaver(TrainingSaver):
    """TrainingSaver's contract with XSCALE_CHECKPOINT_WRITERS=all: every rank writes its part of
    ckpt-STEP.dcp into this run's temporary directory for the step; rank 0 publishes it once DCP
    is done. In the background (DCP's async_save: the call holds training while this rank's
    state is copied to host memory) unless the mode is sync. Made by every rank at once: the
    checkpoints' group and the run token are agreed on here."""

    def __init__(self, output_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scaler: torch.amp.GradScaler | None, *, is_main: bool, keep: int,
                 mode: str, extra: dict[str, Any], scheduler: Any = None) -> None:
        super().__init__(output_dir, model, optimizer, scaler, is_main=is_main, keep=keep,
                         mode=mode, extra=extra, scheduler=scheduler)
        self.group = every_rank.checkpoint_group()
        self.token = every_rank.run_token(self.group)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.stager = every_rank.pinned_stager() if mode == "async" else None

    def regroup(self) -> None:
        """The checkpoints' group went with the broken one: a new one, and rank 0's run token
        handed to every rank again (a replacement has drawn its own). A write under way when
        the group broke failed with its collectives: its folder is never published, and the
        next save prunes it, as a resume passes it over."""
        try:
            self.writer.wait()
        except Exception:  # noqa: BLE001 (gloo's error of the lost peer, whatever its type)
            pass
        every_rank.forget_group()
        self.group = every_rank.checkpoint_group()
        self.token = every_rank.run_token(self.group)

    def __call__(self, step: int, epoch: int) -> Path:
        # Every rank, not only rank 0: the previous save's collectives on the checkpoints' group
        # must be over before this one's begin, and this rank's staged copy is reused.
        self.writer.wait()
        run = {"step": step, "epoch": epoch, "world_size": self.world, **self.extra}
        if self.scaler is not None and self.scaler.is_enabled():
            run["scaler"] = self.scaler.state_dict()
        if self.scheduler is not None:
            run["scheduler"] = self.scheduler.state_dict()
        state = every_rank.state_dict(unwrap(self.model), self.optimizer, run,
                                          every_rank.pack(rng_state()), self.rank)
        partial = every_rank.partial_path(self.output_dir, step, self.token)
        path = checkpoint_path(self.output_dir, step, every_rank.SUFFIX)
        if self.mode == "sync":
            every_rank.save(state, partial, self.group)
            self._publish(partial, path)
            self.writer.last_write_s = 0.0
            return path
        written = every_rank.start_save(state, partial, self.group, self.stager)

        def finish() -> None:
            written.result()  # this rank's part, and on rank 0 every part and the metadata
            self._publish(partial, path)

        self.writer.start(finish)
        return path

    def _publish(self, partial: Path, path: Path) -> None:
        if self.is_main:
            publish_directory(partial, path)
            prune(self.output_dir, self.keep, writing=self.token)


def training_saver(output_dir: Path | None, model: nn.Module, optimizer: torch.optim.Optimizer,
                   scaler: torch.amp.GradScaler | None = None, *, is_main: bool, keep: int,
                   scheduler: Any = None, **extra: Any) -> TrainingSaver | None:
    """The runtime Loop's saver (every rank makes it at the same point); None without an output
    directory."""
    if output_dir is None:
        return None
    make = EveryRankSaver if writers_for(model) == "all" else TrainingSaver
    return make(output_dir, model, optimizer, scaler, is_main=is_main, keep=keep,
                mode=checkpoint_mode(), extra=extra, scheduler=scheduler)

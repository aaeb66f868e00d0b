"""Checkpoints that survive the time limit: written atomically, found by step.

A job killed while saving (time limit, node failure, scancel) must not leave a file that the
requeued job then tries to resume from. So rank 0 writes `ckpt-STEP.pt` under a temporary name
in the same directory, flushes and fsyncs it, checks that the archive is whole, renames it into
place (atomic on one file system, Lustre included) and fsyncs the directory so the rename itself
is on disk. Only the last K are kept: ResNet-50 with its optimizer is ~200 MB a copy.

With XSCALE_CHECKPOINT_WRITERS=all every rank writes a part of a `ckpt-STEP.dcp` directory
(torch.distributed.checkpoint, xscale.dcp_checkpoint) into a temporary directory, and rank 0
renames it into place once the last part and the metadata are written. Both formats are found,
resumed from and pruned together, by step.

The write runs in the background (XSCALE_CHECKPOINT_MODE=async, the default): training stops
only while rank 0 copies the state to host memory (pinned, from a GPU), and the next save, or
the end of the run, waits for the write before it. `sync` writes on the training thread, as
xscale did before. `--checkpoint-every auto` takes Young's interval, sqrt(2 x save cost x mean
time between failures), from the run's own first save (auto_interval).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import shutil
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from xscale import dcp_checkpoint, settings
from xscale.dist import unwrap
from xscale.lifecycle import UserError

PATTERN = re.compile(r"^ckpt-(\d+)\.(pt|dcp)$")
TEMP_PREFIX = ".ckpt-"
PARTIAL_SUFFIX = ".partial"  # an every-rank checkpoint's directory until it is published
NODE_MTBF_H = settings.NODE_MTBF_H  # XSCALE_NODE_MTBF_H's default: Llama 3's figure


def checkpoint_mode(env: Mapping[str, str] = os.environ) -> str:
    """XSCALE_CHECKPOINT_MODE: async (the default) or sync; anything else is a UserError."""
    return settings.value("XSCALE_CHECKPOINT_MODE", env)


def checkpoint_writers(env: Mapping[str, str] = os.environ) -> str:
    """XSCALE_CHECKPOINT_WRITERS: rank0 (the default) or all; anything else is a UserError."""
    return settings.value("XSCALE_CHECKPOINT_WRITERS", env)


def node_mtbf_hours(env: Mapping[str, str] = os.environ) -> float:
    """XSCALE_NODE_MTBF_H, a positive number of hours (default NODE_MTBF_H), for `auto`."""
    return settings.value("XSCALE_NODE_MTBF_H", env)


def checkpoint_interval(text: str) -> int | str:
    """An argparse `type` for a checkpoint interval such as --checkpoint-every: a whole number
    of steps (0: only at the end and at a stop), or `auto` (Young's interval from the cost of
    the run's first save, docs/CHECKPOINTS.md)."""
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"'{text}' is neither a whole number nor auto")
    return int(text)


def auto_interval(stall_s: float, write_s: float, step_s: float, nodes: int,
                  node_mtbf_h: float) -> tuple[int, float, float]:
    """(steps between saves, seconds, the job's mean time between failures in seconds).
    Young's interval: sqrt(2 x the time a save stops training x the job's MTBF), which
    balances the stalls against the work a failure throws away (J. W. Young, CACM 17(9), 1974);
    at least the background write's own time, or each save would wait for the one before."""
    job_mtbf_s = node_mtbf_h * 3600 / max(nodes, 1)
    seconds = max(math.sqrt(2 * stall_s * job_mtbf_s), write_s)
    return max(1, math.ceil(seconds / step_s)), seconds, job_mtbf_s


def auto_decision(option: str, stall_s: float, write_s: float, step_s: float, nodes: int,
                  node_mtbf_h: float) -> tuple[int, str]:
    """(steps between saves, the line rank 0 prints once) for OPTION auto: auto_interval and
    its inputs, in the same words for every trainer."""
    every, seconds, job_mtbf_s = auto_interval(stall_s, write_s, step_s, nodes, node_mtbf_h)
    return every, (
        f"xscale: {option} auto: every {every} steps ({seconds:.1f} s): a save stops training "
        f"{stall_s:.3f} s and writes for {write_s:.3f} s, a step takes {step_s:.3f} s, a failure "
        f"comes every {job_mtbf_s / 3600:,.0f} h on {nodes} node(s) ({node_mtbf_h:,.0f} h per "
        f"node)")


def checkpoint_path(output_dir: str | os.PathLike, step: int, suffix: str = ".pt") -> Path:
    return Path(output_dir) / f"ckpt-{step:06d}{suffix}"


def list_checkpoints(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint, oldest first: rank 0's ckpt-STEP.pt files and
    every rank's ckpt-STEP.dcp directories together, so that a run that changed
    XSCALE_CHECKPOINT_WRITERS resumes from the newest either way."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = []
    for entry in folder.iterdir():
        match = PATTERN.match(entry.name)
        if match and (entry.is_dir() if match.group(2) == "dcp" else entry.is_file()):
            found.append((int(match.group(1)), entry))
    return sorted(found)


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save(obj: Any, path: Path, writer: Callable[[Any, Any], None] = torch.save) -> None:
    """Write `obj` to `path` so that `path` is either absent/old or complete, never partial."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            writer(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        if writer is torch.save:
            check_archive(Path(temp))
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def check_archive(path: Path) -> None:
    """torch.save's zip archive, whole: its central directory (written last) lists the pickle.
    Reading the directory, not every record, keeps the check to milliseconds."""
    with zipfile.ZipFile(path) as archive:
        if not any(name.endswith("/data.pkl") for name in archive.namelist()):
            raise OSError(f"{path}: no data.pkl in the archive")


def publish_directory(partial: Path, path: Path) -> None:
    """Rename a directory that is whole into its name, durably (an older one of that name, from a
    run that resumed from before it, goes first)."""
    fsync_dir(partial)  # every rank's files and DCP's .metadata are entries in it
    if path.exists():
        _discard(path)
    os.replace(partial, path)
    fsync_dir(path.parent)


def prune(output_dir: str | os.PathLike, keep: int, writing: str | None = None) -> list[Path]:
    """Remove all but the newest `keep` checkpoints (and temporaries of interrupted saves).
    WRITING: the run token of this run's every-rank saves, whose temporary directories may be
    under way (the other ranks start the next save before rank 0 prunes); any other run's are
    an interrupted save's. Saves are one at a time: any .tmp file left now is one too."""
    folder = Path(output_dir)
    removed = []
    if keep > 0:
        removed += [path for _, path in list_checkpoints(folder)[:-keep]]
    removed += folder.glob(f"{TEMP_PREFIX}*.tmp")
    removed += [path for path in folder.glob(f"{TEMP_PREFIX}*{PARTIAL_SUFFIX}")
                if writing is None or not path.name.endswith(f".{writing}{PARTIAL_SUFFIX}")]
    for path in removed:
        _discard(path)
    return removed


def _discard(path: Path) -> None:
    """A file, or a directory renamed out of the checkpoints' names first, so that a job killed
    while removing it leaves a temporary to clean, not a ckpt-STEP.dcp with files missing."""
    if not path.is_dir():
        path.unlink(missing_ok=True)
        return
    if not path.name.endswith(PARTIAL_SUFFIX):
        doomed = path.with_name(f".{path.name}.removed{PARTIAL_SUFFIX}")
        shutil.rmtree(doomed, ignore_errors=True)  # an earlier removal's, cut short
        os.replace(path, doomed)
        path = doomed
    shutil.rmtree(path, ignore_errors=True)


def save(output_dir: str | os.PathLike, step: int, state: dict[str, Any], keep: int = 3) -> Path:
    """Rank 0 only: write `state` as ckpt-STEP.pt atomically, then keep the newest `keep`."""
    path = checkpoint_path(output_dir, step)
    atomic_save(state, path)
    prune(output_dir, keep)
    return path


def _unreadable(path: Path, error: object) -> None:
    print(f"xscale: warning: cannot read {path} ({error}); trying an older checkpoint",
          file=sys.stderr, flush=True)


def _read_newest(output_dir: str | os.PathLike, skip: set[Path] | None = None,
                 directories: bool = True) -> tuple[int, Path, dict[str, Any] | None] | None:
    """(step, path, state) of the newest checkpoint that looks whole, not in SKIP: a .pt file
    read (state), or a .dcp directory with its metadata (state None: every rank loads its own
    part, in place, with the model at hand)."""
    for step, path in reversed(list_checkpoints(output_dir)):
        if path in (skip or ()) or (path.suffix == dcp_checkpoint.SUFFIX and not directories):
            continue
        if path.suffix == dcp_checkpoint.SUFFIX:
            if dcp_checkpoint.is_whole(path):
                return step, path, None
            _unreadable(path, f"no {dcp_checkpoint.METADATA}")
            continue
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # a corrupt file of any kind: fall back, loudly
            _unreadable(path, error)
            continue
        state.setdefault("step", step)
        return step, path, state
    return None


def _agree(step: int | None, output_dir: str | os.PathLike) -> None:
    """All ranks must resume from the same step: an output directory on node-local storage
    (/tmp) would give the other nodes no checkpoint, which is a UserError rather than silently
    diverged replicas."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        steps: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(steps, step)
        if len(set(steps)) > 1:
            seen = ", ".join(f"rank {r}: {s}" for r, s in enumerate(steps))
            raise UserError(f"the ranks found different newest checkpoints in {output_dir} "
                            f"({seen}); --output-dir must be on storage all nodes share")


def load_latest(output_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The newest readable ckpt-STEP.pt's state on the CPU, or None; every rank calls this.

    An unreadable newest file (a disk that lied about fsync) is reported and the next older
    one is tried, rather than losing every step since the start. The ranks must agree (_agree).
    """
    found = _read_newest(output_dir, directories=False)
    _agree(None if found is None else found[0], output_dir)
    return None if found is None else found[2]


def rng_state() -> dict[str, Any]:
    """This process's random generators (Python, torch CPU, and the current accelerator's)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    accelerator = _accelerator_module()
    if accelerator is not None and accelerator.is_initialized():
        state["accelerator"] = accelerator.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_python_state(state["python"]))
    torch.set_rng_state(state["torch"])
    accelerator = _accelerator_module()
    saved = state.get("accelerator")
    if saved is not None and accelerator is not None:
        accelerator.set_rng_state(saved)


def _accelerator_module() -> Any:
    """torch.cuda (CUDA and ROCm) or torch.xpu, whichever this process uses; None on CPUs."""
    device = torch.accelerator.current_accelerator(check_available=True)
    return None if device is None else torch.get_device_module(device)


def _as_python_state(value: Any) -> tuple:
    """random.setstate wants tuples; a round trip through the checkpoint may give lists."""
    version, internal, gauss = value
    return (version, tuple(internal), gauss)


def gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's generators, on every rank (ranks draw different augmentations, so each
    resumes its own stream)."""
    mine = rng_state()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    return states


def training_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    epoch: int,
    scaler: torch.amp.GradScaler | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """What a resumed run needs: weights, optimizer, AMP scaler, position, every rank's RNG.

    A collective (the RNG states are gathered): every rank calls it, rank 0 saves the result.
    """
    state: dict[str, Any] = {
        "model": unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "epoch": epoch,
        "rng": gather_rng_states(),
    }
    if scaler is not None and scaler.is_enabled():
        state["scaler"] = scaler.state_dict()
    state.update(extra)
    return state


def restore_training_state(
    state: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None = None,
    rank: int = 0,
) -> tuple[int, int]:
    """Load a training_state() into the model, optimizer and scaler; (step, epoch).

    Each rank takes back its own RNG stream when the world size is unchanged; after a change
    the streams cannot be matched to ranks, so they are left as seeded.
    """
    unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scaler is not None and "scaler" in state:
        scaler.load_state_dict(state["scaler"])
    streams = state.get("rng") or []
    world = dist.get_world_size() if dist.is_initialized() else 1
    if len(streams) == world:
        set_rng_state(streams[rank])
    return int(state["step"]), int(state["epoch"])


def resume_training(output_dir: Path | None, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scaler: torch.amp.GradScaler | None = None, *, rank: int,
                    enabled: bool = True) -> int | None:
    """The step a run resumes from after restoring the newest checkpoint in `output_dir`, a .pt
    file or a .dcp directory, or None for a fresh start (no directory, none there, or
    --no-resume). Every rank calls it. A newest one that cannot be read is reported and the one
    before it is tried, rather than losing every step since the start."""
    if output_dir is None or not enabled:
        return None
    skip: set[Path] = set()
    while True:
        found = _read_newest(output_dir, skip)
        _agree(None if found is None else found[0], output_dir)
        if found is None:
            return None
        _, path, state = found
        if state is not None:
            return restore_training_state(state, model, optimizer, scaler, rank=rank)[0]
        # Only now: torch.distributed.checkpoint costs a second of start-up (dcp_checkpoint).
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            return restore_every_rank(path, model, optimizer, scaler, rank=rank)
        except CheckpointException as error:  # raised on every rank alike: all fall back
            _unreadable(path, error)
            skip.add(path)


def restore_every_rank(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                       scaler: torch.amp.GradScaler | None = None, *, rank: int) -> int:
    """Load a ckpt-STEP.dcp (every rank its part, in place; a collective); the step."""
    run, rng = dcp_checkpoint.load(path, unwrap(model), optimizer, rank=rank,
                                   group=dcp_checkpoint.checkpoint_group())
    if scaler is not None and "scaler" in run:
        scaler.load_state_dict(run["scaler"])
    if rng is not None:
        set_rng_state(dcp_checkpoint.unpack(rng))
    return int(run["step"])


def host_copies(value: Any, _copies: dict | None = None) -> Any:
    """VALUE with its tensors copied to host memory, where training no longer changes them:
    a device's tensors into pinned memory (the copy runs asynchronously; synchronise before
    reading), the CPU's cloned. A tensor that appears twice (tied weights: GPT-neo's embedding
    and output layer) is copied once, so that torch.save still writes it once."""
    copies = {} if _copies is None else _copies
    if isinstance(value, torch.Tensor):
        key = (value.data_ptr(), value.dtype, tuple(value.shape), value.stride())
        if key not in copies:
            copies[key] = host_copy(value.detach())
        return copies[key]
    if isinstance(value, dict):
        return {key: host_copies(item, copies) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = [host_copies(item, copies) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value  # numbers, strings and the RNG states' tuples: not changed in place


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type == "cpu":
        return tensor.clone()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


class Saver(Protocol):
    """How a loop saves, whichever format: `saver(step, epoch)` saves STEP (or starts its
    background write) and returns where it goes; `wait()` returns once it is published;
    `last_write_s` is how long the last background write took (0: written in the call)."""

    def __call__(self, step: int, epoch: int) -> object: ...

    def wait(self) -> None: ...

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
                 mode: str, extra: dict[str, Any]) -> None:
        self.output_dir, self.model = output_dir, model
        self.optimizer, self.scaler = optimizer, scaler
        self.is_main, self.keep, self.mode, self.extra = is_main, keep, mode, extra
        self.writer = BackgroundWriter()

    def __call__(self, step: int, epoch: int) -> Path:
        if self.is_main:
            self.writer.wait()  # one copy of the state in host memory at a time
        state = training_state(self.model, self.optimizer, step, epoch, self.scaler, **self.extra)
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
                 mode: str, extra: dict[str, Any]) -> None:
        super().__init__(output_dir, model, optimizer, scaler, is_main=is_main, keep=keep,
                         mode=mode, extra=extra)
        self.group = dcp_checkpoint.checkpoint_group()
        self.token = dcp_checkpoint.run_token(self.group)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.stager = dcp_checkpoint.pinned_stager() if mode == "async" else None

    def __call__(self, step: int, epoch: int) -> Path:
        # Every rank, not only rank 0: the previous save's collectives on the checkpoints' group
        # must be over before this one's begin, and this rank's staged copy is reused.
        self.writer.wait()
        run = {"step": step, "epoch": epoch, "world_size": self.world, **self.extra}
        if self.scaler is not None and self.scaler.is_enabled():
            run["scaler"] = self.scaler.state_dict()
        state = dcp_checkpoint.state_dict(unwrap(self.model), self.optimizer, run,
                                          dcp_checkpoint.pack(rng_state()), self.rank)
        partial = dcp_checkpoint.partial_path(self.output_dir, step, self.token)
        path = checkpoint_path(self.output_dir, step, dcp_checkpoint.SUFFIX)
        if self.mode == "sync":
            dcp_checkpoint.save(state, partial, self.group)
            self._publish(partial, path)
            self.writer.last_write_s = 0.0
            return path
        written = dcp_checkpoint.start_save(state, partial, self.group, self.stager)

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
                   **extra: Any) -> TrainingSaver | None:
    """The runtime Loop's saver (every rank makes it at the same point); None without an output
    directory."""
    if output_dir is None:
        return None
    make = EveryRankSaver if checkpoint_writers() == "all" else TrainingSaver
    return make(output_dir, model, optimizer, scaler, is_main=is_main, keep=keep,
                mode=checkpoint_mode(), extra=extra)

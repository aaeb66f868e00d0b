"""Checkpoints that survive the time limit: written atomically by rank 0, found by step.

A job killed while saving (time limit, node failure, scancel) must not leave a file that the
requeued job then tries to resume from. So rank 0 writes `ckpt-STEP.pt` under a temporary name
in the same directory, flushes and fsyncs it, renames it into place (atomic on one file system,
Lustre included) and fsyncs the directory so the rename itself is on disk. Only the last K are
kept: ResNet-50 with its optimizer is ~200 MB a copy.
"""

from __future__ import annotations

import os
import random
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from xscale.accounting import unwrap
from xscale.lifecycle import UserError

PATTERN = re.compile(r"^ckpt-(\d+)\.pt$")
TEMP_PREFIX = ".ckpt-"


def checkpoint_path(output_dir: str | os.PathLike, step: int) -> Path:
    return Path(output_dir) / f"ckpt-{step:06d}.pt"


def list_checkpoints(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint, oldest first."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = []
    for entry in folder.iterdir():
        match = PATTERN.match(entry.name)
        if match and entry.is_file():
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
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def prune(output_dir: str | os.PathLike, keep: int) -> list[Path]:
    """Remove all but the newest `keep` checkpoints (and temporaries of interrupted saves)."""
    removed = []
    if keep > 0:
        removed += [path for _, path in list_checkpoints(output_dir)[:-keep]]
    # Only rank 0 writes, one save at a time: any temporary left now is an interrupted save's.
    removed += Path(output_dir).glob(f"{TEMP_PREFIX}*.tmp")
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


def save(output_dir: str | os.PathLike, step: int, state: dict[str, Any], keep: int = 3) -> Path:
    """Rank 0 only: write `state` as ckpt-STEP.pt atomically, then keep the newest `keep`."""
    path = checkpoint_path(output_dir, step)
    atomic_save(state, path)
    prune(output_dir, keep)
    return path


def _read_newest(output_dir: str | os.PathLike) -> dict[str, Any] | None:
    for step, path in reversed(list_checkpoints(output_dir)):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # a corrupt file of any kind: fall back, loudly
            print(f"xscale: warning: cannot read {path} ({error}); trying an older checkpoint",
                  file=sys.stderr, flush=True)
            continue
        state.setdefault("step", step)
        return state
    return None


def load_latest(output_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The newest readable checkpoint's state on the CPU, or None; every rank calls this.

    An unreadable newest file (a disk that lied about fsync) is reported and the next older
    one is tried, rather than losing every step since the start. All ranks must resume from the
    same step: an output directory on node-local storage (/tmp) would give the other nodes no
    checkpoint, which is a UserError rather than silently diverged replicas.
    """
    state = _read_newest(output_dir)
    if dist.is_initialized() and dist.get_world_size() > 1:
        steps: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(steps, None if state is None else int(state["step"]))
        if len(set(steps)) > 1:
            seen = ", ".join(f"rank {r}: {s}" for r, s in enumerate(steps))
            raise UserError(f"the ranks found different newest checkpoints in {output_dir} "
                            f"({seen}); --output-dir must be on storage all nodes share")
    return state


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
    """The step a run resumes from after restoring the newest checkpoint in `output_dir`, or
    None for a fresh start (no directory, none there, or --no-resume). Every rank calls it."""
    if output_dir is None or not enabled:
        return None
    state = load_latest(output_dir)
    if state is None:
        return None
    step, _ = restore_training_state(state, model, optimizer, scaler, rank=rank)
    return step


def training_saver(output_dir: Path | None, model: nn.Module, optimizer: torch.optim.Optimizer,
                   scaler: torch.amp.GradScaler | None = None, *, is_main: bool, keep: int,
                   **extra: Any) -> Callable[[int, int], Path] | None:
    """save(step, epoch) for xscale.runtime.Loop: every rank gathers, rank 0 writes; None
    without an output directory."""
    if output_dir is None:
        return None

    def save_step(step: int, epoch: int) -> Path:
        state = training_state(model, optimizer, step, epoch, scaler, **extra)
        if is_main:
            save(output_dir, step, state, keep=keep)
        return checkpoint_path(output_dir, step)

    return save_step

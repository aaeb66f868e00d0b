"""Checkpoints that survive the time limit: written atomically, found by step.

A job killed while saving (time limit, node failure, scancel) must not leave a file that the
requeued job then tries to resume from. So rank 0 writes `ckpt-STEP.pt` under a temporary name
in the same directory, flushes and fsyncs it, checks that the archive is whole, renames it into
place (atomic on one file system, Lustre included) and fsyncs the directory so the rename itself
is on disk. Only the last K are kept: ResNet-50 with its optimizer is ~200 MB a copy.

With XSCALE_CHECKPOINT_WRITERS=all every rank writes a part of a `ckpt-STEP.dcp` directory
(xscale.checkpoints.every_rank) into a temporary directory, and rank 0 renames it into place
once the last part and the metadata are written. Both formats are found, resumed from and
pruned together, by step.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from xscale.checkpoints import every_rank
from xscale.lifecycle import UserError

PATTERN = re.compile(r"^ckpt-(\d+)\.(pt|dcp)$")


TEMP_PREFIX = ".ckpt-"


PARTIAL_SUFFIX = ".partial"  # an every-rank checkpoint's directory until it is published


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


def warn_unreadable(path: Path, error: object) -> None:
    print(f"xscale: warning: cannot read {path} ({error}); trying an older checkpoint",
          file=sys.stderr, flush=True)


def read_newest(output_dir: str | os.PathLike, skip: set[Path] | None = None,
                directories: bool = True) -> tuple[int, Path, dict[str, Any] | None] | None:
    """(step, path, state) of the newest checkpoint that looks whole, not in SKIP: a .pt file
    read (state), or a .dcp directory with its metadata (state None: every rank loads its own
    part, in place, with the model at hand)."""
    for step, path in reversed(list_checkpoints(output_dir)):
        if path in (skip or ()) or (path.suffix == every_rank.SUFFIX and not directories):
            continue
        if path.suffix == every_rank.SUFFIX:
            if every_rank.is_whole(path):
                return step, path, None
            warn_unreadable(path, f"no {every_rank.METADATA}")
            continue
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # a corrupt file of any kind: fall back, loudly
            warn_unreadable(path, error)
            continue
        state.setdefault("step", step)
        return step, path, state
    return None


def ranks_agree_on(step: int | None, output_dir: str | os.PathLike) -> None:
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
    one is tried, rather than losing every step since the start. The ranks must agree
    (ranks_agree_on).
    """
    found = read_newest(output_dir, directories=False)
    ranks_agree_on(None if found is None else found[0], output_dir)
    return None if found is None else found[2]

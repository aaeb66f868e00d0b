"""Pre-staging a data set into node-local storage (LUMI AI workshop, E09
"Extreme scale AI", "Pre-stage in memory").

Reading a million small JPEGs from Lustre starves the GPUs; reading one tarball is cheap.
LUMI-G nodes have no local SSD but their /tmp lives in RAM, so each node unpacks the tarball
once into its own /tmp and every rank of that node reads from there. Local rank 0 unpacks
(into a temporary directory, renamed into place when complete, then a marker file); the other
local ranks wait for the marker, polling with a bounded timeout. A second run on the same node
finds the marker and starts at once.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from xscale.lifecycle import UserError
from xscale.shared import archive

DEFAULT_TIMEOUT_S = 1800.0  # ImageNet's 150 GB from Lustre into RAM takes minutes, not hours
POLL_S = 0.2


def _identity(tar_path: Path) -> str:
    """What the marker records: a changed tarball (new size or time) is staged again."""
    info = tar_path.stat()
    return f"{tar_path.resolve()} {info.st_size} {info.st_mtime_ns}\n"


def staged_paths(tar_path: Path, dest_root: Path) -> tuple[Path, Path, Path]:
    """(the staged directory, its completion marker, its failure marker)."""
    stem = archive.stem(tar_path.name)
    return dest_root / stem, dest_root / f".{stem}.staged", dest_root / f".{stem}.failed"


def _run_token() -> str:
    """This job step, so that a failure marker left by an earlier job is not taken as ours."""
    env = os.environ
    for name in ("SLURM_JOB_ID", "PBS_JOBID"):
        if env.get(name):
            return f"{env[name]}.{env.get('SLURM_STEP_ID', '')}"
    return f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"


@contextmanager
def _node_lock(dest_root: Path, name: str) -> Iterator[None]:
    """Serialise the unpackers that share dest_root: two jobs of one user on a node, or (on a
    test cluster) two "nodes" with one /tmp. A file system without locks just goes unlocked."""
    dest_root.mkdir(parents=True, exist_ok=True)
    with open(dest_root / f".{name}.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            pass
        yield  # closing the file releases the lock


def _unpack(tar_path: Path, dest_root: Path, identity: str) -> Path:
    with _node_lock(dest_root, staged_paths(tar_path, dest_root)[0].name):
        return _unpack_locked(tar_path, dest_root, identity)


def _unpack_locked(tar_path: Path, dest_root: Path, identity: str) -> Path:
    final, marker, failed = staged_paths(tar_path, dest_root)
    failed.unlink(missing_ok=True)
    try:
        dest_root.mkdir(parents=True, exist_ok=True)
        # No space check: sizing the tarball means reading it through (or every header of it)
        # once more from Lustre on every node; a full /tmp stops tar with its own cause instead.
        archive.publish(str(tar_path), str(dest_root), final.name, identity, str(marker))
    except (OSError, archive.ArchiveError) as error:
        message = " ".join(str(error).split())
        if not isinstance(error, archive.ArchiveError):
            message = f"cannot unpack {tar_path} into {dest_root}: {message}"
        archive.write_atomic(str(failed), identity + _run_token() + "\n" + message + "\n")
        raise UserError(message) from None
    return final


def _wait(tar_path: Path, dest_root: Path, identity: str, timeout_s: float,
          poll_s: float) -> Path:
    final, marker, failed = staged_paths(tar_path, dest_root)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if marker.read_text() == identity and final.is_dir():
                return final
        except FileNotFoundError:
            pass
        try:
            failure = failed.read_text()
        except FileNotFoundError:
            failure = ""
        ours = identity + _run_token() + "\n"
        if failure.startswith(ours):
            raise UserError(f"local rank 0 failed to stage it: {failure[len(ours):].strip()}")
        if time.monotonic() > deadline:
            raise UserError(f"{tar_path} was not staged into {dest_root} within {timeout_s:.0f} s "
                            "(did local rank 0 of this node start?)")
        time.sleep(poll_s)


def stage_tar(tar_path: str | os.PathLike, dest_root: str | os.PathLike, *,
              local_rank: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
              poll_s: float = POLL_S) -> Path:
    """Unpack `tar_path` once per node under `dest_root`; the unpacked directory (every rank).

    The directory is dest_root/<tarball name without .tar>, holding the tarball's contents.
    local_rank: this rank's index on its node (default: LOCAL_RANK, else 0).
    """
    tar_path, dest_root = Path(tar_path), Path(dest_root)
    if not tar_path.is_file():
        raise UserError(f"--stage-tar '{tar_path}': no such file")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK") or 0)
    identity = _identity(tar_path)
    if local_rank == 0:
        return _unpack(tar_path, dest_root, identity)
    return _wait(tar_path, dest_root, identity, timeout_s, poll_s)

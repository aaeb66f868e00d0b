"""The every-rank checkpoint format (XSCALE_CHECKPOINT_WRITERS=all): torch.distributed.checkpoint.

`ckpt-STEP.dcp` is a directory that every rank writes a part of: DCP's default save planner
deduplicates the tensors that several ranks hold (DDP's replicas) and spreads them over the ranks
by size, so each rank writes its own `__RANK_0.distcp`; a sharded model's ranks would each write
their shard. The coordinator (rank 0) writes `.metadata` only after every rank's write has come
back. Nothing here publishes or prunes: xscale.checkpoints.files does that, for both formats.

Layout of the state, by key:
  model, optimizer    DCP's state-dict helpers (fully qualified parameter names), so that a
                      fresh optimizer's state is loaded in place (set_state_dict)
  run                 step, epoch, world size, AMP scaler and the trainer's extra fields, one
                      blob (identical on every rank: one rank writes it)
  rng/rankN           rank N's random generators, one blob per rank: DCP deduplicates values
                      with the same key across ranks, so one shared key would keep one stream

Every collective here runs on a gloo group of the checkpoints' own (checkpoint_group): a
background write's planning and gathering must not interleave with the training's collectives on
the default group, and async_save needs a CPU backend even where training uses NCCL/RCCL.
"""

from __future__ import annotations

import io
import uuid
from concurrent.futures import Future
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from xscale.dist import timeout_from_env

if TYPE_CHECKING:
    from torch.distributed.checkpoint.staging import DefaultStager

SUFFIX = ".dcp"
RUN_KEY = "run"
METADATA = ".metadata"  # torch.distributed.checkpoint.filesystem's name, written last
_group: dist.ProcessGroup | None = None


def rng_key(rank: int) -> str:
    return f"rng/rank{rank}"


def checkpoint_group() -> dist.ProcessGroup | None:
    """The checkpoints' gloo group, made on first use; None without a process group (one
    process). Making it is a collective: every rank must ask at the same point of the run."""
    global _group
    if _group is None and dist.is_initialized():
        _group = dist.new_group(backend="gloo", timeout=timeout_from_env())
    return _group


def forget_group() -> None:
    """The checkpoints' group was aborted with the broken one (live recovery): the next use
    makes another."""
    global _group
    _group = None


def run_token(group: dist.ProcessGroup | None) -> str:
    """A name this run's ranks agree on (rank 0's, broadcast): the part of a temporary directory's
    name that tells this run's writes from those an earlier, killed run left behind."""
    token = [uuid.uuid4().hex[:8]]
    if group is not None:
        dist.broadcast_object_list(token, group=group, group_src=0)
    return token[0]


def partial_path(output_dir: Path, step: int, token: str) -> Path:
    """Where every rank writes step STEP's checkpoint until rank 0 publishes it."""
    return Path(output_dir) / f".ckpt-{step:06d}{SUFFIX}.{token}.partial"


def is_whole(path: Path) -> bool:
    return (path / METADATA).is_file()


def pack(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def unpack(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=True)


def _dcp() -> ModuleType:
    """torch.distributed.checkpoint, imported at its first use: about a second of every rank's
    start-up that a job writing rank 0's .pt checkpoints never needs."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.staging
    import torch.distributed.checkpoint.state_dict  # noqa: F401  (dcp.state_dict below)

    return dcp


def state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, run: dict[str, Any],
               rng: bytes, rank: int) -> dict[str, Any]:
    """What this rank hands DCP: the live tensors (DCP stages or writes them) and two blobs."""
    model_state, optimizer_state = _dcp().state_dict.get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state, RUN_KEY: pack(run),
            rng_key(rank): rng}


def save(state: dict[str, Any], path: Path, group: dist.ProcessGroup | None) -> None:
    """Every rank writes its part into PATH; returns once .metadata is written (a collective)."""
    _dcp().save(state, checkpoint_id=path, process_group=group)


def pinned_stager() -> DefaultStager | None:
    """On a GPU, staging into pinned host memory, one copy per tensor reused from save to save
    (the next save waits for the one before). None on CPUs: async_save's own stager clones.
    Untested on a GPU in this project's CI (no GPU there)."""
    if not torch.accelerator.is_available():
        return None
    staging = _dcp().staging
    return staging.DefaultStager(staging.StagingOptions(
        use_pinned_memory=True, use_shared_memory=False, use_async_staging=False,
        use_non_blocking_copy=True))


def start_save(state: dict[str, Any], path: Path, group: dist.ProcessGroup | None,
               stager: DefaultStager | None) -> Future:
    """Copy this rank's state to host memory, then write it on DCP's own thread; the future is
    done when the whole checkpoint is (its .metadata written), on every rank."""
    return _dcp().async_save(state, checkpoint_id=path, process_group=group,
                             async_stager=stager)


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, *, rank: int,
         group: dist.ProcessGroup | None) -> tuple[dict[str, Any], bytes | None]:
    """Load PATH into MODEL and OPTIMIZER in place; (the run's fields, this rank's RNG blob, or
    None after a change of world size, when the streams cannot be matched to ranks). Collectives:
    a file that cannot be read raises CheckpointException on every rank alike."""
    dcp = _dcp()
    head: dict[str, Any] = {RUN_KEY: None}
    dcp.load(head, checkpoint_id=path, process_group=group)
    run = unpack(head[RUN_KEY])
    model_state, optimizer_state = dcp.state_dict.get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    world = dist.get_world_size() if dist.is_initialized() else 1
    mine = rng_key(rank)
    if run["world_size"] == world:
        state[mine] = None
    dcp.load(state, checkpoint_id=path, process_group=group)
    dcp.state_dict.set_state_dict(model, optimizer, model_state_dict=state["model"],
                                  optim_state_dict=state["optimizer"])
    return run, state.get(mine)

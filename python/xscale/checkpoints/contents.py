"""The training state a checkpoint holds (the model, the optimizer, the scaler, the position and
every rank's random generators), its copy to host memory, and the resume from the newest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from xscale.checkpoints import every_rank
from xscale.checkpoints.files import ranks_agree_on, read_newest, warn_unreadable
from xscale.checkpoints.generators import rng_state, set_rng_state
from xscale.dist import unwrap
from xscale.reductions import all_gather_objects


def gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's generators, on every rank (ranks draw different augmentations, so each
    resumes its own stream). A collective that a lost peer ends at once under live recovery
    (xscale.recovery.link.GroupBroken)."""
    return all_gather_objects(rng_state())


def training_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    epoch: int,
    scaler: torch.amp.GradScaler | None = None,
    *,
    scheduler: Any = None,
    **extra: Any,
) -> dict[str, Any]:
    """What a resumed run needs: weights, optimizer, AMP scaler, LR scheduler, position, every
    rank's RNG.

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
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    state.update(extra)
    return state


def restore_training_state(
    state: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None = None,
    rank: int = 0,
    scheduler: Any = None,
) -> tuple[int, int]:
    """Load a training_state() into the model, optimizer, scaler and scheduler; (step, epoch).

    Each rank takes back its own RNG stream when the world size is unchanged; after a change
    the streams cannot be matched to ranks, so they are left as seeded.
    """
    unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scaler is not None and "scaler" in state:
        scaler.load_state_dict(state["scaler"])
    if scheduler is not None and "scheduler" in state:
        scheduler.load_state_dict(state["scheduler"])
    streams = state.get("rng") or []
    world = dist.get_world_size() if dist.is_initialized() else 1
    if len(streams) == world:
        set_rng_state(streams[rank])
    return int(state["step"]), int(state["epoch"])


def resume_training(output_dir: Path | None, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scaler: torch.amp.GradScaler | None = None, *, rank: int,
                    enabled: bool = True, scheduler: Any = None) -> int | None:
    """The step a run resumes from after restoring the newest checkpoint in `output_dir`, a .pt
    file or a .dcp directory, or None for a fresh start (no directory, none there, or
    --no-resume). Every rank calls it. A newest one that cannot be read is reported and the one
    before it is tried, rather than losing every step since the start."""
    if output_dir is None or not enabled:
        return None
    skip: set[Path] = set()
    while True:
        found = read_newest(output_dir, skip)
        ranks_agree_on(None if found is None else found[0], output_dir)
        if found is None:
            return None
        _, path, state = found
        if state is not None:
            return restore_training_state(state, model, optimizer, scaler, rank=rank,
                                          scheduler=scheduler)[0]
        # Only now: torch.distributed.checkpoint costs a second of start-up (dcp_checkpoint).
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            return restore_every_rank(path, model, optimizer, scaler, rank=rank,
                                      scheduler=scheduler)
        except CheckpointException as error:  # raised on every rank alike: all fall back
            warn_unreadable(path, error)
            skip.add(path)


def restore_every_rank(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                       scaler: torch.amp.GradScaler | None = None, *, rank: int,
                       scheduler: Any = None) -> int:
    """Load a ckpt-STEP.dcp (every rank its part, in place; a collective); the step."""
    run, rng = every_rank.load(path, unwrap(model), optimizer, rank=rank,
                                   group=every_rank.checkpoint_group())
    if scaler is not None and "scaler" in run:
        scaler.load_state_dict(run["scaler"])
    if scheduler is not None and "scheduler" in run:
        scheduler.load_state_dict(run["scheduler"])
    if rng is not None:
        set_rng_state(every_rank.unpack(rng))
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

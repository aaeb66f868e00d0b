"""Live recovery of an FSDP2 model (torch's fully_shard) in xscale.Loop: a kind of training whose
state is sharded (xscale.recovery.protocol.Recoverable; docs/FAILURES.md, "A sharded model:
peer snapshots").

- A lost rank's shard of the weights and of the optimizer's state is held by no other rank: it
  comes back from the peer snapshots (xscale.recovery.snapshots), taken every K steps at the
  step's end. A recovery rolls every rank back, in place, to the newest snapshot every rank can
  load; at most K steps are redone.
- FSDP2's all-gathers and reduce-scatters go through comms of this module's
  (FSDPModule.set_custom_all_gather/_reduce_scatter) that never raise in the script's lines:
  when the group breaks they end at once and leave their output as it is, the step's forward
  and backward finish on whatever it holds, and a step pre-hook on the optimizer drops the
  gradients, so that the update changes nothing. The loop then recovers without counting the
  step, as with DDP (xscale.recovery.ddp).
- The next group keeps the default group's name ("0": the abort resets torch's group count),
  so FSDP's device mesh finds it by name; the process group each parameter group cached is
  set again from the mesh.
- A replacement builds its model as the others did, makes its optimizer's state with one update
  of zero gradients (its tensors must exist to be loaded into), and loads the copy its buddy
  holds for it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)

from xscale import dist as xdist
from xscale.recovery import link as links
from xscale.recovery.protocol import Place, StateSize
from xscale.recovery.snapshots import PeerSnapshots


def why_not(model: nn.Module, optimizer: Any, nnodes: int, every: int | str) -> str | None:
    """Why this loop's FSDP2 model cannot be recovered live; None: it can."""
    if optimizer is None:
        return "the loop was given no optimizer (Loop(optimizer=...)) whose step it can drop"
    if nnodes < 2:
        return "its ranks are on one node: a snapshot needs a peer on another"
    if every == 0:
        return "XSCALE_SNAPSHOT_EVERY=0: no peer snapshots, and a lost shard is held nowhere else"
    return None


class FsdpRecovery:
    """An FSDP2 model and its optimizer, recoverable live from peer snapshots (module
    docstring)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, link: links.Link,
                 ctx: xdist.DistContext, every: int | str) -> None:
        self.model, self.optimizer, self.link, self.ctx = model, optimizer, link, ctx
        self.units = [model, *xdist.sharded_units(model)]  # the root's group too
        for unit in self.units:
            unit.set_custom_all_gather(_AbortableAllGather(link))
            unit.set_custom_reduce_scatter(_AbortableReduceScatter(link))
        self._dropped = False
        optimizer.register_step_pre_hook(self._before_step)
        self.snapshots = PeerSnapshots(self._state, ctx.rank, ctx.world_size,
                                       ctx.local_world_size, every)

    @property
    def step_dropped(self) -> bool:
        return self._dropped

    def before_batch(self) -> None:
        """Nothing: FSDP2 broadcasts no buffers."""

    def before_update(self) -> None:
        """Nothing: the reduce-scatter left each rank its own shard's gradients."""

    def after_step(self, place: Place) -> float | None:
        """The peer snapshot, every K steps: the seconds it held the step up."""
        return self.snapshots.after_step(place)

    def state_size(self) -> StateSize:
        return StateSize("sharded", sum(tensor.numel() * tensor.element_size()
                                        for tensor in self._state()))

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.link.broken.is_set():
            self._dropped = True
            for group in optimizer.param_groups:
                for parameter in group["params"]:
                    parameter.grad = None

    def _state(self) -> list[torch.Tensor]:
        return shard_state(self.model, self.optimizer)

    # ---- the recovery ---------------------------------------------------------------------

    def leave(self) -> None:
        self.snapshots.leave()
        links.abort_group()

    def reform(self) -> None:
        xdist.join_next_group(self.ctx)
        for unit in self.units:
            for group in unit._get_fsdp_state()._fsdp_param_groups:
                for info in {id(i): i for i in (group.mesh_info, group.post_forward_mesh_info)
                             if i is not None}.values():
                    info.shard_process_group = info.mesh.get_group(info.shard_mesh_dim)

    def hand_over(self, position: Place | None) -> Place:
        """Every rank loads its snapshot of the newest step all can (the replacement the copy
        its buddy holds); the source's place at that step."""
        joining = position is None
        if joining:
            self._make_optimizer_state()
        else:
            # FSDP's per-iteration state as at a first step, as the replacement's: a step or an
            # evaluation the break cut short leaves no gather, reduction or recorded forward
            # order behind (torch's reset for a forward or backward cut short).
            self.model.reset_iter_state()
        return self.snapshots.restore(joining, self.link.source)

    def _make_optimizer_state(self) -> None:
        """One update of zero gradients: the optimizer's state tensors exist (lazily made at its
        first step), to be loaded into; the parameters are loaded after it."""
        for parameter in self.model.parameters():
            parameter.grad = torch.zeros_like(parameter)
        self.optimizer.step()
        self.optimizer.zero_grad()

    def go_on(self) -> None:
        self._dropped = False

    def close(self) -> None:
        self.snapshots.finish()


def shard_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's part of the state, in the same order on every rank: its shards of the
    parameters, the buffers, its shards of the optimizer's state."""
    parameters = list(model.parameters())
    tensors = [_local(p) for p in parameters] + list(model.buffers())
    for parameter in parameters:
        state = optimizer.state.get(parameter, {})
        tensors += [_local(state[key]) for key in sorted(state) if torch.is_tensor(state[key])]
    return tensors


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's parameters and their optimizer state); else itself."""
    to_local = getattr(tensor, "to_local", None)
    return tensor if to_local is None else to_local()


class _AbortableAllGather(DefaultAllGather):
    """FSDP2's all-gather, ended at once when the group breaks, without raising (module
    docstring): the forward goes on with what the output holds, and the step is dropped."""

    def __init__(self, link: links.Link) -> None:
        self.link = link

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None:
        _run_abortably(self.link, lambda: super(_AbortableAllGather, self).__call__(
            output_tensor, input_tensor, group, async_op=True))
        return None


class _AbortableReduceScatter(DefaultReduceScatter):
    """FSDP2's reduce-scatter of the gradients, ended as the all-gather is."""

    def __init__(self, link: links.Link) -> None:
        self.link = link

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any, async_op: bool = False) -> dist.Work | None:
        _run_abortably(self.link, lambda: super(_AbortableReduceScatter, self).__call__(
            output_tensor, input_tensor, group, op, async_op=True))
        return None


def _run_abortably(link: links.Link, start: Any) -> None:
    """Start a collective and wait for it; on a broken group, return as if it had ended."""
    if link.broken.is_set():
        return
    generation = link.generation
    try:
        work = start()
    except RuntimeError as error:  # a peer's connection already closed
        link.declare_broken(str(error), generation)
        return
    try:
        links.wait(work)
    except links.GroupBroken:
        pass

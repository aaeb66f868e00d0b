"""Live recovery of a DDP model in xscale.Loop: the first kind of training that implements
xscale.recovery.protocol.Recoverable (docs/FAILURES.md, "Live recovery").

- DDP's gradient all-reduce goes through a comm hook whose future this module completes: with
  the sum when the all-reduce ends, or with the local gradients when it fails or the
  coordinator says ABORT. A failure therefore never raises in the script's own lines;
  `optimizer.step()` then finds no gradients (a step pre-hook drops them) and changes nothing,
  and the loop recovers without counting the step. With several micro-batches per step, the
  all-reduce of the last one is the step's only collective but for the buffers' broadcast, so
  a step broken earlier runs to its end alone and is dropped the same way.
- The all-reduced gradients are divided by the launch's world size, the ranks each step's
  global batch is laid out for: in a smaller world (no spare left) the ranks left train on
  every micro-batch of the step between them (xscale.data.Share), so the sum over them divided
  so is the same mean as before.
- DDP's buffer broadcast at each forward is done by the loop before it hands out a batch
  (before_batch), abortably, like the loop's own collectives (xscale.recovery.link.wait).
- The state is replicated: the lowest surviving rank sends the model, the optimizer and the
  loop's Position to every rank, and every rank takes them, survivors too, so all go on at the
  same step. The first step after sums every gradient in the parameters' order: the
  replacements' DDP buckets are not yet laid out as the survivors' are (DDP lays them out again
  at the next forward, everywhere alike).

A replacement builds its DDP without DDP's start-up broadcast (prepare_replacement: the
survivors are not there to match it) and receives its state in the loop's constructor instead
of reading a checkpoint.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from xscale import dist as xdist
from xscale.recovery import link as links
from xscale.recovery.protocol import Place, StateSize

DDP = nn.parallel.DistributedDataParallel


def prepare_replacement() -> None:
    """A replacement's DDP must not broadcast its fresh weights from its rank 0 at start: the
    survivors are in their recovery, not in a DDP constructor, and its rank 0 may be the
    replacement itself. Its state comes from a survivor instead (hand_over). Called before the
    script builds its model; nothing changes in a process that is no replacement."""
    if not links.joining():
        return
    original = DDP.__init__

    @functools.wraps(original)
    def init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        if links.joining():
            kwargs["init_sync"] = False
        original(self, *args, **kwargs)

    DDP.__init__ = init


def why_not(model: nn.Module, optimizer: Any) -> str | None:
    """Why this loop's training cannot be recovered as a DDP model; None: it can."""
    if not isinstance(model, DDP):
        kind = type(model)
        return (f"the loop's model is a {kind.__module__}.{kind.__qualname__}, not torch's "
                "DistributedDataParallel, whose gradient all-reduce live recovery takes over")
    if optimizer is None:
        return "the loop was given no optimizer (Loop(optimizer=...)) whose step it can drop"
    return None


class DdpRecovery:
    """A DDP model and its optimizer, recoverable live (module docstring)."""

    def __init__(self, model: DDP, optimizer: torch.optim.Optimizer, link: links.Link,
                 ctx: xdist.DistContext) -> None:
        self.model, self.optimizer, self.link, self.ctx = model, optimizer, link, ctx
        self.buffers = list(model.module.buffers()) if model.broadcast_buffers else []
        model.broadcast_buffers = False  # the loop broadcasts them, abortably (before_batch)
        self._pending: dict[int, tuple[torch.futures.Future, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.layout_free = link.joining  # the first step after (re)forming (module docstring)
        self._dropped = False  # the group broke before this step's update: none was made
        model.register_comm_hook(None, self._all_reduce)
        optimizer.register_step_pre_hook(self._before_step)
        link.on_broken.append(self._release_pending)

    @property
    def broken(self) -> bool:
        return self.link.broken.is_set()

    @property
    def step_dropped(self) -> bool:
        return self._dropped

    def state_size(self) -> StateSize:
        tensors = [*self.model.module.parameters(), *self.model.module.buffers(),
                   *(value for state in self.optimizer.state.values()
                     for value in state.values() if torch.is_tensor(value))]
        return StateSize("replicated", sum(t.numel() * t.element_size() for t in tensors))

    # ---- the gradient all-reduce ---------------------------------------------------------

    def _all_reduce(self, state, bucket):  # DDP reads the annotations: none, or real classes
        gradients = bucket.buffer()
        mine: torch.futures.Future = torch.futures.Future()
        if self.layout_free or self.broken:
            mine.set_result(gradients)
            return mine
        key, generation = id(mine), self.link.generation
        with self._lock:
            self._pending[key] = (mine, gradients)

        def finished(work_future: torch.futures.Future) -> None:
            try:
                work_future.value()
                result = gradients.div_(self.link.launch_world)
            except Exception as error:
                self.link.declare_broken(str(error), generation)
                result = gradients
            self._complete(key, result)

        try:
            dist.all_reduce(gradients, async_op=True).get_future().then(finished)
        except Exception as error:
            self.link.declare_broken(str(error), generation)
            self._complete(key, gradients)
        return mine

    def _complete(self, key: int, result: torch.Tensor) -> None:
        with self._lock:
            entry = self._pending.pop(key, None)
        if entry is not None:
            entry[0].set_result(result)

    def _release_pending(self) -> None:
        """ABORT or a failure: every all-reduce still waited on ends with its local part."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for future, gradients in pending.values():
            future.set_result(gradients)

    def before_update(self) -> None:
        """On the first step of a new group, the gradients summed in the parameters' order
        (module docstring): for a loop that reads them before the update (Trainer clips them);
        else the update's pre-hook does it."""
        if self.layout_free and not self.broken:
            self._sum_in_parameter_order()
            self.layout_free = False

    def after_step(self, place: Place) -> None:
        """Nothing: a survivor's copy serves a replacement (the state is replicated)."""
        return None

    def close(self) -> None:
        """Nothing runs in the background."""

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Drop the gradients of a broken step, so that the step changes nothing; on the first
        step of a new group, sum them in the parameters' order first."""
        try:
            self.before_update()
        except links.GroupBroken:
            pass
        if self.broken:
            self._dropped = True
            for group in optimizer.param_groups:
                for parameter in group["params"]:
                    parameter.grad = None

    def _sum_in_parameter_order(self) -> None:
        parameters = [p for p in self.model.parameters() if p.grad is not None]
        if not parameters:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in parameters])
        links.wait(dist.all_reduce(flat, async_op=True))
        flat.div_(self.link.launch_world)
        offset = 0
        for parameter in parameters:
            size = parameter.grad.numel()
            parameter.grad.copy_(flat[offset:offset + size].view_as(parameter.grad))
            offset += size

    # ---- the buffers (BatchNorm's statistics) ---------------------------------------------

    def before_batch(self) -> None:
        """Rank 0's buffers to every rank, as DDP does at each forward; GroupBroken if the
        group fails meanwhile."""
        for buffer in self.buffers:
            links.wait(dist.broadcast(buffer, 0, async_op=True))

    # ---- the recovery ---------------------------------------------------------------------

    def leave(self) -> None:
        links.abort_group()

    def reform(self) -> None:
        xdist.join_next_group(self.ctx)
        self.model._update_process_group(dist.group.WORLD)

    def hand_over(self, position: Place | None) -> Place:
        """The source rank's model, optimizer and POSITION to every rank (a collective); the
        source's place. A survivor's copy serves: the state is replicated."""
        source = self.link.source
        for tensor in [*self.model.module.parameters(), *self.model.module.buffers()]:
            dist.broadcast(tensor.data, source)
        carried = [self.optimizer.state_dict(), position]
        dist.broadcast_object_list(carried, source, device=xdist.collective_device())
        if dist.get_rank() != source:
            self.optimizer.load_state_dict(carried[0])
        return carried[1]

    def go_on(self) -> None:
        self._dropped = False
        self.layout_free = True

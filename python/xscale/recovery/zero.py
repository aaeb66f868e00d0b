"""Live recovery of a DeepSpeed engine with ZeRO stage 1, 2 or 3 in xscale.Loop: a kind of
training whose state is sharded (xscale.recovery.protocol.Recoverable; docs/FAILURES.md, "A
sharded model: peer snapshots"), recovered as FSDP2's is (xscale.recovery.fsdp).

- Each rank's part of the state is held by no other rank: its fp32 partition of the weights
  (ZeRO 1 and 2's single_partition_of_fp32_groups, ZeRO 3's fp32_partitioned_groups_flat), the
  optimizer's state of that partition, and the module's buffers (BatchNorm's statistics, each
  rank's own). They come back from the peer snapshots (xscale.recovery.snapshots), taken every
  K steps at the step's end; a recovery rolls every rank back, in place, to the newest snapshot
  every rank can load. The module's weights are not snapshotted: after the partitions are
  loaded, ZeRO 1 and 2 gather them whole on every rank (update_lp_params, as after a step);
  ZeRO 3 copies them into the weights' own partitions and gathers only its persistent ones, as
  after loading a checkpoint (its forward gathers the others).
- The engine's counters (global_steps, global_samples, micro_steps, skipped_steps), its LR
  scheduler's state, the optimizer's hyperparameters (the LR the scheduler set) and the loss
  scaler's are the same on every rank: they travel with the loop's place in the snapshot
  (EnginePlace), and every rank takes the source rank's copy with the place.
- The step's collectives (ZeRO 3's gathers of the weights, the gradients' reduction, the
  overflow and norm all-reduces, the all-gather of the updated partitions) run, within the
  engine's forward, backward and step only, through torch.distributed functions of this module
  that never raise: when the group breaks they end at once and leave their output as it is
  (DeepSpeed's comm backend calls torch.distributed at call time, but for the
  all_gather_into_tensor and reduce_scatter_tensor it cached at its start, which are swapped on
  the backend too). A step pre-hook on the engine's base optimizer drops the gradients of a
  step the break came before, so that its update changes nothing, and the loop recovers
  without counting the step. The step is therefore *dropped* where the break came before the
  update, and otherwise *harmless*: what else the broken step did (a gather cut short leaves
  some ranks' weights half updated, the scheduler and the counters advanced) is undone by the
  rollback, which every rank, survivors too, makes to the snapshot's partitions, counters and
  weights.
- The next group keeps the default group's name ("0": the abort resets torch's group count);
  DeepSpeed's clone of it (deepspeed.utils.groups._WORLD_GROUP, its data-parallel group) is
  made again as the group's first new group, as a replacement's engine makes it at its start,
  and every process group the engine, its ZeRO optimizer and ZeRO 3's weights cached is
  re-pointed to the new ones. ZeRO 3's record of the order its forward gathers the weights in
  is dropped on the survivors, so that every rank records it again alike (the replacement's is
  new), with the collectives that check it.
- A replacement builds its engine as the others did, but the collectives its engine makes as it
  starts (the model's broadcast, ZeRO 3's broadcast of each weight, its barriers and gathers)
  are served in the replacement alone (prepare_replacement): the survivors are in their
  recovery, and what those collectives would bring is overwritten by the hand-over. It makes its
  optimizer's state with one update of zero gradients (the tensors must exist to be loaded
  into), and loads the copy its buddy holds for it.

Not served: ZeRO stage 0, an optimizer or weights offloaded to the CPU or NVMe, and engines with
model, pipeline, expert or sequence parallel groups. The script calls the engine, then
engine.backward and engine.step (a loss.backward() of its own would reduce outside them).
DeepSpeed is imported only once there is an engine (the script that made it imported DeepSpeed
already).
"""

from __future__ import annotations

import copy
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from xscale import dist as xdist
from xscale.recovery import link as links
from xscale.recovery.protocol import Place, StateSize
from xscale.recovery.snapshots import PeerSnapshots

STAGES = (1, 2, 3)
# What a ZeRO step calls in torch.distributed (through DeepSpeed's comm backend).
STEP_COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
                    "reduce_scatter_tensor", "barrier")
# The collectives DeepSpeed's comm backend cached at its start (TorchBackend.__init__).
CACHED_COLLECTIVES = ("all_gather_function", "reduce_scatter_function")
COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")
# Each stage's fp32 partitions of the weights: the optimizer's own parameters.
PARTITIONS = {1: "single_partition_of_fp32_groups", 2: "single_partition_of_fp32_groups",
              3: "fp32_partitioned_groups_flat"}


def is_engine(model: Any) -> bool:
    """Whether MODEL is a DeepSpeed engine: read from sys.modules, a script that made one has
    imported DeepSpeed, and one that did not is spared the import (seconds)."""
    engine = sys.modules.get("deepspeed.runtime.engine")
    return engine is not None and isinstance(model, engine.DeepSpeedEngine)


# What a DeepSpeed engine's start calls in torch.distributed, through its comm backend.
START_COLLECTIVES = ("broadcast", "barrier", "all_reduce", "all_gather",
                     "all_gather_into_tensor", "reduce_scatter_tensor")
_quiet_start: dict[str, Callable[..., Any]] = {}  # the collectives served alone, while so


def prepare_replacement() -> None:
    """A replacement's DeepSpeed engine must not make its start's collectives with the others
    (module docstring): until end_quiet_start, a collective DeepSpeed calls is served in this
    process alone, and leaves its output as it is. Called before the script builds its engine;
    nothing changes in a process that is no replacement, nor for collectives of the script's
    own or torch's."""
    if not links.joining() or _quiet_start:
        return
    _quiet_start.update(links.swap_collectives(START_COLLECTIVES, _served_alone_for_deepspeed))


def end_quiet_start() -> None:
    """The engine is built: its collectives are the group's again, the ones DeepSpeed's comm
    backend cached at its start too."""
    backend = getattr(sys.modules.get("deepspeed.comm.comm"), "cdb", None)
    for name, original in _quiet_start.items():
        served = getattr(dist.distributed_c10d, name)
        for cached in CACHED_COLLECTIVES:
            if getattr(backend, cached, None) is served:
                setattr(backend, cached, original)
    links.restore_collectives(_quiet_start)
    _quiet_start.clear()


def _served_alone_for_deepspeed(collective: Callable[..., Any]) -> Callable[..., Any]:
    """COLLECTIVE, not made when DeepSpeed calls it (its comm backend is the caller): it returns
    as if it had ended."""
    signature = _signature(collective)

    @functools.wraps(collective)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not sys._getframe(1).f_globals.get("__name__", "").startswith("deepspeed."):
            return collective(*args, **kwargs)
        return _Ended() if signature.bind(*args, **kwargs).arguments.get("async_op") else None

    return call


def why_not(engine: Any, nnodes: int, every: int | str) -> str | None:
    """Why this loop's DeepSpeed engine cannot be recovered live; None: it can."""
    stage = engine.zero_optimization_stage()
    if stage not in STAGES:
        return (f"its DeepSpeed engine runs ZeRO stage {stage}: live recovery serves ZeRO stages "
                "1, 2 and 3")
    if not hasattr(engine.optimizer, PARTITIONS[stage]):
        kind = type(engine.optimizer)
        return (f"its DeepSpeed engine's optimizer is a {kind.__module__}.{kind.__qualname__}, "
                "not ZeRO's, whose partitions live recovery snapshots")
    if (engine.zero_offload_optimizer() is not None and engine.zero_use_cpu_optimizer()) \
            or engine.zero_offload_param() is not None:
        return ("its ZeRO optimizer or weights are offloaded (offload_optimizer, "
                "offload_param), which live recovery does not serve")
    if (getattr(engine, "mpu", None) is not None or engine.has_moe_layers
            or engine.pipeline_parallelism or engine.sequence_parallel_size > 1):
        return ("its DeepSpeed engine has model, pipeline, expert or sequence parallel groups: "
                "live recovery forms again only the data-parallel one")
    if nnodes < 2:
        return "its ranks are on one node: a snapshot needs a peer on another"
    if every == 0:
        return "XSCALE_SNAPSHOT_EVERY=0: no peer snapshots, and a lost shard is held nowhere else"
    return None


@dataclass(frozen=True)
class EnginePlace:
    """The loop's place at a snapshot, with the engine's counters then (module docstring): the
    same on every rank, so the source rank's copy serves every rank."""

    place: Any
    counters: dict

    @property
    def step(self) -> int:
        return self.place.step


class ZeroRecovery:
    """A DeepSpeed engine with ZeRO stage 1, 2 or 3, recoverable live from peer snapshots
    (module docstring)."""

    def __init__(self, engine: Any, link: links.Link, ctx: xdist.DistContext,
                 every: int | str) -> None:
        from deepspeed.comm import comm as ds_comm  # the script made an engine: it is imported

        self.engine, self.optimizer, self.link, self.ctx = engine, engine.optimizer, link, ctx
        self.stage = engine.zero_optimization_stage()
        self.backend = ds_comm.cdb
        self.world = dist.group.WORLD  # the default group: the engine's references re-pointed too
        self._dropped = False
        self._stepping = False  # inside the engine's forward, backward or step
        # Instance attributes: the script calls these (the forward through the module's call).
        for name in ("forward", "backward", "step"):
            setattr(engine, name, self._within_step(getattr(engine, name)))
        engine.optimizer.optimizer.register_step_pre_hook(self._before_step)
        self.snapshots = PeerSnapshots(self._state, ctx.rank, ctx.world_size,
                                       ctx.local_world_size, every)

    @property
    def step_dropped(self) -> bool:
        return self._dropped

    def before_batch(self) -> None:
        """Nothing: ZeRO 3's gathers in the forward are the engine's (_within_step)."""

    def before_update(self) -> None:
        """Nothing: the engine's step reduces the gradients itself."""

    def after_step(self, place: Place) -> float | None:
        """The peer snapshot, every K steps, with the engine's counters in its place: the
        seconds it held the step up."""
        return self.snapshots.after_step(EnginePlace(place, self._counters()))

    def state_size(self) -> StateSize:
        return StateSize("sharded", sum(tensor.numel() * tensor.element_size()
                                        for tensor in self._state()))

    # ---- the step -------------------------------------------------------------------------

    def _within_step(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """The engine's METHOD (forward, backward, step), its collectives ended when the group
        breaks."""

        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            if self._stepping:  # already within
                return method(*args, **kwargs)
            self._stepping = True
            try:
                with _ended_when_broken(self.link, self.backend):
                    return method(*args, **kwargs)
            finally:
                self._stepping = False

        return call

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The base optimizer's step on this rank's partition: with the group broken, no
        gradients (the update changes nothing)."""
        if self._stepping and self.link.broken.is_set():
            self._dropped = True
            for group in optimizer.param_groups:
                for parameter in group["params"]:
                    parameter.grad = None

    # ---- the state ------------------------------------------------------------------------

    def _state(self) -> list[torch.Tensor]:
        """This rank's part of the state, in the same order on every rank: its fp32 partitions,
        the optimizer's state of each, the module's buffers."""
        partitions = list(self._partitions())
        tensors = list(partitions)
        for partition in partitions:
            state = self.optimizer.optimizer.state.get(partition, {})
            tensors += [state[key] for key in sorted(state) if torch.is_tensor(state[key])]
        return tensors + list(self.engine.module.buffers())

    def _partitions(self) -> list[torch.Tensor]:
        return getattr(self.optimizer, PARTITIONS[self.stage])

    def _counters(self) -> dict:
        """What every rank holds alike (module docstring): copied, as the snapshot is."""
        scheduler = self.engine.lr_scheduler
        return copy.deepcopy({
            "engine": {name: getattr(self.engine, name) for name in COUNTERS},
            "scheduler": None if scheduler is None else scheduler.state_dict(),
            "param_groups": [{key: value for key, value in group.items() if key != "params"}
                             for group in self.optimizer.optimizer.param_groups],
            "loss_scaler": {key: value for key, value in vars(self.optimizer.loss_scaler).items()
                            if isinstance(value, (bool, int, float, torch.Tensor))}})

    def _set_counters(self, counters: dict) -> None:
        for name, value in counters["engine"].items():
            setattr(self.engine, name, value)
        if counters["scheduler"] is not None:
            self.engine.lr_scheduler.load_state_dict(counters["scheduler"])
        for group, saved in zip(self.optimizer.optimizer.param_groups, counters["param_groups"],
                                strict=True):
            group.update(saved)
        vars(self.optimizer.loss_scaler).update(counters["loss_scaler"])

    # ---- the recovery ---------------------------------------------------------------------

    def leave(self) -> None:
        self.snapshots.leave()
        links.abort_group()  # every group, DeepSpeed's clone too

    def reform(self) -> None:
        """The next default group, DeepSpeed's clone of it made again first (as a
        replacement's engine does at its start), and every cached group re-pointed; ZeRO 3's
        record of its gathers' order dropped."""
        from deepspeed.utils import groups

        xdist.join_next_group(self.ctx)
        old_clone = groups._WORLD_GROUP
        groups._WORLD_GROUP = None
        clone = groups._clone_world_group()
        renamed = {id(old_clone): clone, id(self.world): dist.group.WORLD}
        holders = [self.engine, self.optimizer]
        if self.stage == 3:  # each weight gathers in its own ds_process_group, the default one
            holders += [self.optimizer.parameter_offload, *self.engine.module.parameters()]
        for holder in holders:
            _repoint(vars(holder), renamed)
        self.world = dist.group.WORLD
        if self.stage == 3:
            coordinator = self.optimizer.parameter_offload.get_param_coordinator()
            if not coordinator.is_invalid_trace():
                coordinator._invalidate_trace()

    def hand_over(self, position: Place | None) -> Place:
        """Every rank loads its snapshot of the newest step all can (the replacement the copy
        its buddy holds) and the source's counters, and gathers the weights from the
        partitions; the source's place at that step."""
        joining = position is None
        if self.stage == 3:
            self.optimizer.checkpoint_event_prologue()  # none left gathered by a broken step
        if joining:
            self._make_optimizer_state()
        carried = self.snapshots.restore(joining, self.link.source)
        self._set_counters(carried.counters)
        self.optimizer.zero_grad(set_to_none=True)
        self._weights_from_partitions()
        return carried.place

    def _weights_from_partitions(self) -> None:
        """The module's weights from the fp32 partitions just loaded: gathered whole (ZeRO 1
        and 2, as after a step), or into each weight's partition and the persistent weights
        gathered (ZeRO 3, as after loading a checkpoint)."""
        if self.stage < 3:
            self.optimizer.update_lp_params()
            return
        for group in range(len(self.optimizer.fp16_groups)):
            self.optimizer._reassign_or_swap_out_partitioned_parameters(group)
        self.optimizer.checkpoint_event_epilogue()

    def _make_optimizer_state(self) -> None:
        """One update of zero gradients: the optimizer's state tensors exist (lazily made at its
        first step), to be loaded into; the partitions are loaded after it."""
        partitions = self._partitions()
        for partition in partitions:
            partition.grad = torch.zeros_like(partition)
        if self.stage == 3:  # its base optimizer is given one partition at a time
            for group in range(len(partitions)):
                self.optimizer._optimizer_step(group)
        else:
            self.optimizer.optimizer.step()
        for partition in partitions:
            partition.grad = None
        link_state = getattr(self.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if link_state is not None:  # the weights' views of their optimizer state
            link_state()

    def go_on(self) -> None:
        self._dropped = False

    def close(self) -> None:
        self.snapshots.finish()


def _repoint(holder: dict | list, renamed: dict[int, dist.ProcessGroup], depth: int = 0) -> None:
    """Every process group in HOLDER (an object's attributes, and the lists and dicts in them)
    that RENAMED names, replaced in place by the group it maps to."""
    items = holder.items() if isinstance(holder, dict) else enumerate(holder)
    for key, value in list(items):
        if isinstance(value, dist.ProcessGroup):
            holder[key] = renamed.get(id(value), value)
        elif isinstance(value, (dict, list)) and depth < 2:
            _repoint(value, renamed, depth + 1)
        elif isinstance(value, tuple) and any(isinstance(v, dist.ProcessGroup) for v in value):
            holder[key] = tuple(renamed.get(id(v), v) for v in value)


@contextmanager
def _ended_when_broken(link: links.Link, backend: Any) -> Iterator[None]:
    """Within it, the collectives a ZeRO step calls end without raising once the group is
    known broken (module docstring): torch.distributed's, and those DeepSpeed's comm BACKEND
    cached."""
    cached = {name: getattr(backend, name, None) for name in CACHED_COLLECTIVES}
    for name, original in cached.items():
        if original is not None:
            setattr(backend, name, _ending(link, original))
    try:
        with links.swapped_collectives(STEP_COLLECTIVES, functools.partial(_ending, link)):
            yield
    finally:
        for name, original in cached.items():
            if original is not None:
                setattr(backend, name, original)


def _ending(link: links.Link, collective: Callable[..., Any]) -> Callable[..., Any]:
    """COLLECTIVE, started and waited for abortably: on a broken group it returns as if it had
    ended (a caller's async work too), its output as it is."""
    signature = _signature(collective)

    @functools.wraps(collective)
    def call(*args: Any, **kwargs: Any) -> Any:
        arguments = signature.bind(*args, **kwargs).arguments
        asked = arguments.get("async_op", False)
        if link.broken.is_set():
            return _Ended() if asked else None
        generation = link.generation
        try:
            work = collective(**{**arguments, "async_op": True})
        except RuntimeError as error:  # a peer's connection already closed
            link.declare_broken(str(error), generation)
            return _Ended() if asked else None
        if work is None:  # this rank is not in the group
            return None
        if asked:
            return _AbortableWork(work)
        _wait(work)
        return None

    return call


@functools.cache
def _signature(collective: Callable[..., Any]) -> inspect.Signature:
    """A collective's signature, read once (the wrappers are made at every backward and
    step)."""
    return inspect.signature(collective)


def _wait(work: Any) -> None:
    """WORK's end, or the group's break: never raises (the step goes on, and is dropped)."""
    try:
        links.wait(work)
    except links.GroupBroken:
        pass


class _AbortableWork:
    """A work a caller waits for itself, ended as the blocking collectives are."""

    def __init__(self, work: Any) -> None:
        self.work = work

    def wait(self, *_: Any) -> bool:
        _wait(self.work)
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


class _Ended:
    """A collective not started: the group was already broken."""

    def wait(self, *_: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

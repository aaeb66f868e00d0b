"""Live recovery on the ranks' side: when a node fails, this rank keeps its process and all it
holds (model, optimizer, data position, caches, device context), leaves the broken group, forms
the next one with a replacement from a spare node, and trains on (docs/FAILURES.md, "Live
recovery"; the supervisor's side is jobs/lib/recovery.py, the messages are xscale.contract's).

Only under the supervisor with spares (it exports XSCALE_RECOVERY), and only in xscale.Loop with
a DDP model and one micro-batch per step, whose step can be dropped and done again:

- DDP's gradient all-reduce goes through a comm hook whose future this module completes: with
  the sum when the all-reduce ends, or with the local gradients when it fails or the
  coordinator says ABORT. A failure therefore never raises in the script's own lines;
  `optimizer.step()` then finds no gradients (a step pre-hook drops them) and changes nothing,
  and Loop.record() recovers without counting the step.
- The loop's own collectives (the vote) wait on their work or on ABORT, whichever comes first
  (wait()), and DDP's buffer broadcast at each forward is the loop's, done the same way before
  it hands out a batch (sync_buffers).
- The next group forms on a store that the lowest surviving rank hosts; DDP moves to it
  (_update_process_group); the lowest surviving rank sends the model, the optimizer and the
  loop's Position to every rank, and every rank takes them, survivors too: all go on at the
  same step, from the same place in the epoch, voting at the same steps. The first step after sums
  every gradient in the parameters' order: the replacements' DDP buckets are not yet laid out
  as the survivors' are (DDP lays them out again at the next forward, everywhere alike).

A replacement (XSCALE_RECOVERY_JOIN) joins the group it is told of instead of a rendezvous of its
own, builds its DDP without DDP's start-up broadcast (the survivors are not there to match it),
and receives its state in Loop's constructor instead of reading a checkpoint. A failure
anywhere else (a save, an evaluation) raises as it always did, and the supervisor falls back to
a restart of the whole launch.
"""

from __future__ import annotations

import atexit
import functools
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from xscale import contract, lifecycle, settings

FALLBACK_EXIT = 75  # a rank told that live recovery cannot be (EX_TEMPFAIL): the launch ends
POLL_S = 0.02  # how often a wait looks at the abort flag (its work's end wakes it at once)


class GroupBroken(Exception):
    """The process group failed (a peer is lost): the loop recovers and goes on."""


@dataclass(frozen=True)
class Position:
    """Where a loop is, as the source rank sends it after a recovery: the optimizer steps done
    (the place in the epoch follows from it), the step its log and vote intervals count from,
    its newest checkpoint and its checkpoint interval (auto_every: not yet decided)."""

    step: int
    log_from: int
    saved_step: int | None
    saved_path: str | None
    checkpoint_every: int
    auto_every: bool


class Link:
    """This rank's connection to the supervisor's coordinator: hello, heartbeats, and what the
    coordinator says (ABORT sets `broken`; JOIN sets `join`; HOST_STORE makes a store)."""

    def __init__(self, address: str, rank: int, world_size: int, generation: int,
                 heartbeat_s: float) -> None:
        host, _, port = address.rpartition(":")
        self.rank, self.world_size, self.generation = rank, world_size, generation
        self.node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        self.socket = socket.create_connection((host, int(port)), timeout=30)
        self.socket.settimeout(None)
        self._send_lock = threading.Lock()
        self.broken = threading.Event()
        self.joined = threading.Event()
        self.join: dict[str, Any] | None = None
        self.store: dist.TCPStore | None = None  # the store this rank hosts, when asked
        self.on_broken: list[Callable[[], None]] = []
        self.closed = False
        self.send(contract.HELLO, rank=rank, node=self.node, pid=os.getpid(),
                  generation=generation)
        threading.Thread(target=self._listen, daemon=True, name="xscale-recovery").start()
        threading.Thread(target=self._beat, args=(max(heartbeat_s / 6, 0.2),), daemon=True,
                         name="xscale-heartbeat").start()

    def send(self, kind: str, **fields: Any) -> None:
        try:
            with self._send_lock:
                self.socket.sendall(contract.message(kind, **fields))
        except OSError:
            pass  # the coordinator is the batch host's: if it is gone, so is the job

    def declare_broken(self, why: str, generation: int) -> None:
        """This rank saw GENERATION's group fail: say so once, and leave what waits on it. A
        work of a generation already left that fails late (it was aborted) is no news."""
        if generation == self.generation and not self.broken.is_set():
            self.send(contract.BROKEN, generation=generation, why=why[:200])
            self._break()

    def not_live(self, why: str) -> None:
        """This rank's training cannot be recovered live, for WHY (said once, at its start)."""
        self.send(contract.NOT_LIVE, why=why[:200])

    def failed(self, error: BaseException) -> None:
        """An error of this rank's own ends it: no live recovery for the launch."""
        if not self.closed:
            self.send(contract.FAILED, why=f"{type(error).__name__}: {str(error)[:200]}")

    def _break(self) -> None:
        self.broken.set()
        for callback in list(self.on_broken):
            callback()

    def _listen(self) -> None:
        with self.socket.makefile("rb") as stream:
            for received in contract.read_messages(stream):
                kind = received.get("kind")
                if kind == contract.ABORT and received.get("generation") == self.generation:
                    self._break()
                elif kind == contract.HOST_STORE:
                    self._host_store()
                elif kind == contract.JOIN:
                    self.join = received
                    self.joined.set()
                elif kind == contract.FALLBACK:
                    self._exit(received.get("why", "?"))

    def _host_store(self) -> None:
        """The next group's store, on this node's address as the batch host sees it (the
        interface the other nodes reach it by, too)."""
        host = self.socket.getsockname()[0]
        self.store = dist.TCPStore(host, 0, self.world_size, is_master=True,
                                   wait_for_workers=False, timeout=store_timeout())
        self.send(contract.STORE, address=[host, self.store.port])

    def _exit(self, why: str) -> None:
        if self.closed:
            return  # its training is over; the launch ends anyway
        print(f"xscale: rank {self.rank}: live recovery is not possible ({why}); this rank "
              f"exits, and the supervisor restarts the launch or requeues the job", flush=True,
              file=sys.stderr)
        os._exit(FALLBACK_EXIT)

    def _beat(self, every_s: float) -> None:
        while not self.closed:
            self.send(contract.BEAT)
            time.sleep(every_s)

    def close(self) -> None:
        """The training is over on this rank."""
        if not self.closed:
            self.closed = True
            self.send(contract.BYE)


_link: Link | None = None


def link() -> Link | None:
    return _link


def connect(rank: int, world_size: int, environ: dict | None = None) -> Link | None:
    """Connect to the coordinator when the supervisor started one (XSCALE_RECOVERY)."""
    global _link
    env = os.environ if environ is None else environ
    address = env.get(contract.RECOVERY_VAR)
    if not address or world_size < 2:
        return None
    generation = int(env.get(contract.JOIN_VAR) or 0)
    try:
        _link = Link(address, rank, world_size, generation,
                     settings.value("XSCALE_HEARTBEAT_S", env))
    except OSError as error:  # the batch host unreachable from here: train, without it
        print(f"xscale: warning: rank {rank}: no live recovery: the supervisor's coordinator "
              f"at {address} cannot be reached ({error.strerror or error})", file=sys.stderr,
              flush=True)
        return None
    lifecycle.on_failure(_link.failed)
    lifecycle.on_exit(_link.close)  # the clean exit's os._exit skips atexit
    atexit.register(_link.close)
    return _link


def joining() -> bool:
    """Whether this process is a replacement that has yet to receive its state."""
    return _link is not None and bool(os.environ.get(contract.JOIN_VAR)) \
        and _link.generation == int(os.environ[contract.JOIN_VAR]) and not _received


_received = False


def store_timeout() -> timedelta:
    return timedelta(seconds=120)


def join_group(backend: str, rank: int, world_size: int, timeout: timedelta,
               device: torch.device) -> None:
    """Form the generation the coordinator named, on its store (waits for JOIN)."""
    assert _link is not None
    _link.joined.wait()
    join = _link.join
    host, port = join["store"]
    if _link.store is not None and _link.store.port == port:
        store = _link.store
    else:
        store = dist.TCPStore(host, port, world_size, is_master=False,
                              timeout=store_timeout())
    options: dict[str, Any] = {"backend": backend, "rank": rank, "world_size": world_size,
                               "timeout": timeout,
                               "store": dist.PrefixStore(f"xscale/{join['generation']}", store)}
    if backend == "nccl":
        options["device_id"] = device
    dist.init_process_group(**options)
    _link.generation = join["generation"]
    _link.joined.clear()


def build_ddp_without_start_sync() -> None:
    """A replacement's DDP must not broadcast its fresh weights from its rank 0 at start: the
    survivors are in their recovery, not in a DDP constructor, and its rank 0 may be the
    replacement itself. Its state comes from a survivor instead (Recovery.receive)."""
    ddp_class = nn.parallel.DistributedDataParallel
    original = ddp_class.__init__

    @functools.wraps(original)
    def init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        if joining():
            kwargs["init_sync"] = False
        original(self, *args, **kwargs)

    ddp_class.__init__ = init


def wait(work: Any) -> None:
    """Wait for a collective's WORK, or raise GroupBroken as soon as the group is known broken
    (its own failure, or the coordinator's ABORT): a rank never sits out a collective timeout
    for a lost peer."""
    if _link is None:
        work.wait()
        return
    done, generation = threading.Event(), _link.generation
    future = work.get_future()
    future.add_done_callback(lambda _: done.set())
    while not done.wait(POLL_S):
        if _link.broken.is_set():
            raise GroupBroken("the group is broken")
    try:
        future.value()
    except Exception as error:  # gloo: "Connection closed by peer", a timeout...
        _link.declare_broken(str(error), generation)
        raise GroupBroken(str(error)) from None


class Recovery:
    """What one Loop's model and optimizer need to survive a lost node (module docstring)."""

    def __init__(self, model: nn.parallel.DistributedDataParallel,
                 optimizer: torch.optim.Optimizer, link: Link, backend: str,
                 device: torch.device) -> None:
        self.model, self.optimizer, self.link = model, optimizer, link
        self.backend, self.device = backend, device
        self.buffers = list(model.module.buffers()) if model.broadcast_buffers else []
        model.broadcast_buffers = False  # the loop broadcasts them, abortably (sync_buffers)
        self._pending: dict[int, tuple[torch.futures.Future, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.layout_free = joining()  # the first step after (re)forming (module docstring)
        self.step_dropped = False  # the group broke before this step's update: none was made
        model.register_comm_hook(None, self._all_reduce)
        optimizer.register_step_pre_hook(self._before_step)
        link.on_broken.append(self._release_pending)
        link.send(contract.LIVE)

    @property
    def broken(self) -> bool:
        return self.link.broken.is_set()

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
        world = dist.get_world_size()

        def finished(work_future: torch.futures.Future) -> None:
            try:
                work_future.value()
                result = gradients.div_(world)
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

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Drop the gradients of a broken step, so that the step changes nothing; on the first
        step of a new group, sum them in the parameters' order first."""
        if self.layout_free and not self.broken:
            try:
                self._sum_in_parameter_order()
                self.layout_free = False
            except GroupBroken:
                pass
        if self.broken:
            self.step_dropped = True
            for group in optimizer.param_groups:
                for parameter in group["params"]:
                    parameter.grad = None

    def _sum_in_parameter_order(self) -> None:
        parameters = [p for p in self.model.parameters() if p.grad is not None]
        if not parameters:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in parameters])
        wait(dist.all_reduce(flat, async_op=True))
        flat.div_(dist.get_world_size())
        offset = 0
        for parameter in parameters:
            size = parameter.grad.numel()
            parameter.grad.copy_(flat[offset:offset + size].view_as(parameter.grad))
            offset += size

    # ---- the buffers (BatchNorm's statistics) ---------------------------------------------

    def sync_buffers(self) -> None:
        """Rank 0's buffers to every rank, as DDP does at each forward; GroupBroken if the
        group fails meanwhile."""
        for buffer in self.buffers:
            wait(dist.broadcast(buffer, 0, async_op=True))

    # ---- the recovery ---------------------------------------------------------------------

    def recover(self, position: Position) -> tuple[float, float, Position]:
        """Leave the broken group, form the next, and send (from the lowest surviving rank) or
        take the state; the seconds it took, those of the state's transfer, and the source's
        POSITION, which every rank takes (its model is the one every rank now has)."""
        started = time.perf_counter()
        generation = self.link.generation
        dist.distributed_c10d._abort_process_group()  # gloo and NCCL alike: returns at once
        self.link.send(contract.LEFT, generation=generation)
        join_group(self.backend, dist_rank(), self.link.world_size, collective_timeout(),
                   self.device)
        self.model._update_process_group(dist.group.WORLD)
        formed = time.perf_counter()
        source_position = self._take_state(position)
        self.link.broken.clear()
        self.step_dropped = False
        self.layout_free = True
        self.link.send(contract.JOINED, generation=self.link.generation)
        done = time.perf_counter()
        return done - started, done - formed, source_position

    def receive(self) -> Position:
        """A replacement's state and position, from the survivors (in Loop's constructor)."""
        position = self._take_state(None)
        self.link.send(contract.JOINED, generation=self.link.generation)
        return position

    def _take_state(self, position: Position | None) -> Position:
        """The source rank's model, optimizer and POSITION to every rank (a collective); the
        source's position."""
        from xscale.dist import collective_device  # xscale.dist imports this module

        global _received
        source = self.link.join["source"]
        for tensor in [*self.model.module.parameters(), *self.model.module.buffers()]:
            dist.broadcast(tensor.data, source)
        carried = [self.optimizer.state_dict(), position]
        dist.broadcast_object_list(carried, source, device=collective_device())
        if dist_rank() != source:
            self.optimizer.load_state_dict(carried[0])
        _received = True
        return carried[1]


def dist_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def collective_timeout() -> timedelta:
    from xscale.dist import timeout_from_env
    return timeout_from_env()


def for_loop(model: nn.Module, optimizer: Any, accumulation: int, backend: str,
             device: torch.device) -> tuple[Recovery | None, str | None]:
    """A Loop's recovery when the coordinator is there and the loop can drop and redo its step;
    else None, and why not (None as well without the coordinator: nothing to say)."""
    if _link is None:
        return None, None
    why = _not_recoverable(model, optimizer, accumulation)
    if why is not None:
        _link.not_live(why)
        return None, why
    return Recovery(model, optimizer, _link, backend, device), None


def _not_recoverable(model: nn.Module, optimizer: Any, accumulation: int) -> str | None:
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        kind = type(model)
        return (f"the loop's model is a {kind.__module__}.{kind.__qualname__}, not torch's "
                "DistributedDataParallel, whose gradient all-reduce live recovery takes over")
    if optimizer is None:
        return "the loop was given no optimizer (Loop(optimizer=...)) whose step it can drop"
    if accumulation != 1:
        return (f"the loop accumulates {accumulation} micro-batches per step; a dropped step's "
                "earlier micro-batches cannot be done again")
    return None

"""This rank's link to the supervisor's coordinator (jobs/lib/coordinator.py), the lowest part of
live recovery: what the process-group code (xscale.dist) and the sums over ranks
(xscale.reductions) need, and nothing that needs them.

The link says HELLO, beats, tells the coordinator what this rank sees (its collective broke,
it left a group, it joined the next, it ended) and hears back ABORT (leave now), HOST_STORE,
JOIN (the next group's store and the rank whose state every rank takes), FALLBACK (no live
recovery: exit) and DISMISS (this rank's node is lost: exit, the others go on without it).
`wait` ends a collective's wait as soon as the group is known broken, so no rank sits out a
collective timeout for a lost peer. The messages are xscale.shared.contract's.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, NoReturn

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from xscale import lifecycle
from xscale.observe import flight
from xscale.shared import contract, settings

FALLBACK_EXIT = 75  # a rank told that live recovery cannot be (EX_TEMPFAIL): the launch ends
POLL_S = 0.02  # how often a wait looks at the abort flag (its work's end wakes it at once)
STORE_TIMEOUT = timedelta(seconds=120)  # the next group's store: every rank reaches it by then


class GroupBroken(Exception):
    """The process group failed (a peer is lost): the loop recovers and goes on."""


class Link:
    """This rank's connection to the coordinator: hello, heartbeats, and what the coordinator
    says (ABORT sets `broken`; JOIN sets `join`; HOST_STORE makes a store)."""

    def __init__(self, address: str, rank: int, world_size: int, generation: int,
                 heartbeat_s: float) -> None:
        host, _, port = address.rpartition(":")
        self.rank, self.world_size, self.generation = rank, world_size, generation
        # The launch's numbering, kept in a smaller world: each step's global batch is laid
        # out for its ranks, and the coordinator names this rank by it.
        self.launch_rank, self.launch_world = rank, world_size
        self.socket = socket.create_connection((host, int(port)), timeout=30)
        self.socket.settimeout(None)
        os.register_at_fork(after_in_child=self._leave_to_parent)
        self._send_lock = threading.Lock()
        self.broken = threading.Event()
        self.joined = threading.Event()
        self.join: contract.Join | None = None
        self.store: dist.TCPStore | None = None  # the store this rank hosts, when asked
        self.on_broken: list[Callable[[], None]] = []
        self.closed = False
        self.is_live = False  # said Live: its loop can leave a broken step and re-enter
        self.stepping_in: int | None = None  # the generation it said Stepping in
        self.received_state = generation == 0  # a replacement's comes from the survivors
        self.send(contract.Hello(rank=rank, node=contract.node_name(), pid=os.getpid(),
                                 generation=generation))
        threading.Thread(target=self._listen, daemon=True, name="xscale-recovery").start()
        threading.Thread(target=self._beat, args=(max(heartbeat_s / 6, 0.2),), daemon=True,
                         name="xscale-heartbeat").start()

    def _leave_to_parent(self) -> None:
        """In a forked child (a DataLoader worker on the CPU): the connection is its parent's.
        Kept open here, it would outlive the parent's death, which the coordinator learns from
        its close (the worker notices the death only seconds later)."""
        self.closed = True
        # Not socket.close(): the listening thread's makefile() keeps the descriptor open.
        descriptor = self.socket.detach()  # -1 where a fork before this one closed it
        if descriptor >= 0:
            os.close(descriptor)

    def send(self, message: Any) -> None:
        try:
            with self._send_lock:
                self.socket.sendall(contract.encode(message))
        except OSError:
            pass  # the coordinator is the batch host's: if it is gone, so is the job

    @property
    def joining(self) -> bool:
        """Whether this process is a replacement that has yet to receive its state."""
        return not self.received_state

    def declare_broken(self, why: str, generation: int) -> None:
        """This rank saw GENERATION's group fail: say so once, and leave what waits on it. A
        work of a generation already left that fails late (it was aborted) is no news."""
        if generation == self.generation and not self.broken.is_set():
            leave_record(why)
            self.send(contract.Broken(generation=generation, why=why[:200]))
            self._break()

    def live(self, shrinks: bool) -> None:
        """This rank's training can leave a broken step and re-enter: recovery may be live.
        SHRINKS: it can also go on in a smaller world, when no spare is left."""
        self.is_live = True
        self.send(contract.Live(shrinks=shrinks))

    def not_live(self, why: str) -> None:
        """This rank's training cannot be recovered live, for WHY (said once, at its start)."""
        self.send(contract.NotLive(why=why[:200]))

    def failed(self, error: BaseException) -> None:
        """An error of this rank's own ends it; its first line is the coordinator's to report
        (and, after XSCALE_MAX_RANK_RESTARTS tries at one step, to stop the launch with)."""
        if not self.closed:
            self.send(contract.Failed(why=f"{type(error).__name__}: {str(error)[:200]}"))

    def left(self, step: int) -> None:
        """This rank left its broken group (aborted it), with STEP optimizer steps done."""
        self.send(contract.Left(generation=self.generation, step=step))

    def stepping(self) -> None:
        """This rank's loop begins a step: said once a generation, as from here an ABORT is
        answered within a step (a rank still starting its loop may take far longer)."""
        if self.stepping_in != self.generation:
            self.stepping_in = self.generation
            self.send(contract.Stepping(generation=self.generation))

    def next_store(self) -> tuple[dist.Store, int]:
        """The next group's store, and its generation, once the coordinator names them (JOIN):
        the store this rank hosts, or a client of the one another rank hosts. In a smaller
        world this rank takes its number there (`rank`, `world_size`)."""
        self.joined.wait()
        join = self.join
        if join.ranks is not None:
            self.rank, self.world_size = join.ranks.index(self.launch_rank), len(join.ranks)
        host, port = join.store
        if self.store is not None and self.store.port == port:
            store = self.store
        else:
            store = dist.TCPStore(host, port, self.world_size, is_master=False,
                                  timeout=STORE_TIMEOUT)
        return dist.PrefixStore(f"xscale/{join.generation}", store), join.generation

    def formed(self, generation: int) -> None:
        """The group of GENERATION is formed; this rank's collectives are its now."""
        self.generation = generation
        self.joined.clear()

    @property
    def nnodes(self) -> int:
        """The nodes the group just formed runs on (fewer than the launch's in a smaller world)."""
        return self.join.nodes

    @property
    def source(self) -> int:
        """The rank whose state every rank takes in the group just formed."""
        return self.join.source

    def took_state(self) -> None:
        """This rank holds the group's state and trains on in it: the broken flag is cleared."""
        self.received_state = True
        self.broken.clear()
        self.send(contract.Joined(generation=self.generation))

    def _break(self) -> None:
        self.broken.set()
        for callback in list(self.on_broken):
            callback()

    def _listen(self) -> None:
        with self.socket.makefile("rb") as stream:
            for received in contract.read_messages(stream):
                if isinstance(received, contract.Abort):
                    if received.generation == self.generation:
                        if not self.broken.is_set():
                            leave_record("the coordinator aborted the group", replace=False)
                        self._break()
                elif isinstance(received, contract.HostStore):
                    self._host_store()
                elif isinstance(received, contract.Join):
                    self.join = received
                    self.joined.set()
                elif isinstance(received, contract.Fallback):
                    self._exit(received.why)
                elif isinstance(received, contract.Dismiss):
                    self._dismissed(received.why)

    def _host_store(self) -> None:
        """The next group's store, on this node's address as the batch host sees it (the
        interface the other nodes reach it by, too)."""
        host = self.socket.getsockname()[0]
        self.store = dist.TCPStore(host, 0, self.world_size, is_master=True,
                                   wait_for_workers=False, timeout=STORE_TIMEOUT)
        self.send(contract.Store(address=[host, self.store.port]))

    def cannot_recover(self, why: str) -> NoReturn:
        """This rank found live recovery not possible, for WHY: one line, and it exits as at the
        coordinator's FALLBACK (the others find the same, or hear the fallback)."""
        self._leave_process(why)

    def _exit(self, why: str) -> None:
        if not self.closed:  # else its training is over; the launch ends anyway
            self._leave_process(why)

    def _dismissed(self, why: str) -> NoReturn:
        """This rank's node is lost to the training (the coordinator's DISMISS): it exits, with
        status 0 (it failed in nothing), and the others go on without the node."""
        print(f"xscale: rank {self.rank}: {why}: this rank leaves the training, which goes on "
              f"without its node", flush=True, file=sys.stderr)
        os._exit(0)

    def _leave_process(self, why: str) -> NoReturn:
        print(f"xscale: rank {self.rank}: live recovery is not possible ({why}); this rank "
              f"exits, and the supervisor restarts the launch or requeues the job", flush=True,
              file=sys.stderr)
        os._exit(FALLBACK_EXIT)

    def _beat(self, every_s: float) -> None:
        while not self.closed:
            self.send(contract.Beat())
            time.sleep(every_s)

    def close(self) -> None:
        """The training is over on this rank."""
        if not self.closed:
            self.closed = True
            self.send(contract.Bye())


_broken_groups: list[dist.ProcessGroup] = []  # kept for the process's life: abort_group


def abort_group(group: dist.ProcessGroup | None = None) -> None:
    """End every collective still waited on in GROUP (None: every group), and keep the broken
    groups referenced for the rest of the process. The last reference's release runs a gloo
    group's destructor, which joins the group's threads; one still waiting on a peer that is
    alive but left the group (a survivor a step behind) held DDP's reform until the collective
    timeout (55 s in tests/test_recovery.py). Kept, their threads end at that timeout, unseen."""
    _broken_groups.extend([group] if group is not None else list(c10d._world.pg_map))
    c10d._abort_process_group(group)  # gloo and NCCL alike: returns at once


def leave_record(why: str, replace: bool = True) -> None:
    """This rank's flight record, as its group breaks: if live recovery cannot follow (a peer
    hung, and another rank's collective timed out), the report names the rank that never
    joined from every rank's record, as it does without live recovery (jobs/lib/hangs.py; a
    record without a timeout names nobody). Not held for the supervisor (this may be a
    collective's thread). REPLACE: a record of xscale's already there (else it is kept: the
    coordinator's abort after the rank's own error leaves the error's record)."""
    flight.record_failure(RuntimeError(why), hold=False, replace=replace)


_link: Link | None = None


def link() -> Link | None:
    """This process's link, when the supervisor started a coordinator and it was reached."""
    return _link


def recovering() -> bool:
    """Whether a broken group is recovered live here: this rank's loop can re-enter
    (Link.live) and its training is not over (Link.close)."""
    return _link is not None and _link.is_live and not _link.closed


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
    # First: the flight record's hook holds the rank for the supervisor's release, and until
    # the coordinator hears of the error it would take the held rank for a hung one.
    lifecycle.on_failure(_link.failed, first=True)
    lifecycle.on_exit(_link.close)  # the clean exit's os._exit skips atexit
    atexit.register(_link.close)
    return _link


def joining() -> bool:
    """Whether this process is a replacement that has yet to receive its state."""
    return _link is not None and _link.joining


def wait(work: Any) -> None:
    """Wait for a collective's WORK, or raise GroupBroken as soon as the group is known broken
    (its own failure, or the coordinator's ABORT): a rank never sits out a collective timeout
    for a lost peer."""
    if _link is None:
        work.wait()
        return
    generation = _link.generation
    waiting = _Waiting(work)
    while not waiting.ended.wait(POLL_S):
        if _link.broken.is_set():
            raise GroupBroken("the group is broken")
    if waiting.error is not None:  # gloo: "Connection closed by peer", a timeout...
        _link.declare_broken(str(waiting.error), generation)
        raise GroupBroken(str(waiting.error)) from None


class _Waiting:
    """A work's end, as an event, and its error. Its future sets the event at once; gloo's send,
    receive and reduce-scatter have none, and run only when waited for: a thread of their own
    waits for them, once (a receive waited for twice waits for a second message)."""

    def __init__(self, work: Any) -> None:
        self.ended = threading.Event()
        self.error: BaseException | None = None
        try:
            future = work.get_future()
        except RuntimeError:  # "Work::getFuture not implemented"
            threading.Thread(target=self._wait, args=(work.wait,), daemon=True,
                             name="xscale-wait").start()
        else:
            future.add_done_callback(lambda _: self._wait(future.value))

    def _wait(self, wait: Callable[[], Any]) -> None:
        try:
            wait()
        except Exception as error:
            self.error = error
        finally:
            self.ended.set()


# torch.distributed's collectives that a framework's own loop calls blocking (below).
BLOCKING_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast",
                        "barrier", "gather", "reduce", "scatter", "reduce_scatter_tensor")


@contextmanager
def abortable_collectives() -> Iterator[None]:
    """Within it, torch.distributed's blocking collectives end as soon as the group is known
    broken (`wait`), as xscale's own do: those of a framework's loop that xscale does not
    write (Trainer's logging and evaluation gathers, accelerate's broadcast of the data order).
    gloo's abort does not end a collective that waits on a peer that lives but has left the
    group: it would wait for the collective timeout, and the coordinator would take the rank
    for a hung one. The object collectives (broadcast_object_list, ...) are built on these and
    end the same way. Without a link it changes nothing."""
    if _link is None:
        yield
        return
    with swapped_collectives(BLOCKING_COLLECTIVES, _abortable):
        yield


@contextmanager
def swapped_collectives(names: Iterable[str],
                        wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """Within it, each torch.distributed collective in NAMES is WRAP(the collective)
    (swap_collectives)."""
    originals = swap_collectives(names, wrap)
    try:
        yield
    finally:
        restore_collectives(originals)


def swap_collectives(names: Iterable[str],
                     wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
                     ) -> dict[str, Callable[..., Any]]:
    """Each torch.distributed collective in NAMES made WRAP(the collective), as
    torch.distributed and its c10d module name it (callers reach it through either); the
    originals, for restore_collectives."""
    originals = {name: getattr(c10d, name) for name in names}
    for name, original in originals.items():
        setattr(c10d, name, wrap(original))
        setattr(dist, name, getattr(c10d, name))
    return originals


def restore_collectives(originals: dict[str, Callable[..., Any]]) -> None:
    for name, original in originals.items():
        setattr(c10d, name, original)
        setattr(dist, name, original)


def _abortable(collective: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(collective)

    @functools.wraps(collective)
    def call(*args: Any, **kwargs: Any) -> Any:
        if signature.bind(*args, **kwargs).arguments.get("async_op"):
            return collective(*args, **kwargs)  # the caller waits for it itself
        work = collective(*args, **{**kwargs, "async_op": True})
        if work is not None:  # None: this rank is not in the group
            wait(work)
        return None

    return call

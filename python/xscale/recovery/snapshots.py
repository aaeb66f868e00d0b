"""Peer snapshots: a sharded training's state kept in host memory twice, on its rank and on one
rank of another node, so that a lost node's parts come back without the disk (docs/FAILURES.md,
"Peer snapshots").

Every K steps each rank copies its state's tensors (its shard of the weights and of the
optimizer's state, its buffers) and its random generators (a model with dropout draws its masks
from them; xscale.checkpoints.generators) into host memory, one flat byte buffer with a header
(a magic, the step, the payload's size and CRC-32), and sends that copy to its *buddy*, the same
local rank on the next node, whose copy of its own partner it receives in turn. Two slots
alternate, so that a failure while one is being filled leaves the other whole. A live recovery
then agrees on the newest step that every survivor holds and that every lost rank's buddy holds
for it, hands each replacement its copy, checks every copy's CRC-32 and, if all match, has every
rank load its copy in place: the survivors roll back to that step and the replacements take
their part; at most K steps are redone. A copy that fails its checksum is never loaded: the
recovery is not possible, with one line, and the launch falls back to its newest checkpoint.

The copies travel on a gloo group of their own (host memory to host memory, whatever the
training's backend), made again after every recovery. A device's tensors go straight into pinned
memory on a stream of their own (SideCopy): the step's host side does not wait for them, and the
device's training stream waits only for the copy itself, not for a drained queue. Host tensors
are copied before the step goes on. The checksum and the exchange run in a thread while training
goes on, and the next snapshot waits for them. K is XSCALE_SNAPSHOT_EVERY, or with `auto` Young's
interval from the first snapshot's stall.
"""

from __future__ import annotations

import struct
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from xscale.checkpoints import cadence, generators
from xscale.recovery import link as links
from xscale.recovery.protocol import Place

# A copy's header: MAGIC, the step, the payload's bytes and CRC-32. The magic and the size let a
# reader of raw memory find copies and check them (tests/cluster/corrupt_snapshots.py).
HEADER = struct.Struct("<8sqQQ")
MAGIC = b"xscsnap1"


class SnapshotUnusable(RuntimeError):
    """No snapshot serves this recovery: none that every rank holds, or a copy that fails its
    checksum. Live recovery is not possible; the launch falls back to its newest checkpoint."""


@dataclass
class Slot:
    """One of a rank's two snapshots: its own copy and its partner's, of one step."""

    own: torch.Tensor  # uint8: header and payload
    held: torch.Tensor
    step: int | None = None  # the own copy's step, once whole
    held_step: int | None = None  # the partner's copy's step, once received
    place: Place | None = None  # where the loop was at that step


def buddy(rank: int, world_size: int, per_node: int) -> int:
    """The rank that holds RANK's copy: the same local rank on the next node."""
    return (rank + per_node) % world_size


def partner(rank: int, world_size: int, per_node: int) -> int:
    """The rank whose copy RANK holds."""
    return (rank - per_node) % world_size


ALIGN = 16  # each tensor starts at a multiple: its bytes are viewed as its dtype in place


def payload_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(_room(tensor) for tensor in tensors)


def _room(tensor: torch.Tensor) -> int:
    """The bytes TENSOR takes in a snapshot: its own, rounded up to ALIGN."""
    return -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN


AUTO_FIRST = 10  # with `auto`, the first snapshot comes this many steps after the launch's
# first step: the steps between time a step, the snapshot times itself, and K follows


@dataclass(frozen=True)
class Schedule:
    """When snapshots are due: every `every` steps counted from `anchor`, or, with `auto` not
    yet decided (every None), at the first step from `first_step` + AUTO_FIRST. Every rank
    holds the same; a replacement takes the source's."""

    every: int | None
    anchor: int = 0
    first_step: int | None = None  # the launch's first step, with auto

    def due(self, step: int) -> bool:
        if self.every is None:
            return self.first_step is not None and step >= self.first_step + AUTO_FIRST
        return self.every > 0 and (step - self.anchor) % self.every == 0


class PeerSnapshots:
    """This rank's snapshots of the tensors `state()` lists (always the same tensors, in the same
    order, on every rank of the same place), every `every` steps, or `auto`."""

    def __init__(self, state: Callable[[], list[torch.Tensor]], rank: int, world_size: int,
                 per_node: int, every: int | str) -> None:
        self.state, self.rank, self.world_size, self.per_node = state, rank, world_size, per_node
        self.schedule = Schedule(None if every == "auto" else int(every))
        self._clock: tuple[int, float] | None = None  # this rank's first step seen, and when
        self.buddy = buddy(rank, world_size, per_node)
        self.partner = partner(rank, world_size, per_node)
        self.slots: list[Slot] = []
        self.sized = False  # the ranks' sizes gathered (again after a recovery, by every rank)
        self.group: dist.ProcessGroup | None = None  # made at the first snapshot
        self.taken = 0
        self.off: str | None = None  # why snapshots are off (host memory), once checked
        self.exchange: Exchange | None = None  # the newest snapshot's, while it runs
        self.copy_s: float | None = None  # a device copy's seconds, measured at the first

    def _every_text(self) -> str:
        if self.schedule.every is None:
            return "(auto: the interval follows from this first one's cost)"
        return f"every {self.schedule.every} steps"

    # ---- taking them ----------------------------------------------------------------------

    def after_step(self, place: Place) -> float | None:
        """At a step's end: the snapshot when one is due (GroupBroken if the group breaks
        meanwhile), and the seconds it held the step up; None when none was taken."""
        started = time.perf_counter()
        if self._clock is None:
            self._clock = (place.step, started)
            if self.schedule.every is None and self.schedule.first_step is None:
                self.schedule = Schedule(None, first_step=place.step)
        if not self.schedule.due(place.step) or not self.take(place.step, place):
            return None
        held_s = time.perf_counter() - started + self._device_copy_s()
        if self.schedule.every is None:
            self._decide(place.step, held_s, started)
        return held_s

    def _device_copy_s(self) -> float:
        """What the newest snapshot's copy holds the device's training stream up (SideCopy):
        measured at the first snapshot, whose wait for it is the one time the host waits too;
        later ones copy the same bytes. 0 when the state is on the host."""
        copying = self.exchange.copying if self.exchange is not None else None
        if copying is None:
            return 0.0
        if self.copy_s is None:
            self.copy_s = copying.seconds()
        return self.copy_s

    def _decide(self, step: int, held_s: float, now: float) -> None:
        """`auto`: K from rank 0's first snapshot and its steps' time (Young's interval, as
        --checkpoint-every auto: the snapshot's stall against the work a failure throws away),
        broadcast to every rank from there."""
        decided: list[Any] = [None]
        if self.rank == 0:
            first_step, first_time = self._clock
            step_s = (now - first_time) / max(step - first_step, 1)
            nodes, mtbf_h = self.world_size // self.per_node, cadence.node_mtbf_hours()
            every, seconds, job_mtbf_s = cadence.auto_interval(held_s, 0.0, step_s, nodes, mtbf_h)
            print(f"xscale: XSCALE_SNAPSHOT_EVERY auto: every {every} steps ({seconds:.1f} s): "
                  f"a snapshot stops training {held_s:.3f} s, a step takes {step_s:.3f} s, a "
                  f"failure comes every {job_mtbf_s / 3600:,.0f} h on {nodes} node(s)",
                  flush=True)
            decided = [every]
        self.finish()  # the group's collectives run one at a time
        with links.abortable_collectives():
            dist.broadcast_object_list(decided, 0, group=self.group)
        self.schedule = Schedule(decided[0], anchor=step)

    def take(self, step: int, place: Place) -> bool:
        """The snapshot of STEP (every rank at the same step): the own copy, which the step
        waits for on the host (a device's, on a side stream, it does not); its checksum and the
        exchange with the buddy and the partner follow in the background (Exchange), the one
        before being finished first. GroupBroken if the group broke meanwhile (a slot being
        filled is then incomplete, the other one whole). False: snapshots are off (too little
        host memory), none was taken."""
        self.finish()
        tensors = self._tensors()
        if self.group is None:
            self.group = dist.new_group(backend="gloo")
        if not self.sized and not self._size_slots(tensors):
            return False
        slot = self.slots[self.taken % 2]
        slot.step = slot.held_step = None
        copying = _copy_in(slot.own, tensors)
        slot.place = place
        self.exchange = Exchange(slot, step, copying, self.buddy, self.partner, self.group)
        self.taken += 1
        return True

    def finish(self) -> None:
        """Wait for the exchange under way, if one is: GroupBroken if it failed."""
        exchange, self.exchange = self.exchange, None
        if exchange is not None:
            exchange.finish()

    def _size_slots(self, tensors: list[torch.Tensor]) -> bool:
        """Every rank's snapshot size, gathered (FSDP2's shards differ by a row: the partner's
        is not its own), and this rank's slots made where it has none. At the launch's first
        snapshot, the memory they take is checked against each node's free memory; too little
        anywhere turns them off on every rank (False)."""
        mine = (HEADER.size + payload_bytes(tensors), host_memory_free(), bool(self.slots))
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine, group=self.group)
        sizes = [size for size, _, _ in gathered]
        if not any(has_slots for _, _, has_slots in gathered):  # the launch's first snapshot
            self.off = memory_shortfall(sizes, [free for _, free, _ in gathered], self.per_node)
            if self.rank == 0:
                print(f"xscale: peer snapshots off: {self.off}; training goes on, and a lost "
                      "node's ranks come back from the newest checkpoint" if self.off else
                      f"xscale: peer snapshots {self._every_text()}: "
                      f"{2 * (sizes[0] + sizes[self.partner]) / 2**20:.1f} MiB of host "
                      "memory on rank 0 (its two snapshots, and two of its partner's)",
                      flush=True)
        if self.off:
            self.schedule = Schedule(0)
            return False
        if not self.slots:  # a survivor keeps its own: the partner's place is the same
            self.slots = [Slot(_host_bytes(sizes[self.rank]), _host_bytes(sizes[self.partner]))
                          for _ in range(2)]
        self.sized = True
        return True

    # ---- a recovery -----------------------------------------------------------------------

    def leave(self) -> None:
        """The group broke: the snapshots' group goes with it (made again in `restore`), once
        an exchange under way has ended (its waits end as the group is known broken)."""
        try:
            self.finish()
        except links.GroupBroken:
            pass
        if self.group is not None:
            links.abort_group(self.group)
            self.group = None

    def restore(self, joining: bool, source: int) -> Place:
        """Every rank loads its copy of the newest step every rank can (a collective in the new
        group): the survivors their own, each replacement the one its buddy holds for it. The
        place every rank goes on from: the source rank's at that step."""
        self.leave()  # an exchange under way ends first (`leave` has ended it in a recovery)
        self.group = dist.new_group(backend="gloo")
        inventories: list[Any] = [None] * self.world_size
        dist.all_gather_object(inventories, (joining, self._whole_steps()))
        step = self._agreed_step(inventories)
        own = self._copy_to_load(step, joining, inventories)
        bad = [None] * self.world_size
        dist.all_gather_object(bad, None if _checksum_matches(own) else self.rank)
        if any(rank is not None for rank in bad):
            raise SnapshotUnusable(
                f"the snapshot of rank {next(r for r in bad if r is not None)} at step {step} "
                "fails its checksum: it is not loaded, and the launch falls back to its newest "
                "checkpoint")
        streams = generators.generator_tensors()  # copies, read into and then set
        _read(own, self.state() + streams)
        generators.set_generators(streams)
        carried = [(self._slot(step).place, self.schedule) if self.rank == source else None]
        dist.broadcast_object_list(carried, source)
        self.sized = False  # the next snapshot gathers the sizes, the replacement's slots too
        place, self.schedule = carried[0]
        return place

    def _whole_steps(self) -> dict[str, list[int]]:
        """The steps of this rank's whole own copies, and of its partner's it holds."""
        return {"own": [slot.step for slot in self.slots if slot.step is not None],
                "held": [slot.held_step for slot in self.slots if slot.held_step is not None]}

    def _agreed_step(self, inventories: list[Any]) -> int:
        """The newest step every survivor holds its own copy of, and every replacement's buddy
        (itself a survivor) holds the replacement's copy of."""
        if self.off:
            raise SnapshotUnusable(f"peer snapshots were off ({self.off}): the launch falls "
                                   "back to its newest checkpoint")
        candidates: set[int] | None = None
        for rank, (joining, steps) in enumerate(inventories):
            if joining:
                holder = buddy(rank, self.world_size, self.per_node)
                if inventories[holder][0]:
                    raise SnapshotUnusable(
                        f"rank {rank} and rank {holder}, which held its snapshot, were lost "
                        "together: its part of the state is gone; the launch falls back to its "
                        "newest checkpoint")
                have = set(inventories[holder][1]["held"])
            else:
                have = set(steps["own"])
            candidates = have if candidates is None else candidates & have
        if not candidates:
            raise SnapshotUnusable(
                "no snapshot step that every rank holds (none was taken yet, or a failure "
                "during the first left none whole): the launch falls back to its newest "
                "checkpoint")
        return max(candidates)

    def _copy_to_load(self, step: int, joining: bool, inventories: list[Any]) -> torch.Tensor:
        """This rank's copy of STEP: its own, or, for a replacement, the one its buddy sends; a
        buddy of a replacement sends it the copy it holds."""
        works = []
        own = self._slot(step).own if not joining else _host_bytes(self._size())
        for rank, (rank_joining, _) in enumerate(inventories):
            holder = buddy(rank, self.world_size, self.per_node)
            if rank_joining and holder == self.rank:
                works.append(dist.isend(self._held_slot(step).held, rank, group=self.group))
        if joining:
            works.append(dist.irecv(own, self.buddy, group=self.group))
        for work in works:  # in the recovery: the link's broken flag is still up
            work.wait()
        return own

    def _slot(self, step: int) -> Slot:
        return next(slot for slot in self.slots if slot.step == step)

    def _held_slot(self, step: int) -> Slot:
        return next(slot for slot in self.slots if slot.held_step == step)

    def _size(self) -> int:
        return HEADER.size + payload_bytes(self._tensors())

    def _tensors(self) -> list[torch.Tensor]:
        """What a snapshot holds: the kind's state (the same tensors each time, loaded in place)
        and this process's random generators, last."""
        return self.state() + generators.generator_tensors()


SHARE_OF_FREE = 0.5  # what snapshots may take of a node's free memory: the rest is for the
# host memory a run takes after its first steps (loader workers' batches, pinned buffers,
# checkpoint copies); running out kills the node's ranks, worse than having no snapshot


def host_memory_free(meminfo: str = "/proc/meminfo") -> int | None:
    """The node's available memory (Linux's MemAvailable) in bytes; None where not known."""
    try:
        with open(meminfo) as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def memory_shortfall(sizes: list[int], free: list[int | None], per_node: int) -> str | None:
    """Why the snapshots do not fit (None: they do): the first node whose ranks' two slots (an
    own copy and a partner's each) need more than SHARE_OF_FREE of its free memory. Ranks
    are placed per_node to a node, in order; a node's free memory is its lowest figure."""
    world_size = len(sizes)
    for first in range(0, world_size, per_node):
        ranks = range(first, min(first + per_node, world_size))
        need = sum(2 * (sizes[r] + sizes[partner(r, world_size, per_node)]) for r in ranks)
        known = [free[r] for r in ranks if free[r] is not None]
        if known and need > SHARE_OF_FREE * min(known):
            return (f"they need {need / 2**30:.2f} GiB of host memory on the node of rank "
                    f"{ranks[0]}, which has {min(known) / 2**30:.2f} GiB free (they may take "
                    f"{SHARE_OF_FREE:.0%} of it)")
    return None


class Exchange:
    """A snapshot's background part, in a thread of its own: the own copy's end (a device's,
    on its side stream), its checksum, then the copy sent to the buddy while the partner's is
    received. The slot's steps are set as each part is whole, so that a recovery counts only
    whole copies."""

    def __init__(self, slot: Slot, step: int, copying: SideCopy | None, buddy_rank: int,
                 partner_rank: int, group: dist.ProcessGroup) -> None:
        self.slot, self.step, self.copying, self.group = slot, step, copying, group
        self.buddy, self.partner = buddy_rank, partner_rank
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="xscale-snapshot")
        self.thread.start()

    def _run(self) -> None:
        try:
            if self.copying is not None:
                self.copying.wait()
            _seal(self.slot.own, self.step)  # zlib releases the GIL: training goes on
            self.slot.step = self.step
            works = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, self.slot.own, self.buddy, self.group),
                dist.P2POp(dist.irecv, self.slot.held, self.partner, self.group)])
            for work in works:
                links.wait(work)
            self.slot.held_step = HEADER.unpack_from(self.slot.held.numpy())[1]
        except Exception as error:  # GroupBroken, or gloo's error: the training's thread reads it
            self.error = error

    def finish(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise links.GroupBroken(str(self.error))


def _host_bytes(size: int) -> torch.Tensor:
    pinned = torch.accelerator.is_available()  # a device-to-host copy from pinned memory
    return torch.empty(size, dtype=torch.uint8, pin_memory=pinned)


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view(-1).view(torch.uint8)


def _copy_in(buffer: torch.Tensor, tensors: list[torch.Tensor]) -> SideCopy | None:
    """TENSORS into BUFFER's payload, each straight into its place (pinned memory: no staging
    copy). With a device's tensors among them, on a side stream: the SideCopy to wait for
    before BUFFER is read. None: all were on the host, and BUFFER is whole."""
    device = next((tensor.device for tensor in tensors if tensor.device.type != "cpu"), None)
    if device is None:
        _copy_each(buffer, tensors)
        return None
    return SideCopy(device, lambda: _copy_each(buffer, tensors))


def _copy_each(buffer: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = HEADER.size
    for tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        buffer[offset:offset + size].copy_(_byte_view(tensor), non_blocking=True)
        offset += _room(tensor)


_SIDE_STREAMS: dict[torch.device, torch.Stream] = {}  # SideCopy's, one per device, kept


class SideCopy:
    """A snapshot's copy from a device into pinned host memory, issued on a stream of its own.

    It starts after the training stream's work so far (the step's update), and the training
    stream's next work starts after it: the next forward changes the buffers, the next optimizer
    step the rest, so the device cannot train while it copies. What it spares is the host's
    wait: the host goes on queueing the next step at once, where a synchronize would drain the
    device's queue first and leave it idle until the host had queued work again. The same
    ordering keeps a temporary of `state()` whole until copied: its memory goes back to the
    training stream's pool, whose next work waits for the copy."""

    def __init__(self, device: torch.device, issue: Callable[[], None]) -> None:
        training = torch.accelerator.current_stream(device)
        side = _SIDE_STREAMS.get(device)
        if side is None:
            side = _SIDE_STREAMS[device] = torch.Stream(device)
        self.started = torch.Event(device, enable_timing=True)
        self.done = torch.Event(device, enable_timing=True)
        side.wait_stream(training)
        with side:  # the copies are issued on it
            self.started.record(side)
            issue()
            self.done.record(side)
        training.wait_event(self.done)

    def wait(self) -> None:
        """Until the bytes are in host memory (the host waits; the device goes on)."""
        self.done.synchronize()

    def seconds(self) -> float:
        """The copy's time on the device, once it has ended."""
        self.wait()
        return self.started.elapsed_time(self.done) / 1000


def _seal(buffer: torch.Tensor, step: int) -> None:
    """The header: STEP, the payload's size and CRC-32."""
    payload = buffer[HEADER.size:].numpy()
    HEADER.pack_into(buffer.numpy(), 0, MAGIC, step, payload.size, zlib.crc32(payload))


def _checksum_matches(buffer: torch.Tensor) -> bool:
    _, _, _, crc = HEADER.unpack_from(buffer.numpy())
    return zlib.crc32(buffer[HEADER.size:].numpy()) == crc


def _read(buffer: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """BUFFER's payload into TENSORS, in place."""
    if HEADER.size + payload_bytes(tensors) != buffer.numel():
        raise SnapshotUnusable("the snapshot's size is not this rank's state's: the model or "
                               "the optimizer differs from the one it was taken of")
    offset = HEADER.size
    with torch.no_grad():
        for tensor in tensors:
            size = tensor.numel() * tensor.element_size()
            part = buffer[offset:offset + size].view(tensor.dtype).view(tensor.shape)
            tensor.copy_(part)
            offset += _room(tensor)

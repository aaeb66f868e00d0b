"""Peer snapshots: a sharded training's state kept in host memory twice, on its rank and on one
rank of another node, so that a lost node's parts come back without the disk (docs/FAILURES.md,
"Peer snapshots").

Every K steps each rank copies its state's tensors (its shard of the weights and of the
optimizer's state, its buffers) into host memory, one flat byte buffer with a header (the step,
the payload's CRC-32), and sends that copy to its *buddy*, the same local rank on the next node,
whose copy of its own partner it receives in turn. Two slots alternate, so that a failure while
one is being filled leaves the other whole. A live recovery then agrees on the newest step that
every survivor holds and that every lost rank's buddy holds for it, hands each replacement its
copy, checks every copy's CRC-32 and, if all match, has every rank load its copy in place: the
survivors roll back to that step and the replacements take their part; at most K steps are
redone. A copy that fails its checksum is never loaded: the recovery is not possible, with one
line, and the launch falls back to its newest checkpoint.

The copies travel on a gloo group of their own (host memory to host memory, whatever the
training's backend), made again after every recovery. The copy to host memory and the exchange
are made at the step's end, in the training's thread: the step waits for them, every K steps
(XSCALE_SNAPSHOT_EVERY; a copy in the background, and K from the copy's cost, are not built).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from xscale.recovery import link as links
from xscale.recovery.protocol import Place

HEADER = struct.Struct("<qQ")  # the step, the payload's CRC-32


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


class PeerSnapshots:
    """This rank's snapshots of the tensors `state()` lists (always the same tensors, in the same
    order, on every rank of the same place), every `every` steps."""

    def __init__(self, state: Callable[[], list[torch.Tensor]], rank: int, world_size: int,
                 per_node: int, every: int) -> None:
        self.state, self.rank, self.world_size = state, rank, world_size
        self.per_node, self.every = per_node, every
        self.buddy = buddy(rank, world_size, per_node)
        self.partner = partner(rank, world_size, per_node)
        self.slots: list[Slot] = []
        self.sized = False  # the ranks' sizes gathered (again after a recovery, by every rank)
        self.group: dist.ProcessGroup | None = None  # made at the first snapshot
        self.taken = 0

    # ---- taking them ----------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def take(self, step: int, place: Place) -> None:
        """The snapshot of STEP (every rank at the same step): the own copy, then the exchange
        with the buddy and the partner; GroupBroken if the group breaks meanwhile (the slot
        filled is then incomplete, the other one whole)."""
        tensors = self.state()
        if self.group is None:
            self.group = dist.new_group(backend="gloo")
        if not self.sized:  # FSDP2's shards differ in size by a row: the partner's is its own
            sizes: list[Any] = [None] * self.world_size
            dist.all_gather_object(sizes, HEADER.size + payload_bytes(tensors), group=self.group)
            if not self.slots:  # a survivor keeps its own: the partner's place is the same
                self.slots = [Slot(_host_bytes(sizes[self.rank]),
                                   _host_bytes(sizes[self.partner])) for _ in range(2)]
                if self.rank == 0:
                    print(f"xscale: peer snapshots every {self.every} steps: "
                          f"{2 * (sizes[0] + sizes[self.partner]) / 2**20:.1f} MiB of host "
                          "memory on rank 0 (its two snapshots, and two of its partner's)",
                          flush=True)
            self.sized = True
        slot = self.slots[self.taken % 2]
        slot.step = slot.held_step = None
        _write(slot.own, step, tensors)
        slot.place = place
        slot.step = step
        self._exchange(slot)
        slot.held_step = HEADER.unpack_from(slot.held.numpy())[0]
        self.taken += 1

    def _exchange(self, slot: Slot) -> None:
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, slot.own, self.buddy, self.group),
            dist.P2POp(dist.irecv, slot.held, self.partner, self.group)])
        for work in works:
            links.wait(work)

    # ---- a recovery -----------------------------------------------------------------------

    def leave(self) -> None:
        """The group broke: the snapshots' group goes with it (made again in `restore`)."""
        if self.group is not None:
            dist.distributed_c10d._abort_process_group(self.group)
            self.group = None

    def restore(self, joining: bool, source: int) -> Place:
        """Every rank loads its copy of the newest step every rank can (a collective in the new
        group): the survivors their own, each replacement the one its buddy holds for it. The
        place every rank goes on from: the source rank's at that step."""
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
        _read(own, self.state())
        carried = [self._slot(step).place if self.rank == source else None]
        dist.broadcast_object_list(carried, source)
        self.sized = False  # the next snapshot gathers the sizes, the replacement's slots too
        return carried[0]

    def _whole_steps(self) -> dict[str, list[int]]:
        """The steps of this rank's whole own copies, and of its partner's it holds."""
        return {"own": [slot.step for slot in self.slots if slot.step is not None],
                "held": [slot.held_step for slot in self.slots if slot.held_step is not None]}

    def _agreed_step(self, inventories: list[Any]) -> int:
        """The newest step every survivor holds its own copy of, and every replacement's buddy
        (itself a survivor) holds the replacement's copy of."""
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
                "no snapshot step that every rank holds (the first is taken at step "
                f"{self.every}, and a failure during one leaves the one before): the launch "
                "falls back to its newest checkpoint")
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
        return HEADER.size + payload_bytes(self.state())


def _host_bytes(size: int) -> torch.Tensor:
    pinned = torch.accelerator.is_available()  # a device-to-host copy from pinned memory
    return torch.empty(size, dtype=torch.uint8, pin_memory=pinned)


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view(-1).view(torch.uint8)


def _write(buffer: torch.Tensor, step: int, tensors: list[torch.Tensor]) -> None:
    """STEP and TENSORS into BUFFER, with the payload's CRC-32 in the header."""
    offset = HEADER.size
    for tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        buffer[offset:offset + size].copy_(_byte_view(tensor).cpu())
        offset += _room(tensor)
    crc = zlib.crc32(buffer[HEADER.size:].numpy())
    HEADER.pack_into(buffer.numpy(), 0, step, crc)


def _checksum_matches(buffer: torch.Tensor) -> bool:
    _, crc = HEADER.unpack_from(buffer.numpy())
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

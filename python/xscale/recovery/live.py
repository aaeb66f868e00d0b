"""Live recovery as a loop sees it: one object that says whether the step under way counts,
does the kind's work before a batch, and recovers (docs/FAILURES.md, "Live recovery").

Only under the supervisor with spares (it exports XSCALE_RECOVERY, and the rank's link reached
the coordinator). `for_loop` picks the kind of training that serves the loop's model
(xscale.recovery.protocol.Recoverable: DDP's, replicated; FSDP2's and a DeepSpeed engine's with
ZeRO stage 1, 2 or 3, sharded, from peer snapshots) or says why none does; the recovery's steps
are the same for every kind: leave the broken group, tell the coordinator, form the next, hand
the state over, go on from the source's position. A sharded kind's snapshots that cannot serve
end live recovery with one line.
"""

from __future__ import annotations

import time
from typing import Any

from torch import nn

from xscale.dist import DistContext, is_sharded
from xscale.recovery import ddp, zero
from xscale.recovery import link as links
from xscale.recovery.protocol import Place, Recoverable, Recovered
from xscale.recovery.snapshots import SnapshotUnusable
from xscale.shared import settings


class Live:
    """A loop's live recovery: its kind of training and this rank's link."""

    def __init__(self, kind: Recoverable, link: links.Link, redivides: bool) -> None:
        self.kind, self.link = kind, link
        # A smaller world needs a state every rank holds whole, and a loop that deals each
        # step's batch over the ranks left; the script's part comes later (may_shrink).
        self._shrinkable = redivides and kind.state_size().layout == "replicated"
        link.live(shrinks=False)

    def may_shrink(self) -> None:
        """The loop can deal each step's batch over fewer ranks (xscale.Loop, whose script
        steps its optimizer at the loop's boundary; XscaleTrainer, where accelerate deals
        whole batches): with no spare left, this rank can go on in a smaller world, where it
        may train more micro-batches a step than another."""
        if self._shrinkable:
            self._shrinkable = False
            self.link.live(shrinks=True)

    @property
    def broken(self) -> bool:
        """Whether the group broke (this rank's update of the step may have been made)."""
        return self.link.broken.is_set()

    @property
    def step_dropped(self) -> bool:
        return self.kind.step_dropped

    def before_batch(self) -> None:
        self.link.stepping()
        self.kind.before_batch()

    def before_update(self) -> None:
        self.kind.before_update()

    def after_step(self, place: Place) -> float | None:
        return self.kind.after_step(place)

    def recover(self, position: Place) -> Recovered:
        """Leave the broken group, form the next, and go on from the source rank's position,
        which every rank takes (its model is the one every rank now has)."""
        started = time.perf_counter()
        self.kind.leave()
        self.link.left(position.step)
        self.kind.reform()
        formed = time.perf_counter()
        source_position = self._hand_over(position)
        self.link.took_state()
        self.kind.go_on()
        done = time.perf_counter()
        return Recovered(done - started, done - formed, source_position)

    def receive(self) -> Place:
        """A replacement's state and place, from where the kind keeps them."""
        position = self._hand_over(None)
        self.link.took_state()
        return position

    def _hand_over(self, position: Place | None) -> Place:
        try:
            return self.kind.hand_over(position)
        except SnapshotUnusable as error:  # every rank meets it: the others' checks are its
            self.link.cannot_recover(str(error))

    def close(self) -> None:
        """The training is over: a failure from here on ends the launch as before."""
        try:
            self.kind.close()
        except links.GroupBroken:
            pass  # a snapshot's exchange cut short: no recovery will read it
        self.link.close()


def for_loop(ctx: DistContext, model: nn.Module, optimizer: Any,
             redivides: bool = False) -> tuple[Live | None, str | None]:
    """A loop's live recovery when the coordinator is there and a kind serves its model; else
    None, and why not (None as well without the coordinator: nothing to say). REDIVIDES: the
    loop deals each step's global batch over a smaller world (xscale.Loop's sampler), so with
    a replicated state it can go on without a lost node when no spare is left."""
    link = links.link()
    if link is None:
        return None, None
    zero.end_quiet_start()  # the script built its model: a replacement's engine is made
    if zero.is_engine(model):  # the script imported DeepSpeed; the loop is spared the import
        every = settings.value("XSCALE_SNAPSHOT_EVERY")
        why = zero.why_not(model, ctx.nnodes, every)
        kind = None if why else zero.ZeroRecovery(model, link, ctx, every)
    elif is_sharded(model):  # the script imported FSDP: so may the kind (else it is spared)
        from xscale.recovery import fsdp

        every = settings.value("XSCALE_SNAPSHOT_EVERY")
        why = fsdp.why_not(model, optimizer, ctx.nnodes, every)
        kind = None if why else fsdp.FsdpRecovery(model, optimizer, link, ctx, every)
    else:
        why = ddp.why_not(model, optimizer)
        kind = None if why else ddp.DdpRecovery(model, optimizer, link, ctx)
    if kind is None:
        link.not_live(why)
        return None, why
    return Live(kind, link, redivides), None

"""What a kind of training implements to be recovered live, and the position every rank goes on
from (docs/ARCHITECTURE.md, "Live recovery: one interface").

A loop knows only this interface (through xscale.recovery.live): it asks the kind to do its own
collective work before a batch, whether the step under way was dropped, and, after a failure,
to leave the broken group, form the next, and hand over its state. Where a replacement's state
comes from (a survivor's copy, a peer's snapshot, a checkpoint on disk) is the kind's choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol


class Place(Protocol):
    """Where a loop is, as the source rank sends it after a recovery: any picklable record whose
    `step` counts the optimizer steps done (xscale.Loop's Position, XscaleTrainer's
    TrainerPlace, which carries Trainer's own state)."""

    @property
    def step(self) -> int: ...


# A world a run went on in after live recovery changed it (runtime.Shrinks): its first step,
# ranks and nodes (None: the launch's world again), and when it began, in seconds.
WorldChange = tuple[int, int | None, int | None, float]


@dataclass(frozen=True)
class Position:
    """Where a loop is, as the source rank sends it after a recovery: the optimizer steps done
    (the place in the epoch follows from it), the step its log and vote intervals count from,
    its newest checkpoint and its checkpoint interval (auto_every: not yet decided), the
    state dicts of its LR scheduler and GradScaler (None: the loop has none), which the script
    steps with the optimizer: a replacement's start at step 0, a rollback's at the later step;
    and the smaller worlds so far (its summary names them)."""

    step: int
    log_from: int
    saved_step: int | None
    saved_path: str | None
    checkpoint_every: int
    auto_every: bool
    scheduler: dict | None = None
    scaler: dict | None = None
    shrinks: tuple[WorldChange, ...] = ()  # runtime.Shrinks.handed()


class StateSize(NamedTuple):
    """What a rank hands over in a recovery: `replicated` (every rank holds all of it: a
    survivor's copy serves a replacement) or `sharded` (each rank its own part, found nowhere
    else but in a copy: a peer's snapshot, a checkpoint), and its bytes on this rank."""

    layout: str
    bytes: int


class Recovered(NamedTuple):
    """A recovery done: its seconds from leaving the broken group, those of the state's
    hand-over, and the place every rank now goes on from."""

    seconds: float
    handover_s: float
    position: Place


class Recoverable(Protocol):
    """A kind of training that survives a lost rank in its process (xscale.recovery.ddp is the
    first). Every method but `before_batch` runs only after the group broke."""

    def before_batch(self) -> None:
        """The kind's own collectives outside the step, before each micro-batch (DDP's buffer
        broadcast); raises GroupBroken when the group breaks meanwhile."""

    def before_update(self) -> None:
        """The kind's own collectives between the step's last backward and its update, for a
        loop that reads the gradients there (Trainer clips them); raises GroupBroken when the
        group breaks meanwhile. A loop that does not call it gets them in the update's pre-hook."""

    def after_step(self, place: Place) -> float | None:
        """A step was counted, its update made on every rank: the kind's own work at the
        step's end (a sharded kind's peer snapshot, every K steps); the seconds it held the
        step up when it took a snapshot, else None. Raises GroupBroken when the group breaks
        meanwhile."""

    @property
    def step_dropped(self) -> bool:
        """Whether the group broke before this step's update, which was therefore not made: the
        loop does not count the step."""

    def state_size(self) -> StateSize:
        """What this rank would hand over. Its layout decides whether a smaller world can go
        on with it (replicated: every rank left holds all of it; xscale.recovery.live)."""

    def leave(self) -> None:
        """Abort the broken group's work: every collective still waited on ends now."""

    def reform(self) -> None:
        """Form the next group (the link names its store) and move the kind's collectives to
        it."""

    def hand_over(self, position: Place | None) -> Place:
        """The state and place, from where the kind keeps them, to every rank of the new group
        (a collective); None: this rank is a replacement and has none. Returns the place every
        rank goes on from."""

    def go_on(self) -> None:
        """The group is whole again: clear what the broken one left (the dropped step)."""

    def close(self) -> None:
        """The training is over: end what the kind runs in the background (a snapshot's
        exchange) before the process groups go."""

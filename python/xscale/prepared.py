"""The short form: a script keeps its own loop, its epochs and its `optimizer.step()`; one call
gives it xscale's runtime (docs/YOUR-SCRIPT.md, "The short form"):

    model, optimizer, loader = xscale.prepare(model, optimizer, loader, epochs=args.epochs)

Underneath it is an xscale.Loop that the script never calls: the loader it gets back hands out
the Loop's batches (resumed mid-epoch, in the same shuffled order), and the optimizer's step
hook does what `loop.record()` does in the explicit form (the log, the checkpoint cadence, the
stop vote, the straggler watch, the step clock), so steps are the optimizer's own. At the last
step, or after a stop the ranks agreed, the hook saves the last checkpoint and writes the
summary while the process group is still up; the loader then hands out nothing more, on every
rank after the same step.

The script's epoch loop counts nothing that matters: each pass over the loader is the rest of
the run's current epoch (a resumed run's first pass is the rest of the interrupted one, and the
passes after the run's end are empty), so a script that starts its epochs at 0 again after a
requeue, or at its own snapshot's, still trains exactly the steps left.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from xscale import data, lifecycle
from xscale.checkpoints import engine
from xscale.dist import DistContext
from xscale.lifecycle import UserError
from xscale.recovery import link as links
from xscale.runtime import Loop, context, script_name

# A micro-batch handed out since the last optimizer step: (epoch, batch, its samples).
Drawn = tuple[int, Any, int]
SAMPLERS = (DistributedSampler, RandomSampler, SequentialSampler)


def prepare(model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader, *,
            epochs: int | None = None, max_steps: int | None = None,
            scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
            scaler: torch.amp.GradScaler | None = None, output_dir: str | Path | None = None,
            checkpoint_every: int | str = "auto",
            **options: Any) -> tuple[nn.Module, torch.optim.Optimizer, ResumableLoader]:
    """The script's MODEL, OPTIMIZER and LOADER, ready for a run on a supercomputer: the model
    in torch's DistributedDataParallel on the rank's device (unless it is a wrapper already),
    the optimizer with xscale's step hook, and a loader over the same data and batches that
    resumes mid-epoch and ends at an agreed stop. Every rank calls it once, before its first
    step; the newest checkpoint in OUTPUT_DIR is restored here.

    epochs or max_steps: where the run ends (the last checkpoint and the summary are written
    there, while the process group is up). scheduler, scaler: an LR scheduler and a GradScaler,
    saved with the checkpoints; the script steps them as before (a pass is an epoch, or the
    rest of one, so a per-epoch schedule stays in step).
    output_dir: the checkpoints and the summary (default: $OUTPUT_DIR, as the job templates
    set it; none: no checkpoints). checkpoint_every: steps between checkpoints ("auto": Young's
    interval from the first save's cost; 0: only at a stop and at the end). `options`: the
    explicit form's others (xscale.Loop: accumulation, keep_checkpoints, log_every, ...).
    A mistake is one line and exit status 2, before the first step."""
    try:
        return _prepare(model, optimizer, loader, epochs=epochs, max_steps=max_steps,
                        scheduler=scheduler, scaler=scaler, output_dir=output_dir,
                        checkpoint_every=checkpoint_every, **options)
    except UserError as error:
        _exit_with_error(error)


def _prepare(model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader, *,
             scheduler: Any, scaler: torch.amp.GradScaler | None,
             output_dir: str | Path | None,
             **options: Any) -> tuple[nn.Module, torch.optim.Optimizer, ResumableLoader]:
    if options["epochs"] is None and options["max_steps"] is None:
        raise UserError("xscale.prepare needs epochs= or max_steps=: where the run ends is "
                        "where its last checkpoint and its summary are written")
    check_served(model, optimizer)
    ctx = context()
    model = distributed(model, ctx)
    resumable = resumable_loader(loader, ctx)
    if output_dir is None:
        output_dir = os.environ.get("OUTPUT_DIR") or None
    # The script counts its micro-batches itself: a smaller world's share would not be its.
    loop = Loop(ctx, resumable, model=model, optimizer=optimizer, scaler=scaler,
                scheduler=scheduler, output_dir=output_dir, shrinks=False, **options)
    run = PreparedRun(loop, optimizer, scaler)
    return model, optimizer, ResumableLoader(run, resumable)


def _exit_with_error(error: UserError) -> NoReturn:
    """One line, and the process ends with status 2, the group left without waiting."""
    print(lifecycle.error_line(script_name(), str(error)), file=sys.stderr, flush=True)
    lifecycle.exit_cleanly(lifecycle.USAGE_ERROR)


def check_served(model: nn.Module, optimizer: Any) -> None:
    """The objects prepare() can take: a torch module (not another framework's engine) and a
    torch optimizer, whose step hooks count the steps."""
    if engine.is_engine(model):
        kind = type(model)
        raise UserError(f"the model is a {kind.__module__}.{kind.__qualname__}, an engine of its "
                        "own: use xscale.Loop with it (docs/YOUR-SCRIPT.md, DeepSpeed)")
    if not isinstance(model, nn.Module):
        raise UserError(f"the model is a {type(model).__name__}, not a torch.nn.Module")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(f"the optimizer is a {type(optimizer).__name__}, not a "
                        "torch.optim.Optimizer, whose step hooks count the steps")


def distributed(model: nn.Module, ctx: DistContext) -> nn.Module:
    """MODEL on the rank's device, in torch's DDP when more than one rank trains; a wrapper
    already (torch's DDP, or a script's own class around `.module`) is kept as it is. A
    replacement's DDP skips the start-up broadcast: its state comes from the survivors."""
    if isinstance(getattr(model, "module", None), nn.Module):
        return model
    model.to(ctx.device)  # in place: the optimizer's parameters are the same objects
    if ctx.world_size == 1:
        return model
    device_ids = None if ctx.device.type == "cpu" else [ctx.device.index]
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids,
                                               init_sync=not links.joining())


def resumable_loader(loader: DataLoader, ctx: DistContext) -> DataLoader:
    """The same data, batch size, collation and workers as LOADER, over this rank's share with
    a sampler that resumes mid-epoch (xscale.loader's); shuffled where LOADER's was."""
    if not isinstance(loader, DataLoader):
        raise UserError(f"the loader is a {type(loader).__name__}, not a torch DataLoader")
    if isinstance(loader.dataset, IterableDataset):
        raise UserError("the loader reads an IterableDataset, which has no place to resume "
                        "from: give xscale.prepare a map-style dataset")
    sampler = loader.sampler
    if not isinstance(sampler, SAMPLERS) or loader.batch_size is None:
        raise UserError(f"the loader draws with a {type(sampler).__name__}"
                        f"{'' if loader.batch_size else ' and a batch sampler of its own'}; "
                        "xscale.prepare replaces only DistributedSampler, RandomSampler and "
                        "SequentialSampler (use xscale.Loop to keep one's own)")
    shuffle = not isinstance(sampler, SequentialSampler) and getattr(sampler, "shuffle", True)
    resumable = data.ResumableSampler(loader.dataset, ctx.world_size, ctx.rank,
                                      shuffle=shuffle, seed=getattr(sampler, "seed", 0))
    return data.make_loader(loader.dataset, resumable, batch_size=loader.batch_size,
                            workers=loader.num_workers, device=ctx.device, drop_last=True,
                            collate_fn=loader.collate_fn,
                            worker_init_fn=loader.worker_init_fn)


class PreparedRun:
    """The Loop of a prepared script, driven by its loader's passes and its optimizer's steps."""

    def __init__(self, loop: Loop, optimizer: torch.optim.Optimizer,
                 scaler: torch.amp.GradScaler | None) -> None:
        self.loop, self.scaler = loop, scaler
        self.batches = loop.batches()  # one walk over the run's batches, across the passes
        self.held: tuple[int, Any] | None = None  # the next pass's first batch, drawn already
        self.drawn: list[Drawn] = []  # handed out since the last step: a peek hands them again
        self.losses: list[torch.Tensor] = []
        self.ended = False
        optimizer.register_step_post_hook(self._after_step)
        capture_losses(self.losses)

    def one_pass(self) -> Iterator[Any]:
        """The rest of the current epoch: the batches handed out since the last step first (a
        pass left after one batch, as a script's `next(iter(loader))`, used none), then the
        walk's until its epoch changes, the run ends, or a stop was agreed."""
        replay, self.drawn = self.drawn, []
        epoch = replay[0][0] if replay else None
        for drawn in replay:
            self.drawn.append(drawn)
            yield drawn[1]
        while not self.ended:
            drawn_epoch, batch = self.held or self._next()
            self.held = None
            if drawn_epoch is None:
                self._walk_over()
                return
            if epoch is not None and drawn_epoch != epoch:
                self.held = (drawn_epoch, batch)
                return
            epoch = drawn_epoch
            self.drawn.append((drawn_epoch, batch, samples_in(batch, self.loop.batch_size)))
            yield batch

    def _next(self) -> tuple[int | None, Any]:
        return next(self.batches, (None, None))

    def _walk_over(self) -> None:
        """The last batch was drawn but the step hook did not end the run: a GradScaler
        skipped the last optimizer step (the hook never ran). Count it, and end here."""
        if self.drawn and not self.ended:
            self._after_step(None, (), {})
        if not self.ended:
            self.end()

    def _after_step(self, optimizer: torch.optim.Optimizer | None, args: Any,
                    kwargs: Any) -> None:
        """The optimizer stepped: the step's bookkeeping (Loop.stepped) with the losses whose
        backward() ran since the last step, then the end when the run is over."""
        if self.ended:
            return
        drawn, self.drawn = self.drawn, []
        losses = [self._unscaled(loss) for loss in self.losses]
        self.losses.clear()
        if len(losses) != len(drawn):  # not one loss per micro-batch: the last stands for all
            losses = losses[-1:] * len(drawn) if losses else [None] * len(drawn)
        micro = [(loss, samples) for loss, (_, _, samples) in zip(losses, drawn, strict=True)]
        # A step that a GradScaler skipped (inf gradients: no optimizer.step(), no hook) is
        # counted here before this one, without its loss (it overflowed): steps stay batches /
        # accumulation, the data's position.
        size = self.loop.accumulation
        steps = [micro[first:first + size] for first in range(0, max(len(micro), 1), size)]
        for skipped in steps[:-1]:
            self._stepped([(None, samples) for _, samples in skipped])
        self._stepped(steps[-1])

    def _stepped(self, micro: list[tuple[torch.Tensor | None, int]]) -> None:
        if self.ended:
            return
        self.loop.stepped(micro)
        if self.loop.stopped or self.loop.step == self.loop.end_step:
            self.end()

    def _unscaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss as the script computed it: a GradScaler's backward() ran on it scaled. The
        scale as the device holds it: get_scale() would wait for the device at every step."""
        if self.scaler is None or not self.scaler.is_enabled():
            return loss
        scale = self.scaler._get_scale_async()  # the step's: update() comes after the hook
        return loss / (self.scaler.get_scale() if scale is None else scale)

    def end(self) -> None:
        """The last checkpoint and the summary, once, with the group still up."""
        self.ended = True
        capture_losses(None)
        self.loop.finish()
        self.loop.report()


class ResumableLoader:
    """What xscale.prepare returns for the script's DataLoader: each pass is the rest of the
    run's current epoch (module docstring). `len()` is an epoch's batches on this rank; the
    DataLoader's other attributes (dataset, batch_size, sampler) are its own."""

    def __init__(self, run: PreparedRun, loader: DataLoader) -> None:
        self._run, self._loader = run, loader

    def __iter__(self) -> Iterator[Any]:
        return self._run.one_pass()

    def __len__(self) -> int:
        return self._run.loop.per_epoch * self._run.loop.accumulation

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def samples_in(batch: Any, default: int) -> int:
    """The samples in BATCH: the length of its first tensor (a tuple's, a dict's), else the
    loader's batch size."""
    while isinstance(batch, (list, tuple, dict)) and batch:
        batch = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return len(batch) if torch.is_tensor(batch) and batch.dim() > 0 else default


_loss_sink: list[torch.Tensor] | None = None  # where capture_losses keeps them, while training


def capture_losses(sink: list[torch.Tensor] | None) -> None:
    """Keep each scalar whose backward() runs (the loss) in SINK, for the log and the summary:
    the script computes its loss in its own lines, where nothing else sees it. None: keep no
    more (the training is over)."""
    global _loss_sink
    _loss_sink = sink
    original = torch.Tensor.backward
    if sink is None or hasattr(original, "xscale_wrapped"):
        return

    @functools.wraps(original)
    def backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if _loss_sink is not None and self.numel() == 1:
            _loss_sink.append(self.detach())
        return original(self, *args, **kwargs)

    backward.xscale_wrapped = True
    torch.Tensor.backward = backward

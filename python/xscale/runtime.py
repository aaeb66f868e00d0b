"""The trainer runtime: what every trainer does around its own model, data and step.

    ctx = runtime.start(PROG, require_gpu=args.gpu)        # signals, device, backend, group
    loop = runtime.Loop.from_args(ctx, TRAINER, PROG, args, ...)   # from the resumed step
    for epoch, batch in loop.batches(loader, sampler):      # micro-batches, until done or stopped
        ... forward, backward, optimizer step when loop.boundary ...
        loop.record(loss, samples)                          # rates, log, checkpoint, stop vote
    loop.finish()                                           # last checkpoint, stop message
    loop.report(model, **own_fields)                        # XSCALE_RANK and XSCALE_SUMMARY

Hugging Face's Trainer runs its own loop; xscale.hf plugs the same stop vote, summary and
shielded workers into it.

The stop protocol. A stop signal (xscale.lifecycle) only sets a local flag; the ranks vote on it
every `sync_every` steps (and at the last step), in the all_reduce that already reduces the
loss for the log, so stopping costs no collective and no host sync of its own. Every rank counts
the same steps, so all vote at the same step, stop after it, save one checkpoint and exit 0; a
requeued job resumes from it. Slurm's warning comes minutes before the limit (the templates'
`--signal=B:USR1@300`), ample for a few steps more.

One checkpoint cadence for every trainer: every `checkpoint_every` steps when asked (`auto`:
Young's interval from the run's first save, xscale.checkpoint), at the end, and at a stop;
never twice for the same step. The time saves hold training up, the written ones' wait
included, is the summary's `checkpoint_stall_s`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from xscale import (
    checkpoint,
    data,
    flight,
    lifecycle,
    profiling,
    progress,
    runlog,
    startup,
    stragglers,
)
from xscale.dist import DistContext, init_distributed
from xscale.reductions import all_reduce_sums, gather_to_rank0
from xscale.throughput import Throughput

# The summary's `seconds` run from here: the trainer's imports are done, nothing else is.
STARTED = time.perf_counter()
# Hugging Face's Trainer, whose loss log cannot carry the vote, votes on its own every this many
# steps: a few seconds apart on a GPU, well inside Slurm's warning.
STOP_VOTE_EVERY = 10


def start(prog: str, **options: Any) -> DistContext:
    """Catch the stop signals, then join the process group on this rank's device (options:
    xscale.dist.init_distributed's). Signals first: the warning may come during start-up. A
    collective that fails from then on leaves this rank's flight record (xscale.flight)."""
    startup.mark("imports")  # the trainer's first call: everything it imports is imported
    lifecycle.install_stop_handlers()
    lifecycle.on_failure(flight.record_failure)
    ctx = init_distributed(**options)
    startup.mark("group")
    return ctx


def first_step_done(device: torch.device) -> None:
    """The start-up's last moment (xscale.startup). GPU work is asynchronous: the step is done
    when the device has done it, hence one synchronisation, once per run."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
    startup.mark("first_step")


def vote(reduce: Callable[..., dict[str, Any]] | None = None,
         watch: stragglers.StragglerWatch | None = None,
         **shared: float) -> tuple[bool, dict[str, Any]]:
    """Whether any rank received a stop signal, and SHARED summed over the ranks: a collective,
    all ranks at the same step. `reduce(stop=flag, ...)` sums the flag over ranks along with
    other sums (TrainLog.flush); by default it is one all_reduce. The straggler watch's vector
    travels in the same one."""
    extra: dict[str, Any] = {"stop": 0.0 if lifecycle.stop_received() is None else 1.0, **shared}
    if watch is not None:
        extra["work"] = watch.contribution()
    sums = all_reduce_sums(extra) if reduce is None else reduce(**extra)
    if watch is not None:
        watch.observe(sums["work"])
    return sums["stop"] > 0, {name: sums[name] for name in shared}


def stop_message(prog: str, step: int, saved: object | None) -> str:
    """The line rank 0 prints after a stop (it may not have received the signal itself)."""
    name = lifecycle.signal_name(lifecycle.stop_received()) or "a signal to another rank"
    where = saved if saved is not None else "none (no output directory)"
    return f"{prog}: stopped by {name} at step {step}; checkpoint {where}"


class Loop:
    """This rank's training loop bookkeeping, from `start_step` to `end_step` (None: unbounded).

    save(step, epoch) writes a checkpoint (a collective where the trainer's checkpoint is) and
    returns where; None when the run has no output directory. A save that writes in the
    background also has wait() and last_write_s (xscale.checkpoint.TrainingSaver). With `model`,
    its own work per step is watched for a straggler (xscale.stragglers). The whole summary goes
    into `output_dir` (xscale.runlog.SUMMARY_FILE).
    """

    def __init__(self, ctx: DistContext, trainer: str, prog: str, *, start_step: int,
                 end_step: int | None, per_epoch: int, sync_every: int,
                 save: Callable[[int, int], Path] | None, checkpoint_every: int | str = 0,
                 resumed: bool = False, accumulation: int = 1, batch_size: int,
                 tensorboard_dir: Path | None = None, warmup_steps: int = 1,
                 model: nn.Module | None = None, output_dir: Path | None = None) -> None:
        self.ctx, self.trainer, self.prog = ctx, trainer, prog
        self.output_dir = output_dir
        self.started = STARTED
        self.start_step = self.step = start_step
        self.end_step, self.per_epoch = end_step, per_epoch
        self.epoch = start_step // per_epoch
        self.save_fn = save
        self.auto_every = checkpoint_every == "auto"
        self.checkpoint_every = 0 if self.auto_every else int(checkpoint_every)
        checkpoint.checkpoint_mode()  # a bad setting stops the run before its first step
        checkpoint.checkpoint_writers()
        self.node_mtbf_h = checkpoint.node_mtbf_hours()
        self.stall_s, self.saves = 0.0, 0
        self._first_step_at: float | None = None
        self.accumulation, self.batch_size = accumulation, batch_size
        self.saved_step = start_step if resumed else None
        self.saved_path: Path | None = None
        self.stopped = False
        self._micro = 0  # micro-batches of the optimizer step under way
        self._voted_at: int | None = None
        self.meter = Throughput(ctx.device, warmup_steps=warmup_steps)
        self.log = runlog.TrainLog(is_main=ctx.is_main, start_step=start_step,
                                   total_steps=end_step, log_every=sync_every,
                                   tensorboard_dir=tensorboard_dir, desc=trainer)
        self.window = profiling.window_from_env(ctx.rank, ctx.device)
        self.stragglers = None if model is None else stragglers.watch(
            model, ctx.device, ctx.rank, ctx.world_size, say=self.log.message)
        self.progress = progress.Progress(ctx.is_main)

    @classmethod
    def from_args(cls, ctx: DistContext, trainer: str, prog: str, args: argparse.Namespace, *,
                  resumed: int | None, per_epoch: int, batch_size: int,
                  save: Callable[[int, int], Path] | None, model: nn.Module,
                  accumulation: int | None = None, warmup_steps: int | None = 1) -> Loop:
        """The loop of a trainer with xscale's common command line: --max-steps and --epochs
        (the end step), --log-every (the vote and the log), --checkpoint-every, --output-dir
        (the summary; TensorBoard in OUTPUT_DIR/tb unless --logging-dir), --grad-accum-steps
        (unless the trainer's config decides: `accumulation`). `resumed`: the step the run
        resumed from, None for a fresh start. `warmup_steps` None: a tenth of the run, 1 to 5
        steps (the rate of a short benchmark run starts after its kernel search)."""
        end_step = data.last_step(per_epoch, args.epochs, args.max_steps)
        if warmup_steps is None:
            warmup_steps = min(5, max(1, (end_step or 10) // 10))
        return cls(ctx, trainer, prog, start_step=resumed or 0, resumed=resumed is not None,
                   end_step=end_step, per_epoch=per_epoch, sync_every=args.log_every,
                   batch_size=batch_size,
                   accumulation=args.grad_accum_steps if accumulation is None else accumulation,
                   checkpoint_every=args.checkpoint_every, save=save,
                   tensorboard_dir=args.logging_dir or (args.output_dir and args.output_dir / "tb"),
                   warmup_steps=warmup_steps, model=model, output_dir=args.output_dir)

    # ---- the loop -------------------------------------------------------------------------

    def batches(self, loader: DataLoader, sampler: data.ResumableSampler,
                epochs: int | None = None) -> Iterator[tuple[int, Any]]:
        """(epoch, micro-batch) from the resumed position until the end step or a stop."""
        self.meter.start()
        batches = data.train_batches(loader, sampler, start_step=self.start_step, epochs=epochs,
                                     max_steps=self.end_step, accumulation=self.accumulation)
        while True:
            waited = time.perf_counter()
            try:
                step_index, epoch, batch = next(batches)
            except StopIteration:
                return
            if self.stragglers is not None:  # the wait for a batch is this rank's own work
                self.stragglers.clock.add_wait(time.perf_counter() - waited)
            self.window.step(step_index)
            self.epoch = epoch
            yield epoch, batch
            if self.stopped:
                return

    @property
    def boundary(self) -> bool:
        """Whether the micro-batch under way completes an optimizer step."""
        return self._micro + 1 == self.accumulation

    def sync_gradients(self, model: nn.Module) -> AbstractContextManager:
        """DDP's no_sync() on every micro-batch but the last of a step: one all-reduce per
        optimizer step, not one per micro-batch."""
        if self.boundary or not hasattr(model, "no_sync"):
            return nullcontext()
        return model.no_sync()

    def record(self, loss: torch.Tensor, samples: int, tokens: int = 0) -> None:
        """After each micro-batch: the loss and rates, then at a step's end the checkpoint
        cadence and the stop vote."""
        self.log.add(self.step, loss, samples)
        self._micro += 1
        if self._micro < self.accumulation:
            return
        self._micro = 0
        self.step += 1
        if self.stragglers is not None:
            self.stragglers.step()
        self.meter.step(samples * self.accumulation, tokens)
        if self.step == self.start_step + 1:
            first_step_done(self.ctx.device)
            self.progress.note("first_step", self.step)
            self._first_step_at = time.perf_counter()
        self.log.advance()
        if self.checkpoint_every and self.step % self.checkpoint_every == 0:
            self._save()
        if self.log.due(self.step) or self.step == self.end_step:
            self._vote()

    @property
    def epoch_ended(self) -> bool:
        """The step just recorded closed an epoch that is not the run's last (evaluate now)."""
        return (not self.stopped and self._micro == 0 and self.step % self.per_epoch == 0
                and self.step != self.end_step)

    def _vote(self) -> None:
        self._voted_at = self.step
        stop, shared = vote(self.log.flush, self.stragglers, **self._propose_interval())
        if "every" in shared:  # rank 0's proposal; the others added 0
            self.checkpoint_every, self.auto_every = int(shared["every"]), False
        if stop:
            self.stopped = True
        self.progress.note("interval", self.step)

    def _propose_interval(self) -> dict[str, float]:
        """With --checkpoint-every auto, at the first vote after a timed step: a save now, and
        rank 0's interval from what it cost (checkpoint.auto_interval), which the vote's
        all-reduce hands to every rank."""
        timed_steps = self.step - self.start_step - 1
        if not self.auto_every or self.save_fn is None or timed_steps < 1 \
                or self._first_step_at is None:
            return {}
        step_s = (time.perf_counter() - self._first_step_at) / timed_steps
        stall_s = self._save()
        self._wait_for_writes()
        if not self.ctx.is_main:
            return {"every": 0.0}
        write_s = getattr(self.save_fn, "last_write_s", 0.0)
        every, line = checkpoint.auto_decision("--checkpoint-every", stall_s, write_s, step_s,
                                               self.ctx.nnodes, self.node_mtbf_h)
        self.log.message(line)
        return {"every": float(every)}

    def _save(self) -> float:
        """The checkpoint of this step, once; how long it held training up (0 if none) goes to
        the progress notes (a collective save: every rank waits as long as the slowest)."""
        if self.save_fn is None or self.saved_step == self.step:
            return 0.0
        started = time.perf_counter()
        self.saved_path = self.save_fn(self.step, self.epoch)
        self.saved_step = self.step
        stall_s = time.perf_counter() - started
        self.stall_s += stall_s
        self.saves += 1
        self.progress.note("checkpoint", self.step, stall_s=stall_s)
        return stall_s

    def _wait_for_writes(self) -> None:
        """Until the background write is published; the wait is a stall too (and goes to the
        progress notes as one, for the goodput ledger)."""
        wait = getattr(self.save_fn, "wait", None)
        if wait is not None:
            started = time.perf_counter()
            wait()
            waited = time.perf_counter() - started
            self.stall_s += waited
            self.progress.note("checkpoint", self.step, stall_s=waited)

    # ---- the end --------------------------------------------------------------------------

    def finish(self) -> None:
        """Stop the clocks, take the last vote if the last step had none, save the last
        checkpoint, and say so on rank 0 after a stop."""
        self.meter.stop()
        self.window.close()
        if self._voted_at != self.step:
            self._vote()
        self.log.close()
        self._save()
        self._wait_for_writes()
        self.progress.note("end", self.step)
        if self.stopped and self.ctx.is_main:
            print(stop_message(self.prog, self.step, self.saved_path), flush=True)

    def report(self, model: nn.Module, **own: Any) -> None:
        """XSCALE_RANK on every rank, XSCALE_SUMMARY on rank 0 (the rates are reduced: every
        rank calls this)."""
        write_summary(self.ctx, model, trainer=self.trainer, started=self.started,
                      start_step=self.start_step, steps=self.step, meter=self.meter,
                      loss_first=self.log.loss_first, loss_last=self.log.loss_last,
                      stopped=self.stopped, checkpoint=self.saved_path,
                      batch_size=self.batch_size, accumulation=self.accumulation,
                      counts_tokens=False, stragglers=self.stragglers,
                      checkpoint_stall_s=self.stall_s, checkpoints_saved=self.saves,
                      output_dir=self.output_dir, **own)


def write_summary(ctx: DistContext, model: nn.Module, *, trainer: str, started: float,
                  start_step: int, steps: int, meter: Throughput,
                  loss_first: float | None, loss_last: float | None, stopped: bool,
                  checkpoint: object | None, batch_size: int, accumulation: int,
                  counts_tokens: bool, stragglers: stragglers.StragglerWatch | None = None,
                  checkpoint_stall_s: float = 0.0, checkpoints_saved: int = 0,
                  output_dir: str | Path | None = None, **own: Any) -> None:
    """The one place XSCALE_RANK and XSCALE_SUMMARY are written, for every trainer; the whole
    summary also into OUTPUT_DIR/xscale-summary.json (xscale.runlog)."""
    rates = meter.reduced()
    node, phases = runlog.node_name(), startup.rank_phases()
    runlog.rank_record(rank=ctx.rank, local_rank=ctx.local_rank, node=node, steps=steps,
                       param_digest=runlog.param_digest(model), startup=phases)
    # Once per run, at its end: rank 0 needs every rank's phases for the slowest one's node.
    every_rank = gather_to_rank0((ctx.rank, node, phases))
    if not ctx.is_main:
        return
    started_up = startup.aggregate(startup.RankPhases(*record) for record in every_rank)
    print_startup(started_up, len(every_rank))
    common = {
        "trainer": trainer, "world_size": ctx.world_size, "nodes": ctx.nnodes,
        "device": ctx.device.type, "backend": ctx.backend,
        "start_step": start_step, "steps": steps, "batch_size": batch_size,
        "global_batch_size": batch_size * accumulation * ctx.world_size,
        "accumulation": accumulation,
        "samples_per_s": round(rates["samples_per_s"], 3),
        "samples_per_s_per_rank": round(rates["samples_per_s_per_rank"], 3),
        "tokens_per_s": round(rates["tokens_per_s"], 3) if counts_tokens else None,
        "loss_first": significant(loss_first), "loss_last": significant(loss_last),
        "seconds": round(time.perf_counter() - started, 3),
        "train_seconds": round(meter.local().seconds, 3),
        "stopped_early": stopped,
        "signal": lifecycle.signal_name(lifecycle.stop_received()),
        "checkpoint": checkpoint,
        "checkpoint_stall_s": round(checkpoint_stall_s, 3),
        "checkpoints_saved": checkpoints_saved,
        "startup": started_up,
        "straggler": None if stragglers is None else stragglers.summary(),
        "summary_file": runlog.summary_path(output_dir),
    }
    own = {name: significant(value) if isinstance(value, float) else value
           for name, value in own.items()}
    runlog.emit_summary(runlog.summary_record(common, own))


def significant(value: float | None, digits: int = 6) -> float | None:
    """VALUE to DIGITS significant digits: a loss or an accuracy needs no more, and the summary
    line has no bytes to spare for float noise."""
    return None if value is None else float(f"{value:.{digits}g}")


def print_startup(phases: dict[str, dict], ranks: int) -> None:
    """Rank 0's table of the start-up phases, before the summary line (which stays last)."""
    sys.stderr.flush()
    heading = f"xscale: start-up phases over {ranks} ranks (docs/STARTUP.md)"
    print("\n".join([heading, *startup.table(phases)]), flush=True)

"""The training loop's runtime: what every training script does around its own model, data
and step. Its public names are re-exported by `xscale` (docs/YOUR-SCRIPT.md):

    ctx = xscale.start()                                    # signals, device, backend, group
    loader = xscale.loader(dataset, ctx, batch_size=32)     # resumable, shielded workers
    loop = xscale.Loop(ctx, loader, model=model, optimizer=optimizer, epochs=3,
                       output_dir=out)                      # resumes from the newest checkpoint
    for epoch, batch in loop.batches():                     # until the end or a stop
        ... forward, backward, optimizer step ...
        loop.record(loss, samples)                          # rates, log, checkpoint, stop vote
    loop.finish()                                           # last checkpoint, stop message
    loop.report(**own_fields)                               # XSCALE_RANK and XSCALE_SUMMARY

Hugging Face's Trainer runs its own loop; xscale.hf plugs the same tally (RunTally) into it.

The stop protocol. A stop signal (xscale.lifecycle) only sets a local flag; the ranks vote on it
every `log_every` steps (and at the last step), in the all_reduce that already reduces the
loss for the log, so stopping costs no collective and no host sync of its own. Every rank counts
the same steps, so all vote at the same step, stop after it, save one checkpoint and exit 0; a
requeued job resumes from it. Slurm's warning comes minutes before the limit (the templates'
`--signal=B:USR1@300`), ample for a few steps more.

One checkpoint cadence for every trainer: every `checkpoint_every` steps when asked (`auto`:
Young's interval from the run's first save, xscale.checkpoints), at the end, and at a stop;
never twice for the same step. The time saves hold training up, the written ones' wait
included, is the summary's `checkpoint_stall_s`.
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from xscale import data, lifecycle
from xscale.checkpoints import cadence, contents, engine, savers
from xscale.dist import DistContext, init_distributed, read_placement
from xscale.lifecycle import UserError
from xscale.observe import (
    flight,
    flops,
    peaks,
    profile_window,
    progress,
    runlog,
    startup,
    steptime,
    stragglers,
)
from xscale.observe.throughput import Throughput
from xscale.recovery import ddp as ddp_recovery
from xscale.recovery import live
from xscale.recovery import zero as zero_recovery
from xscale.recovery.link import GroupBroken
from xscale.recovery.protocol import Position, WorldChange
from xscale.reductions import all_reduce_sums, gather_to_rank0
from xscale.shared import contract, settings

# The summary's `seconds` run from here: the trainer's imports are done, nothing else is.
STARTED = time.perf_counter()
# Hugging Face's Trainer, whose loss log cannot carry the vote, votes on its own every this many
# steps: a few seconds apart on a GPU, well inside Slurm's warning.
STOP_VOTE_EVERY = 10


def start(*, backend: str | None = None, init_method: str | None = None,
          require_gpu: bool = False, **placement: Any) -> DistContext:
    """Join the process group on this rank's device; every rank calls it once, first.

    Before that it catches Slurm's stop signals (the warning may come during start-up) and
    checks the XSCALE_* settings; afterwards a collective that fails leaves this rank's flight
    record for the supervisor (xscale.observe.flight). `backend`: nccl, gloo, xccl... (default:
    the device's, or XSCALE_BACKEND); `init_method`: pytorch/examples' --dist-url (default:
    MASTER_ADDR/MASTER_PORT from run.sh); `require_gpu`: fail in one line on a rank without
    one. `placement`: rank, world_size, gpu, as pytorch/examples' --rank, --world-size, --gpu.
    The returned context has the rank's place, device and backend (xscale.Context).
    """
    startup.mark("imports")  # the script's first call: everything it imports is imported
    catch_stop_signals()
    lifecycle.on_failure(flight.record_failure)
    ctx = init_distributed(backend=backend, init_method=init_method, require_gpu=require_gpu,
                           **placement)
    ddp_recovery.prepare_replacement()  # before the script builds its DDP model
    zero_recovery.prepare_replacement()  # or its DeepSpeed engine
    warn_misspelled_settings(ctx.is_main)
    startup.mark("group")
    global _started
    _started = ctx
    return ctx


_started: DistContext | None = None  # start()'s context, which xscale.prepare takes


def context() -> DistContext:
    """The run's context for xscale.prepare: start()'s; for a script that joined its process
    group itself, that group's backend and the rank's current device (with start()'s signal
    handlers and settings check, from now on); start() itself for a script that has none."""
    if _started is not None:
        return _started
    if not dist.is_initialized():
        return start()
    catch_stop_signals()
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    device = torch.device("cpu") if accelerator is None else \
        torch.device(accelerator.type, torch.accelerator.current_device_index())
    ctx = joined(device)
    warn_misspelled_settings(ctx.is_main)
    return ctx


def joined(device: torch.device) -> DistContext:
    """This rank's context in a process group that the script or its framework joined (its own
    init_process_group; Hugging Face's Trainer, whose arguments join it): the start-up's
    `imports` and `group` moments (xscale.observe.startup) end here, and from here a failed
    collective leaves its flight record, as after start()."""
    startup.mark("imports")  # for a script whose first xscale call this is
    startup.mark("group")
    lifecycle.on_failure(flight.record_failure)
    backend = dist.get_backend() if dist.is_initialized() else None
    return DistContext.at(read_placement(), device, backend)


def catch_stop_signals() -> None:
    """Catch Slurm's warning (SIGUSR1) and SIGTERM from now on: they set a flag that the next
    stop vote reads (Loop, stop_agreed, XscaleTrainer), instead of ending the process. Call it
    first thing when the script loads a model for minutes before xscale.start(),
    xscale.prepare() or XscaleTrainer would catch them (each does). Under the spawn start
    method it also starts multiprocessing's resource tracker shielded, before something starts
    it unshielded: the warning would kill it, and every rank would report leaked resources."""
    lifecycle.install_stop_handlers()
    if multiprocessing.get_start_method(allow_none=True) == "spawn":
        lifecycle.shield_resource_tracker()


def warn_misspelled_settings(is_main: bool) -> None:
    """One line on rank 0 for each XSCALE_* variable that is no setting (a typo: the run would
    go on without what was asked for), naming the setting it is close to."""
    if is_main:
        for line in settings.misspelled(os.environ):
            print(line, file=sys.stderr, flush=True)


def first_step_done(device: torch.device) -> None:
    """The start-up's last moment (xscale.observe.startup). GPU work is asynchronous: the step is
    done when the device has done it, hence one synchronisation, once per run."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
    startup.mark("first_step")


class Proposal(NamedTuple):
    """A checkpoint interval put to a vote (auto): rank 0's in steps, 0 from the other ranks
    (the all-reduce hands rank 0's to all), and 0 from a rank 0 that has timed no step yet."""

    every: float


class Vote(NamedTuple):
    """What the ranks agreed at a vote: whether to stop, and the checkpoint interval when one
    was proposed and decided (None: none)."""

    stop: bool
    every: int | None


def vote(reduce: Callable[..., dict[str, Any]] | None = None,
         watch: stragglers.StragglerWatch | None = None,
         proposal: Proposal | None = None) -> Vote:
    """Whether any rank received a stop signal, and the interval PROPOSAL agreed: a collective,
    all ranks at the same step, each with a proposal or none alike (the sizes must match).
    `reduce(stop=flag, ...)` sums the flag over ranks along with other sums (TrainLog.flush); by
    default it is one all_reduce. The straggler watch's vector travels in the same one."""
    shared: dict[str, Any] = {"stop": 0.0 if lifecycle.stop_received() is None else 1.0}
    if proposal is not None:
        shared["every"] = proposal.every
    if watch is not None:
        shared["work"] = watch.contribution()
    sums = all_reduce_sums(shared) if reduce is None else reduce(**shared)
    if watch is not None:
        watch.observe(sums["work"])
    return Vote(stop=sums["stop"] > 0, every=int(sums["every"]) if sums.get("every") else None)


def stop_agreed() -> bool:
    """Whether any rank received Slurm's warning (SIGUSR1) or SIGTERM: a collective, so every
    rank calls it at the same step, and every rank gets the same answer. The piece to take
    alone when a script only wants to save and stop before the time limit:

        if step % 10 == 0 and xscale.stop_agreed():
            save_my_checkpoint(); break

    xscale.start() (or xscale.catch_stop_signals()) must have caught the signals first."""
    return vote().stop


def stop_message(prog: str, step: int, saved: object | None) -> str:
    """The line rank 0 prints after a stop (it may not have received the signal itself)."""
    name = lifecycle.signal_name(lifecycle.stop_received()) or "a signal to another rank"
    where = saved if saved is not None else "none (no output directory)"
    return f"{prog}: stopped by {name} at step {step}; checkpoint {where}"


def script_name() -> str:
    """The running script's file name (`train.py`), the name of its run in messages."""
    return Path(sys.argv[0]).name or "python"


def default_run_name() -> str:
    """The run's name in its summary unless the script gives one: its file name without .py."""
    return Path(script_name()).stem


class Shrinks:
    """Each smaller world a run went on in after live recovery found no spare (Loop's and
    XscaleTrainer's), and where it grew back to the launch's, for the summary."""

    def __init__(self) -> None:
        self._worlds: list[WorldChange] = []  # since: time.perf_counter()

    def went_on(self, step: int, world_size: int, nodes: int) -> None:
        self._worlds.append((step, world_size, nodes, time.perf_counter()))

    def handed(self) -> tuple[WorldChange, ...]:
        """Each smaller world so far, as a position hands it to another process: its step,
        ranks, nodes, and how many seconds ago it began (clocks are not shared)."""
        now = time.perf_counter()
        return tuple((step, world_size, nodes, now - since)
                     for step, world_size, nodes, since in self._worlds)

    def take(self, handed: tuple[WorldChange, ...], step: int, whole: bool) -> None:
        """Go on, at STEP, with the source rank's worlds (handed): a rank started again after a
        shrink has none of its own, and its summary (rank 0's) must say when the run shrank.
        WHOLE: this rank's world is the launch's now. The source hands its worlds as they were
        before the recovery, so a smaller one still going on there ends at STEP: the lost
        nodes' ranks came back (docs/FAILURES.md, "Growing back"), the survivors and the ranks
        that join alike."""
        now = time.perf_counter()
        self._worlds = [(at, world_size, nodes, now - ago)
                        for at, world_size, nodes, ago in handed]
        if whole and self._worlds and self._worlds[-1][1] is not None:
            self._worlds.append((step, None, None, now))

    def done(self) -> list[dict[str, Any]] | None:
        """Each smaller world: from which step, until which (None: the end), its ranks and
        nodes, and the seconds it trained so; None: the run never shrank."""
        if not self._worlds:
            return None
        ends = [(step, since) for step, _, _, since in self._worlds[1:]] + [
            (None, time.perf_counter())]
        return [{"step": step, "until": until, "world_size": world_size, "nodes": nodes,
                 "seconds": round(end - since, 3)}
                for (step, world_size, nodes, since), (until, end)
                in zip(self._worlds, ends, strict=True) if world_size is not None]


def went_smaller(prog: str, world_size: int, nodes: int, global_batch: int,
                 micro_batches: int) -> str:
    """Rank 0's line when the world shrank: MICRO_BATCHES is its share of a step's."""
    return (f"{prog}: no spare node was left: training goes on as {world_size} ranks on "
            f"{nodes} node{'s' if nodes != 1 else ''}, each step's {global_batch} samples dealt "
            f"over them ({micro_batches} micro-batches on rank 0)")


def grew_back(prog: str, world_size: int, nodes: int, step: int) -> str:
    """Rank 0's line when the lost nodes' ranks came back: the launch's world again."""
    return (f"{prog}: the lost ranks are back: training goes on as the launch's {world_size} "
            f"ranks on {nodes} nodes from step {step}, each rank on its own part of each step")


class RunTally:
    """What a run tallies as it trains, whichever loop drives it (Loop, or Hugging Face's Trainer
    through xscale.hf): its first step (the end of the start-up), its log intervals, the time
    each checkpoint held training up, and its end; rank 0 notes each as progress for the step
    supervisor's goodput ledger (xscale.observe.progress). With `checkpoint_every` auto it also
    times the steps for Young's interval (auto_interval). Its `clock` splits the steps after
    `warmup_steps` into data, compute, communication and checkpoints (xscale.observe.steptime): the
    loop books its batch waits there and calls step() after each optimizer step."""

    def __init__(self, ctx: DistContext, warmup_steps: int = 1) -> None:
        self.ctx = ctx
        self.clock = steptime.StepClock(warmup_steps, ctx.world_size, ctx.device)
        self.flops = flops.FlopWindow()  # the first step's FLOPs, for the MFU
        self.node_mtbf_h = cadence.node_mtbf_hours()  # a bad setting stops the run first
        settings.value(peaks.PEAK_VARIABLE)  # and so does a bad peak, read at the end
        self.progress = progress.Progress(ctx.is_main)
        self.stall_s, self.saves, self.last_stall_s = 0.0, 0, 0.0
        self._first: tuple[int, float] | None = None  # (step, when): steps after it are timed
        self._snapshot_times: dict[int, float] = {}  # a snapshot's step: when it was taken

    def first_step(self, step: int) -> None:
        first_step_done(self.ctx.device)
        self.progress.note(contract.FIRST_STEP, step)
        self._first = (step, time.perf_counter())

    def interval(self, step: int) -> None:
        self.progress.note(contract.INTERVAL, step)

    def saved(self, step: int, stall_s: float) -> None:
        """A save held training up `stall_s` (the cost Young's interval is decided from)."""
        self.saves += 1
        self.last_stall_s = stall_s
        self.waited(step, stall_s)

    def waited(self, step: int, stall_s: float) -> None:
        """Training waited `stall_s` for a checkpoint (a save, or a background write)."""
        self.stall_s += stall_s
        self.clock.waited_for_checkpoint(stall_s)
        self.progress.note(contract.CHECKPOINT, step, stall_s=stall_s)

    def snapshot(self, step: int, stall_s: float) -> None:
        """A peer snapshot of STEP held training up `stall_s` (the step-time clock books it
        with the checkpoints: both copy the state)."""
        self.clock.waited_for_checkpoint(stall_s)
        self._snapshot_times[step] = time.time()
        for older in sorted(self._snapshot_times)[:-2]:  # two are kept (snapshots.Slot)
            del self._snapshot_times[older]
        self.progress.note(contract.SNAPSHOT, step, stall_s=stall_s)

    def rolled_back(self, step: int, redone: int, left_at: float) -> None:
        """A live recovery went on from the snapshot of STEP, REDONE steps before where this
        rank left the broken group at `left_at` (time.time()): their seconds are lost work,
        where this rank took that snapshot itself (not in a replacement)."""
        taken = self._snapshot_times.get(step)
        fields = {} if taken is None else {"redone_s": max(left_at - taken, 0.0)}
        self.progress.note(contract.ROLLED_BACK, step, redone=redone, **fields)

    def end(self, step: int, stopped: bool) -> None:
        """Training is over, at STEP; STOPPED: at a stop signal (the supervisor requeues the
        job), else at its end (a warning that came as it ended needs no requeue)."""
        self.progress.note(contract.END, step, stopped=stopped)

    def seconds_per_step(self, step: int) -> float | None:
        """The mean time of the steps since the first (its warm-up left out); None before."""
        if self._first is None or step <= self._first[0]:
            return None
        first_step, first_end = self._first
        return (time.perf_counter() - first_end) / (step - first_step)

    def auto_interval(self, option: str, step_s: float | None,
                      write_s: float = 0.0) -> Proposal:
        """Rank 0's interval from the last save's cost, as the vote's share (the other ranks
        add 0, the all-reduce hands rank 0's to all); the decision is printed on rank 0. A rank
        0 that has timed no step yet (a replacement) adds 0 too: no decision at this vote."""
        if not self.ctx.is_main or step_s is None:
            return Proposal(0.0)
        every, line = cadence.auto_decision(option, self.last_stall_s, write_s, step_s,
                                               self.ctx.nnodes, self.node_mtbf_h)
        print(line, flush=True)
        return Proposal(float(every))


def _saver_and_resume(ctx: DistContext, model: nn.Module, optimizer: Any, scaler: Any,
                      scheduler: Any, config: LoopConfig,
                      resume: bool) -> tuple[savers.Saver | None, int | None]:
    """How the loop saves, and the step restored from the newest checkpoint (None: a fresh
    start): the script's own `save=` and `resumed_step`, else a DeepSpeed engine's own
    checkpointing (xscale.checkpoints.engine), else xscale.checkpoints.savers' with the
    optimizer."""
    if config.save is not None:
        return savers.ForegroundSaver(config.save), config.resumed_step
    output_dir = config.output_dir
    if output_dir is None:
        return None, None
    if engine.is_engine(model):
        return (engine.saver(model, output_dir, config.keep_checkpoints),
                engine.resume(model, output_dir, ctx.rank, resume))
    if optimizer is None:
        return None, None
    resumed = contents.resume_training(output_dir, model, optimizer, scaler, rank=ctx.rank,
                                       enabled=resume, scheduler=scheduler)
    save = savers.training_saver(output_dir, model, optimizer, scaler, is_main=ctx.is_main,
                                 keep=config.keep_checkpoints, scheduler=scheduler,
                                 **(config.checkpoint_fields or {}))
    return save, resumed


@contextmanager
def _without_gradient_sync(model: nn.Module) -> Iterator[None]:
    """FSDP2's no_sync: the micro-batch's gradients stay unsharded and accumulate, with no
    reduce-scatter, until the step's last micro-batch."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


@dataclass(frozen=True)
class LoopConfig:
    """xscale.Loop's options, each with its default (Loop's docstring says what each does)."""

    output_dir: Path | None = None
    epochs: int | None = None
    max_steps: int | None = None
    accumulation: int = 1
    checkpoint_every: int | str = 0
    keep_checkpoints: int = 3
    resume: bool = True
    log_every: int = 10
    tensorboard_dir: Path | None = None
    warmup_steps: int | None = 1
    name: str | None = None
    checkpoint_fields: dict[str, Any] | None = None
    save: Callable[[int, int], Any] | None = None
    resumed_step: int | None = None
    shrinks: bool = True


class Loop:
    """The bookkeeping of a training loop over `loader` (made by xscale.loader): where it
    resumes, when it logs, votes on a stop and saves, what it reports.

    model: the module trained (DDP-wrapped or not), or a DeepSpeed engine; its own work per
    step is watched for a straggler (xscale.observe.stragglers). The options (LoopConfig): with
    `output_dir` and an `optimizer` (or an engine), the loop resumes from the newest checkpoint
    there (unless resume=False) and saves one every `checkpoint_every` steps (0: only at the
    end and at a stop; "auto": Young's interval from the first save's cost), keeping the newest
    `keep_checkpoints`; the summary goes there too (xscale-summary.json). epochs, max_steps:
    where training ends (both: whichever comes first; neither: never). accumulation:
    micro-batches per optimizer step. log_every: steps between the loss log and the stop vote.
    tensorboard_dir: the loss curve (default OUTPUT_DIR/tb). warmup_steps: the first steps left
    out of the rates (None: a tenth of the run, 1 to 5, for a short benchmark run whose first
    steps search kernels). name: the run's name in the summary (default: the script's file name
    without .py). checkpoint_fields: more entries for each checkpoint file. scaler,
    scheduler: a GradScaler and an LR scheduler, saved and restored with the checkpoints.
    A script with checkpoints of its own passes `save(step, epoch)`, called at the cadence
    above (returning where it saved), and `resumed_step`, the step it restored. shrinks: with
    live recovery and no spare left, the ranks left go on without a lost node, each step's
    global batch dealt over them (more micro-batches per rank: the script steps its optimizer
    at `loop.boundary`); False for a script that counts its micro-batches itself.
    """

    def __init__(self, ctx: DistContext, loader: DataLoader, *, model: nn.Module,
                 optimizer: torch.optim.Optimizer | None = None,
                 scaler: torch.amp.GradScaler | None = None, scheduler: Any = None,
                 **options: Any) -> None:
        config = LoopConfig(**options)
        self.ctx, self.model, self.loader = ctx, model, loader
        self.prog = script_name()
        self.trainer = config.name or default_run_name()
        self.output_dir = None if config.output_dir is None else Path(config.output_dir)
        config = replace(config, output_dir=self.output_dir)
        self.sampler = _resumable_sampler(loader)
        self.accumulation, self.batch_size = config.accumulation, loader.batch_size or 1
        self.per_epoch = data.steps_per_epoch(self.sampler, self.batch_size, self.accumulation)
        self.epochs = config.epochs
        self.end_step = data.last_step(self.per_epoch, config.epochs, config.max_steps)
        self.auto_every = config.checkpoint_every == "auto"
        self.checkpoint_every = 0 if self.auto_every else int(config.checkpoint_every)
        savers.checkpoint_mode()  # a bad setting stops the run before its first step
        writers = savers.checkpoint_writers()
        if savers.writers_for(model) != writers and self.output_dir and ctx.is_main:
            print("xscale: the model is sharded (FSDP2): every rank writes its part of each "
                  "checkpoint (ckpt-STEP.dcp; XSCALE_CHECKPOINT_WRITERS=rank0 is for a model "
                  "that every rank holds whole)", flush=True)
        warmup_steps = config.warmup_steps
        if warmup_steps is None:
            warmup_steps = min(5, max(1, (self.end_step or 10) // 10))
        self.tally = RunTally(ctx, warmup_steps)
        self.tally.clock.watch(model)
        if self.output_dir is not None:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        # With spares, live recovery (xscale.recovery); a replacement takes its state from the
        # survivors, not from a checkpoint. A loop it cannot serve says why, once, now.
        self.live, not_live = live.for_loop(ctx, model, optimizer, redivides=config.shrinks)
        if not_live is not None and ctx.is_main:
            print(f"xscale: live recovery is off for this run: {not_live}; a lost node "
                  "restarts the launch on a spare instead (docs/YOUR-SCRIPT.md)", flush=True)
        joining = self.live is not None and self.live.link.joining
        # A replacement takes the survivors' position (and their model) instead of a
        # checkpoint, before it makes its saver: the survivors remake theirs after the hand-over
        # too (Saver.regroup), and the collectives meet.
        self.scheduler, self.scaler = scheduler, scaler  # handed over with the position
        received = self.live.receive() if joining else None
        if received is not None and dist.get_world_size() != ctx.world_size:
            # Started again in a smaller world (its own failure, after a shrink): the number
            # the coordinator gave it there, and its share of each step.
            self._take_world(dist.get_rank(), dist.get_world_size(), self.live.link.nnodes)
            ctx = self.ctx
        self.saver, resumed = _saver_and_resume(ctx, model, optimizer, scaler, scheduler, config,
                                                config.resume and not joining)
        self.start_step = self.step = resumed or 0
        self.epoch = self.start_step // self.per_epoch
        self.saved_step, self.saved_path = resumed, None
        self.stopped = False
        # The micro-batches of the optimizer step under way: recorded (loop.record), and
        # handed out (batches()), which a prepared script's count too (it records none).
        self._micro = self._handed_out = 0
        self._voted_at: int | None = None
        self._moved = False  # a live recovery moved this rank to the source's position
        if received is not None:
            self.start_step = self.step = received.step
            self._take_schedules(received)
        self._schedules: tuple[dict | None, dict | None] = (None, None)
        self._keep_schedules()
        self.meter = Throughput(ctx.device, warmup_steps=warmup_steps)
        tensorboard_dir = config.tensorboard_dir or (self.output_dir and self.output_dir / "tb")
        self.log = runlog.TrainLog(is_main=ctx.is_main, start_step=self.start_step,
                                   total_steps=self.end_step, log_every=config.log_every,
                                   tensorboard_dir=tensorboard_dir, desc=self.trainer)
        self.shrinks = Shrinks()
        if received is not None:
            self._take_position(received)
        self.window = profile_window.window_from_env(ctx.rank, ctx.device)
        self.stragglers = stragglers.watch(model, ctx.device, ctx.rank, ctx.world_size,
                                           say=self.log.message)
        self.stragglers.micro_batches = self.micro_batches  # more than another's, in a share
        self._script_reads: set[str] = set()  # which of boundary, sync_gradients
        if resumed is not None:
            self.message(f"{self.prog}: resuming from step {resumed} in {self.output_dir}")

    @classmethod
    def from_args(cls, ctx: DistContext, loader: DataLoader, args: argparse.Namespace, *,
                  model: nn.Module, accumulation: int | None = None,
                  warmup_steps: int | None = 1, **options: Any) -> Loop:
        """The loop of a script with xscale's trainers' command line: --epochs, --max-steps,
        --grad-accum-steps (unless `accumulation` says), --log-every, --checkpoint-every,
        --keep-checkpoints, --no-resume (args.resume), --output-dir, --logging-dir (TensorBoard).
        `options`: Loop's other keywords."""
        accumulation = args.grad_accum_steps if accumulation is None else accumulation
        return cls(ctx, loader, model=model, output_dir=args.output_dir, epochs=args.epochs,
                   max_steps=args.max_steps, accumulation=accumulation,
                   checkpoint_every=args.checkpoint_every,
                   keep_checkpoints=args.keep_checkpoints, resume=args.resume,
                   log_every=args.log_every, tensorboard_dir=args.logging_dir,
                   warmup_steps=warmup_steps, **options)

    # ---- the loop -------------------------------------------------------------------------

    def batches(self) -> Iterator[tuple[int, Any]]:
        """(epoch, micro-batch) from the resumed position until the end or a stop. A resumed
        run continues the interrupted epoch in the same shuffled order."""
        self.meter.start()
        batches = self._batches_from(self.step)
        while True:
            if self._moved:  # a live recovery: every rank goes on from the source's position
                self._moved = False
                # Now, not in the recovery: the script's lines after it (xscale.prepare's
                # recovers in the optimizer's step) may step the scheduler of the dropped step.
                self._take_schedules(self._schedules_due)
                batches.close()
                batches = self._batches_from(self.step)
            waited = time.perf_counter()
            try:
                step_index, epoch, batch = next(batches)
            except StopIteration:
                return
            # The wait for a batch is this rank's own work (a slow disk makes a straggler).
            waited = time.perf_counter() - waited
            self.stragglers.clock.add_wait(waited)
            self.tally.clock.waited_for_data(waited)
            self.window.step(step_index)
            self.epoch = epoch
            self._before_batch()
            if self._moved:
                continue  # recovered in the broadcast: this batch may not be the step's now
            if self._micro == 0:
                self.tally.flops.begin()  # counts the first step only
            self._handed_out += 1
            yield epoch, batch
            if self.stopped:
                return

    def _batches_from(self, step: int) -> Iterator[tuple[int, int, Any]]:
        """The micro-batches from STEP on: the epoch and the place in it follow from the step
        alone, so ranks at the same step draw the same share of the same shuffled order."""
        return data.train_batches(self.loader, self.sampler, start_step=step,
                                  epochs=self.epochs, max_steps=self.end_step,
                                  accumulation=self.accumulation)

    @property
    def micro_batches(self) -> int:
        """This rank's micro-batches per optimizer step: `accumulation`, or its share of every
        rank's after the world shrank (xscale.data.Share)."""
        return self.sampler.micro_batches(self.accumulation)

    @property
    def boundary(self) -> bool:
        """Whether the micro-batch under way completes an optimizer step."""
        self._script_reads.add("boundary")
        return self._micro + 1 == self.micro_batches

    def sync_gradients(self, model: nn.Module) -> AbstractContextManager:
        """DDP's no_sync() (FSDP2's set_requires_gradient_sync(False)) on every micro-batch
        but the last of a step: one gradient reduction per optimizer step, not one per
        micro-batch."""
        self._script_reads.add("sync_gradients")
        if self._micro + 1 == self.micro_batches:
            return nullcontext()
        if hasattr(model, "no_sync"):
            return model.no_sync()
        if hasattr(model, "set_requires_gradient_sync"):
            return _without_gradient_sync(model)
        return nullcontext()

    def record(self, loss: torch.Tensor, samples: int, tokens: int = 0) -> None:
        """After each micro-batch: its loss and size (samples, tokens for language models);
        at a step's end the checkpoint cadence and, every `log_every` steps, the stop vote."""
        if self.live is not None and self.live.step_dropped:
            self._recover()  # the step changed nothing: it is not counted
            return
        self.log.add(self.step, loss, samples)
        self._micro += 1
        if self._micro < self.micro_batches:
            return
        self._micro = 0
        self._end_step(samples * self.micro_batches, tokens)

    def stepped(self, micro_batches: list[tuple[torch.Tensor | None, int]]) -> None:
        """After an optimizer step that the script made without record() (xscale.prepare's
        step hook): its MICRO_BATCHES, each (its loss or None where the loss is unknown, its
        samples). The same bookkeeping as record()'s."""
        if self.live is not None and self.live.step_dropped:
            self._recover()
            return
        for loss, samples in micro_batches:
            if loss is not None:
                self.log.add(self.step, loss, samples)
        self._micro = 0
        self._end_step(sum(samples for _, samples in micro_batches), 0)

    def _end_step(self, samples: int, tokens: int) -> None:
        """A step is done: the clocks, the log, and at its interval a checkpoint and a vote."""
        self.step += 1
        self._handed_out = 0
        self._keep_schedules()
        self.tally.flops.end()
        self.stragglers.step()
        self.tally.clock.step()
        self.meter.step(samples, tokens)
        if self.live is not None and len(self._script_reads) == 2:
            self.live.may_shrink()  # the script takes its micro-batches from the loop
        if self.step == self.start_step + 1:
            self.tally.first_step(self.step)
        self.log.advance()
        if self.live is not None:
            try:
                if not self.live.broken:
                    held_s = self.live.after_step(self._position())  # a sharded kind's snapshot
                    if held_s is not None:
                        self.tally.snapshot(self.step, held_s)
            except GroupBroken:
                pass
            if self.live.broken:
                self._recover()  # broken after this rank's update: its save and vote are gone
                return
        if self.checkpoint_every and self.step % self.checkpoint_every == 0:
            try:
                self._save()
            except GroupBroken:
                self._recover()  # the save gathers every rank's generators: none was written
                return
        if self.log.due(self.step) or self.step == self.end_step:
            self._vote()

    @property
    def epoch_ended(self) -> bool:
        """The step just recorded closed an epoch that is not the run's last (evaluate now)."""
        return (not self.stopped and self._micro == 0 and self.step % self.per_epoch == 0
                and self.step != self.end_step)

    def message(self, text: str) -> None:
        """Print TEXT once, on rank 0, without breaking the progress bar."""
        self.log.message(text)

    def scalar(self, name: str, value: float) -> None:
        """Log a value at the current step into TensorBoard (rank 0), e.g. an accuracy."""
        self.log.scalar(name, value, self.step)

    def _vote(self) -> None:
        self._voted_at = self.step
        try:
            agreed = vote(self.log.flush, self.stragglers, self._propose_interval())
        except GroupBroken:
            # Not voted again: a survivor may still have been in this step's all-reduce (a ring
            # ends on some ranks first), so after the recovery every rank trains on, and votes
            # at the next interval.
            self._recover()
            return
        if agreed.every is not None:
            self.checkpoint_every, self.auto_every = agreed.every, False
        if agreed.stop:
            self.stopped = True
        self.tally.interval(self.step)

    def _propose_interval(self) -> Proposal | None:
        """With checkpoint_every auto, at the first vote after a timed step: a save now, and
        rank 0's interval from what it cost, which the vote's all-reduce hands to every rank.
        Whether to propose is decided from the position alone, the same on every rank (a
        replacement has timed no step yet; the vote's sizes must match everywhere)."""
        if not self.auto_every or self.saver is None or self.step - self.log.start_step < 2:
            return None
        self._save()
        self._wait_for_writes()
        return self.tally.auto_interval("--checkpoint-every",
                                        self.tally.seconds_per_step(self.step),
                                        self.saver.last_write_s)

    # ---- live recovery (xscale.recovery) ----------------------------------------------------

    def _before_batch(self) -> None:
        """The kind's own collectives before the forward (DDP's buffer broadcast, which would
        raise in the script's lines, is the loop's under live recovery). A recovery here moves
        the loop: the batch is drawn again, and this done again, by batches().

        Only between two steps, though. Inside a step of several micro-batches the script
        counts its micro-batches itself (xscale.prepare's scripts step the optimizer every N),
        so a step cannot be begun again there: the rank finishes the step alone, its optimizer
        step is dropped (the group is broken), and the recovery comes at the step's end."""
        if self.live is None:
            return
        # Broken since the last batch (the coordinator's ABORT, an evaluation): no collective
        # on the broken group.
        if not self.live.broken:
            if self._micro and self.sampler.share is not None:
                return  # unequal shares of a step: the kind's collectives once, at its start
            try:
                self.live.before_batch()
                return
            except GroupBroken:
                pass
        if self._handed_out == 0:
            self._recover()  # between steps; mid-step, the step is dropped at its end

    def _recover(self) -> None:
        """Leave the broken group and train on in the next, the lost node's ranks replaced,
        every rank from the source rank's position (module xscale.recovery)."""
        self.tally.flops.cancel()  # a step left half-done: count the next whole one
        left_at, left_step = time.time(), self.step
        recovered = self.live.recover(self._position())
        if self.saver is not None:
            self.saver.regroup()  # where the replacement makes its saver
        self._take_position(recovered.position)
        if self.step < left_step:  # a sharded kind rolled back to a snapshot
            self.tally.rolled_back(self.step, left_step - self.step, left_at)
        if dist.get_world_size() != self.ctx.world_size:
            self._go_on_in_new_world()
        else:
            self.stragglers.restart(gather_to_rank0(contract.node_name()),  # a node changed
                                    micro_batches=self.micro_batches)
        self.message(f"{self.prog}: live recovery: training goes on at step {self.step}, "
                     f"{recovered.seconds:.1f} s after this rank left the broken group (the "
                     f"state's transfer: {recovered.handover_s:.2f} s)")

    def _go_on_in_new_world(self) -> None:
        """No spare was left: this rank has a new number in a smaller world (the coordinator's,
        xscale.recovery.link), and takes its share of each step's global batch, which stays
        the launch's (xscale.data.Share): the same samples, the same steps, the same mean. Or
        the lost ranks came back: the launch's world again, each rank on its own part."""
        rank, world = dist.get_rank(), dist.get_world_size()
        # Rank 0's list of the nodes, as a joining rank's straggler watch gathers it.
        nodes = gather_to_rank0(contract.node_name())
        self._take_world(rank, world, self.live.link.nnodes)
        self.stragglers.restart(nodes, rank, world, self.micro_batches)
        if self.sampler.share is None:  # the shrink's end is in Shrinks.take
            self.message(grew_back(self.prog, world, self.ctx.nnodes, self.step))
            return
        self.shrinks.went_on(self.step, world, self.ctx.nnodes)
        self.message(went_smaller(self.prog, world, self.ctx.nnodes, self._global_batch,
                                  self.micro_batches))

    def _take_world(self, rank: int, world: int, nnodes: int) -> None:
        """Train on as RANK of WORLD ranks on NNODES nodes, with this rank's share of each
        step's global batch (the launch's ranks laid it out; the script's sampler keeps that
        layout), or, in the launch's world, its own part."""
        self.ctx = replace(self.ctx, rank=rank, world_size=world, nnodes=nnodes)
        self.sampler.share = None if world == self.sampler.num_replicas else data.Share.dealt(
            self.sampler.num_replicas, self.accumulation, self.batch_size, rank, world)
        self.tally.clock.world_size = world

    @property
    def _global_batch(self) -> int:
        """The samples of an optimizer step: the launch's ranks' (the sampler's layout)."""
        return self.batch_size * self.accumulation * self.sampler.num_replicas

    def _position(self) -> Position:
        """Where this rank's loop is; after a recovery the source rank's is every rank's."""
        return Position(
            step=self.step, log_from=self.log.start_step, saved_step=self.saved_step,
            saved_path=None if self.saved_path is None else str(self.saved_path),
            checkpoint_every=self.checkpoint_every, auto_every=self.auto_every,
            scheduler=self._schedules[0], scaler=self._schedules[1],
            shrinks=self.shrinks.handed())

    def _take_position(self, position: Position) -> None:
        """Go on from POSITION, the source rank's: its step (the model is the source's), so
        also its place in the epoch (the next batches are drawn from there), its vote cadence
        and checkpoint interval. The survivors may have stopped a step apart: one finished an
        all-reduce that another still waited in, and kept apart they drew different batches and
        met in different collectives (docs/FAILURES.md, "Live recovery")."""
        self.step = position.step
        self.epoch = self.step // self.per_epoch
        self.saved_step, self.saved_path = position.saved_step, position.saved_path
        self.checkpoint_every, self.auto_every = position.checkpoint_every, position.auto_every
        self._schedules_due = position  # taken before the next batch (batches())
        self.log.start_step = position.log_from
        self._micro = self._handed_out = 0
        self._voted_at = None  # a vote cut short counts as none, on every rank alike
        self.shrinks.take(position.shrinks, self.step,
                          whole=dist.get_world_size() == self.sampler.num_replicas)
        self._moved = True

    def _keep_schedules(self) -> None:
        """The LR scheduler's and the GradScaler's state at the step just counted, for the
        position: the script steps them after a dropped update too, which must not count."""
        if self.live is not None:
            self._schedules = (_state_of(self.scheduler), _state_of(self.scaler))

    def _take_schedules(self, position: Position) -> None:
        """The LR scheduler's and the GradScaler's state at POSITION, the source's, and the
        optimizer's LRs the scheduler set there (loading its state sets none)."""
        if self.scaler is not None and position.scaler is not None:
            self.scaler.load_state_dict(position.scaler)
        if self.scheduler is not None and position.scheduler is not None:
            self.scheduler.load_state_dict(position.scheduler)
            for group, lr in zip(self.scheduler.optimizer.param_groups,
                                 self.scheduler.get_last_lr(), strict=True):
                group["lr"] = lr
        self._keep_schedules()

    def _save(self) -> None:
        """The checkpoint of this step, once (a collective save: every rank waits as long as
        the slowest)."""
        if self.saver is None or self.saved_step == self.step:
            return
        started = time.perf_counter()
        self.saved_path = self.saver(self.step, self.epoch)
        self.saved_step = self.step
        self.tally.saved(self.step, time.perf_counter() - started)

    def _wait_for_writes(self) -> None:
        """Until the background write is published; the wait is a stall too."""
        if self.saver is not None:
            started = time.perf_counter()
            self.saver.wait()
            self.tally.waited(self.step, time.perf_counter() - started)

    # ---- the end --------------------------------------------------------------------------

    def finish(self) -> None:
        """Stop the clocks, take the last vote if the last step had none, save the last
        checkpoint, and say so on rank 0 after a stop. Every rank calls it."""
        self.tally.flops.cancel()  # a step that never ended leaves no counting behind
        self.meter.stop()
        if self.live is not None:
            self.live.close()  # a failure from here on ends the launch as before
        self.window.close()
        if self._voted_at != self.step:
            self._vote()
        self.log.close()
        self._save()
        self._wait_for_writes()
        self.tally.end(self.step, self.stopped)
        if self.stopped and self.ctx.is_main:
            print(stop_message(self.prog, self.step, self.saved_path), flush=True)

    def report(self, **own: Any) -> None:
        """XSCALE_RANK on every rank, XSCALE_SUMMARY on rank 0, with the script's OWN fields
        (an accuracy, ...) after xscale's; every rank calls it (the rates are reduced)."""
        write_summary(self.ctx, self.model, trainer=self.trainer, started=STARTED,
                      start_step=self.start_step, steps=self.step, meter=self.meter,
                      loss_first=self.log.loss_first, loss_last=self.log.loss_last,
                      stopped=self.stopped, checkpoint=self.saved_path,
                      batch_size=self.batch_size, accumulation=self.accumulation,
                      counts_tokens=False, stragglers=self.stragglers, tally=self.tally,
                      output_dir=self.output_dir, global_batch_size=self._global_batch,
                      shrinks=self.shrinks.done(), **own)


def _state_of(schedule: Any) -> dict | None:
    """An LR scheduler's or a GradScaler's state dict, copied (a snapshot keeps it as it was);
    None without one."""
    return None if schedule is None else copy.deepcopy(schedule.state_dict())


def _resumable_sampler(loader: DataLoader) -> data.ResumableSampler:
    if not isinstance(loader.sampler, data.ResumableSampler):
        raise UserError("xscale.Loop needs a loader made by xscale.loader() (its sampler "
                        "resumes mid-epoch), not a DataLoader of the script's own")
    return loader.sampler


def write_summary(ctx: DistContext, model: nn.Module, *, trainer: str, started: float,
                  start_step: int, steps: int, meter: Throughput,
                  loss_first: float | None, loss_last: float | None, stopped: bool,
                  checkpoint: object | None, batch_size: int, accumulation: int,
                  counts_tokens: bool, stragglers: stragglers.StragglerWatch | None,
                  tally: RunTally, output_dir: str | Path | None = None,
                  global_batch_size: int | None = None,
                  shrinks: list[dict[str, Any]] | None = None, **own: Any) -> None:
    """The one place XSCALE_RANK and XSCALE_SUMMARY are written, for every trainer; the whole
    summary also into OUTPUT_DIR/xscale-summary.json (xscale.observe.runlog). The global batch
    is every rank's micro-batches unless the loop says (a world that shrank kept the launch's);
    SHRINKS: each smaller world the run went on in (Shrinks.done)."""
    rates = meter.reduced()
    node, phases = contract.node_name(), startup.rank_phases()
    runlog.rank_record(rank=ctx.rank, local_rank=ctx.local_rank, node=node, steps=steps,
                       param_digest=runlog.param_digest(model), startup=phases)
    # Once per run, at its end: rank 0 needs every rank's phases for the slowest one's node,
    # and every rank's step time for the verdict and the spread.
    every_rank = gather_to_rank0((ctx.rank, node, phases, tally.clock.breakdown()))
    if not ctx.is_main:
        return
    started_up = startup.aggregate(startup.RankPhases(rank, node, phases)
                                   for rank, node, phases, _ in every_rank)
    print_startup(started_up, len(every_rank))
    step_time = steptime.summarise([(rank, breakdown) for rank, _, _, breakdown in every_rank])
    used = flops.utilisation(tally.flops.count, step_time and step_time.seconds, ctx.device)
    if step_time is not None:
        print(step_time.verdict(used), flush=True)
    common = {
        "trainer": trainer, "world_size": ctx.world_size, "nodes": ctx.nnodes,
        "device": ctx.device.type, "backend": ctx.backend,
        "start_step": start_step, "steps": steps, "batch_size": batch_size,
        "global_batch_size": global_batch_size or batch_size * accumulation * ctx.world_size,
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
        "checkpoint_stall_s": round(tally.stall_s, 3),
        "checkpoints_saved": tally.saves,
        "startup": started_up,
        "straggler": None if stragglers is None else stragglers.summary(),
        "step_time": None if step_time is None else step_time.field(),
        "bound": None if step_time is None else step_time.bound,
        "tflops": None if used is None else float(f"{used.tflops:.4g}"),
        "mfu": None if used is None or used.mfu is None else float(f"{used.mfu:.4g}"),
        "step_time_ranks": None if step_time is None else step_time.ranks(),
        "flops": None if used is None else used.field(),
        "shrinks": shrinks,
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

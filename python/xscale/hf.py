"""xscale's runtime inside Hugging Face's Trainer: one subclass, XscaleTrainer, in place of
Trainer (docs/YOUR-SCRIPT.md).

Trainer runs its own loop (DDP from the torchrun variables run.sh exports, the
DistributedSampler, rank-0-only tqdm and checkpoints); XscaleTrainer adds, through callbacks
of its own, what every xscale loop does: the stop vote at Slurm's warning with a checkpoint and
the resume from the newest whole one, shielded DataLoader workers, the straggler line, the
progress notes (xscale.runtime.RunTally), the profiling window and the one XSCALE_SUMMARY;
and with spares, live recovery (xscale.recovery), re-entering Trainer's loop (_LiveSteps).
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.integrations import TensorBoardCallback
from transformers.trainer_callback import ProgressCallback
from transformers.trainer_utils import (
    PREFIX_CHECKPOINT_DIR,
    PredictionOutput,
    TrainOutput,
    has_length,
)

from xscale import data, lifecycle, runtime
from xscale.dist import (
    choose_backend,
    choose_device,
    is_sharded,
    probe_accelerator,
    reach_coordinator,
    read_placement,
    timeout_from_env,
)
from xscale.observe import profile_window, runlog, startup, stragglers
from xscale.observe.throughput import Throughput
from xscale.recovery import ddp as ddp_recovery
from xscale.recovery import link as links
from xscale.recovery import live
from xscale.recovery.link import GroupBroken
from xscale.recovery.protocol import WorldChange
from xscale.reductions import SumMeter, all_reduce_sums, gather_to_rank0
from xscale.shared import contract

TRAINER_STATE = "trainer_state.json"

# Slurm's warning goes to every process of the step, multiprocessing's resource tracker too,
# which dies of it (and every rank then prints a traceback for each of its semaphores) unless it
# started with the signal blocked. Under the spawn start method (the LUMI workshop's script sets
# it) the first data set loaded starts it: datasets' progress bars take a multiprocessing lock,
# long before XscaleTrainer is built. Started here, shielded (40 ms), it is the one every later
# user finds running.
lifecycle.shield_resource_tracker()

# With spares, a rank reaches live recovery's coordinator before the script's TrainingArguments
# join the group, and a replacement joins the survivors' next group there (xscale.dist); its
# DDP skips the start-up broadcast: its state comes from a survivor (_LiveSteps).
reach_coordinator()
ddp_recovery.prepare_replacement()


def ddp_arguments() -> dict[str, Any]:
    """xscale's choices as TrainingArguments' keywords: use_cpu (this rank has no GPU; the GPU
    is torch.accelerator's, by local rank), ddp_backend (the device's: nccl is RCCL on ROCm,
    xccl on Intel GPUs, gloo on CPUs; XSCALE_BACKEND wins) and ddp_timeout (XSCALE_TIMEOUT_S: a
    lost rank fails the job instead of holding every node). Call it before TrainingArguments,
    which joins the process group: a mistake is one line. It also marks the start-up's
    `imports` moment: the script's libraries are imported.

    The lone-rank rule, the same for every xscale trainer: a process that a launcher placed
    (run.sh, torchrun: RANK and WORLD_SIZE set) joins the group it describes, a lone one a
    group of one, with the device's backend, and the summary names it; a process started by
    hand, without them, joins no group through Trainer (xscale.start() makes itself a group of
    one), and the summary's backend is null."""
    startup.mark("imports")
    placement = read_placement()
    accel = probe_accelerator()
    device = choose_device(placement.local_rank, accel=accel)
    backend = choose_backend(None, device, accel)
    placed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    return {"use_cpu": device.type == "cpu",
            "ddp_backend": backend if placed else None,
            "ddp_timeout": int(timeout_from_env().total_seconds())}


class XscaleTrainer(Trainer):
    """Hugging Face's Trainer with xscale's runtime; takes Trainer's arguments, and:

    resume: train() resumes from the newest whole checkpoint in args.output_dir (the attribute
        `resume_from`; a save cut off by the time limit is passed over) unless given one;
        False starts afresh.
    checkpoint_every: "auto" sets save_steps from Young's interval, timed on the run's first
        save (xscale.checkpoints); None keeps args.save_steps.
    report_at_end: train() ends with the summary (XSCALE_SUMMARY and OUTPUT_DIR/
        xscale-summary.json); False: the script calls report(**fields) itself, after its own
        evaluation.
    name: the run's name in the summary (default: the script's file name without .py).

    At Slurm's warning (SIGUSR1) or SIGTERM every rank stops after the same step, with a
    checkpoint, and the run exits 0; the requeued job resumes from it. The DataLoader workers
    start out of reach of the warning (a worker spawned from Trainer's start-method name dies
    of it), and a CPU rank resumes too.
    """

    def __init__(self, *args: Any, resume: bool = True, checkpoint_every: int | str | None = None,
                 report_at_end: bool = True, name: str | None = None, **kwargs: Any) -> None:
        lifecycle.install_stop_handlers()  # Slurm's warning while Trainer sets up: a stop
        super().__init__(*args, **kwargs)
        if self.pop_callback(ProgressCallback) is not None:  # None: disable_tqdm
            self.add_callback(_ProgressLines)
        _load_cpu_ranks_on_the_cpu()
        self.ctx = runtime.joined(self.args.device)  # Trainer's arguments joined it
        reach_coordinator()  # where xscale.hf was imported after the group was joined
        joining = links.joining()  # a replacement: its state comes from the survivors
        self.resume, self.report_at_end = resume, report_at_end
        self.run_name = name or runtime.default_run_name()
        self.started = runtime.STARTED
        self.resume_from = newest_checkpoint(self.args.output_dir) \
            if resume and not joining else None
        self.tally = runtime.RunTally(self.ctx)
        self.train_call = _TrainCall(self.tally, wrapped=lambda: self.model_wrapped)
        auto = None
        if checkpoint_every == "auto":
            self.args.save_steps = _initial_save_steps(self.args.max_steps, self.resume_from)
            auto = _AutoSaveSteps(self.tally)
        elif checkpoint_every is not None:
            self.args.save_steps = int(checkpoint_every)
        watch = stragglers.watch(self.model, self.ctx.device, self.ctx.rank, self.ctx.world_size,
                                 gather=not joining)  # the survivors gather after the hand-over
        self.stop = _StopOnSignal(self.tally, watch=watch, auto=auto,
                                  reduce=self.train_call.reduce_losses)
        self.live_steps = _LiveSteps(self)  # first: a replacement leaves before the others begin
        for callback in (self.live_steps, _NoStepPastTheLast(), self.train_call, self.stop,
                         _ProfileSteps(self.ctx.rank, self.ctx.device)):
            self.add_callback(callback)
        self.saved: str | None = None
        self._said_skipped = False
        # After live recovery found no spare: this rank's share of each step's global batch,
        # laid out by the launch's ranks (take_world); None while the world is the launch's.
        self.share: data.Share | None = None
        self.shrinks = runtime.Shrinks()

    def training_step(self, model: nn.Module, inputs: Mapping[str, Any], *args: Any,
                      **kwargs: Any) -> torch.Tensor:
        """Trainer's step on one micro-batch; its loss and tokens are counted here, whatever
        the logging cadence (logging_steps) and include_num_input_tokens_seen say."""
        self.live_steps.before_micro_batch()
        if self.share is not None:  # Trainer divides by this rank's micro-batches of the step
            self.current_gradient_accumulation_steps = self.share.accumulation
        loss = super().training_step(model, inputs, *args, **kwargs)
        if self.accelerator.sync_gradients:  # the step's last micro-batch: Trainer clips next
            self.live_steps.before_update()
        if self.share is not None:
            # This rank's part of the step's loss, weighted so that the mean over the ranks
            # (Trainer's log, xscale's vote) is the launch's mean over its ranks.
            loss = loss * self.ctx.world_size / self.share.world
        self.train_call.micro_batch(loss, inputs)
        return loss

    def compute_loss(self, model: nn.Module, inputs: Mapping[str, Any],
                     return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        """Trainer's loss. A loss averaged over the step's tokens on every rank (the gathered
        num_items_in_batch) Trainer multiplies by accelerate's process count, for the gradient
        all-reduce to divide again; in a smaller world the all-reduce divides by the launch's
        count (xscale.recovery.ddp), and the loss is multiplied by that one instead."""
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        counted = self.accelerator.num_processes
        averaged_over_ranks = (num_items_in_batch is not None
                               and self.args.average_tokens_across_devices
                               and (self.model_accepts_loss_kwargs or self.compute_loss_func))
        if self.share is None or counted == self.share.world or not averaged_over_ranks:
            return result
        scale = self.share.world / counted
        if return_outputs:
            loss, outputs = result
            return loss * scale, outputs
        return result * scale

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """Trainer's evaluation; after a stop, none (the time left is for the requeue): one
        line, and a NaN loss where the script reads one."""
        if self.stopped:
            return self._skipped("evaluation", kwargs.get("metric_key_prefix", "eval"))
        return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> PredictionOutput:
        """Trainer's prediction; after a stop, none, as evaluate()."""
        if self.stopped:
            metrics = self._skipped("prediction", kwargs.get("metric_key_prefix", "test"))
            return PredictionOutput(predictions=None, label_ids=None, metrics=metrics)
        return super().predict(*args, **kwargs)

    def _skipped(self, what: str, prefix: str) -> dict[str, float]:
        """One line, once (Trainer's own evaluation at the stopping step skips too)."""
        if self.ctx.is_main and not self._said_skipped:
            print(f"xscale: {what} skipped: the run stopped at step {self.stop.stopped_at} for "
                  "the requeue, and the time left is the checkpoint's (docs/YOUR-SCRIPT.md)",
                  flush=True)
        self._said_skipped = True
        return {f"{prefix}_loss": float("nan")}

    def get_train_dataloader(self) -> DataLoader:
        loader = super().get_train_dataloader()
        batches = loader.batch_sampler
        if self.share is not None:
            batches = _SharedBatches(batches, self.share)
        if _draws_by_index(loader) and not data.read_as_stored(loader.dataset):
            seed = self.args.seed if self.args.data_seed is None else self.args.data_seed
            loader = _drawing(loader, _KeyedBatches(batches, seed),
                              data.SeededSamples(loader.dataset))
        elif self.share is not None:
            loader = _drawing(loader, batches)
        return _shield_workers(loader)

    def get_eval_dataloader(self, *args: Any, **kwargs: Any) -> DataLoader:
        return _shield_workers(super().get_eval_dataloader(*args, **kwargs))

    def take_world(self, rank: int, world: int, nnodes: int, launch_world: int) -> None:
        """Train on as RANK of WORLD ranks on NNODES nodes (live recovery found no spare): this
        rank's share of each step's global batch, which stays the one LAUNCH_WORLD ranks laid
        out (xscale.data.Share): the same samples a step, the same steps, the same mean. In
        the launch's world again (the lost ranks came back), this rank's own batches."""
        launch_accumulation = (self.args.gradient_accumulation_steps if self.share is None
                               else self.share.accumulation)
        self.ctx = replace(self.ctx, rank=rank, world_size=world, nnodes=nnodes)
        self.tally.clock.world_size = world
        _tell_accelerate(rank, world)
        self.share = None if world == launch_world else data.Share.dealt(
            launch_world, launch_accumulation, self.args.per_device_train_batch_size, rank,
            world)
        # Trainer's loop takes this many batches a step, and counts its epoch's steps by it.
        self.args.gradient_accumulation_steps = (launch_accumulation if self.share is None
                                                 else len(self.share.micro_batches))

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        """Trainer.train, from the newest whole checkpoint unless told otherwise; then the stop
        line after a stop, and the summary unless report_at_end is False."""
        if resume_from_checkpoint is None:
            resume_from_checkpoint = self.resume_from
        self.train_call.call_begins()
        try:
            output = self._train_recovering(resume_from_checkpoint, **kwargs)
        finally:
            self.live_steps.forget()
        self.tally.end(self.train_call.end_step, self.stopped)
        self.saved = _checkpoint_written(self.args.output_dir, self.train_call)
        if self.stopped and self.ctx.is_main:
            print(runtime.stop_message(runtime.script_name(), self.stop.stopped_at, self.saved),
                  flush=True)
        if self.report_at_end:
            self.report()
        return output

    def _train_recovering(self, resume_from_checkpoint: str | bool | None, **kwargs: Any) -> Any:
        """Trainer.train, begun again after each live recovery (_LiveSteps)."""
        while True:
            try:
                with links.abortable_collectives():  # Trainer's own gathers too
                    return super().train(resume_from_checkpoint=resume_from_checkpoint,
                                         **kwargs)
            except _TrainingDone:
                return self._trained_to_the_end()
            except Exception as error:
                if not self.live_steps.recoverable(error):
                    raise
            # Outside the handler: the broken loop's frames, its DataLoader workers with them,
            # are gone before the recovery begins.
            resume_from_checkpoint = self.live_steps.recover()

    def _trained_to_the_end(self) -> TrainOutput:
        """Trainer's loop began at its last step (_NoStepPastTheLast): the call ends as
        Trainer's does, its callbacks told, with no step and so no loss of its own."""
        self.control = self.callback_handler.on_train_end(self.args, self.state, self.control)
        return TrainOutput(self.state.global_step, float("nan"), {})

    # Trainer's resume, from the state a live recovery handed over instead of a checkpoint.

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not self.live_steps.holds(resume_from_checkpoint):  # else: the source's, broadcast
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self.live_steps.holds(checkpoint):
            self.live_steps.load_optimizer_and_scheduler()
        else:
            super()._load_optimizer_and_scheduler(checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if not self.live_steps.holds(checkpoint):  # the lost rank's generators are gone with it
            super()._load_rng_state(checkpoint)

    def rejoined(self, save_every: int | None) -> None:
        """After a live recovery, before Trainer's loop begins again: every rank's callbacks
        alike, the replacement's and the survivors' (their collectives must match), and rank
        0's list of the ranks' nodes anew (a node changed)."""
        self.stop.rejoined(save_every)
        self.train_call.rejoined()
        self.stop.watch.restart(gather_to_rank0(contract.node_name()), self.ctx.rank,
                                self.ctx.world_size, self.args.gradient_accumulation_steps)

    @property
    def stopped(self) -> bool:
        """Whether training stopped at a stop signal (evaluation can wait for the next run)."""
        return self.stop.stopped_at is not None

    def report(self, **own: Any) -> None:
        """XSCALE_RANK on every rank and XSCALE_SUMMARY on rank 0 for this train() call, with
        the script's OWN fields after xscale's; the whole summary goes into the output
        directory, beside the checkpoints. Every rank calls it."""
        call, args, share = self.train_call, self.args, self.share
        runtime.write_summary(
            self.ctx, self.model, trainer=self.run_name, started=self.started,
            start_step=call.start_step, steps=call.end_step, meter=call.throughput,
            loss_first=call.loss_first, loss_last=call.loss_last,
            stopped=self.stopped, checkpoint=self.saved,
            batch_size=args.per_device_train_batch_size,
            accumulation=args.gradient_accumulation_steps if share is None else share.accumulation,
            global_batch_size=None if share is None else share.per_step * share.world,
            counts_tokens=True, stragglers=self.stop.watch, tally=self.tally,
            output_dir=args.output_dir, shrinks=self.shrinks.done(), **own)


@functools.cache  # once per process
def _load_cpu_ranks_on_the_cpu() -> None:
    """accelerate names a CPU rank's device `cpu:N` (N: its local rank), and Trainer (transformers
    4.x) resumes the optimizer with `torch.load(map_location=that device)` when there are several
    ranks; torch knows the location `cpu` only ("don't know how to restore data location ...
    cpu:0"). torch's own hook for storage locations maps every `cpu:N` to the CPU."""
    torch.serialization.register_package(
        11, lambda storage: None,  # tags nothing: torch's own tagger names CPU storage
        lambda storage, location: storage if location.startswith("cpu:") else None)


def _shield_workers(loader: DataLoader) -> DataLoader:
    """Give `loader` (or the DataLoader inside accelerate's adapter, which iterates it) the
    shielded context (xscale.lifecycle.worker_context) before its workers start; a loader
    without workers has no use for one."""
    inner = getattr(loader, "base_dataloader", loader)
    shielded = (lifecycle.ShieldedForkServerContext, lifecycle.ShieldedForkContext)
    if inner.num_workers > 0 and not isinstance(inner.multiprocessing_context, shielded):
        spawn = multiprocessing.get_start_method(allow_none=True) == "spawn"
        inner.multiprocessing_context = lifecycle.worker_context(spawn=spawn)
    return loader


def _tell_accelerate(rank: int, world: int) -> None:
    """accelerate's process count and this process's number, in the world live recovery made
    (set where accelerate keeps them, its states' shared dicts): its gathers size their
    output by them, and Trainer deals the batches (_SharedBatches) and saves by them."""
    from accelerate.state import AcceleratorState, PartialState

    for state in (PartialState._shared_state, AcceleratorState._shared_state):
        state.update(num_processes=world, process_index=rank)


def _deals_whole_batches(loader: DataLoader) -> bool:
    """Whether accelerate deals LOADER's batches to the ranks in turn, each rank the same
    number (BatchSamplerShard with even_batches, Trainer's default)."""
    from accelerate.data_loader import BatchSamplerShard

    shard = _unkeyed(getattr(loader, "batch_sampler", None))
    return isinstance(shard, BatchSamplerShard) and not shard.split_batches \
        and shard.even_batches


def _cannot_shrink(trainer: XscaleTrainer, loader: DataLoader, launch_world: int) -> str | None:
    """Why Trainer's loop cannot go on as a smaller world with the same steps (each rank
    taking its share of every step's batches, XscaleTrainer.take_world); None: it can."""
    args = trainer.args
    if not _deals_whole_batches(loader):
        return ("its training batches are not dealt to the ranks whole, the same number to "
                "each (accelerate's split_batches, even_batches=False, or an iterable data set)")
    shard = _unkeyed(loader.batch_sampler)
    per_rank = len(type(shard)(shard.batch_sampler, launch_world))
    if per_rank % args.gradient_accumulation_steps:
        return (f"an epoch's {per_rank} batches per rank are not whole steps of "
                f"{args.gradient_accumulation_steps} (gradient_accumulation_steps)")
    if args.include_num_input_tokens_seen not in ("no", False):
        return "include_num_input_tokens_seen gathers at every micro-batch, not at every step"
    if trainer.model_accepts_loss_kwargs and not args.average_tokens_across_devices:
        return "each rank averages its loss over its own tokens (average_tokens_across_devices)"
    return None


class _SharedBatches(BatchSampler):
    """This rank's share of each step's batches in a smaller world (xscale.data.Share): the
    batches the launch's ranks would have drawn, as accelerate dealt them (LAUNCHED: a rank's
    BatchSamplerShard; its `batch_sampler`, the epoch's batches in order, keeps that name for
    accelerate to set the epoch through)."""

    def __init__(self, launched: BatchSampler, share: data.Share) -> None:
        from accelerate.data_loader import BatchSamplerShard

        self.batch_sampler, self.share = launched.batch_sampler, share
        self.batch_size, self.drop_last = launched.batch_size, launched.drop_last
        self._dealt = functools.partial(BatchSamplerShard, num_processes=share.world,
                                        split_batches=False, even_batches=True)
        self._steps = len(self._dealt(self.batch_sampler, process_index=0)) // share.accumulation

    def __iter__(self) -> Iterator[list[int]]:
        # A generator: the epoch is drawn when the first batch is asked for, not when iter()
        # is called. Drawing moves the sampler to its next epoch, and a DataLoader with
        # workers calls iter() twice and uses the second: an eager draw gave each epoch after
        # the first the order of the one after it.
        epoch = list(self.batch_sampler)
        drawn = {owner: list(self._dealt(_Batches(epoch, self.batch_sampler),
                                         process_index=owner))
                 for owner in self.share.owners}
        yield from self.share.batches(drawn, self._steps)

    def __len__(self) -> int:
        return self._steps * len(self.share.micro_batches)


class _Batches(list):
    """A copy of an epoch's BATCHES, with the attributes of the BATCH_SAMPLER that drew them
    that BatchSamplerShard reads (it fills the epoch's last batch up in place)."""

    def __init__(self, batches: list[list[int]], batch_sampler: BatchSampler) -> None:
        super().__init__(list(batch) for batch in batches)
        self.batch_size, self.drop_last = batch_sampler.batch_size, batch_sampler.drop_last


class _KeyedBatches(BatchSampler):
    """BATCHES (this rank's, as accelerate deals them) with each index paired with the seed its
    sample draws from (xscale.data.SeededSamples), from SEED, the epoch and the index: what a
    sample draws in Trainer's DataLoader workers is then the same after a resume or in a
    replacement rank, with any number of workers.

    The epoch is the one accelerate's loader sets before each pass (its set_epoch, also where
    Trainer resumes mid-epoch); the batch sampler's own sampler, whose epoch orders the pass,
    stays where accelerate looks for it (`sampler`, `batch_sampler`), as does how many ranks
    it deals to (the loader's total_batch_size)."""

    def __init__(self, batches: BatchSampler, seed: int) -> None:
        self.batches, self.seed, self.epoch = batches, seed, 0
        self.batch_size, self.drop_last = batches.batch_size, batches.drop_last
        for name in ("sampler", "batch_sampler", "num_processes", "split_batches"):
            if hasattr(batches, name):
                setattr(self, name, getattr(batches, name))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch = self.epoch
        for batch in self.batches:
            yield list(data.with_seeds(batch, self.seed, epoch))

    def __len__(self) -> int:
        return len(self.batches)


def _draws_by_index(loader: DataLoader) -> bool:
    """Whether LOADER is accelerate's loader of a map-style data set (each rank drawing its
    batches by index), the one kind _KeyedBatches serves; not an iterable data set's, nor one
    rank's loader dispatching to the others."""
    from accelerate.data_loader import DataLoaderShard

    return isinstance(loader, DataLoaderShard) and loader.batch_sampler is not None \
        and not isinstance(loader.dataset, IterableDataset)


def _unkeyed(batches: BatchSampler | None) -> BatchSampler | None:
    return batches.batches if isinstance(batches, _KeyedBatches) else batches


def _drawing(loader: DataLoader, batch_sampler: BatchSampler,
             dataset: Dataset | None = None) -> DataLoader:
    """accelerate's LOADER drawing from BATCH_SAMPLER (and DATASET) instead, made as accelerate
    makes one (skip_first_batches): the same device placement, generators and epoch count."""
    from accelerate.data_loader import _PYTORCH_DATALOADER_KWARGS, DataLoaderShard

    drawn_by_sampler = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")
    kwargs = {key: getattr(loader, key, default)
              for key, default in _PYTORCH_DATALOADER_KWARGS.items()
              if key not in drawn_by_sampler}
    return DataLoaderShard(loader.dataset if dataset is None else dataset, device=loader.device,
                           rng_types=loader.rng_types,
                           synchronized_generator=loader.synchronized_generator,
                           iteration=loader.iteration, batch_sampler=batch_sampler, **kwargs)


class _ProgressLines(ProgressCallback):
    """Trainer's progress bars, drawn as lines in a job's output (xscale.observe.runlog.LogLines):
    in place, a long run's drawings make one line that srun --label cuts inside characters."""

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.training_bar = runlog.progress_bar(total=state.max_steps, dynamic_ncols=True)
        self.current_step = 0

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if state.is_world_process_zero and self.prediction_bar is None \
                and has_length(eval_dataloader):
            self.prediction_bar = runlog.progress_bar(
                total=len(eval_dataloader), leave=self.training_bar is None, dynamic_ncols=True)
        super().on_prediction_step(args, state, control, eval_dataloader=eval_dataloader,
                                   **kwargs)


class _AutoSaveSteps:
    """checkpoint_every auto: Trainer's save_steps from Young's interval, as the runtime Loop's
    (RunTally.auto_interval). Trainer saves after the step's callbacks, so the first stop vote
    after a timed step asks for a save, and the next vote, once the save was timed, hands rank
    0's interval to every rank in its all-reduce."""

    def __init__(self, tally: runtime.RunTally) -> None:
        self.tally = tally
        self._saves_before: int | None = None  # the tally's count when the save was asked for
        self.step_s = 0.0
        self.every: int | None = None  # the decision, on every rank

    def at_vote(self, state: TrainerState, control: TrainerControl) -> runtime.Proposal | None:
        """What this rank puts to the vote: rank 0's interval once its save was timed."""
        if self.every is not None:
            return None
        if self._saves_before is None:
            step_s = self.tally.seconds_per_step(state.global_step)
            if step_s is not None:
                self.step_s, self._saves_before = step_s, self.tally.saves
                control.should_save = True
            return None
        if self.tally.saves == self._saves_before:
            return None  # every rank saves at the same step: none has timed it yet
        return self.tally.auto_interval("--save-steps", self.step_s)

    def decided(self, state: TrainerState, agreed: runtime.Vote) -> None:
        if agreed.every is not None:
            self.every = state.save_steps = agreed.every

    def rejoined(self, every: int | None) -> None:
        """After a live recovery: the source rank's decision; undecided, a save is timed anew."""
        self.every, self._saves_before = every, None


def _initial_save_steps(max_steps: int, resume_from: str | None) -> int:
    """Trainer's save_steps with auto, until the timed save decides anew: the interval the
    checkpoint resumed from was saved with (Trainer restores that one anyway, and warns when the
    arguments differ), else none but the last step's."""
    if resume_from is not None:
        with open(os.path.join(resume_from, TRAINER_STATE)) as handle:
            saved = json.load(handle).get("save_steps")
        if isinstance(saved, int) and saved > 0:
            return saved
    return max_steps


class _StopOnSignal(TrainerCallback):
    """The runtime's stop vote and checkpoint cadence on Trainer's steps. Every
    STOP_VOTE_EVERY steps, at the first and at the last, all ranks ask whether any received
    SIGUSR1/SIGTERM; if so, Trainer saves a checkpoint at the end of this step and ends
    training, and the run exits 0. The last step is saved too, as in every xscale loop
    (Trainer itself saves only every save_steps). With auto, the same vote sets save_steps
    (_AutoSaveSteps); the losses since the last vote travel in it (`reduce`)."""

    def __init__(self, tally: runtime.RunTally, every: int = runtime.STOP_VOTE_EVERY,
                 watch: stragglers.StragglerWatch | None = None,
                 auto: _AutoSaveSteps | None = None,
                 reduce: Callable[..., dict[str, Any]] | None = None) -> None:
        self.tally, self.every = tally, every
        self.stopped_at: int | None = None
        self.watch = watch  # its vector travels in the vote (xscale.observe.stragglers)
        self.auto = auto
        self.reduce = reduce  # the vote's all-reduce, with the losses in it (_TrainCall)
        self._voted = False  # the first step votes too: the summary's first loss is its own

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> TrainerControl:
        last = state.global_step >= state.max_steps
        if last:
            control.should_save = True
        if self.watch is not None:
            self.watch.step()
        if last or not self._voted or state.global_step % self.every == 0:
            self._voted = True
            proposal = None
            if self.auto is not None:  # a proposal on every rank, 0 where none: sizes match
                proposal = self.auto.at_vote(state, control) or runtime.Proposal(0.0)
            agreed = runtime.vote(self.reduce, watch=self.watch, proposal=proposal)
            if self.auto is not None:
                self.auto.decided(state, agreed)
            self.tally.interval(state.global_step)
            if agreed.stop:
                control.should_save = True
                control.should_training_stop = True
                self.stopped_at = state.global_step
        return control

    def rejoined(self, save_every: int | None) -> None:
        """After a live recovery: every rank votes at its first step, as at a start (the
        replacement's first is its first), with the source's checkpoint interval."""
        self._voted = False
        if self.auto is not None:
            self.auto.rejoined(save_every)


class _TrainCall(TrainerCallback):
    """What this `train()` call did: its first and last step, its losses, its throughput
    through xscale.observe.throughput (first step left out as warm-up), and its saves' stalls
    in the tally.

    The losses and tokens are counted from XscaleTrainer.training_step, not from Trainer's log,
    whose cadence (logging_steps) and token count (include_num_input_tokens_seen) are the
    script's: with the LUMI workshop's logging_steps=500, a shorter run would log none. The
    losses stay on the device and are averaged over the ranks in the stop vote's all-reduce
    (reduce_losses); each rank books its own tokens, and xscale's sum over ranks is the job's
    rate. The clock includes the evaluations and checkpoints inside training, as the job's
    time does.

    The step time's data share (xscale.observe.steptime) is the time from the last step's end (or
    log, evaluation, save) to the next step's beginning: Trainer fetches the step's batches
    there. The stop vote every ten steps (_StopOnSignal, after this callback) falls into it
    too: one small all-reduce of ranks that the step's own all-reduce has just brought
    together. `wrapped()` is the model as Trainer trains it (DDP on several ranks), known once
    training begins.
    """

    def __init__(self, tally: runtime.RunTally, wrapped: Callable[[], nn.Module]) -> None:
        self.tally, self.wrapped = tally, wrapped
        self.start_step = 0
        self.end_step = 0
        self._began = False  # this train() call's loop began (a live recovery begins it again)
        self.loss_first: float | None = None
        self.loss_last: float | None = None
        self._losses = SumMeter()  # the step losses since the last vote, on the device
        self._tokens = 0  # the step's, on this rank
        self._steps_since_vote = 0
        self.throughput = Throughput(tally.ctx.device, warmup_steps=1)
        # The end of the last step, log, evaluation or save: a save after it is a stall, a
        # step's beginning after it a wait for data.
        self._busy_until = 0.0

    def micro_batch(self, loss: torch.Tensor, inputs: Mapping[str, Any]) -> None:
        """A micro-batch's loss (Trainer's share of the step's: their sum is the step's loss)
        and its tokens (the input_ids', padding included, as Trainer counts them)."""
        self._losses.add(loss_sum=loss)
        input_ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else None
        self._tokens += input_ids.numel() if torch.is_tensor(input_ids) else 0

    def reduce_losses(self, **shared: float) -> dict[str, Any]:
        """The vote's all-reduce with the mean step loss since the last vote in it."""
        steps = {"loss_steps": float(self._steps_since_vote)}
        sums = self._losses.reduce(**shared, **steps) if self._losses \
            else all_reduce_sums({"loss_sum": 0.0, **steps, **shared})
        self._losses.reset()
        self._steps_since_vote = 0
        if sums["loss_steps"]:
            self.loss_last = sums["loss_sum"] / sums["loss_steps"]
            if self.loss_first is None:
                self.loss_first = self.loss_last
        return sums

    def call_begins(self) -> None:
        """A train() call begins: its first step, throughput and clocks are its own."""
        self._began = False

    def rejoined(self) -> None:
        """After a live recovery: the losses since the last vote are forgotten on every rank
        (the replacement has none), and the next vote averages the steps from here."""
        self._losses.reset()
        self._steps_since_vote = 0

    def on_train_begin(self, args, state, control, **kwargs):
        # Called after Trainer restored the checkpoint's state: global_step is where we resume.
        # After a live recovery Trainer's loop begins again within the same call.
        self.end_step = state.global_step
        self._busy_until = time.perf_counter()
        if self._began:
            return
        self._began = True
        self.start_step = state.global_step
        self._steps_since_vote = 0
        self.throughput.start()
        self.tally.clock.watch(self.wrapped())

    def on_step_begin(self, args, state, control, **kwargs):
        self.tally.clock.waited_for_data(time.perf_counter() - self._busy_until)
        self.tally.flops.begin()  # counts the first step only

    def on_step_end(self, args, state, control, **kwargs):
        samples = args.per_device_train_batch_size * args.gradient_accumulation_steps
        self.throughput.step(samples, self._tokens)
        self._tokens = 0
        self._steps_since_vote += 1
        self.tally.flops.end()
        self.tally.clock.step()
        if self.end_step == self.start_step:  # this call's first step
            self.tally.first_step(state.global_step)
        self.end_step = state.global_step
        self._busy_until = time.perf_counter()

    def on_evaluate(self, args, state, control, **kwargs):
        self._busy_until = time.perf_counter()  # an evaluation due at a save is no stall

    def on_save(self, args, state, control, **kwargs):
        # Trainer saves right after the step's end, its log and its evaluation, if due: the
        # time since is how long the checkpoint held training up (every rank saves with it).
        self.tally.saved(state.global_step, time.perf_counter() - self._busy_until)
        self._busy_until = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._busy_until = time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        self.tally.flops.cancel()  # a step that never ended leaves no counting behind
        self.throughput.stop()
        self.end_step = state.global_step


class TrainerPlace(NamedTuple):
    """Where Trainer's loop is, as the source rank hands it over in a live recovery
    (xscale.recovery.protocol.Place): its optimizer steps, Trainer's state (what
    trainer_state.json holds), the scheduler's and the loss scaler's states, and the checkpoint
    interval that checkpoint_every="auto" decided (None: not yet)."""

    step: int
    state: TrainerState
    scheduler: dict
    scaler: dict | None
    save_every: int | None
    shrinks: tuple[WorldChange, ...] = ()  # runtime.Shrinks.handed()


class _TrainingDone(Exception):
    """Trainer's loop began where its last step is done."""


class _NoStepPastTheLast(TrainerCallback):
    """Trainer begun at its last step (max_steps) trains one step more before its loop checks
    the count: a resume from the last step's checkpoint (a finished job submitted again), or a
    live recovery after the last step, before train() returned. The loop is left before that
    step (XscaleTrainer._trained_to_the_end), as xscale.Loop trains none there."""

    def on_step_begin(self, args, state, control, **kwargs):
        if 0 < state.max_steps <= state.global_step:
            raise _TrainingDone()


class _Rejoin(Exception):
    """A replacement received its state: Trainer's loop begins again at the received step."""


class _StepDropped(Exception):
    """The group broke before this step's update: the loop is left before it counts the step."""


class _LiveSteps(TrainerCallback):
    """Live recovery (xscale.recovery.live) under Trainer's loop, which is its own and cannot be
    moved to another step from outside. A broken group therefore leaves Trainer.train()
    through an exception, at a step boundary where the model, optimizer, scheduler and
    global_step agree: before a dropped step is counted (on_optimizer_step: the update was
    dropped, the scheduler not yet stepped), at a step's end, or from a collective that raised
    GroupBroken. XscaleTrainer.train catches it, recovers (leave, form the next group, the
    source rank's state to every rank), and calls Trainer's train() again from the state in
    memory: a folder holding only trainer_state.json stands for the checkpoint, Trainer skips
    its data to the source's step on the same sampler order as at a resume, and the loads of
    weights, optimizer, scheduler and generators are this class's (XscaleTrainer's overrides).

    A replacement builds its Trainer as the others did, receives the state as its loop begins
    (on_train_begin, this callback first), and begins again the same way. The lost rank's
    random generators are not recovered: a model with dropout draws other masks from there."""

    def __init__(self, trainer: XscaleTrainer) -> None:
        self.trainer = trainer
        self.live: live.Live | None = None
        self._asked = False  # whether live.for_loop was asked (at the first loop's beginning)
        self._place: TrainerPlace | None = None  # the state received, to begin again from
        self._loads: tuple[dict, TrainerPlace] | None = None  # the optimizer's state and place
        self._folder: str | None = None
        self._mid_step = False  # a micro-batch of the step under way was begun

    # ---- in Trainer's loop ----------------------------------------------------------------

    def on_train_begin(self, args, state, control, **kwargs):
        if self._asked:
            return
        self._asked = True
        trainer = self.trainer
        if is_sharded(trainer.model_wrapped) and links.link() is not None:
            why = ("the model is sharded (FSDP through accelerate): Trainer's loop takes no peer "
                   "snapshots, and a lost shard is held nowhere else")
            links.link().not_live(why)
        else:
            self.live, why = live.for_loop(trainer.ctx, trainer.model_wrapped,
                                           _torch_optimizer(trainer.optimizer), redivides=True)
        if why is not None and trainer.ctx.is_main:
            print(f"xscale: live recovery is off for this run: {why}; a lost node restarts the "
                  "launch on a spare instead (docs/YOUR-SCRIPT.md)", flush=True)
        if self.live is not None:
            cannot = _cannot_shrink(trainer, kwargs["train_dataloader"],
                                    self.live.link.launch_world)
            if cannot is None:
                self.live.may_shrink()
            elif trainer.ctx.is_main:
                print(f"xscale: with no spare left this run cannot go on in a smaller world: "
                      f"{cannot}", flush=True)
        if self.live is not None and self.live.link.joining:
            self._place = self.live.receive()
            self._take_shrinks()
            raise _Rejoin()

    def before_micro_batch(self) -> None:
        """The kind's collectives before a forward (DDP's buffers), none on a broken group;
        in a smaller world, where ranks take unequal shares of a step, once at its start."""
        if self.live is not None:
            if self.live.broken:
                raise GroupBroken("the group broke before this micro-batch")
            if self._mid_step and self.trainer.share is not None:
                return
            self._mid_step = True
            self.live.before_batch()

    def before_update(self) -> None:
        """The kind's collectives between the last backward and the clipping (DDP's first
        step of a new group)."""
        self._mid_step = False
        if self.live is not None:
            self.live.before_update()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.live is not None and self.live.step_dropped:
            raise _StepDropped()

    def on_step_end(self, args, state, control, **kwargs):
        if self.live is not None and self.live.broken:  # after this rank's update: counted
            raise GroupBroken("the group broke after this rank's update")

    def on_train_end(self, args, state, control, **kwargs):
        if self.live is not None:
            self.live.close()  # a failure from here on ends the launch as before

    # ---- in XscaleTrainer.train -----------------------------------------------------------

    def recoverable(self, error: Exception) -> bool:
        """Whether ERROR left Trainer's loop for a live recovery."""
        if isinstance(error, _Rejoin):
            return True
        return self.live is not None and not self.live.link.closed and (
            isinstance(error, (GroupBroken, _StepDropped)) or self.live.broken)

    def recover(self) -> str:
        """Recover (a survivor) or take the state received (a replacement); the folder Trainer's
        train() resumes from."""
        trainer = self.trainer
        self._mid_step = False
        launch_world = self.live.link.launch_world
        if self._place is None:  # a survivor
            recovered = self.live.recover(self._here())
            self._place = recovered.position
            self._take_shrinks()
            if dist.get_world_size() != trainer.ctx.world_size:
                self._go_on_in_new_world(self._place.step, launch_world)
            if trainer.ctx.is_main:
                print(f"{runtime.script_name()}: live recovery: training goes on at step "
                      f"{self._place.step}, {recovered.seconds:.1f} s after this rank left the "
                      f"broken group (the state's transfer: {recovered.handover_s:.2f} s)",
                      flush=True)
        elif dist.get_world_size() != launch_world:  # started again in a smaller world
            trainer.take_world(dist.get_rank(), dist.get_world_size(), self.live.link.nnodes,
                               launch_world)
        place, self._place = self._place, None
        optimizer = _torch_optimizer(trainer.optimizer)
        # Trainer makes its scheduler again, which sets the optimizer's learning rate to the
        # schedule's first: the state is loaded after it (load_optimizer_and_scheduler).
        self._loads = (optimizer.state_dict(), place)
        trainer.optimizer = optimizer  # Trainer wraps it for accelerate again, once
        if self._folder is None:
            self._folder = tempfile.mkdtemp(prefix="xscale-live-")
        place.state.save_to_json(os.path.join(self._folder, TRAINER_STATE))
        trainer.rejoined(place.save_every)
        return self._folder

    def _take_shrinks(self) -> None:
        """The source's smaller worlds (runtime.Shrinks.take), at the place received."""
        self.trainer.shrinks.take(self._place.shrinks, self._place.step,
                                  whole=dist.get_world_size() == self.live.link.launch_world)

    def _go_on_in_new_world(self, step: int, launch_world: int) -> None:
        """No spare was left: this rank's number in the smaller world (the coordinator's) and
        its share of each step from here (XscaleTrainer.take_world); or the lost ranks came
        back: the launch's world again."""
        trainer, world = self.trainer, dist.get_world_size()
        nodes = self.live.link.nnodes
        trainer.take_world(dist.get_rank(), world, nodes, launch_world)
        share = trainer.share
        if share is None:  # the shrink's end is in _take_shrinks
            line = runtime.grew_back(runtime.script_name(), world, nodes, step)
        else:
            trainer.shrinks.went_on(step, world, nodes)
            line = runtime.went_smaller(runtime.script_name(), world, nodes,
                                        share.per_step * share.world, len(share.micro_batches))
        if trainer.ctx.is_main:
            print(line, flush=True)

    def _here(self) -> TrainerPlace:
        """This rank's place; the source rank's is every rank's after the hand-over."""
        trainer = self.trainer
        scaler = getattr(trainer.accelerator, "scaler", None)
        auto = trainer.stop.auto
        return TrainerPlace(step=trainer.state.global_step, state=trainer.state,
                            scheduler=trainer.lr_scheduler.state_dict(),
                            scaler=None if scaler is None else scaler.state_dict(),
                            save_every=None if auto is None else auto.every,
                            shrinks=trainer.shrinks.handed())

    def holds(self, checkpoint: str | None) -> bool:
        """Whether CHECKPOINT is the folder that stands for the state in memory."""
        return checkpoint is not None and checkpoint == self._folder

    def load_optimizer_and_scheduler(self) -> None:
        trainer = self.trainer
        optimizer_state, place = self._loads
        self._loads = None
        trainer.optimizer.load_state_dict(optimizer_state)
        trainer.lr_scheduler.load_state_dict(place.scheduler)
        scaler = getattr(trainer.accelerator, "scaler", None)
        if scaler is not None and place.scaler is not None:
            scaler.load_state_dict(place.scaler)

    def forget(self) -> None:
        """The train() call is over, or failed: the folder goes."""
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's wrappers (AcceleratedOptimizer.optimizer): the
    one whose step live recovery's pre-hook drops, and whose state it hands over."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


class _ProfileSteps(TrainerCallback):
    """xscale's profiling window (PROFILE_STEP_START, PROFILE_STEPS, from run-profile.sh) on
    Trainer's steps: the window is built before training, so a bad setting fails at once."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.window = profile_window.window_from_env(rank, device)

    def on_step_begin(self, args, state, control, **kwargs):
        self.window.step(state.global_step)  # the 0-based index of the step about to run

    def on_train_end(self, args, state, control, **kwargs):
        self.window.close()


def _checkpoint_written(output_dir: str, call: _TrainCall) -> str | None:
    """The checkpoint of the step this train() call ended at, if it wrote one."""
    path = os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{call.end_step}")
    written = call.end_step > call.start_step and os.path.isfile(
        os.path.join(path, TRAINER_STATE))
    return path if written else None


def tensorboard(logging_dir: str) -> TensorBoardCallback:
    """A callback for TensorBoard logging into `logging_dir` (rank 0 writes), the same on
    transformers 4.x and 5.x (5.0 removed TrainingArguments.logging_dir)."""
    return _TensorBoardInto(logging_dir)


class _TensorBoardInto(TensorBoardCallback):
    """TensorBoardCallback writing into one directory on transformers 4.x and 5.x alike: 4.x
    reads TrainingArguments.logging_dir (which 5.0 removed) in `_init_summary_writer(args,
    log_dir)`, 5.x the callback's own `logging_dir` in `_init_summary_writer(args)`."""

    def __init__(self, logging_dir: str) -> None:
        super().__init__()
        self.logging_dir = logging_dir

    def _init_summary_writer(self, args: TrainingArguments, *_: Any) -> None:
        if self._SummaryWriter is not None:
            self.tb_writer = self._SummaryWriter(log_dir=self.logging_dir)


def newest_checkpoint(output_dir: str) -> str | None:
    """The highest-numbered complete `checkpoint-N` in `output_dir`, or None.

    Trainer writes trainer_state.json last, so a directory without it is a save that was cut
    off (time limit, node failure): resuming from it would fail, so it is passed over.
    """
    if not os.path.isdir(output_dir):
        return None
    steps = []
    for name in os.listdir(output_dir):
        prefix, _, number = name.partition("-")
        if prefix == PREFIX_CHECKPOINT_DIR and number.isdigit():
            if os.path.isfile(os.path.join(output_dir, name, TRAINER_STATE)):
                steps.append(int(number))
    if not steps:
        return None
    return os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{max(steps)}")

"""xscale's runtime inside Hugging Face's Trainer: its device and backend, the stop vote, shielded
DataLoader workers, and the one XSCALE_SUMMARY.

Trainer runs its own loop (DDP from the torchrun variables run.sh exports, the
DistributedSampler, rank-0-only tqdm and checkpoints); XscaleTrainer and the callbacks here only
connect it to what every xscale trainer reports and how every xscale trainer stops.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import time
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.integrations import TensorBoardCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from xscale import checkpoint, flight, lifecycle, profiling, progress, runtime, startup, stragglers
from xscale.dist import (
    DistContext,
    Placement,
    choose_backend,
    choose_device,
    probe_accelerator,
)
from xscale.throughput import Throughput

TRAINER_STATE = "trainer_state.json"


def device_and_backend(placement: Placement) -> tuple[torch.device, str]:
    """xscale's choice for Trainer (device from torch.accelerator, backend from the device,
    XSCALE_BACKEND winning), made before Trainer joins the group so a mistake is one line. The
    start-up's `imports` moment: the trainer's libraries are imported by now."""
    startup.mark("imports")
    accel = probe_accelerator()
    device = choose_device(placement.local_rank, accel=accel)
    return device, choose_backend(None, device, accel)


def context(placement: Placement, device: torch.device, backend: str | None) -> DistContext:
    """This rank's context, once Trainer's arguments have joined the group (accelerate does, as
    TrainingArguments is built): the start-up's `group` moment (xscale.startup). From here a
    failed collective leaves its flight record, as in xscale.runtime.start."""
    startup.mark("group")
    lifecycle.on_failure(flight.record_failure)
    return DistContext.at(placement, device, backend)


class XscaleTrainer(Trainer):
    """Trainer whose DataLoader workers start out of reach of Slurm's warning signal, and which
    resumes on CPU ranks too.

    Trainer gives DataLoader a start-method name; a worker spawned from it dies of the SIGUSR1
    that Slurm sends to every process of the step. The loaders Trainer builds get xscale's
    shielded context instead (xscale.lifecycle.worker_context), before their workers start.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _load_cpu_ranks_on_the_cpu()

    def get_train_dataloader(self) -> DataLoader:
        return shield_workers(super().get_train_dataloader())

    def get_eval_dataloader(self, *args: Any, **kwargs: Any) -> DataLoader:
        return shield_workers(super().get_eval_dataloader(*args, **kwargs))


@functools.cache  # once per process
def _load_cpu_ranks_on_the_cpu() -> None:
    """accelerate names a CPU rank's device `cpu:N` (N: its local rank), and Trainer (transformers
    4.x) resumes the optimizer with `torch.load(map_location=that device)` when there are several
    ranks; torch knows the location `cpu` only ("don't know how to restore data location ...
    cpu:0"). torch's own hook for storage locations maps every `cpu:N` to the CPU."""
    torch.serialization.register_package(
        11, lambda storage: None,  # tags nothing: torch's own tagger names CPU storage
        lambda storage, location: storage if location.startswith("cpu:") else None)


def shield_workers(loader: DataLoader) -> DataLoader:
    """Give `loader` (or the DataLoader inside accelerate's adapter, which iterates it) the
    shielded context; a loader without workers has no use for one."""
    inner = getattr(loader, "base_dataloader", loader)
    shielded = (lifecycle.ShieldedSpawnContext, lifecycle.ShieldedForkContext)
    if inner.num_workers > 0 and not isinstance(inner.multiprocessing_context, shielded):
        spawn = multiprocessing.get_start_method(allow_none=True) == "spawn"
        inner.multiprocessing_context = lifecycle.worker_context(spawn=spawn)
    return loader


class AutoSaveSteps:
    """--save-steps auto: Trainer's checkpoint cadence from Young's interval, as the runtime's
    --checkpoint-every auto (xscale.checkpoint.auto_decision). Trainer saves after the step's
    callbacks, so the first stop vote after a timed step asks for a save, and the next vote,
    once RunRecord has timed that save, hands rank 0's interval to every rank in its
    all-reduce."""

    def __init__(self, record: RunRecord, is_main: bool, nodes: int, node_mtbf_h: float) -> None:
        self.record = record
        self.is_main, self.nodes, self.node_mtbf_h = is_main, nodes, node_mtbf_h
        self._first_end: tuple[int, float] | None = None  # this call's first step: warm-up
        self._saves_before: int | None = None  # RunRecord's count when the save was asked for
        self.step_s = 0.0
        self.every: int | None = None  # the decision, on every rank

    def at_vote(self, state: TrainerState, control: TrainerControl) -> dict[str, float]:
        """What this rank adds to the vote: rank 0's interval once its save was timed."""
        if self.every is not None or self._first_end is None:
            return {}
        first_step, first_end = self._first_end
        if self._saves_before is None and state.global_step > first_step:
            self.step_s = (time.perf_counter() - first_end) / (state.global_step - first_step)
            self._saves_before = self.record.saves
            control.should_save = True
            return {}
        if self._saves_before is None or self.record.saves == self._saves_before:
            return {}  # every rank saves at the same step: none has timed it yet
        if not self.is_main:
            return {"every": 0.0}
        every, line = checkpoint.auto_decision("--save-steps", self.record.last_stall_s, 0.0,
                                               self.step_s, self.nodes, self.node_mtbf_h)
        print(line, flush=True)
        return {"every": float(every)}

    def step_ended(self, state: TrainerState) -> None:
        if self._first_end is None:
            self._first_end = (state.global_step, time.perf_counter())

    def decided(self, state: TrainerState, shared: dict[str, float]) -> None:
        if "every" in shared:
            self.every = state.save_steps = int(shared["every"])


def initial_save_steps(save_steps: int | str, max_steps: int, resume_from: str | None) -> int:
    """Trainer's save_steps as training starts. With auto, until the timed save decides anew:
    the interval the checkpoint resumed from was saved with (Trainer restores that one anyway,
    and warns when the arguments differ), else none but the last step's."""
    if save_steps != "auto":
        return int(save_steps)
    if resume_from is not None:
        with open(os.path.join(resume_from, TRAINER_STATE)) as handle:
            saved = json.load(handle).get("save_steps")
        if isinstance(saved, int) and saved > 0:
            return saved
    return max_steps


class StopOnSignal(TrainerCallback):
    """The runtime's stop vote and checkpoint cadence on Trainer's steps. Every
    STOP_VOTE_EVERY steps and at the last, all ranks ask whether any received SIGUSR1/SIGTERM;
    if so, Trainer saves a checkpoint at the end of this step and ends training, and the run
    exits 0. The last step is saved too, as in every xscale trainer (Trainer itself saves only
    every save_steps). With `auto`, the same vote sets save_steps (AutoSaveSteps)."""

    def __init__(self, every: int = runtime.STOP_VOTE_EVERY,
                 watch: stragglers.StragglerWatch | None = None,
                 auto: AutoSaveSteps | None = None) -> None:
        self.every = every
        self.stopped_at: int | None = None
        self.watch = watch  # its vector travels in the vote (xscale.stragglers)
        self.auto = auto

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> TrainerControl:
        last = state.global_step >= state.max_steps
        if last:
            control.should_save = True
        if self.watch is not None:
            self.watch.step()
        if self.auto is not None:
            self.auto.step_ended(state)
        if last or state.global_step % self.every == 0:
            proposal = self.auto.at_vote(state, control) if self.auto is not None else {}
            stop, shared = runtime.vote(watch=self.watch, **proposal)
            if self.auto is not None:
                self.auto.decided(state, shared)
            if stop:
                control.should_save = True
                control.should_training_stop = True
                self.stopped_at = state.global_step
        return control


class RunRecord(TrainerCallback):
    """What this `train()` call did: its first and last step, the losses it logged, and its
    throughput through xscale.throughput (first step left out as warm-up).

    Trainer's log_history also holds the entries of the run a checkpoint came from, so the
    losses are collected from `on_log` of this call's steps. Trainer logs the mean loss over
    all ranks, and counts tokens over all ranks (include_num_input_tokens_seen): each rank
    books its share so that xscale's sum over ranks is the job's rate. The clock includes the
    evaluations and checkpoints inside training, as the job's time does.
    """

    def __init__(self, device: torch.device, is_main: bool = False) -> None:
        self.start_step = 0
        self.end_step = 0
        self.losses: list[float] = []
        self.throughput = Throughput(device, warmup_steps=1)
        self.progress = progress.Progress(is_main)  # for the step supervisor's goodput ledger
        self._tokens_seen = 0
        self._before_save = 0.0
        self.stall_s, self.saves = 0.0, 0  # Trainer's saves: synchronous, on every rank
        self.last_stall_s = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        # Called after Trainer restored the checkpoint's state: global_step is where we resume.
        self.start_step = self.end_step = state.global_step
        self._tokens_seen = state.num_input_tokens_seen
        self.throughput.start()

    def on_step_end(self, args, state, control, **kwargs):
        tokens = state.num_input_tokens_seen - self._tokens_seen
        self._tokens_seen = state.num_input_tokens_seen
        samples = args.per_device_train_batch_size * args.gradient_accumulation_steps
        self.throughput.step(samples, tokens / args.world_size)
        if self.end_step == self.start_step:  # this call's first step
            runtime.first_step_done(self.throughput.device)
            self.progress.note("first_step", state.global_step)
        elif state.global_step % runtime.STOP_VOTE_EVERY == 0:
            self.progress.note("interval", state.global_step)
        self.end_step = state.global_step
        self._before_save = time.perf_counter()

    def on_evaluate(self, args, state, control, **kwargs):
        self._before_save = time.perf_counter()  # an evaluation due at a save is no stall

    def on_save(self, args, state, control, **kwargs):
        # Trainer saves right after the step's end, its log and its evaluation, if due: the
        # time since is how long the checkpoint held training up.
        self.last_stall_s = time.perf_counter() - self._before_save
        self.stall_s += self.last_stall_s
        self.saves += 1
        self.progress.note("checkpoint", state.global_step, stall_s=self.last_stall_s)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))
        self._before_save = time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        self.throughput.stop()
        self.end_step = state.global_step
        self.progress.note("end", state.global_step)


class ProfileSteps(TrainerCallback):
    """xscale's profiling window (PROFILE_STEP_START, PROFILE_STEPS, from run-profile.sh) on
    Trainer's steps: the window is built before training, so a bad setting fails at once."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.window = profiling.window_from_env(rank, device)

    def on_step_begin(self, args, state, control, **kwargs):
        self.window.step(state.global_step)  # the 0-based index of the step about to run

    def on_train_end(self, args, state, control, **kwargs):
        self.window.close()


def write_summary(ctx: DistContext, model: torch.nn.Module, trainer: str, started: float,
                  args: TrainingArguments, record: RunRecord, stop: StopOnSignal,
                  checkpoint: str | None, **own: Any) -> None:
    """xscale.runtime's XSCALE_RANK and XSCALE_SUMMARY lines for a Trainer run; the whole
    summary goes into Trainer's output directory, beside its checkpoints."""
    runtime.write_summary(
        ctx, model, trainer=trainer, started=started, start_step=record.start_step,
        steps=record.end_step, meter=record.throughput,
        loss_first=record.losses[0] if record.losses else None,
        loss_last=record.losses[-1] if record.losses else None,
        stopped=stop.stopped_at is not None, checkpoint=checkpoint,
        batch_size=args.per_device_train_batch_size,
        accumulation=args.gradient_accumulation_steps, counts_tokens=True,
        stragglers=stop.watch, checkpoint_stall_s=record.stall_s,
        checkpoints_saved=record.saves, output_dir=args.output_dir, **own)


def checkpoint_written(output_dir: str, record: RunRecord) -> str | None:
    """The checkpoint of the step this train() call ended at, if it wrote one."""
    path = os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{record.end_step}")
    written = record.end_step > record.start_step and os.path.isfile(
        os.path.join(path, TRAINER_STATE))
    return path if written else None


def tensorboard(logging_dir: str) -> TensorBoardCallback:
    """TensorBoard logging into `logging_dir` (rank 0 writes; the callback checks)."""
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

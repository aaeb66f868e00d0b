"""Glue between xscale and Hugging Face's Trainer: callbacks for signals, run records, TensorBoard.

Trainer already does the distributed work (DDP from the torchrun variables run.sh exports, the
DistributedSampler, rank-0-only tqdm and checkpoints); these callbacks only connect it to what
every xscale trainer reports and how every xscale trainer stops.
"""

from __future__ import annotations

import os

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.integrations import TensorBoardCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from xscale import profiling, signals
from xscale.throughput import Throughput

TRAINER_STATE = "trainer_state.json"


class StopOnSignal(TrainerCallback):
    """On SIGUSR1/SIGTERM (Slurm's warning before the time limit, or scancel), save a checkpoint
    at the end of the current step and end training, so the run exits 0 and a requeued job
    resumes from that step instead of losing everything since the last periodic save.

    All ranks must stop at the same step (Trainer's save and DDP's next all-reduce are
    collective), so the decision is xscale.signals' rank-agreed one, asked once per step.
    """

    def __init__(self) -> None:
        self.stopped_at: int | None = None

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs
    ) -> TrainerControl:
        if signals.should_stop():
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

    def __init__(self) -> None:
        self.start_step = 0
        self.end_step = 0
        self.losses: list[float] = []
        self.throughput: Throughput | None = None
        self._tokens_seen = 0

    def on_train_begin(self, args, state, control, **kwargs):
        # Called after Trainer restored the checkpoint's state: global_step is where we resume.
        self.start_step = self.end_step = state.global_step
        self._tokens_seen = state.num_input_tokens_seen
        self.throughput = Throughput(args.device, warmup_steps=1)
        self.throughput.start()

    def on_step_end(self, args, state, control, **kwargs):
        tokens = state.num_input_tokens_seen - self._tokens_seen
        self._tokens_seen = state.num_input_tokens_seen
        samples = args.per_device_train_batch_size * args.gradient_accumulation_steps
        self.throughput.step(samples, tokens / args.world_size)
        self.end_step = state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))

    def on_train_end(self, args, state, control, **kwargs):
        self.throughput.stop()
        self.end_step = state.global_step

    def rates(self) -> dict[str, float]:
        """samples_per_s and tokens_per_s summed over ranks, and the training seconds (a
        collective: every rank calls it)."""
        if self.throughput is None:
            return {"samples_per_s": 0.0, "tokens_per_s": 0.0, "train_seconds": 0.0}
        rates = self.throughput.reduced()
        return {"samples_per_s": rates["samples_per_s"], "tokens_per_s": rates["tokens_per_s"],
                "train_seconds": self.throughput.local().seconds}


class ProfileSteps(TrainerCallback):
    """xscale's profiling window (PROFILE_STEP_START, PROFILE_STEPS, from run-profile.sh) on
    Trainer's steps: the window is built before training, so a bad setting fails at once."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.window = profiling.window_from_env(rank, device)

    def on_step_begin(self, args, state, control, **kwargs):
        self.window.step(state.global_step)  # the 0-based index of the step about to run

    def on_train_end(self, args, state, control, **kwargs):
        self.window.close()


def tensorboard(logging_dir: str) -> TensorBoardCallback:
    """TensorBoard logging into `logging_dir` (rank 0 writes; the callback checks).

    transformers 5 dropped TrainingArguments.logging_dir; the callback's own directory replaces it.
    """
    callback = TensorBoardCallback()
    callback.logging_dir = logging_dir
    return callback


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

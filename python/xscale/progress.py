"""What a person watches during training: the loss (reduced across ranks), a tqdm bar and
TensorBoard scalars, all from rank 0.

Per-step losses stay on the device and are summed there; every `log_every` steps one small
all_reduce turns the window into the job's mean loss. A host sync per step (`loss.item()`)
would stall the GPU queue on every step of every rank.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from xscale.metrics import SumMeter, mean


class TrainLog:
    """Call step() after every training step (all ranks: it contains collectives)."""

    def __init__(self, *, is_main: bool, start_step: int, total_steps: int | None,
                 log_every: int = 10, tensorboard_dir: Path | None = None,
                 desc: str = "train") -> None:
        self.is_main = is_main
        self.start_step = start_step
        self.step_count = start_step
        self.log_every = max(log_every, 1)
        self.loss_first: float | None = None
        self.loss_last: float | None = None
        self._window = SumMeter()
        self._bar = tqdm(total=total_steps, initial=start_step, desc=desc, unit="step",
                         disable=not is_main, file=sys.stderr, dynamic_ncols=True,
                         mininterval=1.0)
        self._writer: Any = None
        if is_main and tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # rank 0 only: a slow import

            self._writer = SummaryWriter(log_dir=str(tensorboard_dir))

    def step(self, step: int, loss: torch.Tensor, samples: int) -> None:
        """`step`: global steps done, including this one; `loss`: this rank's mean loss."""
        self.step_count = step
        self._window.add(loss_sum=loss.detach().float() * samples, samples=samples)
        self._bar.update(1)
        if step == self.start_step + 1 or (step - self.start_step) % self.log_every == 0:
            self.flush()

    def flush(self) -> None:
        """Reduce the losses since the last flush (a collective; a no-op when none)."""
        if not self._window:
            return
        sums = self._window.reduce()
        self._window.reset()
        loss = mean(sums, "loss_sum", "samples")
        if self.loss_first is None:
            self.loss_first = loss
        self.loss_last = loss
        self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        self.scalar("train/loss", loss)

    def scalar(self, name: str, value: float, step: int | None = None) -> None:
        if self._writer is not None:
            self._writer.add_scalar(name, value, self.step_count if step is None else step)

    def message(self, text: str) -> None:
        """A line on rank 0 that does not tear the progress bar."""
        if self.is_main:
            self._bar.write(text, file=sys.stderr)

    def close(self) -> None:
        self.flush()
        self._bar.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

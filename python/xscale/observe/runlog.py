"""The run log: what a person watches while a run goes on, and the records it leaves.

- TrainLog: the loss reduced every `log_every` steps, a tqdm bar and TensorBoard, on rank 0.
- The machine-readable lines, for tests, benchmarks, the supervisor and xscale.observe.report
  (xscale.shared.taglines reads them). Every rank: `XSCALE_RANK {json}` (rank, local_rank, node,
  steps, param_digest, startup): replicas that are really replicas have the same digest, the
  cheapest proof that gradients were reduced; startup holds the rank's start-up phases in seconds
  (xscale.observe.startup).
- The summary, rank 0's, in two places. Whole, every field, in SUMMARY_FILE in the run's output
  directory; then, as the run's last line, `XSCALE_SUMMARY {json}`: the same record without the
  per-phase start-up detail, short enough that `srun --label` never cuts it (LINE_BUDGET), so
  that `grep XSCALE_SUMMARY job.out | cut -d' ' -f3- | jq .` works on any job's output. Its
  `summary_file` says where the whole record is (null: the run had no output directory).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from xscale.dist import unwrap
from xscale.reductions import SumMeter

RANK_TAG = "XSCALE_RANK"
SUMMARY_TAG = "XSCALE_SUMMARY"
# Every trainer's summary has these, in this order (a value may be null: tokens_per_s where a
# trainer counts no tokens, losses of a run that took no step, checkpoint when this run wrote
# none, summary_file without an output directory), then the trainer's own fields. One schema, so
# that report, bench and tests read any trainer alike.
SUMMARY_FIELDS = (
    "trainer", "world_size", "nodes", "device", "backend",
    "start_step", "steps", "batch_size", "global_batch_size", "accumulation",
    "samples_per_s", "samples_per_s_per_rank", "tokens_per_s",
    "loss_first", "loss_last", "seconds", "train_seconds",
    "stopped_early", "signal", "checkpoint", "checkpoint_stall_s", "checkpoints_saved",
    "startup", "straggler", "step_time", "bound", "tflops", "mfu", "step_time_ranks", "flops",
    "shrinks", "summary_file",
)
# The whole summary, written by rank 0 into the run's output directory before the line.
SUMMARY_FILE = "xscale-summary.json"
# Only in the file: each phase's median, slowest rank and its node, six times over, is 500 to
# 700 bytes on a large job, and the step time's rank and each share's lowest and highest rank
# 400; the line would not fit with them.
FILE_ONLY = ("startup", "step_time_ranks", "flops")
# srun --label cuts a line's text after 1024 bytes (xscale.shared.taglines.SRUN_LABEL_CUT) and
# prefixes it with the task's number, as wide as the job's largest ("123456: "). The line's JSON
# stays within this many bytes, so that even counting its tag and that label it keeps 11 bytes to
# spare (19 of the text srun counts).
LINE_BUDGET = 990
# Where a line would still be longer (output paths of unusual length, a trainer with many fields
# of its own), fields are left out of it, the file keeping them: the checkpoint's path first (the
# longest field, which only a resumed run reads, from the file), then the trainer's own from the
# last (an accuracy is what people grep the line for), then these.
LEFT_OUT_FIRST = ("checkpoint",)
LEFT_OUT_NEXT = ("straggler", "summary_file")


# ---- what a person watches -------------------------------------------------------------------

# Where stderr is a file or a pipe (a batch job's output), the bar is drawn as a line this often.
LOG_LINE_EVERY_S = 30.0


class LogLines:
    """The bar's stream where stderr is not a terminal: each drawing of the bar a line of its own.

    tqdm redraws in place, '\\r' and no newline, so in a job's output all of a run's drawings make
    one line. srun --label cuts that line every 1024 bytes and puts the task's label in the cut,
    which can fall inside a character: the output is then not even valid UTF-8."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        drawn = text.replace("\r", "").strip()  # tqdm pads a shorter drawing with spaces
        if drawn:  # not tqdm's erasures (spaces) or its last newline
            self.stream.write(drawn + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(**options: Any) -> tqdm:
    """tqdm(**options); where stderr is not a terminal, drawn as lines (LogLines) in ASCII every
    LOG_LINE_EVERY_S instead, whatever `options` say of the drawing."""
    if not sys.stderr.isatty():
        options.update(file=LogLines(sys.stderr), mininterval=LOG_LINE_EVERY_S, ascii=True)
    return tqdm(**options)


class TrainLog:
    """The job's mean loss every `log_every` steps (and after the first), a tqdm bar and
    TensorBoard scalars from rank 0. Per-step losses stay on the device; each flush is one small
    all_reduce, which also carries whatever the caller adds (the stop flag)."""

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
        self._bar = progress_bar(total=total_steps, initial=start_step, desc=desc, unit="step",
                                 disable=not is_main, file=sys.stderr, dynamic_ncols=True,
                                 mininterval=1.0)
        self._writer: Any = None
        if is_main and tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # rank 0 only: a slow import

            self._writer = SummaryWriter(log_dir=str(tensorboard_dir))

    def add(self, step: int, loss: torch.Tensor, samples: int) -> None:
        """One micro-batch's loss (this rank's mean over `samples`); `step`: steps done."""
        self.step_count = step
        self._window.add(loss_sum=loss.detach().float() * samples, samples=samples)

    def advance(self) -> None:
        self._bar.update(1)

    def due(self, step: int) -> bool:
        """Whether the loss is reduced after `step` (the same answer on every rank)."""
        done = step - self.start_step
        return done == 1 or done % self.log_every == 0

    def flush(self, **extra: float) -> dict[str, float]:
        """Reduce the losses since the last flush and `extra` (a collective); the reduced
        extras."""
        sums = self._window.reduce(samples=0.0, loss_sum=0.0, **extra) if not self._window \
            else self._window.reduce(**extra)
        self._window.reset()
        if sums["samples"]:
            loss = sums["loss_sum"] / sums["samples"]
            if self.loss_first is None:
                self.loss_first = loss
            self.loss_last = loss
            self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            self.scalar("train/loss", loss)
        return {name: sums[name] for name in extra}

    def scalar(self, name: str, value: float, step: int | None = None) -> None:
        if self._writer is not None:
            self._writer.add_scalar(name, value, self.step_count if step is None else step)

    def message(self, text: str) -> None:
        """A line on rank 0 that does not tear the progress bar."""
        if self.is_main:
            self._bar.write(text, file=sys.stderr)

    def close(self) -> None:
        self._bar.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None


# ---- the records a run leaves ----------------------------------------------------------------


def param_digest(model: nn.Module) -> str:
    """sha256 over every parameter's name, dtype, shape and bytes, in name order.

    Parameters only: BatchNorm's running statistics are buffers that each rank updates from
    its own batches, so they legitimately differ between replicas. A sharded model's (FSDP2's
    DTensors) are gathered whole first, a collective: every rank calls this, in the same order.
    """
    digest = hashlib.sha256()
    for name, param in sorted(unwrap(model).named_parameters(), key=lambda item: item[0]):
        whole = param.full_tensor() if hasattr(param, "full_tensor") else param
        tensor = whole.detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _plain(value: Any) -> Any:
    """JSON-safe: tensors become numbers, paths strings, NaN/inf null (strict JSON has neither)."""
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def encode(fields: Mapping[str, Any]) -> str:
    """Compact JSON (no spaces after the separators: the summary line has bytes to spare for
    none)."""
    return json.dumps(_plain(fields), separators=(",", ":"))


def line(tag: str, fields: Mapping[str, Any]) -> str:
    return f"{tag} {encode(fields)}"


def rank_record(**fields: Any) -> None:
    """Print this rank's `XSCALE_RANK {json}` line (every rank calls this)."""
    print(line(RANK_TAG, fields), flush=True)


def summary_record(common: Mapping[str, Any], own: Mapping[str, Any]) -> dict[str, Any]:
    """SUMMARY_FIELDS in their order, then the trainer's own; a missing common field is a bug
    in xscale, not the user's, so it fails loudly."""
    missing = [name for name in SUMMARY_FIELDS if name not in common]
    if missing:
        raise KeyError(f"XSCALE_SUMMARY lacks {missing}")
    clash = sorted(set(own) & set(SUMMARY_FIELDS))
    if clash:
        raise KeyError(f"trainer fields {clash} would overwrite XSCALE_SUMMARY's own")
    return {**{name: common[name] for name in SUMMARY_FIELDS}, **own}


def line_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """The summary line's fields: the record without FILE_ONLY, within LINE_BUDGET bytes."""
    fields = {name: value for name, value in record.items() if name not in FILE_ONLY}
    own = [name for name in fields if name not in SUMMARY_FIELDS]
    for name in (*LEFT_OUT_FIRST, *reversed(own), *LEFT_OUT_NEXT):
        if len(encode(fields).encode()) <= LINE_BUDGET:
            break
        fields.pop(name, None)
    return fields


def summary_path(output_dir: str | Path | None) -> Path | None:
    """Where the whole summary goes: SUMMARY_FILE in the output directory, absolute, so that
    the line names it for a reader in any directory; None without an output directory."""
    return None if output_dir is None else Path(os.path.abspath(output_dir)) / SUMMARY_FILE


def write_summary_file(record: Mapping[str, Any], path: Path) -> None:
    """The record as indented JSON, published whole (a reader never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.",
                                     delete=False) as handle:
        json.dump(_plain(record), handle, indent=1)
        handle.write("\n")
    os.replace(handle.name, path)


def emit_summary(record: Mapping[str, Any]) -> None:
    """The whole record into its file (when it names one), then the line (rank 0, last)."""
    if record.get("summary_file") is not None:
        write_summary_file(record, Path(record["summary_file"]))
    sys.stderr.flush()
    print(line(SUMMARY_TAG, line_record(record)), flush=True)

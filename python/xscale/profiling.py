"""A profiling window of PROFILE_STEPS steps from step PROFILE_STEP_START, on the chosen ranks.

Profiling every step of every rank drowns the profiler and the file system; training is
balanced, so a few dozen steps of one rank tell the story (the LUMI AI workshop, E09, profiles
rank 14 for 32 steps). Two ways, chosen by what run.sh / run-profile.sh exported for this rank:

- XSCALE_PROFILED=1: an external profiler (rocprof, nsys) already wraps this process. On a GPU
  the window is marked for it: cudaProfilerStart/Stop (hipProfilerStart/Stop on ROCm) at its
  edges, so `--capture-range=cudaProfilerApi` style options record only the window, and an
  NVTX/ROCTX range per step so the timeline reads in steps.
- XSCALE_TORCH_PROFILER=1: torch.profiler records the window itself and writes a Chrome/
  TensorBoard trace into PROFILE_DIR/rank<R>.
- neither: nothing happens; step() is two integer comparisons.

Steps are global training steps, so a resumed run profiles only if the window is still ahead.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from xscale import settings
from xscale.lifecycle import UserError

DEFAULT_START = 10
DEFAULT_STEPS = 32


def _count(env: Mapping[str, str], name: str, default: int, least: int) -> int:
    raw = env.get(name, "")
    if raw == "":
        return default
    if not raw.strip().isdigit() or int(raw) < least:
        raise UserError(f"{name}='{raw}' is not a whole number >= {least}")
    return int(raw)


class ProfileWindow:
    """Call step(step) before each training step (its 0-based global index), close() at the
    end. mode: "off", "external" or "torch"."""

    def __init__(self, mode: str, rank: int, device: torch.device, start: int = DEFAULT_START,
                 steps: int = DEFAULT_STEPS, directory: Path | None = None) -> None:
        if mode not in ("off", "external", "torch"):
            raise ValueError(f"unknown profiling mode {mode!r}")
        self.mode = mode
        self.rank = rank
        self.device = device
        self.start = start
        self.end = start + steps
        self.directory = directory
        self.active = False
        self._in_step_range = False
        self._profiler: torch.profiler.profile | None = None
        self._finished = mode == "off"

    # -- the per-step call ---------------------------------------------------------------------

    def step(self, step: int) -> None:
        if self._finished:
            return
        if self.mode == "external":
            self._external(step)
        else:
            self._torch(step)

    def close(self) -> None:
        """End a window the run did not reach the end of (max steps, a stop signal)."""
        if self.mode == "external" and self.active:
            self._stop_external(None)
        elif self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
            self.active = False
        self._finished = True

    # -- an external profiler wraps us: mark the window for it ------------------------------------

    def _on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def _external(self, step: int) -> None:
        if self.active and step >= self.end:
            self._stop_external(step)
            return
        if not self.active and self.start <= step < self.end:
            self.active = True
            self._say(f"profiling window opens: steps {step}..{self.end - 1}")
            if self._on_gpu():
                torch.cuda.synchronize(self.device)
                torch.cuda.profiler.start()
        if self.active and self._on_gpu():
            if self._in_step_range:
                torch.cuda.nvtx.range_pop()
            torch.cuda.nvtx.range_push(f"step {step}")
            self._in_step_range = True

    def _stop_external(self, step: int | None) -> None:
        if self._on_gpu():
            if self._in_step_range:
                torch.cuda.nvtx.range_pop()
                self._in_step_range = False
            torch.cuda.synchronize(self.device)
            torch.cuda.profiler.stop()
        self.active = False
        self._finished = True
        self._say(f"profiling window closed at step {step if step is not None else 'end'}")

    # -- torch.profiler records the window itself -------------------------------------------------

    def _torch(self, step: int) -> None:
        if self._profiler is None:
            if step >= self.end:  # a resumed run that starts past the window
                self._finished = True
                return
            self._profiler = self._make_torch_profiler(step)
            self._profiler.start()
            self.active = True
            return
        self._profiler.step()
        if step >= self.end:
            self._profiler.stop()
            self._profiler = None
            self.active = False
            self._finished = True
            self._say(f"torch.profiler trace written to {self.directory}")

    def _make_torch_profiler(self, first_step: int) -> torch.profiler.profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self._on_gpu():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        ahead = max(self.start - first_step, 0)
        warmup = 1 if ahead >= 1 else 0  # one unrecorded step to settle the profiler
        schedule = torch.profiler.schedule(skip_first=ahead - warmup, wait=0, warmup=warmup,
                                           active=self.end - max(self.start, first_step),
                                           repeat=1)
        assert self.directory is not None
        self.directory.mkdir(parents=True, exist_ok=True)
        handler = torch.profiler.tensorboard_trace_handler(str(self.directory),
                                                           worker_name=f"rank{self.rank}")
        return torch.profiler.profile(activities=activities, schedule=schedule,
                                      on_trace_ready=handler, record_shapes=False)

    def _say(self, message: str) -> None:
        print(f"xscale: rank {self.rank}: {message}", file=sys.stderr, flush=True)


def window_from_env(rank: int, device: torch.device,
                    environ: Mapping[str, str] | None = None) -> ProfileWindow:
    """The window run.sh / run-profile.sh asked for on this rank (mode "off" if none)."""
    env = os.environ if environ is None else environ
    if settings.value("XSCALE_PROFILED", env):
        mode = "external"  # a second profiler inside would fight the outer one for the GPU
    elif settings.value("XSCALE_TORCH_PROFILER", env):
        mode = "torch"
    else:
        return ProfileWindow("off", rank, device)
    start = _count(env, "PROFILE_STEP_START", DEFAULT_START, 0)
    steps = _count(env, "PROFILE_STEPS", DEFAULT_STEPS, 1)
    directory = Path(env.get("PROFILE_DIR") or "xscale-profile") / f"rank{rank}"
    return ProfileWindow(mode, rank, device, start, steps, directory)

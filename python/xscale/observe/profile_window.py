"""A profiling window of PROFILE_STEPS steps from step PROFILE_STEP_START, on the chosen ranks.

Profiling every step of every rank drowns the profiler and the file system; training is
balanced, so a few dozen steps of one rank tell the story (the LUMI AI workshop, E09, profiles
rank 14 for 32 steps). Two ways, chosen by what run.sh / run-profile.sh exported for this rank:

- XSCALE_PROFILED=1: an external profiler (rocprof, nsys) already wraps this process. On a GPU
  the window is marked for it: cudaProfilerStart/Stop (hipProfilerStart/Stop on ROCm) at its
  edges, so `--capture-range=cudaProfilerApi` style options record only the window, and an
  NVTX/ROCTX range per step so the timeline reads in steps.
- XSCALE_TORCH_PROFILER=1 (run-profile.sh's PROFILER=torch): torch.profiler records the window
  itself and writes a Chrome trace into PROFILE_DIR/rank<R>; the end of the run prints its
  summary (xscale.observe.profile_report: top operators and kernels, the collectives' share, the
  verdict).
- neither: nothing happens; step() is two integer comparisons.
At the end of the run an external profiler's rank says where its files go and how to read
them back (`xscale report --profile PROFILE_DIR`).

Steps are global training steps, so a resumed run profiles only if the window is still ahead.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from xscale.lifecycle import UserError
from xscale.observe import profile_report
from xscale.shared import settings

DEFAULT_START = 10
DEFAULT_STEPS = 32
# A trace is read at about 20 MB/s (a 1 MB CPU trace in 0.05 s here); past this size its summary
# would hold the end of the run, and the other ranks with it, for over 10 s: left to the report.
SUMMARY_LIMIT_BYTES = 200_000_000


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
                 steps: int = DEFAULT_STEPS, profile_dir: Path | None = None) -> None:
        if mode not in ("off", "external", "torch"):
            raise ValueError(f"unknown profiling mode {mode!r}")
        self.mode = mode
        self.rank = rank
        self.device = device
        self.start = start
        self.end = start + steps
        self.profile_dir = profile_dir
        self.trace: Path | None = None  # the torch.profiler trace, once written
        if mode == "torch":  # made now: a directory that cannot be is one line before training
            assert profile_dir is not None
            try:
                (profile_dir / f"rank{rank}").mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise UserError(f"PROFILE_DIR '{profile_dir}' cannot be created: "
                                f"{error.strerror}") from None
        self.active = False
        self._in_step_range = False
        self._profiler: torch.profiler.profile | None = None
        self._finished = mode == "off"
        self._closed = False

    # -- the per-step call ---------------------------------------------------------------------

    def step(self, step: int) -> None:
        if self._finished:
            return
        if self.mode == "external":
            self._external(step)
        else:
            self._torch(step)

    def close(self) -> None:
        """At the end of the run: end a window the run did not reach the end of (max steps, a
        stop signal), and say what the profile holds (torch) or where it goes (external)."""
        if self.mode == "off" or self._closed:  # Trainer may end training twice
            return
        self._closed = True
        if self.mode == "external":
            if self.active:
                self._stop_external(None)
            self._say(f"the profiler writes its files under {self.profile_dir} as this rank "
                      f"exits; `xscale report --profile {self.profile_dir}` names them and "
                      f"what opens them")
        else:
            if self._profiler is not None:
                self._profiler.stop()
                self._profiler = None
                self.active = False
            if self.trace is not None:
                self._summarise()
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

    def _make_torch_profiler(self, first_step: int) -> torch.profiler.profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self._on_gpu():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        ahead = max(self.start - first_step, 0)
        warmup = 1 if ahead >= 1 else 0  # one unrecorded step to settle the profiler
        schedule = torch.profiler.schedule(skip_first=ahead - warmup, wait=0, warmup=warmup,
                                           active=self.end - max(self.start, first_step),
                                           repeat=1)
        profiler = torch.profiler.profile(activities=activities, schedule=schedule,
                                          on_trace_ready=self._write_trace, record_shapes=False)
        profiler.preset_metadata_json(profile_report.FIRST_STEP, str(first_step))
        return profiler

    def _write_trace(self, profiler: torch.profiler.profile) -> None:
        """Where torch.profiler's own TensorBoard handler would write it, so that TensorBoard
        reads the directory too; kept to be summarised at the end of the run."""
        assert self.profile_dir is not None
        directory = self.profile_dir / f"rank{self.rank}"  # made by the constructor
        self.trace = directory / f"rank{self.rank}.{time.time_ns()}.pt.trace.json"
        profiler.export_chrome_trace(str(self.trace))
        self._say(f"torch.profiler trace written to {self.trace}")

    def _summarise(self) -> None:
        """Print the trace's summary; a trace that cannot be read costs a line, not the run."""
        try:
            size = self.trace.stat().st_size
            if size > SUMMARY_LIMIT_BYTES:
                self._say(f"the trace has {size / 1e6:.0f} MB; `xscale report --profile "
                          f"{self.profile_dir}` summarises it after the run")
                return
            print(profile_report.summarise(self.trace).text(), flush=True)
        except (OSError, profile_report.ProfileError) as error:
            self._say(f"cannot summarise the profile: {error}")

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
    profile_dir = Path(env.get("PROFILE_DIR") or "xscale-profile")
    return ProfileWindow(mode, rank, device, start, steps, profile_dir)

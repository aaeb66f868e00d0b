"""A profile directory, read back: `xscale report --profile DIR`, and the summary a profiled rank
prints at the end of its run (xscale.observe.profile_window).

A torch.profiler trace (`*.pt.trace.json`, `.gz` too) is summarised from its spans:
- the steps: the `ProfilerStep#N` spans, on the thread that has them (the training thread);
- the top operators by self time on that thread (an operator's time less its children's);
- the top device kernels by time, the communication ones marked, and their share of the
  kernel time (LUMI's profiling exercise: once RCCL kernels dominate, the run is network bound);
- the step split into the parts xscale.observe.steptime measures, from the timeline alone: each
  moment of a step goes to the first part that claims it. On a device: compute (a kernel other than
  a collective runs), communication (only collectives run: not hidden), data (the training thread
  waits in the DataLoader), other. On the CPU, where the training thread computes: data, compute
  (the thread is in an operator), communication (a collective runs on the backend's threads while
  the training thread waits for it), other. A trace cannot tell a checkpoint save from other host
  work, so it has no checkpoint part.
The other profilers' files (nsys, rocprof, unitrace, py-spy) are named, with what opens them.
No torch here: this runs where torch is not installed (a login node).
"""

from __future__ import annotations

import gzip
import json
import re
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from xscale.observe.bounds import verdict

TRACE_ENDINGS = (".pt.trace.json", ".pt.trace.json.gz")
STEP = "ProfilerStep#"
FIRST_STEP = "xscale_first_step"  # the trace's note of the training step its profiler began at
DATA = "enumerate(DataLoader)"  # the DataLoader iterator's own span around each next()
# Collectives by name: NCCL/RCCL kernels (ncclDevKernel_*, ncclKernel_*), oneCCL's, gloo's
# spans on its worker threads, c10d's operators and the profiler's record_param_comms.
COMMUNICATION = re.compile(r"ccl|gloo:|c10d::|record_param_comms|all_?reduce|all_?gather|"
                           r"reduce_?scatter|all_?to_?all", re.IGNORECASE)
DEVICE = {"kernel", "gpu_memcpy", "gpu_memset"}  # what a device ran (Kineto's categories)
TOP = 8
# Each other file a profiler leaves, by the end(s) of its name: what it is and what opens it.
OPENERS = (
    ((".nsys-rep", ".qdrep"), "Nsight Systems report",
     "nsys stats FILE (kernel and API tables) or nsys-ui"),
    (".stats.csv", "rocprof's statistics (calls and time per kernel or API)",
     "a spreadsheet, or column -s, -t < FILE"),
    (".csv", "rocprof's list of kernel dispatches", "a spreadsheet, or column -s, -t < FILE"),
    (".db", "rocprof's database", "sqlite3 FILE"),
    (".json", "a Chrome trace (rocprof --hip-trace, unitrace)",
     "https://ui.perfetto.dev (Open trace file)"),
    (".svg", "a py-spy flame graph", "a web browser"),
)


class ProfileError(Exception):
    """A directory or trace that cannot be read: one line, status 2."""


class Span(NamedTuple):
    name: str
    category: str
    thread: tuple
    start: float  # microseconds
    end: float


# ---- intervals: sorted, disjoint (start, end) pairs ---------------------------------------------

def merged(pairs: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(pairs):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def common(first: list[tuple[float, float]],
           second: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(first) and j < len(second):
        start, end = max(first[i][0], second[j][0]), min(first[i][1], second[j][1])
        if start < end:
            out.append((start, end))
        if first[i][1] < second[j][1]:
            i += 1
        else:
            j += 1
    return out


def without(first: list[tuple[float, float]],
            second: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, j = [], 0
    for start, end in first:
        while j < len(second) and second[j][1] <= start:
            j += 1
        k = j
        while k < len(second) and second[k][0] < end:
            if second[k][0] > start:
                out.append((start, second[k][0]))
            start = max(start, second[k][1])
            k += 1
        if start < end:
            out.append((start, end))
    return out


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


# ---- one trace -------------------------------------------------------------------------------

def read_trace(path: Path) -> tuple[dict, list[Span]]:
    """The trace's header and its complete spans."""
    try:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt") as file:
            document = json.load(file)
        events = document["traceEvents"]
        spans = [Span(str(event["name"]), str(event.get("cat", "")),
                      (event.get("pid"), event.get("tid")), float(event["ts"]),
                      float(event["ts"]) + float(event["dur"]))
                 for event in events if event.get("ph") == "X" and "dur" in event]
    except (OSError, EOFError, ValueError, KeyError, TypeError) as error:
        reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
        raise ProfileError(f"{path}: not a readable torch.profiler trace ({reason})") from None
    return document, spans


@dataclass(frozen=True)
class TraceSummary:
    """What one profiled rank's steps spent their time on (times in seconds per step)."""

    path: Path
    rank: int | str
    first_step: int
    steps: int
    seconds: float
    shares: dict[str, float]
    operators: list[tuple[str, float]]
    kernels: list[tuple[str, float]]
    kernel_seconds: float
    communication_kernel_seconds: float
    collectives: float  # the share of the step in which some collective ran

    def text(self) -> str:
        last = self.first_step + self.steps - 1
        lines = [f"xscale: profile of rank {self.rank}, steps {self.first_step}-{last} "
                 f"({self.steps} steps): {self.path}",
                 "  top operators by self time on the training thread, per step:"]
        lines += [self._row(name, seconds, self.seconds) for name, seconds in self.operators]
        if self.kernels:
            lines.append("  top device kernels by time, per step:")
            lines += [self._row(name, seconds, self.kernel_seconds)
                      for name, seconds in self.kernels]
            share = self.communication_kernel_seconds / max(self.kernel_seconds, 1e-12)
            lines.append(f"  communication kernels: {share:.0%} of the kernel time")
        else:
            lines.append("  no device kernels in this trace (a CPU run)")
        lines.append(f"  collectives ran during {self.collectives:.0%} of the step time; "
                     f"{self.shares['communication']:.0%} was not hidden behind compute")
        lines.append(verdict(self.seconds, self.shares, f"rank {self.rank}'s trace"))
        lines.append("  open the trace in https://ui.perfetto.dev (or chrome://tracing)")
        return "\n".join(lines)

    @staticmethod
    def _row(name: str, seconds: float, whole: float) -> str:
        marker = "  (communication)" if collective(name) else ""
        return f"    {seconds * 1000:9.3f} ms {seconds / max(whole, 1e-12):4.0%}  " \
               f"{name[:90]}{marker}"


def summarise(path: Path) -> TraceSummary:
    """The summary of the torch.profiler trace at PATH."""
    document, spans = read_trace(path)
    step_spans = [span for span in spans if span.name.startswith(STEP)]
    if not step_spans:
        raise ProfileError(f"{path}: no {STEP}N spans (a trace of torch.profiler's "
                           f"schedule, as run-profile.sh records, has one per step)")
    training = statistics.mode(span.thread for span in step_spans)
    step_spans = [span for span in step_spans if span.thread == training]
    steps = merged((span.start, span.end) for span in step_spans)
    on_thread = [span for span in spans if span.thread == training and span.category != "Trace"
                 and not span.name.startswith(STEP)]
    device = [span for span in spans if span.category in DEVICE]
    whole, count = length(steps), len(step_spans)

    def per_step(micros: float) -> float:  # seconds
        return micros / 1e6 / count

    def share(micros: float) -> float:
        return micros / max(whole, 1e-12)

    kernel_time = _totals((span.name, span.end - span.start) for span in device)
    return TraceSummary(
        path=path, rank=_rank(document, path), first_step=_first_step(document, step_spans),
        steps=count, seconds=per_step(whole),
        shares={name: share(micros)
                for name, micros in _parts(steps, on_thread, spans, device).items()},
        operators=[(name, per_step(micros))
                   for name, micros in _top(_self_times(on_thread, steps))],
        kernels=[(name, per_step(micros)) for name, micros in _top(kernel_time)],
        kernel_seconds=per_step(sum(kernel_time.values())),
        communication_kernel_seconds=per_step(sum(micros for name, micros in kernel_time.items()
                                                  if collective(name))),
        collectives=share(length(common(covered(spans, collective), steps))))


def collective(name: str) -> bool:
    return COMMUNICATION.search(name) is not None


def covered(spans: list[Span], chosen: Callable[[str], bool]) -> list[tuple[float, float]]:
    """The time covered by the spans whose name is CHOSEN."""
    return merged((span.start, span.end) for span in spans if chosen(span.name))


def _parts(steps: list[tuple[float, float]], on_thread: list[Span], spans: list[Span],
           device: list[Span]) -> dict[str, float]:
    """Each part's microseconds of the steps: every moment goes to the first part in the
    order (module docstring) whose spans cover it; the rest is other."""
    data = covered(on_thread, lambda name: name.startswith(DATA))
    if device:
        order = [("compute", covered(device, lambda name: not collective(name))),
                 ("communication", covered(device, collective)), ("data", data)]
    else:
        busy = covered(on_thread, lambda name: not name.startswith(DATA)
                       and not collective(name))
        order = [("data", data), ("compute", busy),
                 ("communication", covered(spans, collective))]
    parts, taken = {}, []
    for name, intervals in order:
        claimed = without(common(intervals, steps), taken)
        parts[name] = length(claimed)
        taken = merged(taken + claimed)
    parts["other"] = length(steps) - length(taken)
    return {name: parts[name] for name in ("data", "compute", "communication", "other")}


def _first_step(document: dict, step_spans: list[Span]) -> int:
    """The training step the trace begins at. The profiler counts its steps from its start;
    xscale.observe.profile_window notes the training step it started at, so that the summary names
    training steps."""
    numbers = [int(span.name[len(STEP):]) for span in step_spans
               if span.name[len(STEP):].isdigit()]
    began_at = document.get(FIRST_STEP, 0)
    return min(numbers, default=0) + (began_at if isinstance(began_at, int) else 0)


def _rank(document: dict, path: Path) -> int | str:
    """The rank torch.profiler noted (distributedInfo), else the one in the file's name."""
    info = document.get("distributedInfo")
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        return info["rank"]
    found = re.match(r"rank(\d+)", path.name)
    return int(found.group(1)) if found else "?"


def _self_times(on_thread: list[Span], steps: list[tuple[float, float]]) -> dict[str, float]:
    """Each operator's time on the training thread during the steps, less its children's."""
    inside = [s for s in on_thread if common([(s.start, s.end)], steps)]
    totals: dict[str, float] = defaultdict(float)
    stack: list[Span] = []
    for span in sorted(inside, key=lambda s: (s.start, -s.end)):
        while stack and stack[-1].end <= span.start:
            stack.pop()
        totals[span.name] += span.end - span.start
        if stack:
            totals[stack[-1].name] -= span.end - span.start
        stack.append(span)
    return totals


def _totals(pairs: Iterable[tuple[str, float]]) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for name, micros in pairs:
        totals[name] += micros
    return totals


def _top(totals: dict[str, float]) -> list[tuple[str, float]]:
    return sorted(totals.items(), key=lambda item: -item[1])[:TOP]


# ---- a directory -----------------------------------------------------------------------------

def describe(directory: Path) -> str:
    """Every trace in DIRECTORY (and below) summarised, every other profiler file named with
    what opens it."""
    if not directory.is_dir():
        raise ProfileError(f"{directory}: no such directory")
    try:
        files = sorted(path for path in directory.rglob("*") if path.is_file())
    except OSError as error:
        raise ProfileError(f"{directory}: cannot read it ({error.strerror})") from None
    if not files:
        raise ProfileError(f"{directory}: no profile in it (empty)")
    sections, others = [], []
    for path in files:
        if path.name.endswith(TRACE_ENDINGS):
            sections.append(summarise(path).text())
        else:
            others.append(_named(path))
    if others:
        sections.append("\n".join([f"xscale: other profile files in {directory}:", *others]))
    return "\n\n".join(sections)


def _named(path: Path) -> str:
    for ending, what, opener in OPENERS:
        if path.name.endswith(ending):
            return f"  {path}: {what}; open it with {opener.replace('FILE', str(path))}"
    return f"  {path}: not a profiler file xscale knows"

"""Start-up phases: where each rank's time went between the step's launch and its first step.

Six moments, wall-clock seconds since 1970 (bash's EPOCHREALTIME and Python's time.time() read
the same clock; across nodes they agree as well as NTP or PTP keeps the nodes' clocks):

    launch      XSCALE_LAUNCH_T: the batch script launched the step (jobs/lib/supervisor.py)
    run_sh      XSCALE_T_RUNSH: run.sh began on this rank
    exec        XSCALE_T_EXEC: run.sh exec'd the trainer
    imports     the trainer's imports are done (torch, its other libraries, xscale's modules):
                its first call that starts the run marks it (xscale.start for the plain
                trainers, hf.ddp_arguments or XscaleTrainer for Trainer's)
    group       the process group formed (runtime.start; Trainer's arguments for GPT-neo)
    first_step  this run's first optimizer step done (runtime.RunTally, for Loop and XscaleTrainer)

A phase is the time between two successive moments, PHASES below, and `total` runs from the launch
to the first step. A moment that was not recorded (a step started by hand has no XSCALE_LAUNCH_T, a
trainer started without run.sh has no run.sh times) makes the phases next to it unknown (None),
never a guess. docs/STARTUP.md models how each phase grows with the job's size.

Standard library only: `xscale report` aggregates and draws these without torch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from xscale.shared import settings


@dataclass(frozen=True)
class Phase:
    name: str
    begins: str  # the moment it starts at
    ends: str
    what: str  # for the table: what runs in it


PHASES = (
    Phase("launch", "launch", "run_sh", "srun to run.sh: step set-up, container start"),
    Phase("run_sh", "run_sh", "exec", "run.sh's own work"),
    Phase("imports", "exec", "imports", "python start, import torch and the trainer's libraries"),
    Phase("group", "imports", "group", "the trainer's checks, the rendezvous"),
    Phase("first_step", "group", "first_step", "model, data, the first step"),
)
TOTAL = Phase("total", "launch", "first_step", "launch to the first step done")
# What the summary and the report list, in order.
NAMES = tuple(phase.name for phase in (*PHASES, TOTAL))
# Where run.sh and the batch script leave their moments.
FROM_ENVIRONMENT = {"launch": "XSCALE_LAUNCH_T", "run_sh": "XSCALE_T_RUNSH",
                    "exec": "XSCALE_T_EXEC"}

_marks: dict[str, float] = {}


def mark(moment: str) -> None:
    """Record that `moment` ("imports", "group", "first_step") has come; the first call wins,
    so a loop may mark its every step and only the first counts."""
    _marks.setdefault(moment, time.time())


def parse_clock(text: str | None) -> float | None:
    """A time as bash's EPOCHREALTIME prints it (the locale's decimal separator: "1.5" or
    "1,5"); None when absent or unreadable (bash before 5 leaves it empty)."""
    if not text:
        return None
    try:
        return float(text.strip().replace(",", "."))
    except ValueError:
        return None


def moments(environ: Mapping[str, str] | None = None) -> dict[str, float | None]:
    """This process's moments: the environment's and the ones marked here."""
    found: dict[str, float | None] = {name: parse_clock(settings.value(variable, environ))
                                      for name, variable in FROM_ENVIRONMENT.items()}
    for name in ("imports", "group", "first_step"):
        found[name] = _marks.get(name)
    return found


def durations(at: Mapping[str, float | None]) -> dict[str, float | None]:
    """Each phase's seconds (to the millisecond) from the moments; None where either end is
    unknown."""
    result: dict[str, float | None] = {}
    for phase in (*PHASES, TOTAL):
        begins, ends = at.get(phase.begins), at.get(phase.ends)
        result[phase.name] = None if begins is None or ends is None else round(ends - begins, 3)
    return result


def rank_phases() -> dict[str, float | None]:
    """This rank's phases, for its XSCALE_RANK record."""
    return durations(moments())


@dataclass(frozen=True)
class RankPhases:
    rank: int
    node: str
    phases: Mapping[str, float | None]


def aggregate(records: Iterable[RankPhases]) -> dict[str, dict]:
    """For each phase: the median over the ranks that know it, the slowest rank and its node,
    and how many ranks knew it (all None/0 where none did)."""
    records = list(records)
    result = {}
    for name in NAMES:
        known = [(r.phases[name], r.rank, r.node) for r in records
                 if r.phases.get(name) is not None]
        if not known:
            result[name] = {"median": None, "slowest": None, "rank": None, "node": None,
                            "ranks": 0}
            continue
        slowest = max(known, key=lambda item: (item[0], -item[1]))  # ties: the lowest rank
        result[name] = {"median": round(statistics.median(v for v, _, _ in known), 3),
                        "slowest": slowest[0], "rank": slowest[1], "node": slowest[2],
                        "ranks": len(known)}
    return result


def table(summary: Mapping[str, Mapping]) -> list[str]:
    """The aggregate as lines a person reads: one per phase, median and slowest rank@node."""
    lines = [f"  {'phase':<11} {'median':>9} {'slowest':>9}  {'rank@node':<18} what"]
    for phase in (*PHASES, TOTAL):
        entry = summary.get(phase.name) or {}
        if entry.get("median") is None:
            lines.append(f"  {phase.name:<11} {'unknown':>9} {'':>9}  {'':<18} {phase.what}")
            continue
        where = f"{entry['rank']}@{entry['node']}"
        lines.append(f"  {phase.name:<11} {entry['median']:>8.3f}s {entry['slowest']:>8.3f}s  "
                     f"{where:<18} {phase.what}")
    return lines


def slowest_per_node(records: Iterable[RankPhases]) -> list[RankPhases]:
    """One record per node, its slowest rank (the most known seconds in all), in node order:
    the rank a node's start-up waits for."""
    by_node: dict[str, RankPhases] = {}
    for record in records:
        seconds = _known_sum(record)
        current = by_node.get(record.node)
        if current is None or seconds > _known_sum(current):
            by_node[record.node] = record
    return [by_node[node] for node in sorted(by_node)]


def _known_sum(record: RankPhases) -> float:
    return sum(record.phases.get(p.name) or 0.0 for p in PHASES)

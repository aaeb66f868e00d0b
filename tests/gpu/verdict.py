"""The gpu-check's results: one Check per row (pass, fail or skip, the reason, the figures), a
trainer's XSCALE_SUMMARY judged against what the node should have given it, the table printed at
the end and the same as JSON. No torch and no subprocess here: the unit tests cover all of it.

The summary is read with xscale.observe.report (through xscale.shared.taglines, the one reader
of XSCALE_* lines), never parsed here.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from xscale.observe import report

PASS, FAIL, SKIP = "pass", "fail", "skip"


@dataclass
class Check:
    name: str
    status: str  # PASS, FAIL or SKIP
    reason: str = ""
    figures: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Expected:
    """What a trainer's summary must say on this node: the device type xscale.dist chose, the
    backend it chose for that device (a lone rank's group of one included), and the ranks
    launched."""

    device: str
    backend: str | None
    world_size: int


def summary_of(output: str) -> dict | None:
    """The run's last XSCALE_SUMMARY, or None when it printed none (it crashed before the end)."""
    try:
        return report.last_summary(output.splitlines())
    except report.ReportError:
        return None


def mismatches(summary: dict, expected: Expected) -> list[str]:
    """Why the summary is not what the node should have given the trainer (empty: it is)."""
    wrong = []
    for key, want in (("device", expected.device), ("backend", expected.backend),
                      ("world_size", expected.world_size)):
        if summary.get(key) != want:
            wrong.append(f"{key} {summary.get(key)}, expected {want}")
    first, last = summary.get("loss_first"), summary.get("loss_last")
    if first is None or last is None:
        wrong.append("no loss logged")
    elif not last < first:
        wrong.append(f"loss did not fall ({first:.4g} -> {last:.4g})")
    return wrong


def judge_training(name: str, output: str, exit_code: int, expected: Expected) -> Check:
    """A trainer's run: pass when it exited 0 and its summary shows the GPU, the native backend,
    every rank and a falling loss."""
    summary = summary_of(output)
    if summary is None:
        return Check(name, FAIL,
                     f"exit status {exit_code}, no XSCALE_SUMMARY; {telling_line(output)}")
    wrong = mismatches(summary, expected)
    if exit_code != 0:
        wrong.insert(0, f"exit status {exit_code}")
    figures = {key: summary.get(key) for key in ("device", "backend", "world_size", "loss_first",
                                                  "loss_last", "samples_per_s", "tokens_per_s",
                                                  "seconds", "tflops", "mfu")}
    return Check(name, FAIL if wrong else PASS, "; ".join(wrong), figures)


SNAPSHOT_RESULT = "SNAPSHOT_BENCH "  # the start of tests/bench/snapshots.py's JSON line
SNAPSHOT_SHARE = 0.01  # at `auto` K, snapshots may take this share of the step time at most


def judge_snapshots(name: str, output: str) -> Check:
    """tests/bench/snapshots.py --device: pass when its snapshot, copied on a side stream while
    the next step was queued, is the state of its step, and when at `auto` K and 1,024 nodes
    snapshots take at most SNAPSHOT_SHARE of the step time."""
    results = [json.loads(line[len(SNAPSHOT_RESULT):]) for line in output.splitlines()
               if line.startswith(SNAPSHOT_RESULT)]
    if not results:
        return Check(name, FAIL, f"the benchmark gave no result; {telling_line(output)}")
    result = results[-1]
    figures = {key: result.get(key) for key in ("state_mib", "step_s", "stall_s",
                                                 "stall_synchronize_s", "copy_s",
                                                 "auto_every_1024", "auto_share_1024")}
    if not result["changed"]:
        return Check(name, FAIL, "the step after the snapshot left the state as it was: the "
                                 "comparison proves nothing", figures)
    if not result["whole"]:
        return Check(name, FAIL, "the snapshot is not the state of its step: the next step "
                                 "overtook its copy", figures)
    if result["auto_share_1024"] > SNAPSHOT_SHARE:
        return Check(name, FAIL, f"at auto K, snapshots take {result['auto_share_1024']:.2%} "
                                 f"of the step time (at most {SNAPSHOT_SHARE:.0%})", figures)
    return Check(name, PASS, "", figures)


def telling_line(output: str) -> str:
    """The run's first `PROG: error: ...` line (every xscale program's one-line errors), else its
    last line: under torchrun that would be its closing banner, not the rank's reason."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if ": error: " in line]
    if errors:
        return errors[0][:300]
    return f"last line: {lines[-1][:200]}" if lines else "no output"


def figure_text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def render_table(checks: list[Check]) -> str:
    """One line per check: its name, PASS/FAIL/SKIP, its figures, then the reason; and a count."""
    width = max([len("check")] + [len(check.name) for check in checks])
    lines = [f"{'check':<{width}}  result  figures / reason"]
    for check in checks:
        shown = ", ".join(f"{key}={figure_text(value)}" for key, value in check.figures.items()
                          if value is not None)
        detail = "; ".join(part for part in (shown, check.reason) if part)
        lines.append(f"{check.name:<{width}}  {check.status.upper():<6}  {detail}".rstrip())
    counts = {status: sum(check.status == status for check in checks)
              for status in (PASS, FAIL, SKIP)}
    lines.append(f"gpu-check: {counts[PASS]} passed, {counts[FAIL]} failed, "
                 f"{counts[SKIP]} skipped")
    return "\n".join(lines)


def result_json(checks: list[Check], node: dict[str, Any]) -> dict[str, Any]:
    """What build/gpu-check/result.json holds: the node's facts, every check, and `ok`."""
    return {"node": node, "ok": not any(check.status == FAIL for check in checks),
            "checks": [asdict(check) for check in checks]}


def write_result(path: Path, checks: list[Check], node: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result_json(checks, node), indent=1) + "\n")

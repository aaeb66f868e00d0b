"""Readable summary of a finished run: `python -m xscale.report JOB_OUTPUT_FILE`.

Reads the machine-readable lines a trainer prints (XSCALE_SUMMARY from rank 0, XSCALE_RANK from
every rank) and run.sh's `xscale: launcher=...` line, and prints what a person wants to know.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


def tagged(lines: list[str], tag: str) -> list[dict]:
    prefix = tag + " "
    return [json.loads(line[line.index(prefix) + len(prefix):]) for line in lines if prefix in line]


def rendezvous(lines: list[str]) -> str:
    for line in lines:
        found = re.search(r"xscale: launcher=(\S+) site=(\S+) .*master=(\S+)", line)
        if found:
            return f"{found.group(3)} (launcher {found.group(1)}, site {found.group(2)})"
    return "unknown"


def throughput(summary: dict) -> str:
    for key, unit in (("tokens_per_s", "tokens/s"), ("samples_per_s", "samples/s")):
        if summary.get(key) is not None:
            return f"{summary[key]:,.0f} {unit} (all ranks)"
    return "n/a"


def losses(summary: dict) -> str:
    """First and last loss; a run that resumed and took no step logged none (both null)."""
    first, last = summary.get("loss_first"), summary.get("loss_last")
    steps = summary["steps"] - summary.get("start_step", 0)
    if first is None or last is None:
        return f"none logged ({steps} steps taken, at step {summary['steps']})"
    return f"{first:.4f} -> {last:.4f} over {steps} steps (to step {summary['steps']})"


def render(lines: list[str]) -> str:
    summaries = tagged(lines, "XSCALE_SUMMARY")
    if not summaries:
        raise SystemExit("xscale.report: error: no XSCALE_SUMMARY line (did the run finish?)")
    summary = summaries[-1]
    nodes = sorted({record["node"] for record in tagged(lines, "XSCALE_RANK")})
    rows = [
        ("trainer", summary.get("trainer", "?")),
        ("world size", f"{summary['world_size']} ranks on {len(nodes) or '?'} nodes "
                       f"({', '.join(nodes)})"),
        ("master", rendezvous(lines)),
        ("loss", losses(summary)),
        ("throughput", throughput(summary)),
        ("time", f"{summary['seconds']:.1f} s"),
    ]
    if summary.get("stopped_early"):
        rows.append(("stopped", f"by {summary.get('signal') or 'a signal to another rank'}; "
                                f"checkpoint {summary.get('checkpoint')}"))
    if summary.get("accuracy") is not None:
        rows.append(("accuracy", f"{summary['accuracy']:.3f} (all ranks)"))
    return "\n".join(f"  {name:<11} {value}" for name, value in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="the job's output file")
    args = parser.parse_args()
    if not args.output.is_file():
        print(f"xscale.report: error: no such file: {args.output}", file=sys.stderr)
        raise SystemExit(2)
    print(render(args.output.read_text(errors="replace").splitlines()))


if __name__ == "__main__":
    main()

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
        if key in summary:
            return f"{summary[key]:,.0f} {unit} (all ranks)"
    return "n/a"


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
        ("loss", f"{summary['loss_first']:.4f} -> {summary['loss_last']:.4f} "
                 f"over {summary['steps']} steps"),
        ("throughput", throughput(summary)),
        ("time", f"{summary['seconds']:.1f} s"),
    ]
    if "accuracy" in summary:
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

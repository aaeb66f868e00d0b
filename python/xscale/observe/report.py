"""Readable summary of a finished run: `xscale report JOB_OUTPUT_FILE [--png]`, or
`xscale report OUTPUT_DIR/xscale-summary.json` (also `python -m xscale.observe.report ...`); its
profile: `xscale report --profile PROFILE_DIR` (xscale.observe.profile_report).

Reads the machine-readable lines a trainer prints (XSCALE_SUMMARY from rank 0, XSCALE_RANK from
every rank), run.sh's `xscale: launcher=...` line and the supervisor's XSCALE_GOODPUT, and
the whole summary in the file the summary line names (xscale.shared.taglines.whole_summary), or that
file alone; prints what a person wants to know, with the start-up phases (xscale.observe.startup):
each phase's median and slowest rank@node. `--png` also draws them, one row per node, into
JOB_OUTPUT_FILE.startup.png (xscale.observe.picture). Bad input (no such file, no summary, no phases
to draw, no readable profile) is one line on stderr and status 2.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from xscale.observe import profile_report, startup
from xscale.shared import taglines


class ReportError(Exception):
    """Input this report cannot read: one line and status 2."""


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


def step_time(summary: dict) -> str:
    """The mean step after the warm-up, each part's share and the bound (docs/STEPTIME.md)."""
    shares = {name: share for name, share in summary["step_time"].items() if name != "seconds"}
    parts = ", ".join(f"{name} {'not measured' if share is None else f'{share:.0%}'}"
                      for name, share in shares.items())
    return (f"{summary['step_time']['seconds'] * 1000:.0f} ms: {parts}: "
            f"{summary['bound']}-bound (docs/STEPTIME.md)")


def render(lines: list[str]) -> str:
    summary = last_summary(lines)
    nodes = sorted({record["node"] for record in taglines.tagged(lines, "XSCALE_RANK")})
    where = f"{len(nodes)} nodes ({', '.join(nodes)})" if nodes \
        else f"{summary.get('nodes', '?')} nodes"
    rows = [
        ("trainer", summary.get("trainer", "?")),
        ("world size", f"{summary['world_size']} ranks on {where}"),
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
    slowest = summary.get("straggler")
    if isinstance(slowest, dict) and summary.get("world_size", 1) > 1:
        rows.append(("slowest", f"rank {slowest['rank']} on {slowest['node']}: "
                                f"{slowest['factor']:.2f}x the median rank's own work per step"))
    if summary.get("step_time"):
        rows.append(("step time", step_time(summary)))
    ledgers = taglines.tagged(lines, "XSCALE_GOODPUT")  # the supervisor's, as the job ended
    if ledgers and ledgers[-1].get("text"):
        rows.append(("goodput", ledgers[-1]["text"]))
    text = "\n".join(f"  {name:<11} {value}" for name, value in rows)
    return text + startup_section(summary, rank_phases(lines, summary))


def last_summary(lines: list[str]) -> dict:
    """The last run's summary: the whole record from its file when the line names one that is
    still there, else the line's."""
    summaries = taglines.tagged(lines, "XSCALE_SUMMARY")
    if not summaries:
        raise ReportError("no XSCALE_SUMMARY line (did the run finish?)")
    return taglines.whole_summary(summaries[-1])


def rank_phases(lines: list[str], summary: dict) -> list[startup.RankPhases]:
    """Each rank's start-up phases from its XSCALE_RANK line. A requeued job's output holds one
    line per rank per run: the last one of each rank is the run the summary is about."""
    latest: dict[int, startup.RankPhases] = {}
    for record in taglines.tagged(lines, "XSCALE_RANK"):
        phases, rank = record.get("startup"), record.get("rank")
        if isinstance(phases, dict) and isinstance(rank, int) \
                and rank < summary.get("world_size", rank + 1):
            latest[rank] = startup.RankPhases(rank, str(record.get("node", "?")), phases)
    return [latest[rank] for rank in sorted(latest)]


def startup_section(summary: dict, ranks: list[startup.RankPhases]) -> str:
    """The phase table from the ranks' records, else the summary's own aggregate; nothing for
    a run from before xscale recorded phases."""
    phases = startup.aggregate(ranks) if ranks else summary.get("startup")
    if not isinstance(phases, dict):
        return ""
    counted = f"{len(ranks)} ranks" if ranks else "the summary"
    return "\n".join(["", f"  start-up    phases from {counted} (median, slowest rank@node):",
                       *("  " + line for line in startup.table(phases))])


def read_output(output: Path) -> list[str]:
    """The job output's lines; a summary file (JSON, one object) as the one summary line it
    stands for."""
    if output.suffix != ".json":
        return output.read_text(errors="replace").splitlines()
    try:
        record = taglines.read_summary_file(output)
    except ValueError as error:
        raise ReportError(f"{output}: not a summary file ({error})") from None
    return [f"XSCALE_SUMMARY {json.dumps(record)}"]


def png_path(output: Path) -> Path:
    return output.with_name(output.name + ".startup.png")


def report(output: Path, png: bool) -> None:
    if not output.is_file():
        raise ReportError(f"no such file: {output}")
    lines = read_output(output)
    text = render(lines)
    ranks = rank_phases(lines, last_summary(lines))
    if png and not ranks:  # before any output: a bad input is one line, nothing else
        raise ReportError(f"--png: no XSCALE_RANK line with start-up phases in {output}")
    print(text)
    if png:
        path = png_path(output)
        save_picture(ranks, path)
        print(f"  picture     {path}")


def save_picture(ranks: list[startup.RankPhases], path: Path) -> None:
    try:  # Pillow, only for the picture: torchvision depends on it, so every image has it
        from xscale.observe import picture
    except ImportError as error:
        raise ReportError(f"--png needs Pillow ({error})") from None
    try:
        picture.draw_startup(ranks).save(path, format="PNG")
    except OSError as error:
        raise ReportError(f"--png: cannot write {path}: {error.strerror or error}") from None


def main(argv: list[str] | None = None, prog: str = "python -m xscale.observe.report") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, nargs="?",
                        help="the job's output file, or a run's xscale-summary.json")
    parser.add_argument("--png", action="store_true",
                        help="also draw the start-up phases, one row per node, into "
                             "OUTPUT.startup.png")
    parser.add_argument("--profile", type=Path, metavar="PROFILE_DIR",
                        help="instead: summarise run-profile.sh's profiles (torch.profiler "
                             "traces) and say what opens the other profilers' files")
    args = parser.parse_args(argv)
    if (args.output is None) == (args.profile is None):
        parser.error("give a job output file or --profile PROFILE_DIR (one of them)")
    try:
        if args.profile is not None:
            print(profile_report.describe(args.profile))
        else:
            report(args.output, args.png)
    except (ReportError, profile_report.ProfileError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

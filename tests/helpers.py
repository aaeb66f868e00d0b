"""Parsing of the machine-readable lines xscale prints (XSCALE_SUMMARY, XSCALE_RANK, ...)."""

from __future__ import annotations

from xscale import records


def tagged_records(output: str, tag: str) -> list[dict]:
    """Every `TAG {json}` line in the output, in order: after srun --label's `RANK: `, and
    joined again where srun --label cut it (xscale.records.unsplit)."""
    return records.tagged(output.splitlines(), tag)


def summary(output: str) -> dict:
    """The last XSCALE_SUMMARY record; fails loudly (with the output) when there is none."""
    found = tagged_records(output, "XSCALE_SUMMARY")
    if not found:
        raise AssertionError(f"no XSCALE_SUMMARY line in output:\n{output[-4000:]}")
    return found[-1]


def rank_records(output: str, tag: str = "XSCALE_RANK") -> list[dict]:
    return tagged_records(output, tag)


def env_lines(output: str) -> dict[str, str]:
    """KEY=VALUE lines (run.sh --print-env) as a dict."""
    pairs = {}
    for line in output.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            pairs[key] = value
    return pairs

"""When to save: `--checkpoint-every N` or `auto`, Young's interval, sqrt(2 x save cost x mean
time between failures), from the run's own first save (docs/CHECKPOINTS.md)."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping

from xscale.shared import settings

NODE_MTBF_H = settings.NODE_MTBF_H  # XSCALE_NODE_MTBF_H's default: Llama 3's figure


def node_mtbf_hours(env: Mapping[str, str] = os.environ) -> float:
    """XSCALE_NODE_MTBF_H, a positive number of hours (default NODE_MTBF_H), for `auto`."""
    return settings.value("XSCALE_NODE_MTBF_H", env)


def checkpoint_interval(text: str) -> int | str:
    """An argparse `type` for a checkpoint interval such as --checkpoint-every: a whole number
    of steps (0: only at the end and at a stop), or `auto` (Young's interval from the cost of
    the run's first save, docs/CHECKPOINTS.md)."""
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"'{text}' is neither a whole number nor auto")
    return int(text)


def auto_interval(stall_s: float, write_s: float, step_s: float, nodes: int,
                  node_mtbf_h: float) -> tuple[int, float, float]:
    """(steps between saves, seconds, the job's mean time between failures in seconds).
    Young's interval: sqrt(2 x the time a save stops training x the job's MTBF), which
    balances the stalls against the work a failure throws away (J. W. Young, CACM 17(9), 1974);
    at least the background write's own time, or each save would wait for the one before."""
    job_mtbf_s = node_mtbf_h * 3600 / max(nodes, 1)
    seconds = max(math.sqrt(2 * stall_s * job_mtbf_s), write_s)
    return max(1, math.ceil(seconds / step_s)), seconds, job_mtbf_s


def auto_decision(option: str, stall_s: float, write_s: float, step_s: float, nodes: int,
                  node_mtbf_h: float) -> tuple[int, str]:
    """(steps between saves, the line rank 0 prints once) for OPTION auto: auto_interval and
    its inputs, in the same words for every trainer."""
    every, seconds, job_mtbf_s = auto_interval(stall_s, write_s, step_s, nodes, node_mtbf_h)
    return every, (
        f"xscale: {option} auto: every {every} steps ({seconds:.1f} s): a save stops training "
        f"{stall_s:.3f} s and writes for {write_s:.3f} s, a step takes {step_s:.3f} s, a failure "
        f"comes every {job_mtbf_s / 3600:,.0f} h on {nodes} node(s) ({node_mtbf_h:,.0f} h per "
        f"node)")

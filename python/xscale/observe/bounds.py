"""What limits a step, and what to do about it: the parts of a step, the advice for each bound
and the verdict line, shared by the step clock (xscale.observe.steptime) and the profile summary
(xscale.observe.profile_report). No torch here: `xscale report --profile` runs where torch is not
installed.
"""

from __future__ import annotations

from collections.abc import Mapping

from xscale.observe.utilisation import Utilisation

SHARES = ("data", "compute", "communication", "checkpoint", "other")
BOUNDS = ("data", "compute", "communication", "checkpoint")
ADVICE = {
    "data": "stage the data set to node-local storage (jobs/lib/stage) or raise the "
            "DataLoader's workers (--workers)",
    "compute": "profile one rank (runscripts/run-profile.sh) to see which operators take "
               "the time",
    "communication": "check the network with runscripts/doctor (the RCCL/NCCL network "
                     "plugin, the interfaces, the all-reduce bandwidth against the site's "
                     "floor: docs/DOCTOR.md)",
    "checkpoint": "save less often (--checkpoint-every auto) or in the background "
                  "(XSCALE_CHECKPOINT_MODE=async)",
}
LABELS = {"data": "data", "compute": "compute", "communication": "communication",
          "checkpoint": "checkpoints", "other": "other"}


def bound_of(parts: Mapping[str, float | None]) -> str:
    """The part that limits the step: the largest of BOUNDS (a part missing or None counts 0)."""
    return max(BOUNDS, key=lambda name: parts.get(name) or 0.0)


def verdict(seconds: float, shares: Mapping[str, float | None], whence: str,
            utilisation: Utilisation | None = None) -> str:
    """The line a person reads: the mean step, each share (None: not measured, left inside
    compute), the bound, the MFU where the step's FLOPs were counted, and the advice; WHENCE
    says which rank's view it is."""
    parts = []
    for name, share in shares.items():
        if share is None:
            parts.append(f"{LABELS[name]} not measured (inside compute: no DDP)")
        else:
            hidden = " (not hidden)" if name == "communication" else ""
            parts.append(f"{LABELS[name]} {share:.0%}{hidden}")
    bound = bound_of(shares)
    advice = ADVICE[bound]
    used = ""
    if utilisation is not None:
        used = f", {utilisation.clause()}"
        if bound == "compute":
            advice = utilisation.compute_advice(advice)
    return (f"xscale: step time {seconds * 1000:.0f} ms: {', '.join(parts)}: {bound}-bound"
            f"{used}; {advice} ({whence}; docs/STEPTIME.md)")

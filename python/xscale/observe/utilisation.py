"""How much of the device a step used, and, when little, why: the words of the verdict line
(xscale.observe.bounds) about the model FLOPs utilisation (MFU).

The MFU is the step's model FLOPs (counted once, xscale.observe.flops) over the measured step
time, against the device's published peak at the precision the FLOPs ran in
(xscale.observe.peaks). A compute-bound step far below the peak is waiting for something other
than arithmetic; below LOW_MFU the verdict names what the counted step shows:

- matmuls in fp32, where bf16 runs at 8 to 15 times the rate on every GPU in the peaks table;
- attention computed as matmul + softmax (eager) rather than one fused kernel (SDPA, flash);
- kernels so many and so short that the host's launches set the pace: the step time over its
  kernels is under SMALL_KERNEL_US each, the time eager PyTorch needs to issue one.

No torch here: `xscale report` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from xscale.observe.peaks import PEAK_VARIABLE, Peak

# Below this share of the peak a compute-bound verdict looks for a cause. Tuned transformer
# training reaches 35 to 55% on current GPUs (PaLM's 46%, Llama 3's 38 to 43% on H100s); under 20%
# one of the causes below is usually the reason.
LOW_MFU = 0.20
# Microseconds per kernel under which the host's launches, not the device, set the pace: eager
# PyTorch spends some 10 to 20 us of host time issuing each operator, the driver 5 more.
SMALL_KERNEL_US = 30.0


@dataclass(frozen=True)
class Utilisation:
    """One rank's view of its steps: the achieved model TFLOP/s (`tflops`) over a step of
    `step_seconds`, against `peak` at `precision`, and what the counted step ran: its FLOPs, its
    kernels, its attention and its optimizer (xscale.observe.flops.StepCount)."""

    tflops: float
    peak: Peak
    precision: str
    flops: int
    kernels: int
    step_seconds: float
    attention: str | None = None
    optimizer: str | None = None

    @property
    def mfu(self) -> float | None:
        """The share of the device's peak (None: the peak is unknown)."""
        return None if self.peak.tflops is None else self.tflops / self.peak.tflops

    @property
    def low(self) -> bool:
        """Whether the MFU is known and under LOW_MFU."""
        return self.mfu is not None and self.mfu < LOW_MFU

    def clause(self) -> str:
        """The verdict's words after the bound: the MFU and its figures."""
        achieved = rate_text(self.tflops)
        if self.mfu is None:
            return f"{achieved}, MFU unknown ({PEAK_VARIABLE} gives the peak)"
        return (f"MFU {percent_text(self.mfu)} ({achieved} of {self.peak.tflops:g} TFLOP/s "
                f"{self.precision})")

    def us_per_kernel(self) -> float:
        return self.step_seconds * 1e6 / max(self.kernels, 1)

    def causes(self) -> list[tuple[str, str]]:
        """(what the counted step showed, what to try) for each cause of a low MFU found."""
        found = []
        if self.precision == "fp32":
            found.append(("matmuls in fp32", "bf16 autocast (torch.autocast)"))
        if self.attention == "eager":
            found.append(("attention as matmul + softmax", "SDPA or flash attention"))
        if self.us_per_kernel() < SMALL_KERNEL_US:
            remedy = "torch.compile, larger micro-batches"
            if self.optimizer not in (None, "fused"):
                remedy += ", a fused optimizer (fused=True)"
            found.append((f"{self.kernels} kernels a step, one per {self.us_per_kernel():.0f} "
                          "us: the host's launches set the pace", remedy))
        return found

    def compute_advice(self, otherwise: str) -> str:
        """The advice of a compute-bound verdict: OTHERWISE (profile a rank) unless the MFU
        is known and low, then the causes found and their remedies."""
        if not self.low:
            return otherwise
        causes = self.causes()
        if not causes:
            return (f"under {LOW_MFU:.0%} of the peak for none of the causes xscale looks for "
                    f"(fp32, eager attention, small kernels): {otherwise}")
        return (f"under {LOW_MFU:.0%} of the peak, likely for "
                f"{'; '.join(cause for cause, _ in causes)}: try "
                f"{'; '.join(remedy for _, remedy in causes)}")

    def field(self) -> dict[str, Any]:
        """The summary file's `flops` field: what the figures were computed from."""
        return {"per_step": self.flops, "kernels": self.kernels, "precision": self.precision,
                "peak_tflops": self.peak.tflops, "peak_source": self.peak.source,
                "attention": self.attention, "optimizer": self.optimizer,
                "causes": [cause for cause, _ in self.causes()] if self.low else []}


def rate_text(tflops: float) -> str:
    """A rate of model FLOPs, in GFLOP/s under a tenth of a TFLOP/s (a CPU's)."""
    return f"{tflops:.3g} TFLOP/s" if tflops >= 0.1 else f"{tflops * 1000:.3g} GFLOP/s"


def percent_text(share: float) -> str:
    """A share in percent: one decimal, two significant digits under 0.1%."""
    return f"{share:.1%}" if share >= 0.001 else f"{share * 100:.2g}%"

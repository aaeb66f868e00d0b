"""The model FLOPs of one training step, counted once per run, on every trainer.

The loop opens a FlopWindow at the start of its first optimizer step and closes it at the step's
end: torch's FlopCounterMode counts the step's matmul, convolution and attention FLOPs from the
operators' shapes (forward, backward and all micro-batches, whatever code the script runs
between), and a second dispatch mode beside it notes what the device was asked to do: how many
kernels, in which precision the FLOPs ran, how attention was computed, whether the optimizer
was fused. The first step is the warm-up the step clock leaves out (xscale.observe.steptime), so
the counting's own cost (a Python call per operator, once) shows in no figure. A model that
torch.compile has compiled runs that step eagerly, under the compiler's "force_eager" stance
(torch >= 2.6), and compiles at the next (which the step clock leaves out, xscale.observe.warmup);
its FLOPs are the same (torch before 2.6 has no stance: a run there that may compile counts
nothing). The stance matters: dynamo, called under a dispatch mode, skips the frame, and torch
up to 2.13 then marks its code never to be compiled: on an H200 (torch 2.11) a compiled
GPT-neo-125M step so stayed at the eager 94 ms instead of 38 ms.

At the end, the FLOPs over the measured step time give the achieved TFLOP/s per device and,
against the device's peak (xscale.observe.peaks), the MFU (xscale.observe.utilisation).
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from xscale.observe import peaks
from xscale.observe.utilisation import Utilisation

PRECISION_OF = {torch.bfloat16: "bf16", torch.float16: "fp16"}  # anything else counts as fp32


@dataclass(frozen=True)
class StepCount:
    """What one optimizer step asked of the device: its model FLOPs, its kernels (operators
    that are not views), the FLOPs of each precision, how attention ran ("sdpa", "flash",
    "eager" for matmul + softmax, None: no attention) and the optimizer's kind ("fused",
    "foreach", "per-parameter"; None: no optimizer step seen)."""

    flops: int
    kernels: int
    flops_by_precision: dict[str, int] = field(default_factory=dict)
    attention: str | None = None
    optimizer: str | None = None

    @property
    def precision(self) -> str:
        """The precision most of the FLOPs ran in (fp32 when none was seen)."""
        if not self.flops_by_precision:
            return "fp32"
        return max(self.flops_by_precision, key=self.flops_by_precision.__getitem__)


class _StepOps(TorchDispatchMode):
    """Notes each operator the step runs (inside FlopCounterMode, which counts the FLOPs)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = 0
        self.flops_by_precision: Counter[str] = Counter()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if not func.is_view:
            self.kernels += 1
        formula = flop_registry.get(packet)
        if formula is not None:
            first = next((arg for arg in args if isinstance(arg, torch.Tensor)), None)
            precision = "fp32" if first is None else PRECISION_OF.get(first.dtype, "fp32")
            self.flops_by_precision[precision] += formula(*args, **kwargs, out_val=out)
        self.names.add(packet.__name__)
        return out

    def attention(self) -> str | None:
        if any("scaled_dot_product" in name for name in self.names):
            return "sdpa"
        if any("flash" in name for name in self.names):
            return "flash"
        return "eager" if "_softmax" in self.names else None

    def optimizer(self) -> str | None:
        if any(name.startswith("_fused_") for name in self.names):
            return "fused"
        if any(name.startswith("_foreach_") for name in self.names):
            return "foreach"
        return "per-parameter" if {"addcdiv_", "addcmul_", "lerp_"} & self.names else None


def _eager_stance() -> Any:
    """torch.compile told to step aside (entered); None where nothing can have been compiled:
    dynamo, whose import would cost a second, is not even imported."""
    if "torch._dynamo" not in sys.modules:
        return None
    return torch.compiler.set_stance("force_eager")


def _can_count() -> bool:
    """Whether counting leaves torch.compile alone: a torch before 2.6 has no stance to keep
    its dynamo out of the counted step, so a run there that may compile counts nothing."""
    return hasattr(torch.compiler, "set_stance") or "torch._dynamo" not in sys.modules


class FlopWindow:
    """Counts one optimizer step: begin() as it starts, end() when it is done (cancel(): the
    step did not complete, count the next one). Only the first completed step is counted."""

    def __init__(self) -> None:
        self.count: StepCount | None = None
        self._modes: tuple[Any, FlopCounterMode, _StepOps] | None = None

    def begin(self) -> None:
        if self.count is not None or self._modes is not None or not _can_count():
            return
        stance, counter, ops = _eager_stance(), FlopCounterMode(display=False), _StepOps()
        counter.__enter__()
        ops.__enter__()
        self._modes = (stance, counter, ops)

    def end(self) -> None:
        modes = self._close()
        if modes is not None:
            _, counter, ops = modes
            self.count = StepCount(counter.get_total_flops(), ops.kernels,
                                   dict(ops.flops_by_precision), ops.attention(),
                                   ops.optimizer())

    def cancel(self) -> None:
        self._close()

    def _close(self) -> tuple[Any, FlopCounterMode, _StepOps] | None:
        modes, self._modes = self._modes, None
        if modes is not None:
            stance, counter, ops = modes
            ops.__exit__(None, None, None)
            counter.__exit__(None, None, None)
            if stance is not None:
                stance.__exit__(None, None, None)  # the stance before, back
        return modes


def device_name(device: torch.device) -> str:
    """The name the peaks table is matched against ("NVIDIA H100 80GB HBM3", "AMD Instinct
    MI250X / MI250", "Intel(R) Data Center GPU Max 1550"); "cpu" on a CPU."""
    if device.type == "cpu":
        return device.type
    return torch.get_device_module(device).get_device_name(device)


def utilisation(count: StepCount | None, step_seconds: float | None,
                device: torch.device) -> Utilisation | None:
    """The step's achieved TFLOP/s per device and its share of the peak; None without a count
    or a measured step (or for a step without a FLOP: nothing to measure)."""
    if count is None or not step_seconds or count.flops <= 0:
        return None
    return Utilisation(tflops=count.flops / step_seconds / 1e12,
                       peak=peaks.peak_for(device_name(device), count.precision),
                       precision=count.precision, flops=count.flops, kernels=count.kernels,
                       step_seconds=step_seconds, attention=count.attention,
                       optimizer=count.optimizer)


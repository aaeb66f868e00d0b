"""The devices' published peaks, the denominator of the model FLOPs utilisation (MFU).

Dense (no sparsity) figures in TFLOPS per device torch sees, for the precision a step's matmuls
run in: bf16 and fp16 (the same on every device here), and fp32. Matched against torch's device
name, first match wins (so "GH200" before "H200", "NVL" and "PCIe" before the plain name).
NVIDIA gives its Tensor Core figures "with sparsity": they are halved here. XSCALE_PEAK_TFLOPS
replaces the table's figure (a device it lacks, a clock the site runs lower). No torch here:
`xscale report` and the gpu-check read it too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from xscale.shared import settings

PEAK_VARIABLE = "XSCALE_PEAK_TFLOPS"
PRECISIONS = ("bf16", "fp16", "fp32")


class DevicePeaks(NamedTuple):
    """A device's row: the part of torch's name that finds it, its bf16/fp16 and fp32 TFLOPS,
    and where the figures come from."""

    name: str
    half: float
    fp32: float
    source: str


PEAKS = tuple(DevicePeaks(*row) for row in (
    # NVIDIA GH200 data sheet: BF16/FP16 Tensor Core 1,979 TFLOPS (sparse), FP32 67.
    ("GH200", 989.5, 67.0, "NVIDIA GH200 data sheet"),
    # NVIDIA H200 data sheet (nvidia.com/en-us/data-center/h200): SXM 1,979 (sparse) and FP32
    # 67; NVL 1,671 and 60.
    ("H200 NVL", 835.5, 60.0, "NVIDIA H200 data sheet, NVL"),
    ("H200", 989.5, 67.0, "NVIDIA H200 data sheet, SXM"),
    # NVIDIA H100 data sheet (nvidia.com/en-us/data-center/h100): SXM 1,979 (sparse) and FP32
    # 67; NVL 1,671 and 60; PCIe 1,513 and 51. torch names the SXM part "NVIDIA H100 80GB HBM3".
    ("H100 NVL", 835.5, 60.0, "NVIDIA H100 data sheet, NVL"),
    ("H100 PCIe", 756.5, 51.0, "NVIDIA H100 data sheet, PCIe"),
    ("H100", 989.5, 67.0, "NVIDIA H100 data sheet, SXM"),
    # NVIDIA A100 data sheet: BF16/FP16 Tensor Core 312 TFLOPS dense, FP32 19.5.
    ("A100", 312.0, 19.5, "NVIDIA A100 data sheet"),
    # AMD Instinct MI250X data sheet: 383.0 TFLOPS bf16/fp16 and 95.7 fp32 matrix for the module;
    # ROCm shows each of its two GCDs as a device (LUMI-G's 8 GPUs are 4 MI250X).
    ("MI250X", 191.5, 47.85, "AMD Instinct MI250X data sheet, per GCD (half a module)"),
    # AMD Instinct MI300X and MI300A data sheets: 1,307.4 and 980.6 TFLOPS bf16/fp16 dense,
    # 163.4 and 122.6 fp32 matrix.
    ("MI300X", 1307.4, 163.4, "AMD Instinct MI300X data sheet"),
    ("MI300A", 980.6, 122.6, "AMD Instinct MI300A data sheet"),
    # Intel Data Center GPU Max 1550 (ark.intel.com, product 232873): 128 Xe cores in 2 stacks at
    # up to 1.6 GHz; per Xe core and clock, 8 matrix engines of 512 bf16/fp16 operations, and 8
    # vector engines of 16 fp32 fused multiply-adds: 839 and 52.4 TFLOPS per GPU. Aurora shows
    # each stack as a device (ZE_FLAT_DEVICE_HIERARCHY=FLAT).
    ("Max 1550", 419.4, 26.2, "Intel Max 1550 specification, per stack (half a GPU)"),
))


@dataclass(frozen=True)
class Peak:
    """A device's peak in TFLOPS at one precision (None: unknown) and where the figure comes
    from."""

    tflops: float | None
    source: str


def peak_for(device_name: str, precision: str = "bf16",
             environ: Mapping[str, str] | None = None) -> Peak:
    """XSCALE_PEAK_TFLOPS when set (UserError when it is not a positive number), else the
    table's figure for the device's name at PRECISION (one of PRECISIONS)."""
    override = settings.value(PEAK_VARIABLE, environ)
    if override is not None:
        return Peak(override, f"{PEAK_VARIABLE}={override:g}")
    for row in PEAKS:
        if row.name.lower() in device_name.lower():
            tflops = row.fp32 if precision == "fp32" else row.half
            return Peak(tflops, f"{row.source}, {precision} dense")
    return Peak(None, f"no published peak known for '{device_name}': set {PEAK_VARIABLE}")

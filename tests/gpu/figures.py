"""The gpu-check's arithmetic: model FLOPs utilisation (MFU), the devices' published peaks,
pytorch/examples' imagenet throughput from its log, and ratios of medians. No torch: the unit
tests check every figure by hand.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# Dense (no sparsity) bf16 peaks in TFLOPS per device torch sees, from the vendors' data sheets.
# Matched against torch's device name, first match wins (so "GH200" before "H200", "NVL" and
# "PCIe" before the plain name). NVIDIA gives its Tensor Core figures "with sparsity": halved here.
PEAK_BF16_TFLOPS: tuple[tuple[str, float, str], ...] = (
    # NVIDIA GH200 Grace Hopper Superchip data sheet: BF16 Tensor Core 1,979 TFLOPS (sparse).
    ("GH200", 989.5, "NVIDIA GH200 data sheet, 1,979 TFLOPS bf16 with sparsity"),
    # NVIDIA H200 data sheet (nvidia.com/en-us/data-center/h200): SXM 1,979, NVL 1,671 (sparse).
    ("H200 NVL", 835.5, "NVIDIA H200 data sheet, NVL: 1,671 TFLOPS bf16 with sparsity"),
    ("H200", 989.5, "NVIDIA H200 data sheet, SXM: 1,979 TFLOPS bf16 with sparsity"),
    # NVIDIA H100 data sheet (nvidia.com/en-us/data-center/h100): SXM 1,979, NVL 1,671,
    # PCIe 1,513 (sparse). torch names the SXM part "NVIDIA H100 80GB HBM3".
    ("H100 NVL", 835.5, "NVIDIA H100 data sheet, NVL: 1,671 TFLOPS bf16 with sparsity"),
    ("H100 PCIe", 756.5, "NVIDIA H100 data sheet, PCIe: 1,513 TFLOPS bf16 with sparsity"),
    ("H100", 989.5, "NVIDIA H100 data sheet, SXM: 1,979 TFLOPS bf16 with sparsity"),
    # NVIDIA A100 data sheet: BF16 Tensor Core 312 TFLOPS (624 with sparsity), SXM and PCIe.
    ("A100", 312.0, "NVIDIA A100 data sheet, 312 TFLOPS bf16 dense"),
    # AMD Instinct MI250X data sheet: 383.0 TFLOPS peak bf16 for the module; ROCm shows each of
    # its two GCDs as a device (LUMI-G's 8 GPUs are 4 MI250X).
    ("MI250X", 191.5, "AMD Instinct MI250X data sheet, 383.0 TFLOPS bf16 per module of 2 GCDs"),
    # AMD Instinct MI300X and MI300A data sheets: 1,307.4 and 980.6 TFLOPS peak bf16 (dense).
    ("MI300X", 1307.4, "AMD Instinct MI300X data sheet, 1,307.4 TFLOPS bf16 dense"),
    ("MI300A", 980.6, "AMD Instinct MI300A data sheet, 980.6 TFLOPS bf16 dense"),
    # Intel Data Center GPU Max 1550 (ark.intel.com, product 232873): 128 Xe cores in 2 stacks at
    # up to 1.6 GHz, 8 matrix engines of 512 bf16 operations per clock each per Xe core: 839
    # TFLOPS per GPU. Aurora shows each stack as a device (ZE_FLAT_DEVICE_HIERARCHY=FLAT).
    ("Max 1550", 419.4, "Intel Max 1550 specification, 839 TFLOPS bf16 per GPU of 2 stacks"),
)
PEAK_VARIABLE = "XSCALE_PEAK_TFLOPS"


@dataclass(frozen=True)
class Peak:
    """A device's peak in TFLOPS (None: unknown) and where the figure comes from."""

    tflops: float | None
    source: str


def peak_override(environ: Mapping[str, str]) -> float | None:
    """XSCALE_PEAK_TFLOPS, checked (ValueError: not a positive number); None when unset."""
    text = environ.get(PEAK_VARIABLE, "").strip()
    if not text:
        return None
    try:
        tflops = float(text)
    except ValueError:
        tflops = 0.0
    if not 0 < tflops < float("inf"):
        raise ValueError(f"{PEAK_VARIABLE}='{text}' is not a positive number of TFLOPS")
    return tflops


def peak_for(device_name: str, environ: Mapping[str, str]) -> Peak:
    """XSCALE_PEAK_TFLOPS when set, else the table's figure for the device's name."""
    override = peak_override(environ)
    if override is not None:
        return Peak(override, f"{PEAK_VARIABLE}={environ[PEAK_VARIABLE].strip()}")
    for pattern, tflops, source in PEAK_BF16_TFLOPS:
        if pattern.lower() in device_name.lower():
            return Peak(tflops, source)
    return Peak(None, f"no published peak known for '{device_name}': set {PEAK_VARIABLE}")


@dataclass(frozen=True)
class TransformerShape:
    """What the FLOPs of one training token depend on."""

    params: int  # without the position embeddings (they cost a lookup, not a matmul)
    layers: int
    heads: int
    head_dim: int
    seq_len: int


def gpt_neo_shape(config: Mapping[str, Any], seq_len: int) -> TransformerShape:
    """A GPTNeoConfig's shape (as keyword arguments). N counts every weight that takes part in a
    matmul: not the position embeddings (a lookup), but the token embeddings, which GPT-neo's
    output layer shares (its logits are a matmul with them), as nanoGPT counts."""
    hidden, layers, vocab = config["hidden_size"], config["num_layers"], config["vocab_size"]
    inner = config.get("intermediate_size") or 4 * hidden  # None: GPT-neo's default
    attention = 4 * hidden * hidden + hidden  # q, k, v without bias, the output with one
    mlp = hidden * inner + inner + inner * hidden + hidden
    per_layer = attention + mlp + 4 * hidden  # and two LayerNorms
    params = vocab * hidden + layers * per_layer + 2 * hidden  # the final LayerNorm
    return TransformerShape(params, layers, config["num_heads"], hidden // config["num_heads"],
                            seq_len)


def flops_per_token(shape: TransformerShape) -> float:
    """Training FLOPs per token, 6N + 12·L·H·Q·T: the weights' matmuls forward and backward
    (6 per parameter) plus attention's scores and weighted sum, as PaLM's appendix B counts them
    (Chowdhery et al. 2022, arXiv:2204.02311) and nanoGPT's estimate_mfu (karpathy/nanoGPT,
    model.py) computes them. GPT-neo's local layers attend to a window only: their attention is
    counted in full, so the MFU is a little high for sequences longer than the window."""
    attention = 12 * shape.layers * shape.heads * shape.head_dim * shape.seq_len
    return 6 * shape.params + attention


def mfu(tokens_per_s_per_device: float, shape: TransformerShape, peak: Peak) -> float | None:
    """The fraction of the device's peak the training's model FLOPs reach (None: peak unknown)."""
    if peak.tflops is None:
        return None
    return tokens_per_s_per_device * flops_per_token(shape) / (peak.tflops * 1e12)


# pytorch/examples' imagenet/main.py prints `Epoch: [0][ 11/5005]\tTime  0.123 ( 0.456)\t...`
# every --print-freq batches (ProgressMeter.display of AverageMeter('Time', ...)): the batch's own
# time, then the running average.
EXAMPLES_BATCH = re.compile(r"^Epoch: \[\d+\]\[\s*(\d+)/\s*\d+\]\s+Time\s+([0-9.]+)\s+\(")


def examples_batch_times(lines: Iterable[str]) -> list[tuple[int, float]]:
    """(batch number, seconds) of each batch main.py printed."""
    found = []
    for line in lines:
        match = EXAMPLES_BATCH.match(line.strip())
        if match:
            found.append((int(match.group(1)), float(match.group(2))))
    return found


def examples_images_per_s(times: list[tuple[int, float]], batch_size: int, warmup: int,
                          steps: int) -> float | None:
    """Images per second over batches warmup+1..warmup+steps (as xscale's summary leaves the
    first steps out); None when main.py printed fewer."""
    window = [seconds for number, seconds in times if warmup < number <= warmup + steps]
    if len(window) < steps or sum(window) <= 0:
        return None
    return batch_size * len(window) / sum(window)


def ratio_of_medians(ours: list[float], theirs: list[float]) -> float | None:
    """median(ours) / median(theirs): over interleaved rounds, so a clock or thermal drift during
    the run affects both sides alike. None when either side has no figure."""
    if not ours or not theirs or statistics.median(theirs) <= 0:
        return None
    return statistics.median(ours) / statistics.median(theirs)

"""The gpu-check's arithmetic: the model FLOPs utilisation (MFU) of GPT-neo's tokens/s against
the devices' published peaks (the library's, xscale.observe.peaks), pytorch/examples' imagenet
throughput from its log, and ratios of medians. No torch: the unit tests check every figure by
hand.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from xscale.observe.peaks import Peak


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

"""How much of the device a step used: the devices' peaks (xscale.observe.peaks), one step's
model FLOPs and what it ran, counted with torch's FlopCounterMode (xscale.observe.flops), and
the verdict's words about them (xscale.observe.utilisation). The trainers' runs check their
summaries' figures against each other (tests/helpers.check_utilisation)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from xscale.observe import bounds, flops, peaks, warmup
from xscale.observe.utilisation import LOW_MFU, Utilisation
from xscale.shared.settings import UserError


@pytest.mark.parametrize("name, bf16, fp32", [
    ("NVIDIA H100 80GB HBM3", 989.5, 67.0), ("NVIDIA H100 PCIe", 756.5, 51.0),
    ("NVIDIA H100 NVL", 835.5, 60.0), ("NVIDIA H200", 989.5, 67.0),
    ("NVIDIA H200 NVL", 835.5, 60.0), ("NVIDIA A100-SXM4-80GB", 312.0, 19.5),
    ("AMD Instinct MI250X", 191.5, 47.85), ("AMD Instinct MI250X / MI250", 191.5, 47.85),
    ("AMD Instinct MI300X", 1307.4, 163.4), ("Intel(R) Data Center GPU Max 1550", 419.4, 26.2),
])
def test_the_published_peak_of_each_device_name_and_precision(name: str, bf16: float,
                                                               fp32: float):
    assert peaks.peak_for(name, "bf16", {}).tflops == bf16
    assert peaks.peak_for(name, "fp16", {}).tflops == bf16  # the same on every device here
    assert peaks.peak_for(name, "fp32", {}).tflops == fp32


def test_gh200_is_not_taken_for_an_h200_and_an_unknown_device_says_how_to_give_its_peak():
    assert "GH200" in peaks.peak_for("NVIDIA GH200 480GB", "bf16", {}).source
    peak = peaks.peak_for("NVIDIA GeForce RTX 4090", "bf16", {})
    assert peak.tflops is None and "XSCALE_PEAK_TFLOPS" in peak.source


def test_xscale_peak_tflops_wins_and_a_bad_value_is_refused():
    peak = peaks.peak_for("AMD Instinct MI250X", "fp32", {"XSCALE_PEAK_TFLOPS": " 150 "})
    assert peak.tflops == 150.0 and peak.source == "XSCALE_PEAK_TFLOPS=150"
    for bad in ("0", "-3", "abc", "inf", "nan", ""):
        with pytest.raises(UserError, match=f"XSCALE_PEAK_TFLOPS='{bad}' is not a positive"):
            peaks.peak_for("AMD Instinct MI250X", "bf16", {"XSCALE_PEAK_TFLOPS": bad})


# ---- one step's count ---------------------------------------------------------------------


def counted(step) -> flops.StepCount:
    window = flops.FlopWindow()
    window.begin()
    step()
    window.end()
    return window.count


def test_a_step_of_two_linear_layers_counts_their_matmuls_forward_and_backward():
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = torch.randn(8, 64)

    def step():
        model(batch).sum().backward()
        optimizer.step()

    count = counted(step)
    # Forward 2·B·in·out per layer; backward the weights' gradient of each, and the input's
    # gradient of the second (the batch needs none): 2·8·64·32·2 + 2·8·32·10·3.
    assert count.flops == 2 * 8 * 64 * 32 * 2 + 2 * 8 * 32 * 10 * 3
    assert count.flops_by_precision == {"fp32": count.flops} and count.precision == "fp32"
    assert count.kernels >= 6 and count.attention is None


def attention_step(sdpa: bool, optimizer_options: dict):
    projection = nn.Linear(16, 48)
    optimizer = torch.optim.AdamW(projection.parameters(), **optimizer_options)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            q, k, v = projection(torch.randn(2, 8, 16)).chunk(3, dim=-1)
            if sdpa:
                out = F.scaled_dot_product_attention(q, k, v)
            else:
                out = torch.softmax(q @ k.transpose(-1, -2) / 4, dim=-1) @ v
        out.float().sum().backward()
        optimizer.step()
    return step


@pytest.mark.parametrize("sdpa, options, attention, optimizer", [
    (False, {"foreach": False}, "eager", "per-parameter"),
    (True, {"foreach": True}, "sdpa", "foreach"),
    (True, {"fused": True}, "sdpa", "fused"),
])
def test_the_count_notes_the_precision_the_attention_and_the_optimizer(sdpa, options, attention,
                                                                       optimizer):
    count = counted(attention_step(sdpa, options))
    assert count.flops > 0 and count.precision == "bf16", count
    assert (count.attention, count.optimizer) == (attention, optimizer)


def test_only_the_first_whole_step_is_counted():
    model = nn.Linear(4, 4)
    window = flops.FlopWindow()
    window.begin()
    model(torch.randn(3, 4)).sum().backward()
    window.cancel()  # a step a live recovery dropped
    assert window.count is None
    window.begin()
    model(torch.randn(2, 4)).sum()
    window.end()
    first = window.count
    window.begin()  # later steps run without the modes
    model(torch.randn(64, 4)).sum()
    window.end()
    assert window.count is first and first.flops == 2 * 2 * 4 * 4


def test_a_compiled_model_runs_its_counted_step_eagerly_and_compiles_at_the_next():
    """torch up to 2.13 marks a frame first met under a dispatch mode never to be compiled (a
    compiled GPT-neo-125M stayed eager on an H200): the counted step must not reach dynamo."""
    model = torch.compile(nn.Linear(4, 4), backend="eager")
    window = flops.FlopWindow()
    before = warmup.compiled_graphs()
    window.begin()
    model(torch.randn(2, 4)).sum()
    window.end()
    assert window.count.flops == 2 * 2 * 4 * 4 and warmup.compiled_graphs() == before
    model(torch.randn(2, 4)).sum()
    assert warmup.compiled_graphs() == before + 1


def test_no_count_or_no_step_time_gives_no_utilisation():
    count = flops.StepCount(flops=10**9, kernels=10)
    assert flops.utilisation(None, 0.1, torch.device("cpu")) is None
    assert flops.utilisation(count, None, torch.device("cpu")) is None
    used = flops.utilisation(count, 0.01, torch.device("cpu"))
    assert used.tflops == pytest.approx(0.1) and used.mfu is None  # no peak for a CPU


# ---- the verdict's words -------------------------------------------------------------------


def used(tflops: float, peak: float | None = 100.0, precision: str = "bf16",
         kernels: int = 100, step_seconds: float = 0.1, attention: str | None = None,
         optimizer: str | None = "fused") -> Utilisation:
    return Utilisation(tflops, peaks.Peak(peak, "a data sheet"), precision,
                       int(tflops * 1e12 * step_seconds), kernels, step_seconds, attention,
                       optimizer)


COMPUTE_BOUND = {"data": 0.0, "compute": 0.9, "communication": 0.05, "checkpoint": 0.0,
                 "other": 0.05}


def test_a_busy_device_is_told_its_mfu_and_to_profile():
    line = bounds.verdict(0.1, COMPUTE_BOUND, "rank 0", used(45.0))
    assert line.endswith("compute-bound, MFU 45.0% (45 TFLOP/s of 100 TFLOP/s bf16); "
                         f"{bounds.ADVICE['compute']} (rank 0; docs/STEPTIME.md)")


def test_a_low_mfu_names_each_cause_the_step_showed_and_its_remedy():
    # 5,000 kernels in 50 ms: 10 us each, an fp32 step with eager attention, Adam per parameter.
    low = used(4.9, precision="fp32", kernels=5000, step_seconds=0.05, attention="eager",
               optimizer="per-parameter")
    line = bounds.verdict(0.05, COMPUTE_BOUND, "rank 0", low)
    assert ("compute-bound, MFU 4.9% (4.9 TFLOP/s of 100 TFLOP/s fp32); "
            f"under {LOW_MFU:.0%} of the "
            "peak, likely for matmuls in fp32; attention as matmul + softmax; 5000 kernels a "
            "step, one per 10 us: the host's launches set the pace: try bf16 autocast "
            "(torch.autocast); SDPA or flash attention; torch.compile, larger micro-batches, "
            "a fused optimizer (fused=True) (rank 0;") in line
    assert low.field()["causes"] == ["matmuls in fp32", "attention as matmul + softmax",
                                     "5000 kernels a step, one per 10 us: the host's launches "
                                     "set the pace"]


def test_a_low_mfu_without_a_known_cause_says_so_and_a_high_one_lists_none():
    line = bounds.verdict(0.1, COMPUTE_BOUND, "rank 0", used(5.0))
    assert "MFU 5.0% (5 TFLOP/s of 100 TFLOP/s bf16); under 20% of the peak for none of the " \
           "causes xscale looks for (fp32, eager attention, small kernels): profile one rank" \
           in line
    assert used(45.0, precision="fp32", attention="eager").field()["causes"] == []


def test_an_unknown_peak_gives_the_tflops_and_other_bounds_keep_their_advice():
    shares = {**COMPUTE_BOUND, "data": 0.8, "compute": 0.1}
    line = bounds.verdict(0.1, shares, "rank 1", used(0.0123, peak=None))
    assert ": data-bound, 12.3 GFLOP/s, MFU unknown (XSCALE_PEAK_TFLOPS gives the peak); " \
           f"{bounds.ADVICE['data']} (rank 1; docs/STEPTIME.md)" in line
    tiny = used(0.0005, peak=2.0)
    assert tiny.clause() == "MFU 0.025% (0.5 GFLOP/s of 2 TFLOP/s bf16)"

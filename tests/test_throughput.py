"""xscale.observe.throughput: the rates count after the warm-up."""

from __future__ import annotations

import pytest
import torch
from xscale.observe.throughput import Throughput

# ---------------------------------------------------------------------------------------------
# throughput
# ---------------------------------------------------------------------------------------------


def test_throughput_counts_after_the_warmup():
    meter = Throughput(torch.device("cpu"), warmup_steps=1)
    meter.start()
    meter.step(1000)  # the slow first step: not counted
    for _ in range(3):
        meter.step(10, tokens=100)
    meter.stop()
    rates = meter.local()
    assert rates.steps == 4
    assert rates.tokens_per_s == pytest.approx(rates.samples_per_s * 10)
    assert meter.reduced()["samples_per_s"] == pytest.approx(rates.samples_per_s)

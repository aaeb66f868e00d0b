"""xscale.observe.throughput: the rates count after the warm-up."""

from __future__ import annotations

import pytest
import torch
from xscale.observe.throughput import Throughput

from tests.test_steptime import compile_a_graph

# ---------------------------------------------------------------------------------------------
# throughput
# ---------------------------------------------------------------------------------------------


def test_throughput_counts_after_the_warmup_and_the_steps_that_compiled():
    meter = Throughput(torch.device("cpu"), warmup_steps=1)
    meter.start()
    meter.step(1000)  # the slow first step: not counted
    compile_a_graph(size=3)
    meter.step(1000)  # the step torch.compile compiled in: not counted either
    for _ in range(3):
        meter.step(10, tokens=100)
    meter.stop()
    rates = meter.local()
    assert rates.steps == 5
    assert rates.tokens_per_s == pytest.approx(rates.samples_per_s * 10)
    assert meter.reduced()["samples_per_s"] == pytest.approx(rates.samples_per_s)

"""xscale.profiling: the window opens and closes at the configured steps."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from xscale import profiling
from xscale.lifecycle import UserError

# ---------------------------------------------------------------------------------------------
# profiling: the window opens and closes at the configured steps
# ---------------------------------------------------------------------------------------------


def test_no_profiling_variables_means_no_window():
    window = profiling.window_from_env(0, torch.device("cpu"), {})
    assert window.mode == "off"
    for step in range(5):
        window.step(step)
    assert not window.active


def test_external_window_is_active_exactly_for_its_steps():
    env = {"XSCALE_PROFILED": "1", "PROFILE_STEP_START": "2", "PROFILE_STEPS": "3"}
    window = profiling.window_from_env(0, torch.device("cpu"), env)
    active = []
    for step in range(8):
        window.step(step)
        active.append(window.active)
    assert active == [False, False, True, True, True, False, False, False]


def test_torch_profiler_writes_this_ranks_trace(tmp_path):
    env = {"XSCALE_TORCH_PROFILER": "1", "PROFILE_STEP_START": "2", "PROFILE_STEPS": "2",
           "PROFILE_DIR": str(tmp_path)}
    window = profiling.window_from_env(3, torch.device("cpu"), env)
    model = nn.Linear(8, 8)
    for step in range(6):
        window.step(step)
        model(torch.randn(4, 8)).sum().backward()
    window.close()
    traces = list((tmp_path / "rank3").glob("rank3*.json"))
    assert len(traces) == 1
    text = traces[0].read_text()
    assert "ProfilerStep#2" in text and "ProfilerStep#3" in text
    assert "ProfilerStep#4" not in text and "ProfilerStep#1" not in text


@pytest.mark.parametrize("name, value", [("PROFILE_STEPS", "0"), ("PROFILE_STEP_START", "ten")])
def test_bad_profile_variables_are_user_errors(name, value):
    with pytest.raises(UserError, match=name):
        profiling.window_from_env(0, torch.device("cpu"), {"XSCALE_PROFILED": "1", name: value})

"""xscale.observe.profile_window: the window opens and closes at the configured steps;
xscale.observe.profile_report: what a profile holds, read back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from xscale.lifecycle import UserError
from xscale.observe import profile_report, profile_window

# ---------------------------------------------------------------------------------------------
# profiling: the window opens and closes at the configured steps
# ---------------------------------------------------------------------------------------------


def test_no_profiling_variables_means_no_window():
    window = profile_window.window_from_env(0, torch.device("cpu"), {})
    assert window.mode == "off"
    for step in range(5):
        window.step(step)
    assert not window.active


def test_external_window_is_active_exactly_for_its_steps():
    env = {"XSCALE_PROFILED": "1", "PROFILE_STEP_START": "2", "PROFILE_STEPS": "3"}
    window = profile_window.window_from_env(0, torch.device("cpu"), env)
    active = []
    for step in range(8):
        window.step(step)
        active.append(window.active)
    assert active == [False, False, True, True, True, False, False, False]


@pytest.mark.parametrize("first_step", [0, 100])  # a fresh run, and one resumed at step 100
def test_torch_profiler_writes_this_ranks_trace_and_summarises_it_at_the_end(tmp_path, capsys,
                                                                            first_step):
    start = first_step + 2
    env = {"XSCALE_TORCH_PROFILER": "1", "PROFILE_STEP_START": str(start), "PROFILE_STEPS": "2",
           "PROFILE_DIR": str(tmp_path)}
    window = profile_window.window_from_env(3, torch.device("cpu"), env)
    model = nn.Linear(8, 8)
    for step in range(first_step, first_step + 6):
        window.step(step)
        model(torch.randn(4, 8)).sum().backward()
    window.close()
    traces = list((tmp_path / "rank3").glob("rank3*.json"))
    assert traces == [window.trace]
    text = traces[0].read_text()
    assert "ProfilerStep#" in text
    summary = capsys.readouterr().out
    assert f"xscale: profile of rank 3, steps {start}-{start + 1} (2 steps): {traces[0]}" \
        in summary, summary
    assert "aten::addmm" in summary and "no device kernels in this trace" in summary
    assert "-bound; " in summary and "(rank 3's trace; docs/STEPTIME.md)" in summary


def test_an_external_profilers_rank_says_where_its_files_go(tmp_path, capsys):
    env = {"XSCALE_PROFILED": "1", "PROFILE_DIR": str(tmp_path)}
    window = profile_window.window_from_env(0, torch.device("cpu"), env)
    window.close()
    window.close()  # Trainer may end training twice: said once
    said = capsys.readouterr().err.splitlines()
    assert said == [f"xscale: rank 0: the profiler writes its files under {tmp_path} as this "
                    f"rank exits; `xscale report --profile {tmp_path}` names them and what "
                    f"opens them"]


# ---------------------------------------------------------------------------------------------
# profiles: a trace summarised, a directory read back
# ---------------------------------------------------------------------------------------------

def span(name: str, start: float, end: float, tid: int = 1, cat: str = "cpu_op") -> dict:
    return {"ph": "X", "name": name, "cat": cat, "pid": 1, "tid": tid, "ts": start,
            "dur": end - start}


def device_trace(path: Path) -> Path:
    """Two steps of 100 µs on a device: a compute kernel 0-40, a collective 30-85 (40-85 not
    hidden), the training thread in the DataLoader 80-90 (85-90 idle but for it); an operator
    10-50 with a child 20-30."""
    events = []
    for offset in (0, 100):
        events += [
            span(f"ProfilerStep#{offset // 100 + 4}", offset, offset + 100, cat="user_annotation"),
            span("aten::mm", offset + 10, offset + 50),
            span("aten::t", offset + 20, offset + 30),
            span("enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__",
                 offset + 80, offset + 90, cat="user_annotation"),
            span("gemm_kernel", offset, offset + 40, tid=7, cat="kernel"),
            span("ncclDevKernel_AllReduce_Sum_f32_RING_LL", offset + 30, offset + 85, tid=8,
                 cat="kernel"),
        ]
    path.write_text(json.dumps({"distributedInfo": {"rank": 5}, profile_report.FIRST_STEP: 10,
                                "traceEvents": events}))
    return path


def test_a_device_trace_splits_each_moment_once_and_names_the_collectives(tmp_path):
    summary = profile_report.summarise(device_trace(tmp_path / "rank5.1.pt.trace.json"))
    assert summary.shares == pytest.approx({"data": 0.05, "compute": 0.4, "communication": 0.45,
                                            "other": 0.1})
    assert (summary.rank, summary.first_step, summary.steps) == (5, 14, 2)
    assert summary.seconds == pytest.approx(100e-6)
    assert dict(summary.operators) == pytest.approx({"aten::mm": 30e-6, "aten::t": 10e-6,
        "enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__": 10e-6})
    text = summary.text()
    assert "steps 14-15 (2 steps)" in text
    assert "ncclDevKernel_AllReduce_Sum_f32_RING_LL  (communication)" in text
    assert "communication kernels: 58% of the kernel time" in text
    assert "collectives ran during 55% of the step time; 45% was not hidden" in text
    assert ": communication-bound; " in text and "(rank 5's trace; " in text


def test_a_profile_directory_names_each_profilers_files_and_what_opens_them(tmp_path):
    (tmp_path / "rank5").mkdir()
    device_trace(tmp_path / "rank5" / "rank5.1.pt.trace.json")
    for name in ("rank3.svg", "rank0.nsys-rep", "rank1/results.stats.csv", "rank1/results.json"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("x")
    text = profile_report.describe(tmp_path)
    assert "xscale: profile of rank 5, steps 14-15" in text
    assert f"{tmp_path / 'rank3.svg'}: a py-spy flame graph; open it with a web browser" in text
    assert f"nsys stats {tmp_path / 'rank0.nsys-rep'}" in text
    assert f"{tmp_path / 'rank1' / 'results.stats.csv'}: rocprof's statistics" in text
    assert f"{tmp_path / 'rank1' / 'results.json'}: a Chrome trace" in text


def test_a_profile_dir_that_cannot_be_made_is_a_user_error_before_training(tmp_path):
    (tmp_path / "file").write_text("")
    env = {"XSCALE_TORCH_PROFILER": "1", "PROFILE_DIR": str(tmp_path / "file" / "prof")}
    with pytest.raises(UserError, match="PROFILE_DIR '.*' cannot be created: Not a directory"):
        profile_window.window_from_env(0, torch.device("cpu"), env)


@pytest.mark.parametrize("name, value", [("PROFILE_STEPS", "0"), ("PROFILE_STEP_START", "ten")])
def test_bad_profile_variables_are_user_errors(name, value):
    with pytest.raises(UserError, match=name):
        profile_window.window_from_env(0, torch.device("cpu"),
                                       {"XSCALE_PROFILED": "1", name: value})


def test_reading_profiles_back_needs_no_torch():
    """`xscale report --profile` runs on a login node, where torch may not be installed."""
    code = ("import sys, xscale.observe.report, xscale.observe.profile_report; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr

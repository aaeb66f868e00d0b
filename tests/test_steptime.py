"""xscale.steptime: how a rank's step splits into data, compute, communication, checkpoints and
the rest, which rank the verdict is read from, and what it advises. Two real ranks with DDP
here; the bed's real faults (a throttled link) in the test at the end."""

from __future__ import annotations

import json

import pytest
from xscale import steptime

from tests.conftest import REPO
from tests.helpers import check_step_time, results_of, run_two_ranks, tagged_records

PROGRAM = (REPO / "tests" / "programs" / "two_ranks_steptime.py").read_text()


def breakdown(seconds: float, data: float = 0.0, compute: float = 0.0,
              communication: float | None = 0.0, checkpoint: float = 0.0) -> steptime.Breakdown:
    other = seconds - data - compute - (communication or 0.0) - checkpoint
    return steptime.Breakdown(seconds, data, compute, communication, checkpoint, other)


def test_the_verdict_is_read_from_the_rank_that_waited_least_and_names_the_largest_part():
    # Rank 1 computes longest; rank 0 waits for it in the all-reduce, which counts as its
    # communication: the run is bound by rank 1's compute, not by the network.
    ranks = [(0, breakdown(0.2, data=0.01, compute=0.05, communication=0.13)),
             (1, breakdown(0.2, data=0.01, compute=0.17, communication=0.01))]
    step_time = steptime.summarise(ranks)
    assert (step_time.rank, step_time.bound) == (1, "compute")
    assert step_time.field() == {"seconds": 0.2, "data": 0.05, "compute": 0.85,
                                 "communication": 0.05, "checkpoint": 0.0, "other": 0.05}
    assert step_time.ranks()["spread"]["communication"] == {
        "min": 0.05, "min_rank": 1, "max": 0.65, "max_rank": 0}
    assert step_time.verdict() == (
        "xscale: step time 200 ms: data 5%, compute 85%, communication 5% (not hidden), "
        "checkpoints 0%, other 5%: compute-bound; " + steptime.ADVICE["compute"]
        + " (rank 1; docs/STEPTIME.md)")


@pytest.mark.parametrize("bound", steptime.BOUNDS)
def test_each_bound_has_its_advice(bound):
    parts = {"data": 0.1, "compute": 0.1, "communication": 0.1, "checkpoint": 0.1, bound: 0.5}
    step_time = steptime.summarise([(0, breakdown(0.9, **parts))])
    assert step_time.bound == bound
    assert step_time.verdict().endswith(
        f": {bound}-bound; {steptime.ADVICE[bound]} (rank 0; docs/STEPTIME.md)")


def test_without_ddp_communication_is_not_measured_and_stays_inside_compute():
    step_time = steptime.summarise([(0, breakdown(0.1, compute=0.09, communication=None)),
                                    (1, None)])  # a rank with too few steps to time
    assert step_time.field()["communication"] is None and step_time.bound == "compute"
    assert "communication not measured (inside compute: no DDP)" in step_time.verdict()
    assert steptime.summarise([(0, None)]) is None


def test_a_clock_leaves_the_warm_up_out_and_books_data_and_checkpoint_waits():
    now = [0.0]
    clock = steptime.StepClock(warmup_steps=2, now=lambda: now[0])
    clock.waited_for_data(5.0)  # the warm-up's waits count for nothing
    for _ in range(2):
        now[0] += 6.0
        clock.step()
    assert clock.breakdown() is None  # no step after the warm-up yet
    for _ in range(2):
        clock.waited_for_data(0.5)
        clock.waited_for_checkpoint(0.25)
        now[0] += 1.0
        clock.step()
    clock.waited_for_checkpoint(9.0)  # the save after the last step is outside its time
    assert clock.breakdown() == steptime.Breakdown(seconds=1.0, data=0.5, compute=0.25,
                                                   communication=0.0, checkpoint=0.25, other=0.0)


@pytest.mark.parametrize("delay_s, bound", [("0", None), ("0.004", "data")])
def test_two_ddp_ranks_measure_every_part_and_slow_reads_are_data_bound(tmp_path, delay_s,
                                                                      bound):
    runs = run_two_ranks(tmp_path, PROGRAM, str(tmp_path / "out"), DATA_DELAY_S=delay_s)
    for record in results_of(runs):
        parts = record["breakdown"]
        assert parts["compute"] > 0 and parts["communication"] is not None, parts
        total = sum(parts[name] for name in steptime.SHARES)
        assert total == pytest.approx(parts["seconds"]), parts
    summary = json.loads((tmp_path / "out" / "xscale-summary.json").read_text())
    check_step_time(summary)
    rank0_out = runs[0][1]
    assert tagged_records(rank0_out, "XSCALE_SUMMARY")[-1]["bound"] == summary["bound"]
    assert "xscale: step time " in rank0_out and f": {summary['bound']}-bound; " in rank0_out
    if bound:
        assert summary["bound"] == bound, summary["step_time"]

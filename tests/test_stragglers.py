"""xscale.observe.stragglers without the cluster: what is timed, how rank 0 decides, what it says.
The real thing, one node of the four slowed for real, runs on the test bed
(tests/test_failures.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from xscale import reductions
from xscale.lifecycle import UserError
from xscale.observe import spans, stragglers


class Clock:
    """Stands in for WorkClock: the seconds each interval reports are the test's."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def take(self) -> float:
        return self.seconds


def watch_of(world: int, said: list[str], factor: float = 2.0,
             intervals: int = 3) -> stragglers.StragglerWatch:
    return stragglers.StragglerWatch(Clock(), 0, world, [f"nid{r + 1:03d}" for r in range(world)],
                                     factor, intervals, say=said.append)


def run_intervals(watch: stragglers.StragglerWatch, per_step: list[list[float]],
                  steps: int = 10) -> None:
    for seconds in per_step:
        for _ in range(steps):
            watch.step()
        watch.observe(seconds)


def test_a_rank_persistently_twice_as_slow_is_named_once_with_its_node():
    said: list[str] = []
    watch = watch_of(4, said)
    warm_up = [[9.0, 1.0, 1.0, 1.0]]  # one-off costs of the first step count for nothing
    run_intervals(watch, warm_up + [[0.1, 0.1, 0.1, 0.3]] * 5)
    assert said == ["xscale: straggler: rank 3 on nid004: 3.0x the median rank's work per step "
                    "over the last 30 steps"]
    assert watch.summary() == {"rank": 3, "node": "nid004", "factor": 3.0}


def test_one_intervals_hiccup_names_nobody_and_the_factor_is_the_users():
    said: list[str] = []
    watch = watch_of(4, said)
    # Rank 1 three times the others once (a checkpoint, a page-cache miss): 5/3 over 3 intervals.
    run_intervals(watch, [[0.1] * 4, [0.1, 0.3, 0.1, 0.1], [0.1] * 4, [0.1] * 4, [0.1] * 4])
    assert said == []
    lower = watch_of(4, said, factor=1.5)
    run_intervals(lower, [[0.1] * 4, [0.1, 0.3, 0.1, 0.1], [0.1] * 4, [0.1] * 4])
    assert said == ["xscale: straggler: rank 1 on nid002: 1.7x the median rank's work per step "
                    "over the last 30 steps"]


def test_short_steps_name_a_rank_only_once_it_lost_more_than_a_hiccup():
    """Steps of 3 ms of work: a rank descheduled for a while is 2.4x the median over three
    intervals but has lost 0.13 s, and over a longer window it is not slow; a rank 2.5x slow
    all along is named once it has lost MIN_EXCESS_S (0.5 s)."""
    said: list[str] = []
    watch = watch_of(4, said)
    healthy = [0.003] * 4
    run_intervals(watch, [healthy] * 20 + [[0.003, 0.0072, 0.003, 0.003]] * 3 + [healthy] * 5)
    assert said == []
    slow = watch_of(4, said)
    run_intervals(slow, [healthy] + [[0.003, 0.003, 0.0075, 0.003]] * 20)
    # 0.045 s lost per interval: the twelfth interval passes 0.5 s.
    assert said == ["xscale: straggler: rank 2 on nid003: 2.5x the median rank's work per step "
                    "over the last 120 steps"]


def test_after_a_recovery_the_first_interval_is_a_warm_up_again():
    """A replacement's first interval (its workers starting, its first forward) names nobody:
    every rank starts its account afresh at the recovery."""
    said: list[str] = []
    watch = watch_of(4, said)
    run_intervals(watch, [[0.1] * 4] * 4)
    watch.restart(["nid001", "nid002", "nid004", "nid003"])
    run_intervals(watch, [[0.1, 0.1, 0.9, 0.1]] + [[0.1] * 4] * 3)
    assert said == []
    run_intervals(watch, [[0.1, 0.1, 0.1, 0.4]] * 3)
    assert said[-1].startswith("xscale: straggler: rank 3 on nid003: ")  # the new placement


def test_only_rank_0_speaks_but_every_rank_keeps_the_same_account():
    said: list[str] = []
    other = stragglers.StragglerWatch(Clock(), 2, 4, [], 2.0, 3, say=said.append)
    run_intervals(other, [[0.1] * 4] + [[0.4, 0.1, 0.1, 0.1]] * 3)
    assert said == [] and other.summary()["rank"] == 0 and other.summary()["node"] == "?"


def test_each_rank_sends_its_seconds_per_step_at_its_own_index():
    clock = Clock()
    watch = stragglers.StragglerWatch(clock, 2, 4, [], 2.0, 3)
    clock.seconds = 1.5
    for _ in range(3):
        watch.step()
    assert watch.contribution().tolist() == [0.0, 0.0, 0.5, 0.0]
    # One all_reduce carries numbers and such vectors alike (one process: the sums are its own).
    sums = reductions.all_reduce_sums({"stop": 0.0, "work": watch.contribution()})
    assert sums == {"stop": 0.0, "work": [0.0, 0.0, 0.5, 0.0]}


def test_the_clock_times_training_forwards_and_batch_waits_not_evaluations(monkeypatch):
    ticks = iter([10.0, 10.05])  # the clock reads as the training forward starts and ends
    monkeypatch.setattr(spans.time, "perf_counter", lambda: next(ticks))
    model = nn.Sequential(nn.Linear(2, 2))
    clock = stragglers.WorkClock(model, torch.device("cpu"))
    model.train()
    model(torch.zeros(1, 2))
    clock.add_wait(0.25)
    model.eval()
    model(torch.zeros(1, 2))  # an evaluation: the clock is not read at all
    assert clock.take() == pytest.approx(0.30)
    assert clock.take() == 0.0


@pytest.mark.parametrize(("env", "words"), [
    ({"XSCALE_STRAGGLER_FACTOR": "1"}, "XSCALE_STRAGGLER_FACTOR='1' must be a number above 1"),
    ({"XSCALE_STRAGGLER_FACTOR": "fast"}, "XSCALE_STRAGGLER_FACTOR='fast'"),
    ({"XSCALE_STRAGGLER_FACTOR": "nan"}, "XSCALE_STRAGGLER_FACTOR='nan'"),
    ({"XSCALE_STRAGGLER_INTERVALS": "0"}, "XSCALE_STRAGGLER_INTERVALS='0' must be a whole"),
    ({"XSCALE_STRAGGLER_INTERVALS": "2.5"}, "XSCALE_STRAGGLER_INTERVALS='2.5'"),
])
def test_bad_settings_are_user_errors(env, words):
    with pytest.raises(UserError, match=words.replace(".", r"\.")):
        stragglers.settings(env)
    assert stragglers.settings({}) == (2.0, 3)

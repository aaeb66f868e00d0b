"""Spares and goodput without the cluster: which nodes a restarted step runs on
(jobs/lib/allocation.py), what the job's time went to (jobs/lib/goodput.py), and the model of
long campaigns in docs/GOODPUT.md (python/xscale/goodput_model.py).

The restarts themselves, on a crashed node of the virtual cluster, are in tests/test_failures.py.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import replace
from pathlib import Path

import pytest
from xscale import goodput_model
from xscale.goodput_model import HOUR
from xscale.shared import contract

from tests.helpers import host_module

allocation = host_module("allocation")
launch_line = host_module("launch_line")
goodput = host_module("goodput")

FOUR_NODES = {"SLURM_JOB_NODELIST": "nid[001-004]", "SLURM_TASKS_PER_NODE": "2(x4)"}


# ---- allocation -----------------------------------------------------------------------------

def training_line():
    """The local prelude's launch line, as its parts (jobs/lib/launch_line.py)."""
    return launch_line.LaunchLine(["python", "train.py"], ["--label"], "img.sif", "/pfs",
                                  "/runscripts/run.sh")


def test_without_spares_the_step_runs_as_the_template_wrote_it():
    nodes = allocation.Allocation.from_env(FOUR_NODES, spares=0)
    assert nodes.placed(training_line()).argv() == [
        "srun", "--label", "singularity", "exec", "-B", "/pfs", "img.sif", "/runscripts/run.sh",
        "python", "train.py"]
    assert nodes.environment() == {}
    assert nodes.layout(FOUR_NODES) == ("nid[001-004]", "2(x4)")
    assert nodes.placement(FOUR_NODES)[7] == "nid004"


def test_a_spare_waits_and_takes_the_place_of_a_blamed_node():
    nodes = allocation.Allocation.from_env(FOUR_NODES, spares=1)
    assert nodes.placed(training_line()).argv()[:5] == [
        "srun", "--nodes=3", "--ntasks=6", "--nodelist=nid[001-003]", "--label"]
    assert nodes.environment() == {"MASTER_ADDR": "nid001"}
    # The rank-0 node fails: the survivors keep their places, the spare joins, the rendezvous
    # moves to the first node of the new step.
    assert nodes.without(["nid001"])
    assert nodes.launch_nodes == ["nid002", "nid003", "nid004"]
    # Beside the failed step, which Slurm may never complete (allocation.py says why).
    assert nodes.placed(training_line()).argv()[:6] == [
        "srun", "--nodes=3", "--ntasks=6", "--nodelist=nid[002-004]", "--overlap", "--label"]
    assert nodes.environment() == {"MASTER_ADDR": "nid002"}
    assert nodes.layout(FOUR_NODES) == ("nid[002-004]", "2(x3)")
    assert nodes.placement(FOUR_NODES) == {0: "nid002", 1: "nid002", 2: "nid003", 3: "nid003",
                                           4: "nid004", 5: "nid004"}
    # No spare left: the step cannot keep its size, and the node stays out for the requeue.
    assert not nodes.without(["nid003"])
    assert nodes.excluded == {"nid001", "nid003"}


def test_nodes_excluded_before_stay_out_of_a_later_step():
    nodes = allocation.Allocation.from_env(FOUR_NODES, spares=1, excluded=["nid002"])
    assert nodes.launch_nodes == ["nid001", "nid003", "nid004"]


def test_a_command_given_whole_runs_as_it_is_and_cannot_be_moved():
    """The supervisor changes only the launch lines it builds: a script's own line runs as it
    is, and asking to move it (spares) is one line, before any launch."""
    whole = launch_line.LaunchLine.whole(["srun", "-n", "6", "python", "train.py"])
    assert allocation.Allocation.from_env(FOUR_NODES, spares=0).placed(whole).argv() == \
        ["srun", "-n", "6", "python", "train.py"]
    with pytest.raises(allocation.AllocationError, match="not a command given whole"):
        allocation.Allocation.from_env(FOUR_NODES, spares=1).placed(whole)


@pytest.mark.parametrize("env, spares, message", [
    (FOUR_NODES, 4, "XSCALE_SPARES=4 must be smaller than the job's 4 nodes"),
    ({"SLURM_JOB_NODELIST": "nid[001-003]", "SLURM_TASKS_PER_NODE": "2(x2),1"}, 1,
     "XSCALE_SPARES needs the same number of tasks on every node (#SBATCH --ntasks-per-node)"),
    ({}, 1, "XSCALE_SPARES=1 must be smaller than the job's 0 nodes"),
])
def test_spares_that_do_not_fit_the_job_are_a_user_error(env, spares, message):
    with pytest.raises(allocation.AllocationError, match=message.replace("(", r"\(")
                       .replace(")", r"\)")):
        allocation.Allocation.from_env(env, spares)


@pytest.mark.parametrize("env, expected", [
    ({"SLURM_NTASKS_PER_NODE": "8"}, 8),
    ({"SLURM_TASKS_PER_NODE": "2(x4)"}, 2),
    ({"SLURM_TASKS_PER_NODE": "2(x3),2"}, 2),
    ({"SLURM_TASKS_PER_NODE": "2(x3),1"}, None),
    ({}, None),
])
def test_tasks_per_node(env, expected):
    assert allocation.tasks_per_node(env) == expected


# ---- the goodput ledger ---------------------------------------------------------------------

def events(*notes: tuple) -> list[dict]:
    """(event, step, time[, stall_s]) tuples as rank 0 notes them
    (python/xscale/observe/progress.py)."""
    keys = ("event", "step", "time", "stall_s")
    return [dict(zip(keys, note, strict=False)) for note in notes]  # stall_s: saves only


# One run: a step that fails at t=70 after a checkpoint at step 10 (t=30) and progress to step 15
# (t=40); the step restarted at t=75 resumes at step 11 and ends at step 20.
FAILED = {"log": "s1", "launched": 0.0, "ended": 70.0, "status": 1}
RESUMED = {"log": "s2", "launched": 75.0, "ended": 121.0, "status": 0}
PROGRESS = {
    "s1": events(("first_step", 1, 10.0), ("checkpoint", 10, 30.0, 1.0), ("interval", 15, 40.0)),
    "s2": events(("first_step", 11, 90.0), ("end", 20, 120.0)),
}


def test_the_ledger_tells_training_from_start_up_checkpoints_lost_work_and_restarts():
    run = {"started": 0.0, "ended": 125.0, "launches": [FAILED, RESUMED]}
    book = goodput.ledger([run], lambda step: PROGRESS[step["log"]])
    assert book["startup_s"] == 10 + 15
    assert book["checkpoints_s"] == 1
    assert book["training_s"] == (30 - 10 - 1) + (120 - 90)
    assert book["lost_work_s"] == 40 - 30 and book["lost_steps"] == 5
    # From the last sign of progress to the step's end (the failure being noticed), then to the
    # next launch.
    assert book["restarts_s"] == (70 - 40) + (75 - 70)
    assert book["other_s"] == 125 - 120
    assert book["goodput"] == pytest.approx(49 / 125)
    assert goodput.line(book) == (
        "39.2% of 2.1 min (start-up 20.0%, checkpoints 0.8%, lost work 8.0%, "
        "restarts 28.0%, other 4.0%); 5 steps redone")


def test_a_launch_that_failed_after_its_training_finished_lost_no_training():
    """Rank 0 noted the end at t=120, then the evaluation failed and the launch ended at t=140:
    the training counts whole, and its tail is neither lost work nor a restart."""
    notes = events(("first_step", 11, 90.0), ("checkpoint", 20, 119.0, 1.0))
    notes.append({"event": "end", "step": 20, "time": 120.0, "stopped": False})
    failed_after = dict(RESUMED, ended=140.0, status=143)
    book = goodput.ledger([{"started": 75.0, "ended": 141.0, "launches": [failed_after]}],
                          lambda launch: notes)
    assert book["training_s"] == 120 - 90 - 1 and book["checkpoints_s"] == 1
    assert (book["lost_work_s"], book["restarts_s"], book["lost_steps"]) == (0, 0, 0)
    assert book["other_s"] == 141 - 120


@pytest.mark.parametrize("world", ["whole", "shrunk", "grown back"])
def test_a_live_recovery_is_its_own_share_and_redoes_no_step(world: str):
    """A launch that lost a node at t=100 and trained on, its group re-formed 2.5 s after the
    failure was noticed (jobs/lib/coordinator.py's record): those seconds are not training.
    Shrunk: no spare was left, and the training from t=102.5 to its end at t=120 went on in a
    smaller world (the record's world_size): training still, and said so. Grown back: at
    t=110 a node job's node took the lost ranks back in (a pause of 1 s, counted as a
    recovery's): the world was smaller from t=102.5 to t=110 only."""
    recoveries = [{"noticed": 100.0, "joined_s": 2.5, "lost": ["nid002"]}]
    if world != "whole":
        recoveries[0].update(world_size=4, smaller=True)
    if world == "grown back":
        recoveries.append({"noticed": 110.0, "joined_s": 1.0, "lost": [], "grown": ["nid009"],
                           "world_size": 6, "smaller": False})
    live = dict(RESUMED, log="live", recoveries=recoveries)
    run = {"started": 70.0, "ended": 125.0, "launches": [live]}
    book = goodput.ledger([run], lambda launch: PROGRESS["s2"])
    paused = 2.5 + (1.0 if world == "grown back" else 0.0)
    assert book["recovery_s"] == paused and book["training_s"] == (120 - 90) - paused
    assert book["lost_steps"] == 0 and book["lost_work_s"] == 0
    assert "live recovery %.1f%%" % (100 * paused / 55) in goodput.line(book), goodput.line(book)
    assert book["smaller_world_s"] == {"whole": 0, "shrunk": 120 - 102.5,
                                       "grown back": 110 - 102.5}[world]
    assert goodput.line(book).endswith("of the training in a smaller world") == (
        world != "whole"), goodput.line(book)


def test_a_sharded_recovery_counts_its_snapshots_and_the_steps_it_rolled_back():
    """Peer snapshots at steps 20 and 40 held training up 0.5 s each; a node lost at t=100 after
    step 45 was recovered from the snapshot of step 40 (t=95): rank 0 noted 5 steps redone, 4 s
    of them. Both come out of the training."""
    notes = [*PROGRESS["s2"][:1], {"event": "snapshot", "step": 20, "time": 95.0, "stall_s": 0.5},
             {"event": "snapshot", "step": 40, "time": 97.0, "stall_s": 0.5},
             {"event": "rolled_back", "step": 40, "time": 103.0, "redone": 5, "redone_s": 4.0},
             PROGRESS["s2"][1]]
    live = dict(RESUMED, log="live", recoveries=[{"noticed": 100.0, "joined_s": 2.5,
                                                  "lost": ["nid002"]}])
    book = goodput.ledger([{"started": 70.0, "ended": 125.0, "launches": [live]}],
                          lambda launch: notes)
    assert (book["snapshots_s"], book["lost_work_s"], book["lost_steps"]) == (1.0, 4.0, 5)
    assert book["recovery_s"] == 2.5 and book["training_s"] == (120 - 90) - 2.5 - 1 - 4
    assert ("snapshots 1.8%, lost work 7.3%, restarts 0.0%, live recovery 4.5%"
            in goodput.line(book)), goodput.line(book)
    assert goodput.line(book).endswith("; 5 steps redone")


def test_a_live_recovery_in_work_a_later_failure_threw_away_is_lost_work():
    """The launch that failed after t=40 (its last checkpoint at t=30) had recovered live at
    t=33: those seconds were thrown away with the rest, and count once, as lost work."""
    failed = dict(FAILED, recoveries=[{"noticed": 33.0, "joined_s": 2.5, "lost": ["nid002"]}])
    book = goodput.ledger([{"started": 0.0, "ended": 72.0, "launches": [failed]}],
                          lambda launch: PROGRESS["s1"])
    plain = goodput.ledger([{"started": 0.0, "ended": 72.0, "launches": [FAILED]}],
                           lambda launch: PROGRESS["s1"])
    assert book["recovery_s"] == 0 and book == dict(plain, recovery_s=0.0)
    assert "live recovery" not in goodput.line(book)


def test_a_requeue_counts_its_wait_in_the_queue_apart_from_the_allocated_time():
    first = {"started": 0.0, "ended": 72.0, "launches": [FAILED]}
    second = {"started": 200.0, "ended": 250.0,
              "launches": [dict(RESUMED, launched=200.0, ended=246.0)]}
    resumed = events(("first_step", 11, 215.0), ("end", 20, 245.0))
    book = goodput.ledger([first, second],
                          lambda step: resumed if step["launched"] == 200.0 else PROGRESS["s1"])
    assert book["allocated_s"] == 72 + 50 and book["queued_s"] == 200 - 72
    assert book["restarts_s"] == 70 - 40  # no next step in the same allocation
    assert goodput.line(book).endswith("; 5 steps redone; 2.1 min queued after requeues")


def test_without_progress_notes_the_ledger_says_what_the_supervisor_saw():
    """A script of one's own notes no progress: the allocated time, the launches, the failed
    ones, restarts and requeues are the supervisor's own records."""
    first = {"started": 0.0, "ended": 72.0, "launches": [FAILED, RESUMED], "restarts": 1}
    second = {"started": 200.0, "ended": 260.0, "launches": [dict(RESUMED, launched=200.0)]}
    book = goodput.launches_only([first, second])
    assert book["goodput"] is None
    assert (book["allocated_s"], book["queued_s"]) == (72 + 60, 200 - 72)
    assert (book["launches"], book["failed"], book["restarts"], book["requeues"]) == (3, 1, 1, 1)
    assert book["text"] == ("unknown, the training noted no progress: 2.2 min allocated, "
                            "3 launches, 1 failed, 1 restarted, 1 requeued")
    one = goodput.launches_only([{"started": 0.0, "ended": 30.0, "launches": [RESUMED]}])
    assert one["text"].endswith("0.5 min allocated, 1 launch, 0 failed, 0 restarted, 0 requeued")


def test_a_step_that_failed_before_its_first_step_is_all_start_up():
    run = {"started": 0.0, "ended": 20.0,
           "launches": [{"log": "s", "launched": 2.0, "ended": 18.0, "status": 1}]}
    book = goodput.ledger([run], lambda step: [])
    assert (book["startup_s"], book["training_s"], book["goodput"]) == (16.0, 0.0, 0.0)


def test_progress_cut_short_by_a_dead_node_is_read_up_to_its_last_whole_line(tmp_path: Path):
    notes = tmp_path / "attempt0-launch1.progress"
    first = {"event": "first_step", "step": 1, "time": 5.0}
    notes.write_text(json.dumps(first) + '\n{"event": "in')
    assert contract.read_progress(str(notes)) == [first]
    assert contract.read_progress(str(tmp_path / "missing")) == []


def test_the_ledger_is_written_whole(tmp_path: Path):
    book = goodput.ledger([], lambda step: [])
    assert goodput.line(book) == "unknown (no training launch ran)"
    path = goodput.write(str(tmp_path), book)
    assert json.loads(Path(path).read_text()) == book


# ---- the model (docs/GOODPUT.md) -------------------------------------------------------------

def test_the_docs_tables_are_the_models_output():
    doc = (Path(__file__).parent.parent / "docs" / "GOODPUT.md").read_text()
    begin, end = "<!-- goodput-model-table: begin -->\n", "\n<!-- goodput-model-table: end -->"
    published = doc[doc.index(begin) + len(begin):doc.index(end)]
    assert published == goodput_model.table(runs=40)


def test_without_failures_a_spare_only_costs_its_share_of_the_node_hours():
    model = replace(goodput_model.Assumptions(nodes=64), failures_per_node_hour=1e-12)
    ettr, per_node_hour = goodput_model.simulate(model, spares=0, runs=2)
    ettr_spared, per_node_hour_spared = goodput_model.simulate(model, spares=4, runs=2)
    assert ettr_spared == pytest.approx(ettr)
    assert per_node_hour_spared == pytest.approx(per_node_hour * 64 / 68)
    # Without failures a 48-hour allocation trains all but its start-up; each requeue at the
    # time limit adds the hold and the wait in the queue.
    allocations = math.ceil(model.work_s / (model.wall_s - model.startup_s))
    assert per_node_hour == pytest.approx(model.work_s / (model.work_s
                                                         + allocations * model.startup_s))


def test_spares_turn_the_wait_in_the_queue_into_training_time():
    model = goodput_model.Assumptions(nodes=1024)
    requeue_only, with_spares = (goodput_model.simulate(model, spares, runs=8)
                                 for spares in (0, 4))
    assert with_spares[0] > requeue_only[0] + 0.05
    no_queue = replace(model, queue_s=0.0)
    assert goodput_model.simulate(no_queue, 0, runs=8)[0] > requeue_only[0] + 0.05


def test_a_smaller_world_trains_at_its_share_of_the_speed_and_saves_the_requeue():
    """Half the nodes do an hour of the whole job's training in two hours and more (the
    checkpoint stalls); with no spares at 1,024 nodes, going on smaller after a node's failure
    beats the requeue by far (docs/GOODPUT.md: 81.9% against 94.9%)."""
    quiet = replace(goodput_model.Assumptions(nodes=64), failures_per_node_hour=1e-12)
    ran, saved, done, ending = goodput_model.step(random.Random(1), quiet, budget=10 * HOUR,
                                                  left=HOUR, startup_s=0.0, speed=0.5)
    assert (ending, saved, done) == ("done", HOUR, HOUR) and ran >= 2 * HOUR
    live = goodput_model.Assumptions(nodes=1024, live=True, rank_restarts=True)
    requeued, shrunk = (goodput_model.simulate(replace(live, shrink=shrink), 0, runs=8)[0]
                        for shrink in (False, True))
    assert shrunk > requeued + 0.1, (requeued, shrunk)
    # Growing back: at 8,192 nodes, where the world is smaller most of the time, a node from
    # the queue within ten minutes of each loss gains half a point (docs/GOODPUT.md).
    large = replace(live, nodes=8192, startup_s=1174.0, shrink=True)
    smaller, grown = (goodput_model.simulate(replace(large, grow_back=grow), 0, runs=4)[0]
                      for grow in (False, True))
    assert grown > smaller + 0.004, (smaller, grown)


def test_the_model_for_one_job_and_its_bad_input(capsys):
    assert goodput_model.main(["--nodes", "16", "--runs", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["0", "1", "2", "4", "8"]
    assert all("of the wall-clock time trains" in line for line in lines)
    with pytest.raises(SystemExit) as stopped:
        goodput_model.main(["--nodes", "0"])
    assert stopped.value.code == 2
    assert "--nodes and --runs must be at least 1" in capsys.readouterr().err


def test_the_notes_the_ranks_write_are_what_the_host_reads(tmp_path: Path, monkeypatch):
    """One round trip through xscale.shared.contract: rank 0's tally notes its first step, a
    checkpoint and its end into XSCALE_PROGRESS, where the supervisor puts the launch's notes;
    the supervisor's programs (loaded as the batch host loads them) find the training finished
    and book its time, and a stopped launch is not finished."""
    import torch
    from xscale import dist, runtime

    supervisor = host_module("supervisor")
    launched = time.time()
    step = {"log": str(tmp_path / "attempt0-launch1.log"), "launched": launched, "status": 0}
    monkeypatch.setenv(contract.PROGRESS_VAR, contract.launch_file(step["log"], contract.PROGRESS))
    tally = runtime.RunTally(dist.DistContext(0, 1, 0, 1, 0, 1, torch.device("cpu"), "gloo"))
    tally.first_step(1)
    tally.saved(10, 0.5)
    tally.end(20, stopped=False)
    step["ended"] = contract.read_progress(os.environ[contract.PROGRESS_VAR])[-1]["time"] + 1
    assert supervisor.training_finished(step["log"])
    book = goodput.ledger([{"started": launched, "ended": step["ended"], "launches": [step]}],
                          lambda step: supervisor.progress_of(step["log"]))
    assert (book["checkpoints_s"], book["lost_steps"]) == (0.5, 0), book
    assert 0 <= book["startup_s"] < 1 <= book["allocated_s"] < 2, book
    tally.end(20, stopped=True)  # a second launch's notes, say, after a stop signal
    assert not contract.training_finished(contract.read_progress(
        os.environ[contract.PROGRESS_VAR])[-1:])

"""xscale.observe.startup: the start-up phases per rank and their aggregate."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from xscale.observe import startup

from tests.conftest import REPO

# ---------------------------------------------------------------------------------------------
# start-up phases: per rank, their aggregate, the report's table and picture
# ---------------------------------------------------------------------------------------------


def test_bash_clocks_parse_in_any_locale_and_absent_ones_are_unknown():
    assert startup.parse_clock("1700000000.250000") == 1700000000.25
    assert startup.parse_clock("1700000000,250000") == 1700000000.25  # de_DE, fr_FR
    assert startup.parse_clock("") is None  # bash before 5 has no EPOCHREALTIME
    assert startup.parse_clock(None) is None
    assert startup.parse_clock("soon") is None


def test_phases_are_differences_of_moments_and_a_missing_one_is_unknown():
    moments = {"launch": None, "run_sh": 100.0, "exec": 100.012, "imports": 103.0,
               "group": 103.5, "first_step": 105.25}
    assert startup.durations(moments) == {"launch": None, "run_sh": 0.012, "imports": 2.988,
                                          "group": 0.5, "first_step": 1.75, "total": None}
    launched = startup.durations({**moments, "launch": 99.5})
    assert (launched["launch"], launched["total"]) == (0.5, 5.75)


def test_moments_come_from_run_sh_and_the_batch_script(monkeypatch):
    environ = {"XSCALE_LAUNCH_T": "10.5", "XSCALE_T_RUNSH": "11,0", "XSCALE_T_EXEC": "11.25"}
    found = startup.moments(environ)
    assert (found["launch"], found["run_sh"], found["exec"]) == (10.5, 11.0, 11.25)
    assert startup.moments({})["launch"] is None


def test_importing_xscale_does_no_work_and_the_first_call_marks_the_imports():
    """No moment is marked, and neither torchvision nor torch.distributed.checkpoint is imported,
    by the modules a trainer imports: the `imports` phase ends at xscale.start(), so it holds
    xscale's own imports too, and mnist_ddp.py pays for no module it does not use."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    probe = REPO / "tests" / "programs" / "trainer_imports_probe.py"
    proc = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True,
                          timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.splitlines()[-1])
    assert (found["heavy"], found["before"]) == ([], None), found
    assert found["after"] is not None


def phases_of(launch, run_sh, imports, group, first_step):
    known = [launch, run_sh, imports, group, first_step]
    total = None if None in known else round(sum(known), 3)
    return {"launch": launch, "run_sh": run_sh, "imports": imports, "group": group,
            "first_step": first_step, "total": total}


RANKS = [
    startup.RankPhases(0, "nid001", phases_of(0.4, 0.01, 2.5, 0.3, 1.2)),
    startup.RankPhases(1, "nid001", phases_of(0.5, 0.01, 2.7, 0.2, 1.2)),
    startup.RankPhases(2, "nid002", phases_of(0.6, 0.01, 6.1, 0.1, 1.1)),
    startup.RankPhases(3, "nid002", phases_of(None, 0.01, 2.1, 0.1, 1.1)),
]


def test_the_aggregate_is_the_median_and_the_slowest_rank_with_its_node():
    summary = startup.aggregate(RANKS)
    assert tuple(summary) == startup.NAMES
    assert summary["imports"] == {"median": 2.6, "slowest": 6.1, "rank": 2, "node": "nid002",
                                  "ranks": 4}
    # Rank 3 has no launch time: the launch phase is over the three ranks that know it.
    assert summary["launch"] == {"median": 0.5, "slowest": 0.6, "rank": 2, "node": "nid002",
                                 "ranks": 3}
    assert summary["run_sh"]["rank"] == 0  # a tie: the lowest rank
    unknown = startup.aggregate([startup.RankPhases(0, "n", phases_of(None, None, 1, 1, 1))])
    assert unknown["launch"] == {"median": None, "slowest": None, "rank": None, "node": None,
                                 "ranks": 0}
    lines = startup.table(unknown)
    assert "unknown" in next(line for line in lines if line.split()[0] == "launch")


def test_each_node_is_drawn_as_its_slowest_rank():
    rows = startup.slowest_per_node(RANKS)
    assert [(row.node, row.rank) for row in rows] == [("nid001", 1), ("nid002", 2)]

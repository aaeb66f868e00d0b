"""Failure handling on the virtual cluster: dead ranks, time limits, caches, shared nodes, input.

Each test provokes the failure for real (kill -9, a Slurm signal, a planted directory, a second
job on the node) and checks what a user would see.
"""

from __future__ import annotations

import configparser
import contextlib
import json
import math
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, tool_env
from tests.fixtures.mnist_idx import write_mnist
from tests.helpers import check_summary_schema, host_module, rank_records, tagged_records, wait_for
from tests.helpers import summary as summary_of
from tests.test_jobs import VIRTUAL, virtual_env

hostlist = host_module("shared").hostlist  # runscripts/lib/hostlist.py, as the supervisor has it
THROWAWAY_USER = "xscale-other"


def job_script(tmp_path: Path, name: str, body: str) -> Path:
    script = tmp_path / name
    script.write_text("#!/bin/bash\nset -euo pipefail\n" + textwrap.dedent(body))
    return script


MNIST_JOB = REPO / "jobs" / "local" / "mnist.sbatch"
# How long a test waits for a job to end: a deadline so that a broken path fails the test instead
# of hanging it, never a claim about speed (the times are printed; docs/FAILURES.md has them).
END_WAIT_S = 120


@pytest.fixture(scope="module")
def mnist_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mnist(tmp_path_factory.mktemp("mnist"), train=2048, test=512)


def job_processes(job_id: str) -> dict[int, dict[str, str]]:
    """pid -> environment of every live process started for the job (Slurm puts SLURM_JOB_ID in
    each task's environment, and run.sh's exec keeps it)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "environ").read_bytes()
        except OSError:  # gone already, or a kernel thread
            continue
        env = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0")
                   if "=" in item)
        if env.get("SLURM_JOB_ID") == job_id:
            found[int(entry.name)] = env
    return found


def rank_pid(job_id: str, rank: int) -> int:
    """The trainer process of one rank (the python that run.sh exec'd, with RANK set)."""
    for pid, env in job_processes(job_id).items():
        if env.get("RANK") == str(rank):
            return pid
    raise AssertionError(f"no process with RANK={rank} in job {job_id}")


# --- fail fast -----------------------------------------------------------------------------------

def start_endless_training(cluster, data: Path, tmp_path: Path,
                           sbatch_options: tuple[str, ...] = (), **env: str) -> tuple[str, Path]:
    """Submit jobs/local/mnist.sbatch with more steps than it will ever reach; return once it is
    training (its first checkpoint exists), with the job id and its output file."""
    out_dir, output = tmp_path / "out", tmp_path / "job.out"
    env = {"DATA": str(data), "OUTPUT_DIR": str(out_dir), "MAX_STEPS": "1000000",
           "EPOCHS": "100000", "CHECKPOINT_EVERY": "4", **env}
    job_id = cluster.submit(MNIST_JOB, env=env, output=output,
                            sbatch_options=(f"--chdir={REPO}", *sbatch_options))
    wait_for(lambda: any(out_dir.glob("ckpt-*.pt")), 240, "training to be under way")
    return job_id, output


def time_to_end(cluster, job_id: str, since: float) -> tuple[str, float]:
    """Wait until the job has ended and every one of its processes is gone; the final state and
    the seconds it took."""
    state = cluster.wait_state(job_id, {"FAILED", "COMPLETED", "CANCELLED"}, END_WAIT_S)
    left = END_WAIT_S - (time.monotonic() - since)
    wait_for(lambda: not job_processes(job_id), max(left, 0), "the job's processes to go")
    return state, time.monotonic() - since


def test_a_network_partition_fails_the_job_and_names_the_cut_off_node(cluster, mnist_data,
                                                                      tmp_path):
    """nid002's hsn0 goes down mid-training (a dead Slingshot link): the rank on nid001 gives up
    after XSCALE_TIMEOUT_S, Slurm loses nid002 after SlurmdTimeout, and the run ends naming it,
    instead of hanging until the time limit. The template asks for --requeue, so Slurm puts the
    job back in the queue itself, as it does on a real partition after a node failure. One rank
    per node: the cut is between nodes."""
    timeout_s = 15
    job_id, output = start_endless_training(
        cluster, mnist_data, tmp_path, XSCALE_TIMEOUT_S=str(timeout_s),
        sbatch_options=("--nodelist=nid[001-002]", "--ntasks-per-node=1"))
    try:
        assert {env["SLURMD_NODENAME"] for env in job_processes(job_id).values()
                if env.get("RANK") == "1"} == {"nid002"}
        cut_at = time.monotonic()
        cluster.fault("link-down", "nid002")
        wait_for(lambda: job_fields(job_id)["JobState"] not in {"RUNNING", "COMPLETING"},
                 timeout_s + END_WAIT_S, "the run to end")
        took = time.monotonic() - cut_at
        fields = job_fields(job_id)
    finally:
        subprocess.run(["scancel", job_id], timeout=30, check=False)
        cluster.fault("heal", "nid002")
    print(f"nid002's hsn0 down, XSCALE_TIMEOUT_S={timeout_s}: the run ended after {took:.1f} s "
          f"({fields['JobState']}, restarts {fields['Restarts']})")
    assert (fields["JobState"], fields["Restarts"]) in {("PENDING", "1"), ("NODE_FAIL", "0")}
    text = output.read_text()
    # The rank left on nid001 times out waiting for its peer on nid002 ...
    assert f"Timed out waiting {timeout_s * 1000}ms" in text
    # ... and Slurm names the node that was cut off.
    assert "srun: error: Node failure on nid002" in text, text[-3000:]
    # Slurm ends the step for the node's failure, or, when slurmctld requeues the job first
    # (seen on the bed, 1 run in many), for the requeue.
    reasons = {"DUE TO NODE FAILURE"} | ({"DUE TO JOB REQUEUE"} if fields["Restarts"] == "1"
                                         else set())
    assert any(reason in text for reason in reasons), text[-3000:]


# --- time limit: signal, checkpoint, requeue, resume ---------------------------------------------

def job_fields(job_id: str) -> dict[str, str]:
    line = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                          text=True, timeout=30, check=True).stdout
    return dict(token.split("=", 1) for token in line.split() if "=" in token)


def seconds(duration: str) -> int:
    """Slurm's [D-]HH:MM:SS as seconds."""
    days, _, clock = duration.rpartition("-")
    hours, minutes, secs = (int(part) for part in clock.split(":"))
    return int(days or 0) * 86400 + hours * 3600 + minutes * 60 + secs


def bring_time_limit_near(job_id: str, warn_s: int) -> None:
    """Shorten the running job's limit so that Slurm's own time-limit check sends the --signal
    warning at its next pass. slurmctld checks every 30 s and signals once at most warn_s + 30 s
    remain; the limit is in whole minutes, so this leaves between warn_s - 30 and warn_s + 30
    seconds to run, and at least warn_s - 60 after the warning."""
    elapsed = seconds(job_fields(job_id)["RunTime"])
    minutes = (elapsed + warn_s + 30) // 60
    subprocess.run(["scontrol", "update", f"JobId={job_id}", f"TimeLimit={minutes}"],
                   check=True, timeout=30)


def test_time_limit_stops_saves_requeues_and_resumes(cluster, mnist_data, tmp_path):
    """The whole path with Slurm's real --signal: USR1 to the batch shell, forwarded to the ranks,
    a checkpoint at the step they stop at, `scontrol requeue`, and a second run that resumes
    there and finishes the job's steps."""
    out_dir, output = tmp_path / "out", tmp_path / "job.out"
    total_steps, every, warn_s = 60, 10, 100
    env = {"DATA": str(mnist_data), "OUTPUT_DIR": str(out_dir), "MAX_STEPS": str(total_steps),
           "EPOCHS": "100000", "CHECKPOINT_EVERY": str(every), **SLOW_STORAGE}
    # The template warns 60 s ahead; 100 leaves room for slurmctld's 30 s checking period below.
    job_id = cluster.submit(MNIST_JOB, env=env, output=output,
                            sbatch_options=(f"--chdir={REPO}", f"--signal=B:USR1@{warn_s}"))
    try:
        # The warning comes while a checkpoint is being written in the background.
        wait_for(lambda: writes_under_way(out_dir), 240, "a checkpoint being written")
        # Hold the ranks mid-training while the warning is on its way (up to 30 s): left running,
        # they could finish all their steps before it arrives on a fast machine.
        ranks = [rank_pid(job_id, rank) for rank in range(4)]
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        bring_time_limit_near(job_id, warn_s)
        wait_for(lambda: "SIGUSR1 received" in output.read_text(), 90, "Slurm's USR1 warning")
        for pid in ranks:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: job_fields(job_id)["Restarts"] == "1"
                 and job_fields(job_id)["JobState"] == "PENDING", 120, "the requeue")
        # Slurm holds a requeued job back (BeginTime) because a node refuses to launch a job id
        # again within the second its previous run's credential was revoked ("Job credential
        # revoked"). Two seconds on is enough, rather than Slurm's minutes; and time to finish.
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now+2",
                        "TimeLimit=10"], check=True, timeout=30)
        state = cluster.wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 300)
    finally:
        subprocess.run(["scancel", job_id], timeout=30, check=False)
    text = output.read_text()
    assert state == "COMPLETED", text[-3000:]
    assert "requeueing job" in text
    assert "xscale: the launch failed" not in text  # the stopped step exited 0
    first, second = tagged_records(text, "XSCALE_SUMMARY")
    assert (first["stopped_early"], first["signal"]) == (True, "SIGUSR1")
    assert every <= first["steps"] < total_steps
    # The stop saved at the step it happened, after the write under way: nothing is redone.
    assert second["start_step"] == first["steps"]
    assert first["checkpoints_saved"] >= 2, first
    assert (second["steps"], second["stopped_early"]) == (total_steps, False)
    # jobs/local/mnist.sbatch as shipped (the demo's job): its resumed run ends with the summary
    # every trainer writes, finite losses, and a record from each of its four ranks.
    record = check_summary_schema(text, "mnist_ddp")
    assert record["world_size"] == 4
    assert all(math.isfinite(record[key]) for key in ("loss_first", "loss_last", "seconds"))
    assert len(rank_records(text.rpartition("requeueing job")[2])) == 4
    print(f"stopped at step {first['steps']}, resumed there, finished at {second['steps']}")


# --- background checkpoint writes (XSCALE_CHECKPOINT_MODE=async, the default) --------------------
# Storage slow to fsync a checkpoint (tests/fakes/slow-storage): each write is under way for
# seconds, so the signal or the kill reliably comes in the middle of one.

SLOW_STORAGE = {"PYTHONPATH": str(REPO / "tests" / "fakes" / "slow-storage"),
                "XSCALE_TEST_SLOW_FSYNC_S": "4"}


def writes_under_way(out_dir: Path) -> list[str]:
    """The temporaries of checkpoints being written (xscale.checkpoints.files' atomic save)."""
    return sorted(path.name for path in out_dir.glob(".ckpt-*.tmp"))


def test_a_killed_rank_ends_the_job_fast_and_its_torn_write_is_passed_over_on_resume(
        cluster, mnist_data, tmp_path):
    """kill -9 of rank 1 (2 nodes x 1) while rank 0's background write of a checkpoint is
    under way: rank 0 ends at once instead of waiting in an all-reduce until the collective
    timeout (an hour here): live recovery's coordinator, with no spare for a rank alone on its
    node and no smaller world below two nodes (XSCALE_MIN_NODES=2), tells it to exit (without
    the coordinator, srun's --kill-on-bad-exit=1 does); the half-written file was never
    published, and the next run resumes from the checkpoint before it."""
    out_dir, output = tmp_path / "out", tmp_path / "job.out"
    env = {"DATA": str(mnist_data), "OUTPUT_DIR": str(out_dir), "MAX_STEPS": "100000",
           "EPOCHS": "100000", "CHECKPOINT_EVERY": "10", "XSCALE_TIMEOUT_S": "3600",
           "XSCALE_MIN_NODES": "2", **SLOW_STORAGE}
    one_per_node = (f"--chdir={REPO}", "--ntasks-per-node=1")
    job_id = cluster.submit(MNIST_JOB, env=env, output=output, sbatch_options=one_per_node)
    try:
        wait_for(lambda: any(out_dir.glob("ckpt-*.pt")) and writes_under_way(out_dir),
                 240, "a published checkpoint and the next one being written")
        victim = rank_pid(job_id, 1)
        victim_node = job_processes(job_id)[victim]["SLURMD_NODENAME"]
        assert victim_node != job_processes(job_id)[rank_pid(job_id, 0)]["SLURMD_NODENAME"]
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        torn = writes_under_way(out_dir)
        state, took = time_to_end(cluster, job_id, killed_at)
    finally:
        subprocess.run(["scancel", job_id], timeout=30, check=False)
    print(f"time to fail after kill -9 of rank 1: {took:.1f} s")
    assert state == "FAILED"
    # srun names the dead task (the shim, like singularity, exits 128+9 for a SIGKILLed command).
    text = output.read_text()
    assert re.search(rf"srun: error: {victim_node}: task 1: (Killed|Exited with exit code 137)",
                     text), text[-3000:]
    assert "Timed out waiting" not in text, text[-3000:]
    published = [path.name for path in sorted(out_dir.glob("ckpt-*.pt"))]
    assert torn and published, (torn, published)
    env.update(MAX_STEPS=str(int(published[-1][5:11]) + 10))
    rerun = tmp_path / "rerun.out"
    job_id = cluster.submit(MNIST_JOB, env=env, output=rerun, sbatch_options=one_per_node)
    try:
        state = cluster.wait_state(job_id, {"FAILED", "COMPLETED", "CANCELLED"}, 300)
    finally:
        subprocess.run(["scancel", job_id], timeout=30, check=False)
    text = rerun.read_text()
    assert state == "COMPLETED", text[-3000:]
    resumed = summary_of(text)
    assert resumed["start_step"] == int(published[-1][5:11]), (resumed, published)
    assert resumed["checkpoints_saved"] >= 1 and resumed["checkpoint_stall_s"] > 0, resumed
    assert not set(torn) & set(writes_under_way(out_dir))  # the torn write was cleared away


# --- a failed step: the report, bad-node blame, the retry without the node ----------------------
# jobs/lumi/mnist.sbatch as a LUMI user gets it (XSCALE_RETRY=1, LUMI's and Slurm's patterns), on
# the virtual cluster. One rank fails on cue through tests/fakes/faulty-python, or one node's
# slurmd dies; everything after that (srun's messages, the report, scontrol requeue, ExcNodeList,
# the resumed run) is the real thing.

LUMI_MNIST = REPO / "jobs" / "lumi" / "mnist.sbatch"
FAULTY_PYTHON = REPO / "tests" / "fakes" / "faulty-python"
RETRY_STEPS, RETRY_EVERY = 30, 10


def lumi_example_line(section: str) -> str:
    """The real line that a LUMI bad-node pattern quotes as its example."""
    patterns = configparser.ConfigParser(interpolation=None)
    patterns.read(REPO / "jobs" / "lib" / "blame" / "lumi.patterns")
    return patterns[section]["example"]


def submit_lumi_mnist(cluster, data: Path, tmp_path: Path, **env: str) -> tuple[str, Path, Path]:
    """jobs/lumi/mnist.sbatch on 2 nodes x 2 ranks, checkpointing every RETRY_EVERY steps."""
    out_dir, output = tmp_path / "out", tmp_path / "job.out"
    job_env = virtual_env(tmp_path, DATA=str(data), OUTPUT_DIR=str(out_dir),
                          MAX_STEPS=str(RETRY_STEPS), **env)
    job_id = cluster.submit(LUMI_MNIST, "--checkpoint-every", str(RETRY_EVERY), "--epochs", "10",
                            env=job_env,
                            output=output, sbatch_options=(*VIRTUAL, "--nodes=2"))
    return job_id, out_dir, output


# Checkpoints far apart and notes close together: the crash, as soon as a note is past the first
# checkpoint, lands well before the second (a step takes about 0.05 s on the bed), so it
# always throws work away.
SPARE_STEPS, SPARE_EVERY, SPARE_LOG_EVERY = 120, 50, 5
# Two crashes come by about step 110 (a checkpoint, a recovery, the next checkpoint); the
# smaller world then trains until the lost node is back (a kill and a restart there, a heal, a
# node job, its ranks' start), and the launch's world the rest.
SHRUNK_STEPS = 400


def submit_with_a_spare(cluster, data: Path, tmp_path: Path, **env: str) -> tuple[str, Path, Path]:
    """jobs/lumi/mnist.sbatch with XSCALE_SPARES=1 on all four nodes: the step trains on three of
    them, two ranks each, and the fourth waits. Epochs enough that a run with MAX_STEPS=100000
    outlasts two crashes: 100 epochs (500 steps) ended in 40 s on a faster machine, before the
    live-recovery test's second crash, which then found no training to requeue."""
    out_dir, output = tmp_path / "out", tmp_path / "job.out"
    job_env = virtual_env(tmp_path, DATA=str(data), OUTPUT_DIR=str(out_dir),
                          XSCALE_SPARES="1",
                          **{"MAX_STEPS": str(SPARE_STEPS), **env})
    job_id = cluster.submit(LUMI_MNIST, "--checkpoint-every", str(SPARE_EVERY), "--log-every",
                            str(SPARE_LOG_EVERY), "--epochs", "1000", env=job_env, output=output,
                            sbatch_options=(*VIRTUAL, "--nodes=4"))
    return job_id, out_dir, output


def job_nodes(job_id: str) -> list[str]:
    """The nodes of the job's first run (read as soon as it runs: it changes on a requeue)."""
    wait_for(lambda: job_fields(job_id)["JobState"] == "RUNNING", 240, "the job to start")
    return allocated(job_id)


def allocated(job_id: str) -> list[str]:
    """The nodes of the job's allocation now."""
    return subprocess.run(["scontrol", "show", "hostnames", job_fields(job_id)["NodeList"]],
                          capture_output=True, text=True, timeout=30, check=True).stdout.split()


def release_requeued(cluster, job_id: str) -> str:
    """Wait for the retry's requeue (the job's restart count and ExcNodeList set), then let the
    job start 2 s on rather than after Slurm's minutes of BeginTime hold, if it is still held
    (see test_time_limit_stops_saves_requeues_and_resumes); the ExcNodeList it was given."""
    def requeued_with_exclusions() -> bool:
        fields = job_fields(job_id)
        return fields["Restarts"] == "1" and fields["ExcNodeList"] != "(null)"

    wait_for(requeued_with_exclusions, 180, "the retry's requeue and its ExcNodeList")
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now+2"], timeout=30,
                   check=False, capture_output=True)  # fails harmlessly once it runs again
    return job_fields(job_id)["ExcNodeList"]


def through_the_retry(cluster, job_id: str, since: float) -> tuple[str, float, str]:
    """The ExcNodeList the retry set, the seconds from SINCE (the fault) to the requeue, and the
    job's state once its resumed run has ended."""
    excluded = release_requeued(cluster, job_id)
    requeued_s = time.monotonic() - since
    return excluded, requeued_s, cluster.wait_state(job_id, {"FAILED", "COMPLETED", "CANCELLED"},
                                                     300)


def check_resumed_without(text: str, bad: str) -> dict:
    """The second run trained on other nodes, from the first run's checkpoint, to the end."""
    second_run = text.rpartition("xscale: retry 1 of")[2]
    second = summary_of(second_run)  # the whole record: the start-up detail is in its file
    assert second["start_step"] >= RETRY_EVERY and second["steps"] == RETRY_STEPS, second
    nodes = {record["node"] for record in rank_records(second_run)}
    assert len(nodes) == 2 and bad not in nodes, second_run[-3000:]
    return second


def test_a_rank_that_exits_3_is_named_first_and_its_job_is_neither_restarted_nor_retried(
        cluster, mnist_data, tmp_path):
    """A failure of the rank's own where starting it again is off (XSCALE_MAX_RANK_RESTARTS=0;
    a bug that comes back at every try ends the same way, tests/test_recovery.py): a spare is
    no cure for it, and neither is a requeue."""
    job_id, _, output = submit_with_a_spare(cluster, mnist_data, tmp_path,
                                            PATH=f"{FAULTY_PYTHON}:{tool_env()['PATH']}",
                                            XSCALE_TEST_FAULT="1:exit:3",
                                            XSCALE_MAX_RANK_RESTARTS="0")
    try:
        state = cluster.wait_state(job_id, {"FAILED", "COMPLETED", "CANCELLED"}, 300)
    finally:
        subprocess.run(["scancel", job_id], timeout=30, check=False)
    text = output.read_text()
    # Its process ended before its summary: its node is the one srun names.
    node = re.search(r"^srun: error: (\S+): task 2: Exited with exit code 3$", text, re.M)
    report = [line for line in text.splitlines() if line.startswith("xscale: ")]
    first = next(line for line in report if line.startswith("xscale: first failure"))
    assert node and first == f"xscale: first failure: rank 2 on {node[1]}: exited with exit code 3"
    knock_on = next(line for line in report if line.startswith("xscale: knock-on"))
    assert knock_on.startswith("xscale: knock-on: 5 ranks ended after it"), knock_on
    # Each ended on the coordinator's word (live recovery is not possible: exit status 75).
    # srun names a node's tasks together ("tasks 0-1") only when they ended together.
    named = [part.partition(" on ")[0].split()[-1] for part in knock_on.split("; ")]
    ranks = [rank for name in named for rank in hostlist.expand_numbers(name)]
    assert sorted(ranks) == [0, 1, 3, 4, 5], knock_on
    assert knock_on.count("exited with exit code 75") == len(named), knock_on
    assert report[-2].startswith("xscale: blame: no node"), text[-3000:]
    assert report[-1].startswith("xscale: goodput: "), text[-3000:]  # as the job ends
    assert (state, job_fields(job_id)["Restarts"]) == ("FAILED", "0")
    assert "requeueing" not in text and "xscale: restart" not in text


def test_a_bad_node_line_requeues_the_job_without_that_node_and_it_resumes(cluster, mnist_data,
                                                                          tmp_path):
    """Rank 2 of 2 x 2 prints a line that blames its node and ends. No spare, and no smaller
    world (XSCALE_MIN_NODES=2): live recovery falls back, the report blames the node, and the
    job requeues itself without it. (With a spare, or a floor that allows it, the node is lost
    live instead: test_a_blamed_nodes_ranks_move_to_the_spare_..., below.)"""
    line = lumi_example_line("lumi-hsa-hw-exception")
    job_id, _, output = submit_lumi_mnist(cluster, mnist_data, tmp_path,
                                          PATH=f"{FAULTY_PYTHON}:{tool_env()['PATH']}",
                                          XSCALE_TEST_FAULT=f"1:say:{line}",
                                          XSCALE_MIN_NODES="2")
    try:
        bad = job_nodes(job_id)[1]
        # The job is RUNNING a moment before slurmstepd creates its output file.
        wait_for(lambda: output.exists() and line in output.read_text(), 240, "the bad-node line")
        excluded, ended_s, state = through_the_retry(cluster, job_id, since=time.monotonic())
    finally:
        subprocess.run(["scancel", job_id], timeout=30, check=False)
    text = output.read_text()
    assert state == "COMPLETED", text[-4000:]
    assert f"xscale: blame: {bad}: lumi.patterns [lumi-hsa-hw-exception] (rank 2)" in text
    assert f"retry 1 of 3: requeueing job {job_id} without {bad}" in text
    assert excluded == bad
    second = check_resumed_without(text, bad)
    print(f"bad-node line on {bad}: first run ended {ended_s:.1f} s after it; the resumed run's "
          f"launch to first step: {second['startup']['total']}")


@contextlib.contextmanager
def crashing(cluster, job_id: str):
    """A function that crashes a node (tests/cluster/fault.sh crash); on the way out JOB_ID is
    cancelled and every node crashed is healed, whatever the test found."""
    crashed: list[str] = []

    def crash(node: str) -> None:
        crashed.append(node)
        cluster.fault("crash", node)

    try:
        yield crash
    finally:
        subprocess.run(["scancel", job_id], timeout=30, check=False)
        # Its node jobs (jobs/lib/grow_back.py), which the supervisor cancels as the launch ends.
        subprocess.run(["scancel", "--name", f"xscale-grow-{job_id}"], timeout=30, check=False)
        for node in crashed:
            cluster.fault("heal", node)


def test_a_frozen_rank_is_named_with_the_collective_it_never_joined(cluster, mnist_data,
                                                                   tmp_path):
    """Rank 3 on nid002 frozen (SIGSTOP: a stuck GPU, a node swapping) mid-training, as a LUMI
    user's job gets it: its peers time out in the collective it never joined, and the report
    names rank 3, not the healthy rank whose collective timed out first, with its Python stack
    and its DataLoader worker's; no node is blamed, so nothing is retried."""
    timeout_s = 10
    out_dir, output = tmp_path / "out", tmp_path / "job.out"
    job_env = virtual_env(tmp_path, DATA=str(mnist_data), OUTPUT_DIR=str(out_dir),
                          MAX_STEPS="1000000",
                          XSCALE_TIMEOUT_S=str(timeout_s))
    job_id = cluster.submit(LUMI_MNIST, "--checkpoint-every", "4", "--epochs", "100000",
                            "--workers", "1", env=job_env, output=output,
                            sbatch_options=(*VIRTUAL, "--nodes=2", "--nodelist=nid[001-002]"))
    try:
        wait_for(lambda: any(out_dir.glob("ckpt-*.pt")), 240, "training to be under way")
        victim = trainer_pids(job_id)[3]  # not its worker, which has its RANK too
        assert job_processes(job_id)[victim]["SLURMD_NODENAME"] == "nid002"
        frozen_at = time.monotonic()
        os.kill(victim, signal.SIGSTOP)
        wait_for(lambda: "xscale: blame:" in output.read_text(), timeout_s + 120, "the report")
        took = time.monotonic() - frozen_at
        state = cluster.wait_state(job_id, {"FAILED", "COMPLETED", "CANCELLED"}, 120)
    finally:
        subprocess.run(["scancel", job_id], timeout=30, check=False)
    text = output.read_text()
    print(f"rank 3 frozen, XSCALE_TIMEOUT_S={timeout_s}: the report came {took:.1f} s later")
    # A rank's collective timed out at XSCALE_TIMEOUT_S (gloo's words; NCCL's watchdog says
    # "collective operation timeout") while rank 3 stayed silent: a hang, which live recovery
    # leaves to the report; its coordinator ended the step, the frozen rank with it, once the
    # hang watch had read rank 3's stack. What the coordinator hears first is a race: a rank
    # whose collective timed out, or one whose connection to rank 2 closed as rank 2's own
    # collective ended (seen once in a clean clone); then rank 3 is the silent one beside a
    # living node-mate. Either way a hang, named below.
    assert re.search(r"^xscale: live recovery: not possible: (rank [0-2]'s collective timed out "
                     r"and rank 3 on nid002 never came|rank 3 on nid002 sent nothing while its "
                     r"node's other ranks live on): a hung process", text, re.M), text[-4000:]
    assert "xscale: live recovery: rank 3 on nid002 has not ended; ending the launch's step" \
        in text, text[-4000:]
    report = [line for line in text.splitlines() if line.startswith("xscale: ")]
    first = next(line for line in report if line.startswith("xscale: first failure"))
    # Which of ranks 0-2 dumped a record before srun ended them after the first timeout is a
    # race ("ranks 0,2" was seen once): the hung rank and its collective are not.
    assert re.fullmatch(r"xscale: first failure: rank 3 on nid002: hung: ranks? [0-2]([-,][0-2])* "
                        r"timed out in gloo:\w+ #\d+ waiting for it", first), text[-4000:]
    # What rank 3 was doing, read with py-spy while it was still there: a Python stack.
    stack = [line for line in text.splitlines() if line.startswith("xscale:   3: ")]
    assert any("Thread" in line for line in stack), text[-4000:]
    assert any(re.search(r"\(\S+\.py:\d+\)", line) for line in stack), stack
    # Its DataLoader worker's, read with it: a rank that waits for a stuck worker shows only the
    # wait, its worker what it is stuck in (docs/FAILURES.md, "A hang names the rank").
    child = next(at for at, line in enumerate(stack)
                 if re.fullmatch(r"xscale:   3: its child process \d+:", line))
    assert re.fullmatch(r'xscale:   3: Thread \d+ \([\w+]+\): "MainThread"', stack[child + 1]) and \
        re.search(r"\(\S+\.py:\d+\)", stack[child + 2]), stack
    knock_on = next(line for line in report if line.startswith("xscale: knock-on"))
    # The three that waited, as srun reported their ends; rank 3's own end is the hang's.
    assert knock_on.startswith("xscale: knock-on: 3 ranks ended after it:"), knock_on
    assert "rank 3 " not in knock_on, knock_on
    assert report[-2].startswith("xscale: blame: no node (a hang names a rank"), report
    assert report[-1].startswith("xscale: goodput: "), report  # as the job ends
    assert (state, job_fields(job_id)["Restarts"]) == ("FAILED", "0")
    records = out_dir / "xscale-records"
    # The records the hang was read from (torch's analyzer reads them too): the three that
    # waited wrote theirs in time; rank 3's, if any, came after Slurm continued it to end it.
    flight = records / "attempt0-launch1.fr"
    assert {"rank0", "rank1", "rank2"} <= {path.name for path in flight.glob("rank*")}
    assert json.loads((flight / "released").read_text()) == {"recorded": [0, 1, 2]}
    assert json.loads((records / "hangs").read_text())["nodes"] == ["nid002"]


# --- spares: a step restarted inside the allocation ----------------------------------------------

def goodput_of(text: str) -> dict:
    return tagged_records(text, "XSCALE_GOODPUT")[-1]


def past_step(progress: Path, step: int) -> bool:
    lines = progress.read_text().splitlines() if progress.exists() else []
    return any(json.loads(line)["step"] > step for line in lines if line.endswith("}"))


def trainer_pids(job_id: str) -> dict[int, int]:
    """rank -> pid of each rank's trainer (its DataLoader workers, which inherit RANK, are its
    children). A process gone by the time its parent is read has none (0): a worker that just
    ended, not a trainer, which a higher pid would put in its rank's place."""
    processes = job_processes(job_id)
    return {int(env["RANK"]): pid for pid, env in processes.items() if "RANK" in env
            and (parent := parent_pid(pid)) and processes.get(parent, {}).get("RANK")
            != env["RANK"]}


def parent_pid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def saved_past(progress: Path, step: int) -> bool:
    lines = progress.read_text().splitlines() if progress.exists() else []
    events = [json.loads(line) for line in lines if line.endswith("}")]
    return any(event["event"] == "checkpoint" and event["step"] > step for event in events)


def last_step(progress: Path) -> int:
    lines = progress.read_text().splitlines() if progress.exists() else []
    return max((json.loads(line)["step"] for line in lines if line.endswith("}")), default=0)


def test_a_crashed_node_is_replaced_live_a_second_crash_shrinks_the_world_and_it_grows_back(
        cluster, mnist_data, tmp_path):
    """XSCALE_SPARES=1: 3 x 2 ranks on four nodes, the fourth waiting. The first crash, between
    two checkpoints: the four healthy ranks keep their processes, the spare takes the lost
    node's two ranks, and training goes on from where it was, in the same launch, nothing
    redone (live recovery, jobs/lib/coordinator.py). The second crash, of the spare, finds no
    spare: the four ranks left (0, 1, 4, 5) go on as a world of 2 x 2 in the same launch
    (XSCALE_MIN_NODES defaults to one of three nodes), renumbered 0-3, each step's global batch
    dealt over them; the supervisor asks the queue for a node in its place (a node job,
    jobs/lib/grow_back.py), which waits: every node is down or the job's. Then rank 5 (rank 3
    of the four) is killed on its own: it starts again on its node as rank 5 of the launch and
    joins as rank 3. Then the first crashed node is healed: the node job runs on it, ranks 2
    and 3 start there as a step of that job, and the world is the launch's 3 x 2 again, in the
    same launch, ranks 0, 1, 4 and 5 in the same processes. The job completes and the node job
    is cancelled. The data order and the gradients of such steps are checked in
    tests/test_recovery.py."""
    job_id, out_dir, output = submit_with_a_spare(cluster, mnist_data, tmp_path,
                                                  MAX_STEPS=str(SHRUNK_STEPS))
    progress = out_dir / "xscale-records" / "attempt0-launch1.progress"
    with crashing(cluster, job_id) as crash:
        nodes = job_nodes(job_id)  # nodes[3] is the spare
        wait_for(lambda: past_step(progress, SPARE_EVERY), 240,
                 "progress past the first checkpoint")
        before = trainer_pids(job_id)
        crashed_at = time.time()
        crash(nodes[1])
        wait_for(lambda: f"in place of {nodes[1]}" in output.read_text(), 120,
                 "the live recovery")
        resumed = last_step(progress)
        # Training after the recovery, to a checkpoint: the second crash throws none of it away.
        wait_for(lambda: saved_past(progress, resumed), 120, "a checkpoint after the recovery")
        after = trainer_pids(job_id)
        crash(nodes[3])
        wait_for(lambda: "go on without" in output.read_text(), 120, "the smaller world")
        # Past the smaller world's second step, where DDP lays its gradient buckets out again
        # with a broadcast that no abort ends (docs/FAILURES.md, "When it falls back").
        shrunk_at = last_step(progress)
        wait_for(lambda: past_step(progress, shrunk_at + 2), 120, "training in the smaller world")
        shrunk = trainer_pids(job_id)
        os.kill(shrunk[5], signal.SIGKILL)
        wait_for(lambda: "rank 5 started again on its node" in output.read_text(), 120,
                 "the rank started again in the smaller world")
        restarted = trainer_pids(job_id)
        node_job = re.search(rf"job (\d+) asks the queue for a node in place of {nodes[3]}",
                             output.read_text())
        assert node_job, output.read_text()[-4000:]
        node_job = node_job.group(1)
        # Slurm drops a crashed node from the job once it declares it down (docs/FAILURES.md):
        # healed then, it is the queue's, and the node job's.
        wait_for(lambda: nodes[1] not in allocated(job_id), 60, f"Slurm to drop {nodes[1]}")
        cluster.fault("heal", nodes[1], XSC_IN_SERVICE="1")  # the node job may take it at once
        healed_at = time.time()
        wait_for(lambda: "the launch's world again" in output.read_text(), 120,
                 "the world grown back")
        grown = {**trainer_pids(job_id), **trainer_pids(node_job)}
        state = cluster.wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, 300)
        node_job_state = cluster.wait_state(node_job, {"CANCELLED", "COMPLETED", "FAILED"}, 60)
    text = output.read_text()
    assert state == "COMPLETED", text[-4000:]
    assert f"xscale: live recovery: {nodes[3]} in place of {nodes[1]}" in text, text[-4000:]
    # The ranks of the healthy nodes are the same processes; the lost node's ranks (2, 3) are
    # new ones, on the spare. After the second crash, ranks 0, 1, 4 and 5 train on in the same
    # processes, as ranks 0-3 of four; after the kill, rank 5's is a new one on its node, the
    # others are the same.
    kept = {rank: pid for rank, pid in before.items() if rank not in (2, 3)}
    assert len(kept) == 4 and all(after[rank] == pid for rank, pid in kept.items()), \
        (before, after)
    assert {2, 3} <= set(after) and not {after[2], after[3]} & {before[2], before[3]}
    assert {rank: shrunk[rank] for rank in (0, 1, 4, 5)} == \
        {rank: after[rank] for rank in (0, 1, 4, 5)}, (after, shrunk)
    assert {rank: restarted[rank] for rank in (0, 1, 4)} == \
        {rank: shrunk[rank] for rank in (0, 1, 4)} and restarted[5] != shrunk[5], \
        (shrunk, restarted)
    assert f"xscale: live recovery: 4 ranks on 2 nodes go on without {nodes[3]} (ranks " \
        "0,1,4,5 before)" in text, text[-4000:]
    assert f"xscale: live recovery: rank 5 starts again on {nodes[2]}, its node" in text
    # Grown back: ranks 2 and 3 on the healed node, in the node job; the others kept.
    assert f"xscale: live recovery: {nodes[1]} is the training's again: ranks 2,3 start " \
        "there" in text, text[-4000:]
    assert "xscale: live recovery: 6 ranks on 3 nodes, the launch's world again (4 before)" \
        in text, text[-4000:]
    assert {rank: grown[rank] for rank in (0, 1, 4, 5)} == \
        {rank: restarted[rank] for rank in (0, 1, 4, 5)} and {2, 3} <= set(grown), \
        (restarted, grown)
    assert node_job_state == "CANCELLED", node_job_state  # with the launch's end
    # One launch throughout, its steps in order: none redone.
    events = [json.loads(line) for line in progress.read_text().splitlines()
              if line.endswith("}")]
    steps = [event["step"] for event in events if event["event"] == "interval"]
    assert steps == sorted(set(steps)) and steps[-1] == SHRUNK_STEPS, steps
    launches = json.loads((out_dir / "xscale-records" / "attempt0.json").read_text())["launches"]
    assert len(launches) == 1 and launches[0]["status"] == 0, launches
    replaced, shrank, started_again, grew = launches[0]["recoveries"]
    assert replaced["lost"] == [nodes[1]] and replaced["spares"] == [nodes[3]], replaced
    assert (shrank["lost"], shrank["spares"], shrank["world_size"]) == ([nodes[3]], [], 4)
    assert (started_again["lost"], started_again["restarted"]) == ([], [5]), started_again
    assert (grew["grown"], grew["ranks"], grew["world_size"], grew["smaller"]) == (
        [nodes[1]], [2, 3], 6, False), grew
    # The summary: the world it ended in, when it shrank, and the launch's global batch.
    summary = tagged_records(text, "XSCALE_SUMMARY")[-1]
    assert (summary["world_size"], summary["nodes"]) == (6, 3), summary
    assert summary["global_batch_size"] == 6 * summary["batch_size"] * summary["accumulation"]
    (shrink,) = summary["shrinks"]
    assert shrink["world_size"] == 4 and resumed < shrink["step"] < shrink["until"] \
        < SHRUNK_STEPS, summary
    ledger = goodput_of(text)
    assert ledger["recovery_s"] == pytest.approx(sum(
        entry["joined_s"] for entry in (replaced, shrank, started_again, grew)), abs=0.01), ledger
    smaller_s = grew["noticed"] - (shrank["noticed"] + shrank["joined_s"])
    assert ledger["smaller_world_s"] == pytest.approx(smaller_s, abs=0.01), ledger
    assert "in a smaller world" in ledger["text"], ledger
    first_after = min(event["time"] for event in events
                      if event["time"] > crashed_at and event["step"] > resumed)
    print(f"{nodes[1]} crashed: the group re-formed {replaced['joined_s']:.1f} s after the "
          f"failure was noticed (left {replaced['left_s']:.2f} s); a logged step "
          f"{first_after - crashed_at:.1f} s after the crash. {nodes[3]} crashed: 2 x 2 ranks "
          f"went on {shrank['joined_s']:.1f} s after it was noticed, at step {shrink['step']}, "
          f"for {shrink['seconds']:.1f} s; rank 5 killed there: started again and joined "
          f"{started_again['joined_s']:.1f} s after; {nodes[1]} healed: back to 3 x 2 at step "
          f"{shrink['until']}, the group re-formed "
          f"{grew['noticed'] + grew['joined_s'] - healed_at:.1f} s after the heal, training "
          f"paused {grew['joined_s']:.1f} s; steps/s at 3 x 2 after the first recovery "
          f"{rate(events, resumed, shrink['step']):.1f}, at 2 x 2 "
          f"{rate(events, shrink['step'], shrink['until']):.1f}, at 3 x 2 again "
          f"{rate(events, shrink['until'], SHRUNK_STEPS):.1f}; {ledger['text']}")


def rate(events: list[dict], first: int, last: int) -> float:
    """Steps per second between the interval notes past step FIRST and up to step LAST (NaN
    with fewer than two: a figure for the note, not a check)."""
    inside = [event for event in events if event["event"] == "interval"
              and first < event["step"] <= last]
    if len(inside) < 2 or inside[-1]["time"] == inside[0]["time"]:
        return math.nan
    return (inside[-1]["step"] - inside[0]["step"]) / (inside[-1]["time"] - inside[0]["time"])


def test_a_blamed_nodes_ranks_move_to_the_spare_and_a_killed_rank_starts_again_on_its_node(
        cluster, mnist_data, tmp_path):
    """jobs/lumi/mnist.sbatch, 3 x 2 ranks and a spare. At the first checkpoint rank 2 prints a
    line that blames its node (a LUMI GPU's hardware exception, jobs/lib/blame) and ends; its
    node-mate lives, so the node runs, but no rank is started again on a bad GPU: rank 3 is
    dismissed, and the spare takes both ranks, live. Then rank 4's process is killed (kill -9,
    not its node): its node-mate answers the coordinator, so it failed on its own, and it
    starts again on its node (a step of one task beside the launch's). The other ranks keep
    their processes throughout, no step is redone, and the job completes in its first launch
    with no report and no requeue."""
    line = lumi_example_line("lumi-hsa-hw-exception")
    job_id, out_dir, output = submit_with_a_spare(cluster, mnist_data, tmp_path,
                                                  PATH=f"{FAULTY_PYTHON}:{tool_env()['PATH']}",
                                                  XSCALE_TEST_FAULT=f"1:say:{line}")
    progress = out_dir / "xscale-records" / "attempt0-launch1.progress"
    try:
        nodes = job_nodes(job_id)  # nodes[3] is the spare
        wait_for(lambda: past_step(progress, SPARE_LOG_EVERY), 240, "training under way")
        before = trainer_pids(job_id)
        wait_for(lambda: f"in place of {nodes[1]}" in output.read_text(), 240,
                 "the blamed node's ranks on the spare")
        moved_at = last_step(progress)
        # Past the second step after the recovery (docs/FAILURES.md, "When it falls back").
        wait_for(lambda: past_step(progress, moved_at + 2), 120, "training on the spare")
        moved = trainer_pids(job_id)
        node = job_processes(job_id)[moved[4]]["SLURMD_NODENAME"]
        killed_at = time.time()
        os.kill(moved[4], signal.SIGKILL)
        wait_for(lambda: "rank 4 started again on its node" in output.read_text(), 120,
                 "the rank started again")
        after = trainer_pids(job_id)
        restarted_on = job_processes(job_id)[after[4]]["SLURMD_NODENAME"]
        state = cluster.wait_state(job_id, {"FAILED", "COMPLETED", "CANCELLED"}, 300)
    finally:
        subprocess.run(["scancel", job_id], timeout=30, check=False)
    text = output.read_text()
    assert state == "COMPLETED" and job_fields(job_id)["Restarts"] == "0", text[-4000:]
    blame = (f"{nodes[1]} is blamed by a line of its ranks' output (lumi.patterns "
             "[lumi-hsa-hw-exception] (rank 2))")
    assert f"xscale: live recovery: {blame}: the node is lost, and rank 3 with it" in text, \
        text[-4000:]
    assert f"xscale: rank 3: {blame}: this rank leaves the training" in text, text[-4000:]
    assert f"xscale: live recovery: {nodes[3]} in place of {nodes[1]}" in text
    assert f"xscale: live recovery: rank 4 starts again on {node}, its node" in text, text
    assert (node, restarted_on) == (nodes[2], nodes[2])
    # Ranks 0, 1 and 5 are the processes they were; 2 and 3 new ones on the spare; then 4 a
    # new one on its node.
    assert all(moved[rank] == after[rank] == before[rank] for rank in (0, 1, 5)), (before, after)
    assert not {moved[2], moved[3]} & {before[2], before[3]} and moved[4] == before[4] != \
        after[4], (before, moved, after)
    events = [json.loads(line) for line in progress.read_text().splitlines()
              if line.endswith("}")]
    steps = [event["step"] for event in events if event["event"] == "interval"]
    assert steps == sorted(set(steps)) and steps[-1] == SPARE_STEPS, steps
    (launch,) = json.loads((out_dir / "xscale-records" / "attempt0.json").read_text())["launches"]
    moved_live, restarted = launch["recoveries"]
    assert {key: moved_live[key] for key in ("lost", "spares", "ranks", "blamed")} == {
        "lost": [nodes[1]], "spares": [nodes[3]], "ranks": [2, 3], "blamed": [nodes[1]]}
    assert (restarted["lost"], restarted["restarted"], restarted["blamed"]) == ([], [4], [])
    assert "xscale: blame:" not in text and "first failure" not in text, text[-4000:]
    # Every rank's record under its own number, the replacements' too (their steps number
    # their tasks from 0: jobs/lib/launches.py's with_launch_ranks); srun's line of the killed
    # rank's end names rank 4 on its node.
    labelled = re.findall(r'^ *(\d+): XSCALE_RANK \{"rank":(\d+),', text, re.M)
    assert sorted((int(label), int(rank)) for label, rank in labelled) == \
        [(rank, rank) for rank in range(6)], labelled
    assert re.search(rf"^srun: error: {node}: task 4: ", text, re.M), text[-4000:]
    first_after = min(event["time"] for event in events if event["time"] > killed_at)
    print(f"{nodes[1]} blamed: its ranks trained on {nodes[3]} after "
          f"{moved_live['joined_s']:.1f} s; rank 4 killed: the group re-formed "
          f"{restarted['joined_s']:.1f} s after the failure was noticed, a logged step "
          f"{first_after - killed_at:.1f} s after the kill")


def test_retries_stop_at_xscale_max_retries(cluster, tmp_path):
    """A step whose second rank prints a LUMI bad-node line on whatever node it runs, every run:
    the first run is retried without its node, the second is not (XSCALE_MAX_RETRIES=1)."""
    line = lumi_example_line("lumi-hsa-hw-exception")
    script = job_script(tmp_path, "blamed.sh", f"""
        export XSCALE_RETRY=1 XSCALE_MAX_RETRIES=1 XSCALE_BLAME=lumi
        export XSCALE_RECORDS_DIR={tmp_path}/records
        # The rank exits once srun has passed its line on to the step's log: exiting at once,
        # it lost the race with srun ending the step on its exit (the line never came, once).
        wait_for_the_line() {{
          local log=$XSCALE_RECORDS_DIR/attempt${{SLURM_RESTART_COUNT:-0}}-launch1.log
          for _ in {{1..300}}; do
            grep -qF "HW Exception" "$log" 2>/dev/null && return
            sleep 0.1
          done
        }}
        export -f wait_for_the_line
        source {REPO}/jobs/lib/supervise.sh
        requeueable_step srun --label --kill-on-bad-exit=1 bash -c \\
          'if ((SLURM_PROCID == 1)); then echo "{line}"; wait_for_the_line; exit 1; fi; sleep 60'
        """)
    output = tmp_path / "job.out"
    job_id = cluster.submit(script, output=output, sbatch_options=(
        "--nodes=2", "--ntasks-per-node=1", "--requeue", "--no-kill", "--open-mode=append"))
    try:
        release_requeued(cluster, job_id)
        state = cluster.wait_state(job_id, {"FAILED", "COMPLETED", "CANCELLED"}, 120)
    finally:
        subprocess.run(["scancel", job_id], timeout=30, check=False)
    text = output.read_text()
    assert state == "FAILED" and job_fields(job_id)["Restarts"] == "1", text
    first, second = re.findall(r"xscale: blame: (\S+): lumi.patterns", text)
    assert first != second
    assert f"not retrying job {job_id} without {second}: 1 retries already" in text
    assert (tmp_path / "records" / "retries").read_text().count("excluded") == 1


# --- atomic checkpoints ----------------------------------------------------------------------

def test_kill_9_during_a_checkpoint_write_leaves_the_previous_one_loadable(tmp_path):
    from xscale.checkpoints import files  # the trainers' own loader, as a resumed job runs it

    halted_save = REPO / "tests" / "programs" / "halted_checkpoint_save.py"
    proc = subprocess.Popen([str(REPO / ".venv" / "bin" / "python"), str(halted_save),
                             str(tmp_path)], env=dict(os.environ),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "halfway"
        half_written = list(tmp_path.glob(".ckpt-*.tmp"))
        assert len(half_written) == 1 and half_written[0].stat().st_size > 0
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert [step for step, _ in files.list_checkpoints(tmp_path)] == [10]
    state = files.load_latest(tmp_path)
    assert state["step"] == 10 and bool((state["weights"] == 10.0).all())
    files.save(tmp_path, 30, {"step": 30})  # the next save clears the leftover
    assert not list(tmp_path.glob(".ckpt-*.tmp"))


# --- two jobs sharing a node -------------------------------------------------------------------

def test_two_jobs_on_one_node_get_their_own_port_and_cache(cluster, tmp_path):
    """Both jobs hold their rendezvous open until the other has announced its own: they overlap
    on nid001, so a shared MASTER_PORT would fail one with 'address already in use'."""
    job_ids, outputs = [], []
    for me, other in (("a", "b"), ("b", "a")):
        script = job_script(tmp_path, f"{me}.sbatch", f"""
            srun singularity exec img /runscripts/run.sh python tests/programs/allreduce.py \\
              --announce {tmp_path}/{me}.ready --hold-until {tmp_path}/{other}.ready
        """)
        outputs.append(tmp_path / f"{me}.out")
        job_ids.append(cluster.submit(
            script, output=outputs[-1],
            sbatch_options=("-w", "nid001", "-N1", "-n1", "--time=5", f"--chdir={REPO}"),
        ))
    for job_id in job_ids:
        assert cluster.wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, 180) == "COMPLETED"
    records = [rank_records(out.read_text(), "XSCALE_CHECK")[0] for out in outputs]
    ports = {r["master"] for r in records}
    caches = {r["cache_dir"] for r in records}
    assert len(ports) == 2, records
    assert len(caches) == 2, records
    assert all(r["master"].startswith("nid001:") for r in records)


# --- caches ------------------------------------------------------------------------------------

@pytest.fixture
def throwaway_user() -> str:
    if os.geteuid() != 0:
        pytest.skip("needs root to create a throwaway user")
    try:
        pwd.getpwnam(THROWAWAY_USER)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin",
                        THROWAWAY_USER], check=True, timeout=30)
    return THROWAWAY_USER


@pytest.fixture
def world_writable_root():
    """Like /tmp: sticky and world-writable, reachable by the throwaway user (pytest's own tmp
    directories are 0700)."""
    root = Path(tempfile.mkdtemp(prefix="xscale-test-", dir="/tmp"))
    root.chmod(0o1777)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def run_sh(env: dict[str, str], *cmd: str) -> subprocess.CompletedProcess[str]:
    base = {"PATH": os.environ["PATH"], "USER": "root", "XSCALE_SITE": "generic",
            "SLURM_JOB_ID": "777", "SLURM_STEP_ID": "3", "SLURMD_NODENAME": "nid001"}
    return subprocess.run([str(REPO / "runscripts" / "run.sh"), *cmd], env={**base, **env},
                          capture_output=True, text=True, timeout=30)


def test_cache_precreated_by_another_user_is_refused(tmp_path, throwaway_user,
                                                     world_writable_root):
    root = world_writable_root
    planted = root / "xscale-root-777.3-nid001"
    subprocess.run(["runuser", "-u", throwaway_user, "--", "mkdir", "-m", "0777", str(planted)],
                   check=True, timeout=30)
    marker = tmp_path / "ran"
    proc = run_sh({"XSCALE_CACHE_ROOT": str(root)}, "touch", str(marker))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"run.sh: error: cache directory '{planted}' belongs to another user; refusing to use it"
    )
    assert not marker.exists()


def test_cache_symlink_planted_by_another_user_is_refused(tmp_path, throwaway_user,
                                                          world_writable_root):
    root = world_writable_root
    target = tmp_path / "victim"
    target.mkdir()
    planted = root / "xscale-root-777.3-nid001"
    subprocess.run(["runuser", "-u", throwaway_user, "--", "ln", "-s", str(target), str(planted)],
                   check=True, timeout=30)
    proc = run_sh({"XSCALE_CACHE_ROOT": str(root)}, "true")
    assert proc.returncode == 2
    assert "is a symlink" in proc.stderr and proc.stderr.count("\n") == 1
    assert list(target.iterdir()) == []


def test_created_cache_is_0700(tmp_path):
    proc = run_sh({"XSCALE_CACHE_ROOT": str(tmp_path)}, "true")
    assert proc.returncode == 0, proc.stderr
    cache = tmp_path / "xscale-root-777.3-nid001"
    assert cache.stat().st_mode & 0o7777 == 0o700


# --- bad input: exit 2, one line, nothing run -------------------------------------------------

SLURM_RANK0 = {"SLURM_JOB_ID": "41", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0",
               "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
               "SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "1(x2)"}
NO_SUCH = "/nonexistent/xscale-data"

# (case, entrypoint, environment, command after the entrypoint, words the one line must hold).
# "MARKER" in a command is replaced by a file that must not exist afterwards: proof that nothing
# was exec'd (run.sh cases) or that the trainer stopped before training (trainer cases).
BAD_INPUT = [
    ("node list unbalanced", "run.sh", {**SLURM_RANK0, "SLURM_JOB_NODELIST": "nid[001-002"},
     ["touch", "MARKER"], ["nid[001-002"]),
    ("node list descending", "run.sh", {**SLURM_RANK0, "SLURM_JOB_NODELIST": "nid[009-002]"},
     ["touch", "MARKER"], ["nid[009-002]"]),
    ("node list empty item", "run.sh", {**SLURM_RANK0, "SLURM_JOB_NODELIST": "nid001,,nid002"},
     ["touch", "MARKER"], ["nid001,,nid002"]),
    ("get-master empty brackets", "get-master", {}, ["nid[]"], ["nid[]"]),
    ("PROFILE_RANKS letters", "run-profile.sh", {"PROFILE_RANKS": "a-3"},
     ["touch", "MARKER"], ["PROFILE_RANKS", "a-3"]),
    ("PROFILE_RANKS backwards", "run-profile.sh", {"PROFILE_RANKS": "5-2"},
     ["touch", "MARKER"], ["PROFILE_RANKS", "5-2"]),
    ("PROFILE_RANKS empty item", "run-profile.sh", {"PROFILE_RANKS": "1,,2"},
     ["touch", "MARKER"], ["PROFILE_RANKS", "1,,2"]),
    ("rank not a number", "run.sh", {**SLURM_RANK0, "SLURM_PROCID": "zero",
                                     "SLURM_JOB_NODELIST": "nid[001-002]"},
     ["touch", "MARKER"], ["SLURM_PROCID", "zero"]),
    ("world size not a number", "run.sh", {"OMPI_COMM_WORLD_RANK": "0",
                                           "OMPI_COMM_WORLD_SIZE": "2x"},
     ["touch", "MARKER"], ["OMPI_COMM_WORLD_SIZE", "2x"]),
    ("log dir cannot be made", "run.sh", {"XSCALE_LOG_DIR": "/proc/xscale-logs"},
     ["touch", "MARKER"], ["XSCALE_LOG_DIR", "/proc/xscale-logs"]),
    ("cache root cannot be made", "run.sh", {"XSCALE_CACHE_ROOT": "/proc/xscale"},
     ["touch", "MARKER"], ["cache directory", "/proc/xscale"]),
    ("gloo interface missing", "run.sh", {"GLOO_SOCKET_IFNAME": "hsn7"},
     ["touch", "MARKER"], ["GLOO_SOCKET_IFNAME='hsn7'", "no interface 'hsn7'", "have: "]),
    ("nccl interfaces match nothing", "run.sh", {"NCCL_SOCKET_IFNAME": "hsn,=ib0"},
     ["touch", "MARKER"], ["NCCL_SOCKET_IFNAME='hsn,=ib0'", "matches no interface"]),
    ("NCCL takes the warning signal", "run.sh", {"NCCL_PROXY_DUMP_SIGNAL": "10"},
     ["touch", "MARKER"], ["NCCL_PROXY_DUMP_SIGNAL=10 is SIGUSR1", "must differ"]),
    ("mnist data missing", "run.sh", {},
     ["python", "python/mnist_ddp.py", "--data", NO_SUCH, "--output-dir", "MARKER"], [NO_SUCH]),
    ("imagenet data missing", "run.sh", {},
     ["python", "python/imagenet.py", "--output-dir", "MARKER", NO_SUCH], [NO_SUCH]),
    ("gpt-neo model missing", "run.sh", {},
     ["python", "python/gpt_neo_imdb.py", "--pretrained-model", NO_SUCH,
      "--output-path", "MARKER"], [NO_SUCH]),
]


def assert_one_line_error(proc: subprocess.CompletedProcess[str], words: list[str]) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    # run.sh's rank-0 announcement precedes the trainer's own line when the trainer ran.
    lines = [line for line in proc.stderr.strip().splitlines()
             if not line.startswith("xscale: launcher=")]
    assert len(lines) == 1, proc.stderr
    assert "error" in lines[0] and "Traceback" not in proc.stderr, lines[0]
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize("entrypoint, env, command, words",
                         [case[1:] for case in BAD_INPUT], ids=[case[0] for case in BAD_INPUT])
def test_bad_input_is_one_line_and_exit_2(tmp_path, entrypoint, env, command, words):
    marker = tmp_path / "marker"
    argv = [str(REPO / "runscripts" / entrypoint)]
    argv += [str(marker) if word == "MARKER" else word for word in command]
    base = {"PATH": f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}", "USER": "root",
            "HOME": str(tmp_path), "XSCALE_SITE": "generic", "XSCALE_CACHE_ROOT": str(tmp_path),
            "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, env={**base, **env}, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert_one_line_error(proc, words)
    assert not marker.exists()


def test_unwritable_log_dir_is_refused(throwaway_user, world_writable_root):
    """Root may write anywhere, so the user who cannot write is a real other user."""
    log_dir = world_writable_root / "logs"
    log_dir.mkdir(mode=0o755)  # root's
    marker = world_writable_root / "ran"
    proc = subprocess.run(
        ["runuser", "-u", throwaway_user, "--", str(REPO / "runscripts" / "run.sh"),
         "touch", str(marker)],
        env={"PATH": os.environ["PATH"], "XSCALE_SITE": "generic", "XSCALE_LOG_DIR": str(log_dir),
             "XSCALE_CACHE_ROOT": str(world_writable_root)},
        cwd=world_writable_root, capture_output=True, text=True, timeout=30)
    assert_one_line_error(proc, ["XSCALE_LOG_DIR", str(log_dir), "not writable"])
    assert not marker.exists()

"""jobs/lib/supervisor.py and the batch-host programs around it, without the cluster.

tests/bats/supervise.bats drives the batch shell's side (signals, requeue, report, retry) with a
recording scontrol; the real paths run on the virtual cluster (tests/test_failures.py,
tests/test_jobs.py). Here: what those leave out, and that every program the batch host runs is
Python 3.6 code, the system Python of LUMI's and Aurora's batch and login nodes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, VENV_BIN, tool_env
from tests.helpers import JOBS_LIB, assert_python36_code, find_python36, host_module, wait_for

# Everything the batch host runs or imports in Python.
HOST_PYTHON = [*(JOBS_LIB / f"{name}.py" for name in ("supervisor", "failure_report", "shared",
                                                      "hangs", "launches", "allocation", "goodput",
                                                      "attempt", "launch_line", "coordinator")),
               JOBS_LIB / "stage", JOBS_LIB / "stage-node",
               REPO / "runscripts" / "lib" / "rank_stack.py",
               *(REPO / "python" / "xscale" / "shared" / f"{name}.py"
                 for name in ("taglines", "archive", "contract")),
               REPO / "runscripts" / "lib" / "hostlist.py"]


@pytest.mark.parametrize("path", HOST_PYTHON, ids=lambda path: path.name)
def test_host_programs_are_python36_code(path: Path):
    assert_python36_code(path)


def test_host_programs_run_under_a_real_python36(tmp_path: Path):
    python36 = find_python36()
    if python36 is None:
        pytest.skip("no Python 3.6 here (pyenv's 3.6.15, or XSCALE_PYTHON36)")
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "5", "XSCALE_RECORDS_DIR": str(tmp_path)}
    check = subprocess.run([python36, str(JOBS_LIB / "supervisor.py"), "check"], env=env,
                           capture_output=True, text=True, timeout=60, check=False)
    assert (check.returncode, check.stderr) == (0, "")
    bad = subprocess.run([python36, str(JOBS_LIB / "supervisor.py"), "check"],
                         env={**env, "XSCALE_RETRY": "2"}, capture_output=True, text=True,
                         timeout=60, check=False)
    assert (bad.returncode, bad.stderr) == (
        2, "xscale: error: XSCALE_RETRY='2' is neither 0 nor 1\n")
    node = subprocess.run([python36, str(JOBS_LIB / "stage-node"), "clean", str(tmp_path / "x")],
                          env={**env, "STAGE_NODE_NAME": "nid009"}, capture_output=True, text=True,
                          timeout=60, check=False)
    assert node.stdout == f"nid009 ok {tmp_path / 'x'} removed\n", node.stderr


# ---- the supervisor's verbs, as supervise.sh calls them -----------------------------------------

def supervisor(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """supervisor.py with a recording scontrol on PATH, in job 42's environment."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/bash\necho "$*" >>"{tmp_path}/scontrol.calls"\n')
    scontrol.chmod(0o755)
    base = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "42",
            "XSCALE_RECORDS_DIR": str(tmp_path / "records")}
    return subprocess.run(["python3", str(JOBS_LIB / "supervisor.py"),
                           "--stop-file", str(tmp_path / "stop"), *args],
                          env={**base, **env}, capture_output=True, text=True, timeout=60,
                          check=False)


def scontrol_calls(tmp_path: Path) -> list[str]:
    calls = tmp_path / "scontrol.calls"
    return calls.read_text().splitlines() if calls.exists() else []


@pytest.mark.parametrize("listed", ["none\n", "", None])
def test_a_file_that_names_no_node_retries_nothing(tmp_path, listed):
    """The doctor writes `none` when every node passed; staging writes no file at all."""
    listing = tmp_path / "exclude"
    if listed is not None:
        listing.write_text(listed)
    proc = supervisor(tmp_path, "retry-without", f"@{listing}", "the preflight doctor",
                      XSCALE_RETRY="1")
    assert (proc.returncode, proc.stderr) == (0, "")
    assert supervisor(tmp_path, "finish").returncode == 0
    assert scontrol_calls(tmp_path) == []
    assert not (tmp_path / "records" / "retries").exists()


def test_a_listed_node_is_retried_as_a_blamed_one(tmp_path):
    (tmp_path / "exclude").write_text("nid[002-003]\n")
    proc = supervisor(tmp_path, "retry-without", f"@{tmp_path / 'exclude'}", "staging",
                      XSCALE_RETRY="1")
    assert proc.stderr == ("xscale: retry 1 of 3: requeueing job 42 without nid[002-003] when "
                           "this script ends\n")
    assert "attempt 0: excluded nid[002-003] after staging" in (
        tmp_path / "records" / "retries").read_text()
    assert scontrol_calls(tmp_path) == []  # not yet: when the script exits
    supervisor(tmp_path, "finish")
    assert scontrol_calls(tmp_path) == ["show job 42", "requeue 42",
                                        "update JobId=42 ExcNodeList=nid[002-003]"]


def run_step(tmp_path: Path, notes: str, *stops: str) -> subprocess.CompletedProcess[str]:
    """A launch whose rank 0 notes NOTES in its XSCALE_PROGRESS (xscale.shared.contract), then the
    judgement of its end with STOPS received."""
    proc = supervisor(tmp_path, "launch", "--", "bash", "-c",
                      'printf "%s" "$1" >>"$XSCALE_PROGRESS"', "launch", notes)
    assert proc.returncode == 0, proc.stderr
    (tmp_path / "stop").write_text("".join(f"{name}\n" for name in stops))
    return supervisor(tmp_path, "judge")


def test_a_finished_training_is_read_from_rank_0s_progress_not_from_the_log(tmp_path):
    """The warning came as the training ended: its `end` note says it was not stopped, so the
    job is not requeued to do nothing."""
    judged = run_step(tmp_path, '{"event": "end", "step": 60, "time": 1.0, "stopped": false}\n',
                      "USR1")
    assert judged.returncode == 0
    assert "had finished its training when SIGUSR1 came: no requeue" in judged.stderr
    supervisor(tmp_path, "finish")
    assert scontrol_calls(tmp_path) == []


def test_a_launch_that_fails_after_its_training_finished_is_no_failed_job(tmp_path):
    """Rank 0 noted the training's end, then the launch failed (an evaluation's collective
    after a live recovery, gloo's abort at exit): the report's first line says the training
    finished, and the job ends with the training's status, neither restarted nor requeued."""
    launched = supervisor(tmp_path, "launch", "--", "bash", "-c",
                          'printf "%s" "$1" >>"$XSCALE_PROGRESS"; exit 134', "launch",
                          '{"event": "end", "step": 40, "time": 1.0, "stopped": false}\n',
                          XSCALE_RETRY="1")
    lines = launched.stderr.splitlines()
    assert lines[0] == (
        "xscale: the training finished at step 40; the launch failed after it (exit status "
        "134), in what follows the training (an evaluation, the summary): the job ends with "
        "the training's status, 0; submitting it again resumes at that step and runs only what "
        "follows"), launched.stderr
    assert "xscale: the launch failed with exit status 134; what srun saw:" in lines
    assert not any("restart" in line or "retry" in line for line in lines), lines
    judged = supervisor(tmp_path, "judge", XSCALE_RETRY="1")
    assert (judged.returncode, judged.stderr) == (0, "")
    supervisor(tmp_path, "finish", XSCALE_RETRY="1")
    assert scontrol_calls(tmp_path) == []


def test_notes_cut_short_are_a_stopped_training_not_a_crash(tmp_path):
    """A step killed mid-line leaves half a note: no proof it finished, so it is requeued."""
    judged = run_step(tmp_path, '{"event": "first_step", "step": 1, "time": 1.0}\n{"event": "en',
                      "USR1")
    assert (judged.returncode, judged.stderr) == (0, "")
    supervisor(tmp_path, "finish")
    assert scontrol_calls(tmp_path)[-1] == "requeue 42"


def test_a_step_that_cannot_start_is_one_line_and_no_traceback(tmp_path):
    proc = supervisor(tmp_path, "launch", "--", str(tmp_path / "no-such-srun"))
    assert proc.returncode == 127
    assert proc.stderr.startswith("xscale: cannot start the launch: ") and \
        len(proc.stderr.splitlines()) == 1, proc.stderr
    launch = json.loads((tmp_path / "records" / "attempt0.json").read_text())["launches"][-1]
    assert (launch["log"], launch["status"]) == (
        str(tmp_path / "records" / "attempt0-launch1.log"), 127)


# ---- a hang, from flight records as torch writes them -------------------------------------------

def flight_record(rank: int, enqueued: int, completed: int, error: str | None = None) -> dict:
    """A flight record of the default process group, as torch's dump pickles it (gloo's counts a
    timed-out collective as completed, NCCL's does not), with xscale's entry when ERROR."""
    record = {
        "version": "2.10", "pg_config": {"": {"name": "", "desc": "", "ranks": "[0, 1, 2, 3]"}},
        "pg_status": {"0": {"last_enqueued_collective": enqueued, "last_started_collective": -1,
                            "last_completed_collective": completed}},
        "entries": [{"collective_seq_id": seq, "pg_id": 0, "profiling_name": "gloo:all_reduce",
                     "state": "scheduled"} for seq in range(max(enqueued - 2, 1), enqueued + 1)],
    }
    if error is not None:
        record["xscale"] = {"error": error, "node": f"nid00{rank // 2 + 1}", "pid": 100 + rank,
                            "job_step": "42.0"}
    return record


def write_records(fr_dir: Path, records: dict[int, dict]) -> None:
    import pickle

    fr_dir.mkdir(parents=True, exist_ok=True)
    for rank, record in records.items():
        (fr_dir / f"rank{rank}").write_bytes(pickle.dumps(record, protocol=2))


TIMEOUT = "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation"
PLACEMENT = {0: "nid001", 1: "nid001", 2: "nid002", 3: "nid002"}


@pytest.mark.parametrize("quiet_rank", [
    None,  # frozen: no record at all
    flight_record(3, 17, 17, TIMEOUT),  # alive, but its last collective came before #18
])
def test_the_rank_without_the_collective_the_others_timed_out_in_hung(tmp_path, quiet_rank):
    hangs = host_module("hangs")
    records = {rank: flight_record(rank, 18, 18, TIMEOUT) for rank in range(3)}
    if quiet_rank is not None:
        records[3] = quiet_rank
    write_records(tmp_path / "fr", records)
    hang = hangs.read_hang(str(tmp_path / "fr"), PLACEMENT, str(tmp_path / "stack-rank"))
    assert (hang.culprits, hang.waiters, hang.what()) == ([3], [0, 1, 2], "gloo:all_reduce #18")


def test_a_rank_held_up_behind_a_frozen_one_is_not_named_with_it(tmp_path):
    """Rank 3 frozen (no record); rank 2 still waited in #17 for rank 3's part when ranks 0-1
    had gone on to #18 (a ring all-reduce ends on some ranks first): rank 3 hung, not 2."""
    hangs = host_module("hangs")
    records = {rank: flight_record(rank, 18, 18, TIMEOUT) for rank in range(2)}
    records[2] = flight_record(2, 17, 17, TIMEOUT)
    write_records(tmp_path / "fr", records)
    hang = hangs.read_hang(str(tmp_path / "fr"), PLACEMENT, str(tmp_path / "stack-rank"))
    assert (hang.culprits, hang.waiters, hang.what()) == ([3], [0, 1], "gloo:all_reduce #18")


def test_nccl_records_count_from_the_first_collective_not_completed(tmp_path):
    """torch's watchdog writes a record on a timeout only, without xscale's entry."""
    hangs = host_module("hangs")
    write_records(tmp_path / "fr", {rank: flight_record(rank, 20, 17) for rank in range(3)})
    hang = hangs.read_hang(str(tmp_path / "fr"), PLACEMENT, str(tmp_path / "stack-rank"))
    assert (hang.culprits, hang.what()) == ([3], "gloo:all_reduce #18")


def test_no_timeout_no_hang_and_late_records_do_not_count(tmp_path):
    hangs = host_module("hangs")
    # Peers of a rank that exited: they lost it, they did not time out.
    lost = "Connection closed by peer [10.77.0.12]:23456"
    write_records(tmp_path / "lost", {rank: flight_record(rank, 18, 18, lost) for rank in range(3)})
    assert hangs.read_hang(str(tmp_path / "lost"), PLACEMENT, str(tmp_path / "s")) is None
    # The frozen rank, continued by Slurm to end it, timed out too and wrote a record after the
    # release: the records the release names are the evidence.
    write_records(tmp_path / "fr", {rank: flight_record(rank, 18, 18, TIMEOUT)
                                    for rank in range(4)})
    hangs.release(str(tmp_path / "fr"), [0, 1, 2])
    (tmp_path / "stack-rank3.txt").write_text(
        'Process 7: python train.py\nThread 7 (idle): "MainThread"\n    step (train.py:9)\n'
        'Thread 8 (idle): "tqdm_monitor"\n    wait (threading.py:331)\n')
    hang = hangs.read_hang(str(tmp_path / "fr"), PLACEMENT, str(tmp_path / "stack-rank"))
    assert hang.culprits == [3]
    assert hang.stacks == {3: ['Thread 7 (idle): "MainThread"', "    step (train.py:9)"]}


# A rank whose DataLoader worker never returns its batch: the rank waits for the worker, as a
# restarted Trainer rank did on the bed (docs/FAILURES.md, "A hang names the rank").
WAITS_FOR_A_STUCK_WORKER = """
import threading
from torch.utils.data import DataLoader, Dataset

class Stuck(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        threading.Event().wait()

for batch in DataLoader(Stuck(), num_workers=1, multiprocessing_context="fork"):
    pass
"""


def test_a_hung_ranks_stack_shows_what_its_dataloader_worker_hung_in(tmp_path):
    """rank_stack.py reads the rank of a job step, not its worker (which inherits the rank's
    environment), with py-spy on the real processes; the report's stack is the rank's main
    thread, which only waits, then its worker's, which says where the wait comes from."""
    step = {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "RANK": "3"}
    rank = subprocess.Popen([str(VENV_BIN / "python"), "-c", WAITS_FOR_A_STUCK_WORKER],
                            env=tool_env(step), start_new_session=True)
    reader = [str(VENV_BIN / "python"), str(REPO / "runscripts" / "lib" / "rank_stack.py"),
              "42.0", "3"]
    try:
        def dumped() -> str:
            dump = subprocess.run(reader, capture_output=True, text=True, timeout=60,
                                  env=tool_env()).stdout
            return dump if "Stuck.__getitem__" in dump and "_try_get_data" in dump else ""

        (tmp_path / "stack-rank3.txt").write_text(wait_for(dumped, 60, "the worker's wait"))
        worker = Path(f"/proc/{rank.pid}/task/{rank.pid}/children").read_text().split()[0]
    finally:
        os.killpg(rank.pid, signal.SIGKILL)  # the worker with it: a stuck one outlives the rank
        rank.wait()
    stack = host_module("hangs").read_stack_file(str(tmp_path / "stack-rank3.txt"))
    child = stack.index(f"its child process {worker}:")
    assert stack[0].startswith(f"Thread {rank.pid} ") and stack[0].endswith('"MainThread"')
    assert any("_try_get_data" in line for line in stack[:child]), stack
    assert stack[child + 1].startswith(f"Thread {worker} "), stack
    assert any("Stuck.__getitem__" in line for line in stack[child + 2:]), stack


# py-spy's dump of a GPU rank with --subprocesses (the format as the test above reads it from
# real processes): its resource tracker comes before the worker, a child of its fork server
# (whose own dump, which only waits too, is left out here).
GPU_RANK_DUMP = """Process 10: python train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 10 (idle): "MainThread"
    _try_get_data (torch/utils/data/dataloader.py:1293)
    train (train.py:40)
Thread 12 (idle): "pin_memory"
    _pin_memory_loop (torch/utils/data/_utils/pin_memory.py:55)

{dashes}
Process 11: python -c from multiprocessing.resource_tracker import main;main(5)
Python v3.11.7 (/usr/bin/python3.11)
Parent Process 10: python train.py

Thread 11 (idle): "MainThread"
    main (multiprocessing/resource_tracker.py:216)

{dashes}
Process 14: python -c from multiprocessing.forkserver import main; main(6, 7, ['torch'])
Python v3.11.7 (/usr/bin/python3.11)
Parent Process 13: python -c from multiprocessing.forkserver import main; main(6, 7, ['torch'])

Thread 14 (idle): "MainThread"
    read (/lustre/data.py:12)
    _worker_loop (/opt/torch/lib/python3.11/site-packages/torch/utils/data/_utils/worker.py:375)
""".format(dashes="-" * 80)


def test_a_hung_ranks_report_shows_its_dataloader_worker_before_its_helper_processes(tmp_path):
    (tmp_path / "stack-rank3.txt").write_text(GPU_RANK_DUMP)
    stack = host_module("hangs").read_stack_file(str(tmp_path / "stack-rank3.txt"))
    assert stack == [
        'Thread 10 (idle): "MainThread"', "    _try_get_data (torch/utils/data/dataloader.py:1293)",
        "    train (train.py:40)",
        "its child process 14:", 'Thread 14 (idle): "MainThread"', "    read (/lustre/data.py:12)",
        "    _worker_loop (/opt/torch/lib/python3.11/site-packages/torch/utils/data/_utils/"
        "worker.py:375)",
        "its child process 11:", 'Thread 11 (idle): "MainThread"',
        "    main (multiprocessing/resource_tracker.py:216)"]


def test_a_stack_reader_runs_in_the_launch_s_image_beside_its_ranks():
    """The py-spy line is built from the launch line's parts, not found in its argv."""
    line = host_module("launch_line").LaunchLine(
        ["python", "train.py"], ["--label"], "img.sif", "/pfs,/x:/runscripts",
        "/runscripts/run-profile.sh", runtime="apptainer")
    assert line.probe("nid002", ["python3", "/runscripts/lib/rank_stack.py"]) == [
        "srun", "--overlap", "--nodelist=nid002", "--nodes=1", "--ntasks=1",
        "--kill-on-bad-exit=0", "apptainer", "exec", "-B", "/pfs,/x:/runscripts", "img.sif",
        "python3", "/runscripts/lib/rank_stack.py"]
    assert line.runscripts == "/runscripts"
    whole = host_module("launch_line").LaunchLine.whole(["srun", "python", "train.py"])
    assert whole.probe("nid002", ["python3"]) is None
    assert host_module("hangs").read_stack(whole, "nid002", "5.0", 3).startswith("no stack: ")


def test_a_node_job_asks_for_a_node_like_the_jobs_for_its_time_left():
    """A smaller world's node job (jobs/lib/grow_back.py) takes the job's partition, account
    and GPUs from scontrol's record, and the whole minutes left; its ranks' line is a step of
    it. (On the bed, where its node is taken back into the training: tests/test_failures.py.)"""
    grow_back = host_module("grow_back")
    record = ("JobId=7 JobName=train UserId=u(1) Account=project_465000 QOS=(null) "
              "JobState=RUNNING Partition=standard-g AllocNode:Sid=uan01:9 Reservation=(null) "
              "Features=(null) EndTime=2026-11-30T18:00:00 TresPerNode=gres/gpu:8 "
              "Command=/users/u/train.sbatch")
    now = time.mktime(time.strptime("2026-11-30T16:30:30", "%Y-%m-%dT%H:%M:%S"))
    assert grow_back.node_job_options(grow_back.job_fields(record), now) == [
        "--partition=standard-g", "--account=project_465000", "--gres=gpu:8", "--time=89"]
    unlimited = "Partition=debug TresPerNode=gres:gpu:4 EndTime=Unknown Features=mi250&hbm"
    assert grow_back.node_job_options(grow_back.job_fields(unlimited), now) == [
        "--partition=debug", "--constraint=mi250&hbm", "--gres=gpu:4"]
    line = host_module("launch_line").LaunchLine(["python", "train.py"], ["--label"], None,
                                                 None, "/runscripts/run.sh")
    assert line.on(1, 2, "nid009", overlap=False).in_job("8").argv() == [
        "srun", "--nodes=1", "--ntasks=2", "--nodelist=nid009", "--jobid=8", "--label",
        "/runscripts/run.sh", "python", "train.py"]


def test_a_replacement_that_dies_after_its_group_formed_is_no_start_that_failed(tmp_path):
    """LiveLaunch watches each replacement's srun. One that ends before its ranks joined the
    generation they were started into ends the recovery under way at once, with that reason.
    One whose generation formed and that dies later (a rank started again, then killed in its
    turn: its death is what began the recovery) is a failure its link told, recovered like any
    rank's: its srun's end changes nothing. Both ends come while a recovery is under way. Its
    node's ranks, started again later, take its place among the replacements."""
    host_side = host_module("coordinator")
    allocation = host_module("allocation").Allocation(["n1", "n2", "n3", "n4"], 2, spares=1)
    line = host_module("launch_line").LaunchLine(["python", "train.py"], [], None, None,
                                                 "/runscripts/run.sh")
    live = host_side.LiveLaunch(allocation, line, str(tmp_path / "launch.log"), 5.0, 3, [])
    fallen_back = []
    live.coordinator.fall_back = fallen_back.append
    live.coordinator.recovering, live.coordinator.formed = True, 3

    def killed_replacement(generation: int) -> None:
        proc = subprocess.Popen(["sh", "-c", "kill -9 $$"])
        live.replacements[("rank", 5)] = proc
        live._watch_replacement(proc, ("rank", 5), "rank 5", generation)

    try:
        killed_replacement(3)  # it joined generation 3, which formed
        assert fallen_back == []
        killed_replacement(4)  # started into generation 4, not formed yet
        assert fallen_back == ["rank 5, started again, ended with status -9 before it joined"]
        # Its node's ranks started again (no srun here) take the killed rank 5's place: the
        # launch's status is then its newest replacements' (LiveLaunch.end).
        live._start = lambda place, *rest: live.replacements.update({place: None})
        live._start_node(2, "the ranks of n3", line.on(1, 2, "n3", overlap=True), 5)
        assert list(live.replacements) == [2]
    finally:
        live.coordinator.server.server_close()


def test_a_replacements_output_goes_on_in_the_launchs_rank_numbers(tmp_path, capsysbinary):
    """A spare's step numbers its tasks from 0, its labels and srun's line of their end alike:
    the copy into the job's output and the launch's log shifts them to the launch's ranks
    (here the ranks of node 1 of 2 per node: 2 and 3), whole lines at a time, the last one too
    when it never ended. The failure report then finds rank 3's node by srun's line."""
    launches, failure_report = host_module("launches"), host_module("failure_report")
    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "wb") as writer:
        writer.write(b"0: step 9\n 1: HW Exception by GPU node-4 reason :GPU Hang\n"
                     b"srun: error: nid004: tasks 0-1: Exited with exit code 1\n1: no newline")
    log = tmp_path / "launch.log"
    with os.fdopen(read_end, "rb") as pipe, open(log, "wb") as handle:
        launches.copy_output(pipe, handle, first_rank=2)
    expected = (b"2: step 9\n 3: HW Exception by GPU node-4 reason :GPU Hang\n"
                b"srun: error: nid004: tasks 2-3: Exited with exit code 1\n3: no newline")
    assert log.read_bytes() == expected == capsysbinary.readouterr().out
    with open(log) as handle:
        step_log = failure_report.StepLog(handle)
    assert step_log.node_of_rank(3, {3: "nid002"}) == "nid004"
    assert step_log.by_rank[3][0].startswith("HW Exception")


def test_the_blame_check_reads_the_whole_lines_at_the_logs_end(tmp_path):
    """Live recovery's check of a node reads only the end of the launch's log, where the rank
    that just failed left its lines: whole lines, the one the cut fell in left out."""
    coordinator = host_module("coordinator")
    log = tmp_path / "launch.log"
    log.write_bytes(b"0: an early line\n2: a line cut\r at its start\n2: HW Exception\n")
    with open(log, "rb") as handle:
        assert coordinator.tail_lines(handle, 30) == ["2: HW Exception", ""]
        assert coordinator.tail_lines(handle, 1 << 20)[:2] == ["0: an early line",
                                                              "2: a line cut\r at its start"]


def test_a_node_is_blamed_for_a_hang_only_when_it_hung_in_the_attempt_before(tmp_path):
    failure_report, hangs = host_module("failure_report"), host_module("hangs")
    log = tmp_path / "step.log"
    log.write_text("srun: error: nid001: tasks 0-1: Exited with exit code 1\n"
                   "srun: error: nid002: tasks 2-3: Killed\n")
    hang = hangs.Hang("gloo:all_reduce", 18, [3], [0, 1, 2], {3: ["Thread 7 (idle)"]})
    once, blamed = failure_report.report(str(log), "nid[001-002]", "2(x2)", "", [], hang, [])
    assert blamed == [] and once[0] == ("first failure: rank 3 on nid002: hung: ranks 0-2 timed "
                                        "out in gloo:all_reduce #18 waiting for it")
    assert once[1] == "  3: Thread 7 (idle)"
    # srun's line for rank 3 is the hang's own end, not a knock-on.
    assert once[2] == ("knock-on: 3 ranks ended after it: ranks 0-1 on nid001: exited with exit "
                       "code 1; rank 2 on nid002: killed")
    twice, blamed = failure_report.report(str(log), "nid[001-002]", "2(x2)", "", [], hang,
                                          ["nid002"])
    assert blamed == ["nid002"]
    assert twice[-1] == ("blame: nid002: a rank on it hung in this attempt and in the one before")


def test_an_attempt_comes_back_from_its_file_as_each_transition_left_it():
    """The supervisor's commands each load the attempt, move it on and save it (attemptA.json):
    every transition survives the round trip, in the form the goodput ledger reads."""
    attempt_type = host_module("attempt").Attempt
    attempt = attempt_type.fresh(5.0)
    launch = attempt.launch("attempt0-launch1.log", "nid[001-002]")
    launch.ended_with(1)
    launch.failed(["nid002"])
    attempt.restarting({"nid002"})
    attempt.launch("attempt0-launch2.log", "nid[001,003]").ended_with(0)
    attempt.requeue_for("the time limit")
    attempt.done()
    again = attempt_type.loaded(json.loads(json.dumps(attempt.saved())))
    assert again.saved() == attempt.saved()
    assert [(one.status, one.blamed) for one in again.launches] == [(1, ["nid002"]), (0, None)]
    assert (again.restarts, again.excluded, again.requeue) == (1, ["nid002"],
                                                               {"why": "the time limit"})
    assert again.saved()["launches"][0]["launched"] <= again.ended


@pytest.mark.parametrize("value", ["two", "-1", "1.5"])
def test_a_rank_restart_limit_that_is_no_whole_number_stops_before_any_launch(tmp_path, value):
    """XSCALE_MAX_RANK_RESTARTS is read with the other settings, at `check`, before the first
    launch: one line and status 2, not a surprise at the first failed rank."""
    proc = supervisor(tmp_path, "check", XSCALE_MAX_RANK_RESTARTS=value)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.startswith(f"xscale: error: XSCALE_MAX_RANK_RESTARTS='{value}' ")
    assert proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.parametrize("live_recovery", [True, False])
def test_live_recovery_runs_with_spares_unless_xscale_live_recovery_is_0(live_recovery: bool):
    """A launch on two nodes with a spare gets a coordinator (its ranks reach it through
    XSCALE_RECOVERY) unless XSCALE_LIVE_RECOVERY=0: then a lost node restarts the launch on the
    spare from its checkpoint (tests/test_trainers_cv.py's corrupted snapshot shows that path)."""
    import types

    supervisor_module = host_module("supervisor")
    settings = types.SimpleNamespace(spares=1, max_rank_restarts=2, live_recovery=live_recovery,
                                     heartbeat_s=30.0, patterns=[], min_nodes=None,
                                     grow_back=True, env={"SLURM_JOB_ID": "7"})
    allocation = types.SimpleNamespace(per_node=2, launch_nodes=["nid001", "nid002"],
                                       nodes=["nid001", "nid002", "nid003"], needed=2)
    line = types.SimpleNamespace(built=True)
    live = supervisor_module.live_launch(settings, allocation, line, "launch.log")
    if not live_recovery:
        assert live is None
        return
    try:
        assert list(live.environment()) == ["XSCALE_RECOVERY"], live.environment()
        assert live.coordinator.world_size == 4
        assert live.node_jobs.job_id == "7"  # a smaller world asks for nodes as job 7's
    finally:
        live.coordinator.server.server_close()  # never started: stop() would wait for it

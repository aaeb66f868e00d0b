"""run.sh / run-profile.sh: launcher tables, rendezvous, caches, sites, arguments, profiling.

These call the scripts directly with each launcher's variables (the Slurm set was recorded from a
real srun task, tests/data/); test_cluster_e2e.py runs the same scripts under real srun.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.conftest import REPO
from tests.helpers import env_lines

RUN_SH = REPO / "runscripts" / "run.sh"
RUN_PROFILE = REPO / "runscripts" / "run-profile.sh"
RECORDED_SLURM = REPO / "tests" / "data" / "slurm-srun-N2-n4-rank3.env"
ARGV_PRINTER = [sys.executable, "-c", "import json,sys; print(json.dumps(sys.argv[1:]))"]


def base_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A minimal environment: no launcher variables leak in from the test runner."""
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "USER": pwd.getpwuid(os.getuid()).pw_name,
        "XSCALE_CACHE_ROOT": str(tmp_path),
        "XSCALE_SITE": "generic",
    }
    env.update(extra)
    return env


def run(args: list[str], env: dict[str, str], script: Path = RUN_SH, **kw):
    return subprocess.run(
        [str(script), *args], env=env, capture_output=True, text=True, timeout=30, **kw
    )


def print_env(env: dict[str, str], script: Path = RUN_SH) -> dict[str, str]:
    proc = run(["--print-env"], env, script)
    assert proc.returncode == 0, proc.stderr
    return env_lines(proc.stdout)


def recorded_slurm_env() -> dict[str, str]:
    lines = RECORDED_SLURM.read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def expected_port(job: int, step: int = 0) -> str:
    return str(10000 + (16 * job + step % 16) % 22768)


def assert_user_error(proc: subprocess.CompletedProcess, *words: str) -> None:
    """Exit 2, exactly one stderr line naming the problem, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(("run.sh: error: ", "run-profile.sh: error: ")), lines[0]
    for word in words:
        assert word in lines[0], lines[0]
    assert "Traceback" not in proc.stderr


# --- launchers --------------------------------------------------------------------------------

LAYOUT = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "NNODES"]


def layout(env: dict[str, str]) -> list[int]:
    return [int(env[k]) for k in LAYOUT]


def test_no_launcher_is_one_process(tmp_path):
    env = print_env(base_env(tmp_path))
    assert layout(env) == [0, 1, 0, 1, 0, 1]
    assert env["MASTER_ADDR"] == "127.0.0.1"
    assert 10000 <= int(env["MASTER_PORT"]) <= 32767
    assert env["XSCALE_LAUNCHER"] == "none"


def test_a_node_without_gpus_has_hugging_face_train_data_parallel_on_its_cpus(tmp_path):
    """accelerate makes the ranks of a CPU-only node one data-parallel job only when told the
    CPU is meant; run.sh tells it on the generic site where no GPU's device file exists (this
    machine), and never on a GPU site."""
    gpu_files = [Path("/dev/kfd"), Path("/dev/nvidiactl"), *Path("/dev/dri").glob("renderD*")]
    if any(path.exists() for path in gpu_files):
        pytest.skip("this machine has a GPU's device file")
    assert print_env(base_env(tmp_path))["ACCELERATE_USE_CPU"] == "true"
    assert "ACCELERATE_USE_CPU" not in print_env(base_env(tmp_path, XSCALE_SITE="nvidia"))


def test_slurm_recorded_from_real_srun(tmp_path):
    env = print_env(base_env(tmp_path, **recorded_slurm_env()))
    assert env["XSCALE_LAUNCHER"] == "slurm"
    assert layout(env) == [3, 4, 1, 2, 1, 2]
    assert env["MASTER_ADDR"] == "nid001"
    assert env["MASTER_PORT"] == expected_port(int(recorded_slurm_env()["SLURM_JOB_ID"]))


@pytest.mark.parametrize(
    ("tasks_per_node", "node", "local_world"),
    [("8(x2),4", 0, 8), ("8(x2),4", 1, 8), ("8(x2),4", 2, 4), ("3,5(x2)", 2, 5), ("16", 0, 16),
     # Leading zeros are decimal, not octal (bash's printf would stop at "08").
     ("08", 0, 8), ("08(x02),09", 2, 9)],
)
def test_slurm_compressed_tasks_per_node(tmp_path, tasks_per_node, node, local_world):
    slurm = {
        "SLURM_PROCID": "16", "SLURM_STEP_ID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "20",
        "SLURM_NODEID": str(node), "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
        "SLURM_NNODES": "3", "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "nid[001-003]",
    }
    env = print_env(base_env(tmp_path, **slurm))
    assert int(env["LOCAL_WORLD_SIZE"]) == local_world
    assert env["NODE_RANK"] == str(node)


def test_slurm_falls_back_to_nprocs_and_job_nodelist(tmp_path):
    slurm = {
        "SLURM_PROCID": "2", "SLURM_STEP_ID": "1", "SLURM_LOCALID": "0", "SLURM_NPROCS": "4",
        "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "9", "SLURM_NODELIST": "gpu[17,19]",
    }
    env = print_env(base_env(tmp_path, **slurm))
    assert layout(env) == [2, 4, 0, 2, 1, 2]
    assert env["MASTER_ADDR"] == "gpu17"
    assert env["MASTER_PORT"] == expected_port(9, 1)


def test_a_replacement_step_takes_the_lost_nodes_ranks(tmp_path):
    """Live recovery's step on a spare: task 1 of 2 on its one node, standing in for node 1 of
    3 (jobs/lib/coordinator.py), is rank 3 of 6; a malformed value stops it in one line."""
    slurm = {"SLURM_PROCID": "1", "SLURM_STEP_ID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2",
             "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NNODES": "1",
             "SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "nid[001-004]"}
    env = print_env(base_env(tmp_path, XSCALE_REPLACEMENT="1/3", **slurm))
    assert layout(env) == [3, 6, 1, 2, 1, 3]
    for bad in ("1", "3/3", "a/3", "1/3:1", "1/3:1/2"):  # the last: one rank, in a 2-task step
        assert_user_error(run(["true"], base_env(tmp_path, XSCALE_REPLACEMENT=bad, **slurm)),
                          "XSCALE_REPLACEMENT")
    # A rank started again on its own node: a step of one task, local rank 1 of 2 there.
    alone = dict(slurm, SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NTASKS="1",
                 SLURM_STEP_TASKS_PER_NODE="1")
    env = print_env(base_env(tmp_path, XSCALE_REPLACEMENT="1/3:1/2", **alone))
    assert layout(env) == [3, 6, 1, 2, 1, 3]


def test_batch_shell_is_not_a_slurm_rank(tmp_path):
    """sbatch's own shell has SLURM_PROCID=0 but no step: it is one process, not rank 0 of N."""
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "5",
             "SLURM_JOB_NODELIST": "nid[001-002]"}
    env = print_env(base_env(tmp_path, **slurm))
    assert env["XSCALE_LAUNCHER"] == "none"
    assert env["WORLD_SIZE"] == "1"


def test_torchrun_values_are_kept(tmp_path):
    torchrun = {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1", "MASTER_ADDR": "head", "MASTER_PORT": "4321",
        "TORCHELASTIC_RUN_ID": "x",
        # Slurm variables are there too when torchrun runs under srun: torchrun wins.
        "SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2",
    }
    env = print_env(base_env(tmp_path, **torchrun))
    assert env["XSCALE_LAUNCHER"] == "torchrun"
    assert layout(env) == [5, 8, 1, 4, 1, 2]
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("head", "4321")


def test_pbs_pals(tmp_path):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("x4000c0s0b0n0\nx4000c0s1b0n0\n")
    pals = {
        "PALS_RANKID": "13", "PALS_LOCAL_RANKID": "1", "PMI_SIZE": "24", "PALS_LOCAL_SIZE": "12",
        "PALS_NODEID": "1", "PBS_NODEFILE": str(nodefile), "PBS_JOBID": "4242.aurora-pbs-0001",
        "PMI_RANK": "13",
    }
    env = print_env(base_env(tmp_path, **pals))
    assert env["XSCALE_LAUNCHER"] == "pbs"
    assert layout(env) == [13, 24, 1, 12, 1, 2]
    assert env["MASTER_ADDR"] == "x4000c0s0b0n0"
    assert env["MASTER_PORT"] == expected_port(4242)


def test_open_mpi(tmp_path):
    ompi = {
        "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        "MASTER_ADDR": "node7", "MASTER_PORT": "23456",
    }
    env = print_env(base_env(tmp_path, **ompi))
    assert env["XSCALE_LAUNCHER"] == "openmpi"
    assert layout(env) == [5, 8, 1, 4, 1, 2]


def test_mpich_pmi(tmp_path):
    pmi = {
        "PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
        "MASTER_ADDR": "node1", "MASTER_PORT": "23456",
    }
    env = print_env(base_env(tmp_path, **pmi))
    assert env["XSCALE_LAUNCHER"] == "pmi"
    assert layout(env) == [3, 4, 1, 2, 1, 2]


def test_mpi_without_master_is_a_clear_error(tmp_path):
    proc = run(ARGV_PRINTER, base_env(tmp_path, PMI_RANK="1", PMI_SIZE="4"))
    assert_user_error(proc, "MASTER_ADDR")


@pytest.mark.parametrize(
    ("variables", "named"),
    [
        ({"SLURM_PROCID": "abc", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4"}, "SLURM_PROCID"),
        ({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "four"}, "SLURM_NTASKS"),
        ({"SLURM_PROCID": "4", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4"}, "world size"),
        ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, "LOCAL_RANK"),
        ({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "2",
          "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "local rank"),
        ({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_NODEID": "0",
          "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_ID": "3", "SLURM_JOB_NODELIST": "nid[1-"},
         "SLURM_JOB_NODELIST"),
        ({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_NODEID": "0",
          "SLURM_TASKS_PER_NODE": "2(x)", "SLURM_JOB_ID": "3", "SLURM_JOB_NODELIST": "n1"},
         "tasks per node"),
        ({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "99999999999"},
         "SLURM_NTASKS"),
    ],
)
def test_bad_rank_variables_stop_before_exec(tmp_path, variables, named):
    marker = tmp_path / "ran"
    proc = run(["touch", str(marker)], base_env(tmp_path, **variables))
    assert_user_error(proc, named)
    assert not marker.exists()


def pals_rank_env(tmp_path: Path) -> dict[str, str]:
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("x4000c0s0b0n0\nx4000c0s1b0n0\n")
    return {"PALS_RANKID": "13", "PALS_LOCAL_RANKID": "1", "PMI_SIZE": "24",
            "PALS_LOCAL_SIZE": "12", "PALS_NODEID": "1", "PBS_NODEFILE": str(nodefile),
            "PBS_JOBID": "4242.aurora-pbs-0001"}


OMPI_RANK = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
             "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
             "MASTER_ADDR": "node7", "MASTER_PORT": "23456"}
PMI_RANK = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
            "MASTER_ADDR": "node1", "MASTER_PORT": "23456"}


@pytest.mark.parametrize(("launcher", "stale", "said"), [
    ("slurm", {"WORLD_SIZE": "16"}, "slurm says 4 (SLURM_NTASKS)"),
    ("slurm", {"LOCAL_WORLD_SIZE": "8"}, "slurm says 2 (SLURM_STEP_TASKS_PER_NODE)"),
    ("slurm", {"RANK": "0"}, "slurm says 3 (SLURM_PROCID)"),
    ("slurm", {"NNODES": "4"}, "slurm says 2 (SLURM_STEP_NUM_NODES)"),
    ("pbs", {"WORLD_SIZE": "12"}, "pbs says 24 (PMI_SIZE)"),
    ("pbs", {"NNODES": "1"}, "pbs says 2 (PBS_NODEFILE)"),
    ("openmpi", {"LOCAL_RANK": "0"}, "openmpi says 1 (OMPI_COMM_WORLD_LOCAL_RANK)"),
    ("pmi", {"LOCAL_WORLD_SIZE": "8"}, "pmi says 2 (MPI_LOCALNRANKS)"),
])
def test_a_rank_variable_that_contradicts_the_launcher_stops_before_exec(
        tmp_path, launcher, stale, said):
    """A job script's stale `export WORLD_SIZE=16` must not win over the launcher: every rank
    would wait in the rendezvous for ranks that never come."""
    launchers = {"slurm": recorded_slurm_env(), "pbs": pals_rank_env(tmp_path),
                 "openmpi": OMPI_RANK, "pmi": PMI_RANK}
    marker = tmp_path / "ran"
    proc = run(["touch", str(marker)], base_env(tmp_path, **launchers[launcher], **stale))
    name, value = next(iter(stale.items()))
    assert_user_error(proc, f"{name}={value} was set before run.sh, but {said}", f"unset {name}")
    assert not marker.exists()


def test_rank_variables_that_agree_with_the_launcher_or_that_it_does_not_say_are_kept(tmp_path):
    agreeing = print_env(base_env(tmp_path, **recorded_slurm_env(), RANK="03", WORLD_SIZE="4"))
    assert (agreeing["RANK"], agreeing["WORLD_SIZE"]) == ("03", "4")
    # Open MPI does not number nodes: NODE_RANK is guessed from block placement, and the user's
    # (a cyclic placement, say) wins.
    assert print_env(base_env(tmp_path, **OMPI_RANK, NODE_RANK="0"))["NODE_RANK"] == "0"


def test_torchrun_is_known_by_its_run_id_and_hand_set_ranks_by_their_absence(tmp_path):
    """RANK and WORLD_SIZE alone, inside a Slurm step, are a job script's exports, checked; with
    no launcher at all they are a hand-made layout, taken as given."""
    exported = {**recorded_slurm_env(), "RANK": "3", "WORLD_SIZE": "8"}
    assert_user_error(run(["true"], base_env(tmp_path, **exported)),
                      "WORLD_SIZE=8 was set before run.sh, but slurm says 4")
    by_hand = print_env(base_env(tmp_path, RANK="2", WORLD_SIZE="4", LOCAL_RANK="0",
                                 LOCAL_WORLD_SIZE="1", NODE_RANK="2", NNODES="4",
                                 MASTER_ADDR="head", MASTER_PORT="4321"))
    assert by_hand["XSCALE_LAUNCHER"] == "manual"
    assert layout(by_hand) == [2, 4, 0, 1, 2, 4]


# --- MASTER_PORT ---------------------------------------------------------------------------------

def slurm_task_env(tmp_path: Path, job: int, step: int, rank: int) -> dict[str, str]:
    """Rank RANK of 8 (4 per node, on nid001 and nid002) of step STEP of Slurm job JOB."""
    node = rank // 4
    return base_env(
        tmp_path, SLURM_JOB_ID=str(job), SLURM_STEP_ID=str(step), SLURM_PROCID=str(rank),
        SLURM_NTASKS="8", SLURM_LOCALID=str(rank % 4), SLURM_NODEID=str(node),
        SLURM_TASKS_PER_NODE="4(x2)", SLURM_JOB_NODELIST="nid[001-002]",
        SLURMD_NODENAME=f"nid00{node + 1}",
    )


def master_port(tmp_path: Path, job: int, step: int, rank: int = 0) -> int:
    return int(print_env(slurm_task_env(tmp_path, job, step, rank))["MASTER_PORT"])


# The ports step by 16 (one per concurrent step) through 22768 numbers, so job ids wrap after
# 22768 / 16 = 1423: jobs closer than that (the neighbours on a shared node) never share a port.
JOB_IDS_BEFORE_WRAP = 1423


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(job=st.integers(1, 2**32), step=st.integers(0, 10**4), rank=st.integers(1, 7),
       later=st.integers(1, 15), apart=st.integers(1, JOB_IDS_BEFORE_WRAP - 1),
       other_step=st.integers(0, 10**4))
@example(job=22768, step=15, rank=7, later=1, apart=1, other_step=0)  # both numbers wrap here
@example(job=1, step=0, rank=4, later=15, apart=JOB_IDS_BEFORE_WRAP - 1, other_step=0)
def test_run_sh_port_is_the_steps_own(tmp_path, job, step, rank, later, apart, other_step):
    """run.sh's MASTER_PORT for generated job and step ids: below Linux's ephemeral ports, the
    same on every rank of the step, and not the port of another of the job's 16 concurrent
    steps, nor of a neighbouring job's step on the same node."""
    port = master_port(tmp_path, job, step)
    assert 10000 <= port <= 32767
    assert master_port(tmp_path, job, step, rank) == port  # another node, another rank
    assert master_port(tmp_path, job, step + later) != port
    assert master_port(tmp_path, job + apart, other_step) != port


def test_port_matches_formula_and_differs_between_jobs_and_steps(tmp_path):
    ports = {}
    for job, step in [(1000, 0), (1001, 0), (1000, 1)]:
        slurm = {
            "SLURM_PROCID": "0", "SLURM_STEP_ID": str(step), "SLURM_NTASKS": "1",
            "SLURM_JOB_ID": str(job), "SLURM_JOB_NODELIST": "n1",
        }
        ports[job, step] = print_env(base_env(tmp_path, **slurm))["MASTER_PORT"]
        assert ports[job, step] == expected_port(job, step)
    assert len(set(ports.values())) == 3


@pytest.mark.parametrize(
    "port", ["http", "70000", "65536", "0", "00000", "", " 80", "80 ", "-1", "1e3", "0x50",
             "12345678901234567890123456"],
)
def test_bad_master_port_stops_before_exec(tmp_path, port):
    marker = tmp_path / "ran"
    env = base_env(tmp_path, **recorded_slurm_env(), MASTER_PORT=port)
    assert_user_error(run(["touch", str(marker)], env), "MASTER_PORT")
    assert not marker.exists()


@pytest.mark.parametrize("port", ["1", "65535", "08080"])
def test_any_port_number_is_accepted(tmp_path, port):
    assert print_env(base_env(tmp_path, MASTER_PORT=port))["MASTER_PORT"] == port


@pytest.mark.parametrize("addr", ["", "node 1", "node1\t", " node1", "a\nb"])
def test_bad_master_addr_stops_before_exec(tmp_path, addr):
    marker = tmp_path / "ran"
    env = base_env(tmp_path, **recorded_slurm_env(), MASTER_ADDR=addr)
    assert_user_error(run(["touch", str(marker)], env), "MASTER_ADDR")
    assert not marker.exists()


def mpi_rank_env(tmp_path: Path, rank: int, **job: str) -> dict[str, str]:
    """Open MPI rank RANK of 4 started by mpirun outside any scheduler."""
    return base_env(
        tmp_path, OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE="4",
        OMPI_COMM_WORLD_LOCAL_RANK=str(rank % 2), OMPI_COMM_WORLD_LOCAL_SIZE="2",
        MASTER_ADDR="node1", **job,
    )


@pytest.mark.parametrize(
    ("name", "first", "second"),
    [
        ("PMIX_NAMESPACE", "prterun-login1-81234@1", "prterun-login1-81235@1"),
        ("OMPI_MCA_ess_base_jobid", "3960602625", "3960602626"),
        ("PALS_APID", "5e7d2a1c-61f3-4c4e-9b0b-6a7c1d2e3f40",
         "5e7d2a1c-61f3-4c4e-9b0b-6a7c1d2e3f41"),
    ],
)
def test_mpi_without_a_scheduler_derives_one_port_for_all_ranks(tmp_path, name, first, second):
    ports = {print_env(mpi_rank_env(tmp_path, rank, **{name: first}))["MASTER_PORT"]
             for rank in range(4)}
    assert len(ports) == 1, ports
    port = int(ports.pop())
    assert 10000 <= port <= 32767
    # Another launch (the next job id or namespace) gets another port.
    assert print_env(mpi_rank_env(tmp_path, 0, **{name: second}))["MASTER_PORT"] != str(port)


def test_mpi_without_any_job_id_asks_for_master_port(tmp_path):
    assert_user_error(run(["true"], mpi_rank_env(tmp_path, 1)), "MASTER_PORT")


def test_user_settings_win(tmp_path):
    env = print_env(base_env(
        tmp_path, MASTER_PORT="4242", MASTER_ADDR="me", OMP_NUM_THREADS="3",
        TORCH_EXTENSIONS_DIR="/somewhere",
    ))
    assert (env["MASTER_PORT"], env["MASTER_ADDR"]) == ("4242", "me")
    assert env["OMP_NUM_THREADS"] == "3"
    assert env["TORCH_EXTENSIONS_DIR"] == "/somewhere"


# --- arguments ---------------------------------------------------------------------------------

TRICKY_ARGS = [
    "plain", "with space", "", "  ", "tab\there", "new\nline", "'single'", '"double"',
    "*", "?.py", "[ab]", "back\\slash", "semi;colon", "pipe|x", "amp&", "$(touch /tmp/x)",
    "`id`", "${HOME:-x}", "$", "$$", "$1", "trailing$", "ü\u00e9",
]


def test_arguments_pass_byte_exact(tmp_path):
    proc = run([*ARGV_PRINTER, *TRICKY_ARGS], base_env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == TRICKY_ARGS


@pytest.mark.parametrize(
    ("arg", "expanded"),
    [
        ("$SLURM_PROCID", "3"),
        ("${SLURM_LOCALID}", "1"),
        ("--rank=$RANK", "--rank=3"),
        ("a${NODE_RANK}b$LOCAL_RANK", "a1b1"),
        ("tcp://$MASTER_ADDR:45678", "tcp://nid001:45678"),
        ("$UNDEFINED_NAME", "$UNDEFINED_NAME"),
        ("${UNDEFINED_NAME}", "${UNDEFINED_NAME}"),
        ("$RANKX", "$RANKX"),
        ("${RANK:-7}", "${RANK:-7}"),
        ("$(echo hi)", "$(echo hi)"),
        ("$$RANK", "$3"),
        ("cost: 5$", "cost: 5$"),
        ("$XS_PROG", "$XS_PROG"),  # run.sh's own unexported variable stays as typed
    ],
)
def test_dollar_names_expand_per_rank(tmp_path, arg, expanded):
    proc = run([*ARGV_PRINTER, arg], base_env(tmp_path, **recorded_slurm_env()))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [expanded]


def test_expansion_can_be_turned_off(tmp_path):
    env = base_env(tmp_path, XSCALE_EXPAND_ARGS="0", **recorded_slurm_env())
    proc = run([*ARGV_PRINTER, "$SLURM_PROCID"], env)
    assert json.loads(proc.stdout) == ["$SLURM_PROCID"]


def test_exec_keeps_the_pid(tmp_path):
    proc = subprocess.Popen(
        [str(RUN_SH), sys.executable, "-c", "import os; print(os.getpid())"],
        env=base_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    out, _ = proc.communicate(timeout=30)
    assert int(out) == proc.pid


@pytest.mark.parametrize("script", [RUN_SH, RUN_PROFILE], ids=lambda path: path.name)
@pytest.mark.parametrize("site", ["generic", "lumi", "aurora", "nvidia", "nvidia-slingshot"])
def test_a_rank_starts_no_process_before_its_command(tmp_path, site, script):
    """Every rank runs this at once: once the node's cache directory exists (the first rank's
    mkdir), bash starts and the next process is the command itself, with no fork between."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed: it is what sees a fork or an exec")
    # Rank 3, not profiled; the interface the LUMI and Slingshot profiles name exists here as lo.
    env = base_env(tmp_path, **recorded_slurm_env(), XSCALE_SITE=site, NCCL_SOCKET_IFNAME="lo",
                   PROFILER="true {rank}")
    marker = tmp_path / "ran"
    command = [shutil.which("touch"), str(marker)]
    assert run(command, env, script).returncode == 0
    trace = tmp_path / "trace"
    proc = run(["strace", "-f", "-qq", "-e", "trace=clone,clone3,fork,vfork,execve",
                "-o", str(trace), str(script), *command], env)
    if proc.returncode != 0 and "ptrace" in proc.stderr:
        pytest.skip(f"strace cannot trace here (ptrace not permitted): {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    calls = [line for line in trace.read_text().splitlines() if "(" in line]
    assert not [call for call in calls if "execve(" not in call], calls
    started = [call for call in calls if call.endswith("= 0")]
    assert len(started) == 3, started  # the script, bash (through env), the command
    assert f'execve("{command[0]}"' in started[-1], started


def test_no_command_is_an_error(tmp_path):
    assert_user_error(run([], base_env(tmp_path)), "no command")


def test_print_env_is_sorted_key_value(tmp_path):
    proc = run(["--print-env"], base_env(tmp_path, **recorded_slurm_env()))
    lines = proc.stdout.splitlines()
    assert lines == sorted(lines)
    assert all("=" in line for line in lines)
    assert {"RANK", "MASTER_PORT", "XSCALE_CACHE_DIR"} <= set(env_lines(proc.stdout))


def test_the_start_up_times_are_run_shs_own_and_stay_out_of_print_env(tmp_path):
    """XSCALE_T_RUNSH and XSCALE_T_EXEC: wall-clock, in order, within this call, replacing any
    inherited value (an outer run.sh's); --print-env stays the same from one run to the next."""
    printer = [sys.executable, "-c",
               "import os; print(os.environ['XSCALE_T_RUNSH'], os.environ['XSCALE_T_EXEC'])"]
    before = time.time()
    proc = run(printer, base_env(tmp_path, XSCALE_T_RUNSH="1.0", XSCALE_T_EXEC="2.0",
                                 **recorded_slurm_env()))
    after = time.time()
    assert proc.returncode == 0, proc.stderr
    runsh, exec_at = (float(word) for word in proc.stdout.split())
    assert before <= runsh <= exec_at <= after
    listed = print_env(base_env(tmp_path, **recorded_slurm_env()))
    assert not {"XSCALE_T_RUNSH", "XSCALE_T_EXEC", "XSCALE_LAUNCH_T"} & set(listed)


@pytest.mark.parametrize(("args", "own"), [
    (["--dist-url", "tcp://nid001:45678"], "--dist-url tcp://nid001:45678"),
    (["--dist-url=tcp://nid001:45678", "--epochs", "3"], "--dist-url=tcp://nid001:45678"),
    (["--init-method", "file:///scratch/rdv"], "--init-method file:///scratch/rdv"),
    (["--master_port", "29500"], "--master_port 29500"),
    (["--master-addr=nid009"], "--master-addr=nid009"),
    (["--dist-url", "env://"], None),
    (["--dist-url", "tcp://${MASTER_ADDR}:$MASTER_PORT"], None),  # run.sh's own, expanded
])
def test_the_banner_says_when_the_commands_own_rendezvous_wins(tmp_path, args, own):
    rank0 = {**recorded_slurm_env(), "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
             "SLURM_NODEID": "0"}
    proc = run(["true", *args], base_env(tmp_path, **rank0))
    banner = proc.stderr.strip()
    assert banner.startswith("xscale: launcher=slurm"), proc.stderr
    if own is None:
        assert "not used" not in banner, banner
    else:
        assert banner.endswith(f" (not used: the command's own {own} wins)"), banner


def test_rank_zero_announces_itself_once(tmp_path):
    rank0 = {**recorded_slurm_env(), "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
             "SLURM_NODEID": "0"}
    proc = run(["true"], base_env(tmp_path, **rank0))
    assert proc.stderr.count("xscale: launcher=slurm") == 1
    assert "world=4 nodes=2 master=nid001:" in proc.stderr
    quiet = run(["true"], base_env(tmp_path, **recorded_slurm_env()))
    assert quiet.stderr == ""
    verbose = run(["true"], base_env(tmp_path, **recorded_slurm_env(), XSCALE_VERBOSE="1"))
    assert "rank=3 local_rank=1 node=nid002" in verbose.stderr


# --- caches ------------------------------------------------------------------------------------

def test_cache_is_private_and_per_user_job_step_node(tmp_path):
    env = print_env(base_env(tmp_path, **recorded_slurm_env()))
    cache = Path(env["XSCALE_CACHE_DIR"])
    user = pwd.getpwuid(os.getuid()).pw_name
    assert cache == tmp_path / f"xscale-{user}-4.0-nid002"
    assert cache.is_dir() and (cache.stat().st_mode & 0o777) == 0o700
    assert env["TORCH_EXTENSIONS_DIR"].startswith(str(cache))
    assert env["TRITON_CACHE_DIR"].startswith(str(cache))


def test_concurrent_ranks_share_the_cache_without_waiting(tmp_path):
    env = base_env(tmp_path, **recorded_slurm_env())
    with ThreadPoolExecutor(8) as pool:
        procs = list(pool.map(lambda _: run(["true"], env), range(8)))
    assert [p.returncode for p in procs] == [0] * 8, [p.stderr for p in procs]


def test_symlinked_cache_is_refused(tmp_path):
    env = base_env(tmp_path, **recorded_slurm_env())
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / f"xscale-{env['USER']}-4.0-nid002").symlink_to(target)
    assert_user_error(run(["true"], env), "symlink")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a directory of another user")
def test_cache_of_another_user_is_refused(tmp_path):
    env = base_env(tmp_path, **recorded_slurm_env())
    planted = tmp_path / f"xscale-{env['USER']}-4.0-nid002"
    planted.mkdir(mode=0o777)
    os.chown(planted, 65534, 65534)  # nobody
    assert_user_error(run(["true"], env), "another user")


def test_unwritable_cache_root_is_an_error(tmp_path):
    missing = tmp_path / "no" / "such" / "root"
    assert_user_error(run(["true"], base_env(tmp_path, XSCALE_CACHE_ROOT=str(missing))), "cache")


# --- threads, GPUs, debug, site ------------------------------------------------------------------

def threads_and_note(env: dict[str, str], cpus: str | None = None) -> tuple[str, list[str]]:
    """OMP_NUM_THREADS from run.sh --print-env (under `taskset -c CPUS`), and its notes."""
    taskset = ["taskset", "-c", cpus] if cpus else []
    proc = subprocess.run([*taskset, str(RUN_SH), "--print-env"], env=env, capture_output=True,
                          text=True, timeout=30, check=True)
    notes = [line for line in proc.stdout.splitlines() if line.startswith("# OMP_NUM_THREADS=")]
    return env_lines(proc.stdout)["OMP_NUM_THREADS"], notes


def test_omp_threads_follow_the_affinity_mask(tmp_path):
    env = base_env(tmp_path)
    assert threads_and_note(env, "0") == (
        "1", ["# OMP_NUM_THREADS=1: this rank's own affinity mask (1 of the node's "
              f"{os.cpu_count()} CPUs)"])
    assert threads_and_note(env)[0] == str(len(os.sched_getaffinity(0)))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to share")
def test_ranks_that_share_the_nodes_cpus_divide_them(tmp_path):
    """srun --cpu-bind=none gives every rank the whole node: two ranks (the recorded step's
    rank 3 has one neighbour) on two CPUs get one thread each, not two."""
    slurm = {**recorded_slurm_env(), "SLURM_CPUS_ON_NODE": "2"}
    slurm.pop("SLURM_CPUS_PER_TASK", None)
    assert threads_and_note(base_env(tmp_path, **slurm), "0,1") == (
        "1", ["# OMP_NUM_THREADS=1: every rank's affinity mask is the node's 2 CPUs, shared by "
              "its 2 ranks"])
    # `srun -c N` says the share itself; never more than the mask.
    asked = base_env(tmp_path, **slurm, SLURM_CPUS_PER_TASK="1")
    assert threads_and_note(asked, "0,1") == (
        "1", ["# OMP_NUM_THREADS=1: SLURM_CPUS_PER_TASK=1 (affinity mask: 2 CPUs)"])
    too_many = base_env(tmp_path, **slurm, SLURM_CPUS_PER_TASK="8")
    assert threads_and_note(too_many, "0,1")[0] == "2"
    # A value set before run.sh wins, and the note says so.
    assert threads_and_note(base_env(tmp_path, **slurm, OMP_NUM_THREADS="3"), "0,1") == (
        "3", ["# OMP_NUM_THREADS=3: set before run.sh"])


@pytest.mark.parametrize(
    ("site", "given", "local_rank", "local_world", "expected"),
    [
        ("nvidia", {}, "1", "4", {"CUDA_VISIBLE_DEVICES": "1"}),
        ("nvidia", {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, "2", "4", {"CUDA_VISIBLE_DEVICES": "6"}),
        # Two GPUs per rank: each rank gets its own pair.
        ("lumi", {"ROCR_VISIBLE_DEVICES": "0,1,2,3"}, "1", "2",
         {"ROCR_VISIBLE_DEVICES": "2,3", "HIP_VISIBLE_DEVICES": "0,1"}),
        # Already one GPU per task (--gpus-per-task): left as the scheduler set it.
        ("lumi", {"ROCR_VISIBLE_DEVICES": "5"}, "1", "2", {"ROCR_VISIBLE_DEVICES": "5"}),
        ("aurora", {}, "3", "12", {"ZE_AFFINITY_MASK": "3"}),
    ],
)
def test_gpu_bind_local(tmp_path, site, given, local_rank, local_world, expected):
    torchrun = {"RANK": local_rank, "WORLD_SIZE": local_world, "LOCAL_RANK": local_rank,
                "LOCAL_WORLD_SIZE": local_world, "MASTER_ADDR": "n1", "MASTER_PORT": "20000"}
    env = print_env(base_env(tmp_path, XSCALE_SITE=site, XSCALE_GPU_BIND="local",
                             **torchrun, **given))
    for name, value in expected.items():
        assert env.get(name, given.get(name)) == value, name


def test_gpu_bind_none_leaves_visibility_alone(tmp_path):
    slurm = recorded_slurm_env()
    assert slurm["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    env = print_env(base_env(tmp_path, **slurm))
    assert "CUDA_VISIBLE_DEVICES" not in env


def test_gpu_bind_bad_value(tmp_path):
    assert_user_error(run(["true"], base_env(tmp_path, XSCALE_GPU_BIND="yes")), "XSCALE_GPU_BIND")


def test_debug_sends_nccl_output_to_a_file_per_rank(tmp_path):
    logs = tmp_path / "logs"
    env = print_env(base_env(tmp_path, XSCALE_DEBUG="1", XSCALE_LOG_DIR=str(logs),
                             **recorded_slurm_env()))
    assert env["NCCL_DEBUG"] == "INFO"
    assert env["NCCL_DEBUG_SUBSYS"] == "INIT,COLL"
    assert env["NCCL_DEBUG_FILE"].startswith(f"{logs}/nccl-rank3.")
    assert logs.is_dir()


def test_unwritable_log_dir_is_an_error(tmp_path):
    assert_user_error(
        run(["true"], base_env(tmp_path, XSCALE_LOG_DIR="/proc/xscale-logs")), "XSCALE_LOG_DIR"
    )


def test_only_the_current_async_error_handling_name_is_exported(tmp_path):
    # torch >= 2.2 warns on every rank when it finds the old NCCL_ASYNC_ERROR_HANDLING.
    env = print_env(base_env(tmp_path, **recorded_slurm_env()))
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert "NCCL_ASYNC_ERROR_HANDLING" not in env


def test_the_flight_recorder_is_on_and_dumps_where_the_supervisor_reads(tmp_path):
    """On by default under its current name (the old TORCH_NCCL_TRACE_BUFFER_SIZE would warn);
    NCCL's dump on a timeout only where the supervisor gave a directory for it."""
    plain = print_env(base_env(tmp_path, **recorded_slurm_env()))
    assert plain["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in plain
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in plain and "TORCH_FR_DUMP_TEMP_FILE" not in plain
    records = tmp_path / "attempt0-launch1.fr"
    supervised = print_env(base_env(tmp_path, XSCALE_FR_DIR=str(records), TORCH_FR_BUFFER_SIZE="50",
                                    **recorded_slurm_env()))
    assert supervised["TORCH_FR_BUFFER_SIZE"] == "50"  # the user's size wins
    assert supervised["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert supervised["TORCH_FR_DUMP_TEMP_FILE"] == f"{records}/rank"


def rocm_release(tmp_path: Path, version: str | None) -> str:
    """A ROCM_PATH whose .info/version holds VERSION (none at all when VERSION is None)."""
    root = tmp_path / f"rocm-{version}"
    (root / ".info").mkdir(parents=True, exist_ok=True)
    if version is not None:
        (root / ".info" / "version").write_text(f"{version}\n")
    return str(root)


@pytest.mark.parametrize(
    ("version", "user", "expected"),
    [
        ("6.1.3-122", {}, "PHB"),            # LUMI's DeepSpeed image: RCCL does not default to PHB
        ("5.7.1", {}, "PHB"),
        ("6.2.4", {}, None),                 # PHB is RCCL's own default from 6.2
        ("7.0.0-38", {}, None),              # forcing it hangs init on ROCm 7 images
        (None, {}, None),                    # no ROCm release file: leave RCCL alone
        ("garbage", {}, None),
        ("6.1.3", {"NCCL_NET_GDR_LEVEL": "SYS"}, "SYS"),
        ("6.2.4", {"XSCALE_NCCL_NET_GDR_LEVEL": "3"}, "3"),
    ],
)
def test_lumi_gdr_level_follows_the_images_rocm(tmp_path, version, user, expected):
    rocm = rocm_release(tmp_path, version)
    env = print_env(base_env(tmp_path, XSCALE_SITE="lumi", ROCM_PATH=rocm, **user))
    assert env.get("NCCL_NET_GDR_LEVEL", user.get("NCCL_NET_GDR_LEVEL")) == expected


def test_sites(tmp_path):
    lumi = print_env(base_env(tmp_path, XSCALE_SITE="lumi", ROCM_PATH=str(tmp_path / "none"),
                              **recorded_slurm_env()))
    assert lumi["NCCL_SOCKET_IFNAME"] == "hsn0,hsn1,hsn2,hsn3"
    assert lumi["MIOPEN_USER_DB_PATH"].startswith(lumi["XSCALE_CACHE_DIR"])
    assert lumi["MIOPEN_CUSTOM_CACHE_DIR"] == lumi["MIOPEN_USER_DB_PATH"]
    assert "NCCL_NET_GDR_LEVEL" not in lumi
    aurora = print_env(base_env(tmp_path, XSCALE_SITE="aurora"))
    # ALCF's minimal functional set for oneCCL training on Aurora.
    assert aurora["FI_MR_CACHE_MONITOR"] == "userfaultfd"
    assert (aurora["CCL_PROCESS_LAUNCHER"], aurora["CCL_ATL_TRANSPORT"],
            aurora["CCL_KVS_MODE"]) == ("pmix", "mpi", "mpi")
    slingshot = print_env(base_env(tmp_path, XSCALE_SITE="nvidia-slingshot"))
    assert slingshot["NCCL_NET"] == "AWS Libfabric"
    assert (slingshot["FI_MR_CACHE_MONITOR"], slingshot["FI_CXI_DISABLE_HOST_REGISTER"]) == (
        "userfaultfd", "1")
    assert slingshot["NCCL_SOCKET_IFNAME"] == "hsn"
    infiniband = print_env(base_env(tmp_path, XSCALE_SITE="nvidia"))
    assert not any(key.startswith(("NCCL_", "FI_")) for key in infiniband)
    generic = print_env(base_env(tmp_path))
    assert "NCCL_SOCKET_IFNAME" not in generic
    detected = base_env(tmp_path, SLURM_CLUSTER_NAME="lumi")
    del detected["XSCALE_SITE"]
    assert print_env(detected)["XSCALE_SITE"] == "lumi"
    assert_user_error(run(["true"], base_env(tmp_path, XSCALE_SITE="../etc")), "XSCALE_SITE")


def test_with_conda_activates_the_image_python(tmp_path):
    env_bin = tmp_path / "conda" / "bin"
    env_bin.mkdir(parents=True)
    fake_python = env_bin / "python"
    fake_python.write_text("#!/bin/sh\necho conda-python \"$@\"\n")
    fake_python.chmod(0o755)
    activate = tmp_path / "activate"
    activate.write_text(f'export PATH="{env_bin}:$PATH"\n')
    env = base_env(tmp_path, WITH_CONDA=f"source {activate}")
    proc = run(["python", "-u", "x.py"], env)
    assert proc.stdout.strip() == "conda-python -u x.py"


# --- run-profile.sh ------------------------------------------------------------------------------

def profile_env(tmp_path: Path, rank: int, ranks: str, world: int = 16) -> dict[str, str]:
    return base_env(
        tmp_path, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
        PROFILE_RANKS=ranks, PROFILE_DIR=str(tmp_path / "prof"),
        PROFILER="echo PROFILED rank={rank} dir={dir} --", MASTER_ADDR="n1", MASTER_PORT="20000",
    )


@pytest.mark.parametrize(
    ("ranks", "profiled"),
    [
        ("14", {14}), ("0,8-15", {0, *range(8, 16)}), ("all", set(range(16))), ("last", {15}),
        ("3-3", {3}), ("007", {7}),
    ],
)
def test_profile_ranks_select(tmp_path, ranks, profiled):
    chosen = set()
    for rank in range(16):
        proc = run(["echo", "ran"], profile_env(tmp_path, rank, ranks), RUN_PROFILE)
        assert proc.returncode == 0, proc.stderr
        if proc.stdout.startswith("PROFILED"):
            expected = f"PROFILED rank={rank} dir={tmp_path / 'prof'} -- echo ran"
            assert proc.stdout.strip() == expected
            chosen.add(rank)
        else:
            assert proc.stdout.strip() == "ran"
    assert chosen == profiled


def test_profile_default_rank_is_zero(tmp_path):
    env = profile_env(tmp_path, 0, "")
    del env["PROFILE_RANKS"]
    assert run(["echo"], env, RUN_PROFILE).stdout.startswith("PROFILED rank=0")


@pytest.mark.parametrize("ranks", ["a-3", "5-2", "1,,2", ",1", "1,", "1-", "-1", "1 2", "last2"])
def test_malformed_profile_ranks_stop_every_rank(tmp_path, ranks):
    marker = tmp_path / "ran"
    for rank in (0, 5):
        proc = run(["touch", str(marker)], profile_env(tmp_path, rank, ranks), RUN_PROFILE)
        assert_user_error(proc, "PROFILE_RANKS")
    assert not marker.exists()


def test_profile_rank_beyond_world_warns_on_rank_zero(tmp_path):
    rank0 = run(["true"], profile_env(tmp_path, 0, "0,99", world=4), RUN_PROFILE)
    assert rank0.returncode == 0
    assert "warning" in rank0.stderr and "99" in rank0.stderr
    rank1 = run(["true"], profile_env(tmp_path, 1, "0,99", world=4), RUN_PROFILE)
    assert "warning" not in rank1.stderr


def test_profile_exports_the_step_window(tmp_path):
    env = print_env(profile_env(tmp_path, 14, "14"), RUN_PROFILE)
    assert (env["PROFILE_STEP_START"], env["PROFILE_STEPS"]) == ("10", "32")
    assert env["XSCALE_PROFILED"] == "1"
    assert (tmp_path / "prof" / "rank14").is_dir()
    other = print_env(profile_env(tmp_path, 1, "14"), RUN_PROFILE)
    assert "XSCALE_PROFILED" not in other


def test_profiler_torch_wraps_nothing_and_asks_the_trainer_for_its_own_trace(tmp_path):
    env = profile_env(tmp_path, 14, "14")
    env["PROFILER"] = "torch"
    profiled = run(["printenv", "XSCALE_TORCH_PROFILER", "PROFILE_DIR"], env, RUN_PROFILE)
    assert profiled.returncode == 0, profiled.stderr
    assert profiled.stdout.split() == ["1", str(tmp_path / "prof")]
    assert (tmp_path / "prof" / "rank14").is_dir()
    other = print_env(profile_env(tmp_path, 1, "14") | {"PROFILER": "torch"}, RUN_PROFILE)
    assert "XSCALE_TORCH_PROFILER" not in other and "XSCALE_PROFILED" not in other


def test_missing_profiler_stops_every_rank_before_anything_runs(tmp_path):
    marker = tmp_path / "ran"
    for rank in (0, 5):  # the profiled rank and one that would run the command plainly
        env = profile_env(tmp_path, rank, "0")
        env["PROFILER"] = "no-such-profiler-xscale -o {dir}/rank{rank} --"
        proc = run(["touch", str(marker)], env, RUN_PROFILE)
        assert_user_error(proc, "'no-such-profiler-xscale'", "PROFILER")
    assert not marker.exists()


def test_generic_sites_default_profiler_missing_is_named(tmp_path):
    # py-spy (the generic default) is not in /usr/bin or /bin here; the venv is left off PATH.
    env = profile_env(tmp_path, 0, "0")
    del env["PROFILER"]
    env["PATH"] = "/usr/bin:/bin"
    assert_user_error(run(["true"], env, RUN_PROFILE), "'py-spy'", "PROFILER")


# --- site detection on a node that looks like Polaris, Alps, Aurora (bubblewrap) ------------------

def fake_node(tmp_path: Path, *, nvidia: bool = False, cxi: bool = False,
              drm_vendors: tuple[str, ...] = ()) -> list[str]:
    """A bwrap prefix: this machine's root with a fresh /dev and /sys/class holding only the
    devices asked for (NVIDIA's control device, a Slingshot CXI NIC, DRM cards of PCI vendors)."""
    if not shutil.which("bwrap"):
        pytest.skip("bubblewrap is needed to fake a node's devices")
    empty = tmp_path / "device"
    empty.touch()
    args = ["bwrap", "--bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
            "--tmpfs", "/sys/class"]
    if nvidia:
        args += ["--ro-bind", str(empty), "/dev/nvidiactl"]
    if cxi:
        args += ["--ro-bind", str(empty), "/dev/cxi0", "--dir", "/sys/class/cxi"]
    for card, vendor in enumerate(drm_vendors):
        vendor_file = tmp_path / f"vendor{card}"
        vendor_file.write_text(f"{vendor}\n")
        args += ["--dir", f"/sys/class/drm/card{card}/device",
                 "--ro-bind", str(vendor_file), f"/sys/class/drm/card{card}/device/vendor"]
    probe = subprocess.run([*args, "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"bubblewrap cannot create a sandbox here: {probe.stderr.strip()}")
    return [*args, "--"]


PALS_RANK = {"PALS_RANKID": "0", "PALS_LOCAL_RANKID": "0", "PMI_SIZE": "1", "PALS_APID": "7"}


@pytest.mark.parametrize(
    ("node", "launcher", "site"),
    [
        ({"nvidia": True}, {}, "nvidia"),                               # InfiniBand cluster
        ({"nvidia": True, "cxi": True}, {}, "nvidia-slingshot"),        # Alps, Isambard-AI
        ({"nvidia": True, "cxi": True}, PALS_RANK, "nvidia-slingshot"),  # Polaris: PBS + PALS
        ({"drm_vendors": ("0x1a03", "0x8086"), "cxi": True}, PALS_RANK, "aurora"),
        ({"cxi": True}, PALS_RANK, "generic"),                          # PALS alone is not Aurora
        ({"drm_vendors": ("0x8086",)}, {}, "generic"),                  # a laptop's Intel graphics
        ({}, {}, "generic"),
    ],
)
def test_site_is_detected_from_the_nodes_devices(tmp_path, node, launcher, site):
    env = base_env(tmp_path, **launcher)
    del env["XSCALE_SITE"]
    proc = subprocess.run([*fake_node(tmp_path, **node), str(RUN_SH), "--print-env"], env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert env_lines(proc.stdout)["XSCALE_SITE"] == site


def test_explicit_site_wins_over_detection(tmp_path):
    env = base_env(tmp_path, XSCALE_SITE="aurora", **PALS_RANK)
    proc = subprocess.run([*fake_node(tmp_path, nvidia=True, cxi=True), str(RUN_SH),
                           "--print-env"], env=env, capture_output=True, text=True, timeout=30)
    assert env_lines(proc.stdout)["XSCALE_SITE"] == "aurora"

"""Shared pytest fixtures: the repository paths and the virtual Slurm cluster.

Tests that cross ranks run on a real Slurm (slurmctld + four slurmd, each node in its own network,
mount and UTS namespace; docs/TESTBED.md) through the bubblewrap `singularity` shim, because
hand-set SLURM_* variables only test our assumptions.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from xscale.shared import contract

from tests.helpers import wait_for

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = REPO / ".venv" / "bin"
SHIM_DIR = REPO / "tests" / "shim"
RUNSCRIPTS = REPO / "runscripts"
IN_CI = os.environ.get("CI") == "true"
CLUSTER_DIR = REPO / "tests" / "cluster"
CLUSTER_STATE = Path(os.environ.get("XSCALE_CLUSTER_STATE", "/run/xscale-cluster"))
NODES = ("nid001", "nid002", "nid003", "nid004")
# Where a job can end up.
ENDED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                   "PREEMPTED", "BOOT_FAIL", "DEADLINE"})


def pytest_configure(config: pytest.Config) -> None:
    """Test files live in the checkout, not under /tmp: each virtual node has a /tmp of its own,
    so files a test hands to a job must be on storage every node shares, as on a real cluster."""
    if config.option.basetemp is None:
        basetemp = REPO / "build" / "pytest-tmp"
        basetemp.parent.mkdir(exist_ok=True)  # pytest makes basetemp itself, not its parents
        config.option.basetemp = str(basetemp)


def torch_extensions() -> Path:
    """The one directory where the tests that run DeepSpeed share its JIT-built CPU op (about a
    minute to build): the one .ci/run keeps between CI runs when it sets one, else build/."""
    path = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or REPO / "build" / "torch-extensions")
    path.mkdir(parents=True, exist_ok=True)
    return path


def tool_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a user's job would have: the shim and the venv first on PATH."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(SHIM_DIR), str(VENV_BIN), env.get("PATH", "")])
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.pop("PYTHONPATH", None)
    if extra:
        env.update(extra)
    return env


@dataclass
class Job:
    job_id: str
    state: str
    exit_code: str
    output: str


class Cluster:
    """Runs srun/sbatch against the virtual cluster from the repository root."""

    nodes = NODES

    @staticmethod
    def node_tmp(node: str) -> Path:
        """NODE's private /tmp, as the host sees it (cluster-up mounts it there)."""
        return CLUSTER_STATE / "nodes" / node / "tmp"

    @staticmethod
    def fault(*args: str, **env: str) -> str:
        """Run tests/cluster/fault.sh (inject or undo a fault) with ENV added; its stdout."""
        proc = subprocess.run(["bash", str(CLUSTER_DIR / "fault.sh"), *args],
                              capture_output=True, text=True, timeout=120, check=False,
                              env={**os.environ, **env})
        assert proc.returncode == 0, f"fault.sh {' '.join(args)}: {proc.stderr}"
        return proc.stdout

    def slow_once_training(self, node: str, records: Path, percent: int = 90) -> None:
        """Slow NODE down PERCENT (fault.sh slow) once rank 0 noted the first step in RECORDS,
        the job's xscale-records: a start-up ten times as slow, `import torch` included, would
        test nothing and cost a minute."""
        notes = records / f"attempt0-launch1{contract.PROGRESS}"
        wait_for(lambda: contract.first(contract.read_progress(notes), contract.FIRST_STEP), 240,
                 "the first step")
        self.fault("slow", node, str(percent))

    def srun(
        self, *args: str, env: dict[str, str] | None = None, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["srun", *args],
            cwd=REPO,
            env=tool_env(env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def srun_signalled(
        self, *args: str, ready: Callable[[], bool], env: dict[str, str] | None = None,
        signal_name: str = "USR1", timeout: float = 600,
    ) -> subprocess.CompletedProcess[str]:
        """srun ARGS as its own job; once ready() says training is under way, send SIGNAL to
        the whole step as Slurm's --signal and scancel do (`scancel --signal=USR1 JOB.0`: every
        process of every task, DataLoader workers included); then wait for the end."""
        name = f"xscale-signalled-{os.getpid()}-{time.monotonic_ns()}"
        proc = subprocess.Popen(["srun", "-J", name, *args], cwd=REPO, env=tool_env(env),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_for(lambda: ready() or proc.poll() is not None, timeout, "training under way")
            if not ready():
                out, err = proc.communicate(timeout=60)
                raise AssertionError(f"srun ended before it was ready (status {proc.returncode})"
                                     f":\n{out[-3000:]}{err[-3000:]}")
            job_id = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i"], capture_output=True,
                                    text=True, timeout=30, check=True).stdout.strip()
            assert job_id.isdigit(), f"no job named {name} in squeue: {job_id!r}"
            subprocess.run(["scancel", f"--signal={signal_name}", f"{job_id}.0"], check=True,
                           timeout=30)
            out, err = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def submit(
        self,
        script: str | Path,
        *args: str,
        sbatch_options: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        output: Path | None = None,
        timeout: float = 600,
        cwd: Path = REPO,
    ) -> str:
        """sbatch the script from CWD (the job's submit directory) and return its job id."""
        out_opts = ("-o", str(output)) if output else ()
        proc = subprocess.run(
            ["sbatch", "--parsable", *out_opts, *sbatch_options, str(script), *args],
            cwd=cwd,
            env=tool_env(env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        match = re.match(r"(\d+)", proc.stdout)
        if not match:
            raise AssertionError(f"sbatch failed: {proc.stdout}{proc.stderr}")
        return match.group(1)

    def sbatch(
        self,
        script: str | Path,
        *args: str,
        sbatch_options: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        output: Path | None = None,
        timeout: float = 600,
        cwd: Path = REPO,
    ) -> Job:
        """Submit, wait for the job to end, and return its state and output. The wait polls
        the job's state rather than use `sbatch --wait`, whose back-off between polls (2, 8, then
        32 s) returns a 12 s job after 42 s."""
        job_id = self.submit(script, *args, sbatch_options=sbatch_options, env=env,
                             output=output, timeout=timeout, cwd=cwd)
        try:
            self.wait_state(job_id, ENDED, timeout)
        except AssertionError:
            subprocess.run(["scancel", job_id], check=False, timeout=30)
            raise
        return self.job(job_id, output)

    def job(self, job_id: str, output: Path | None = None) -> Job:
        state, exit_code = self.job_state(job_id)
        text = output.read_text() if output and output.exists() else ""
        return Job(job_id, state, exit_code, text)

    def job_state(self, job_id: str) -> tuple[str, str]:
        info = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id],
            capture_output=True, text=True, timeout=30, check=False,
        ).stdout
        state = re.search(r"JobState=(\S+)", info)
        code = re.search(r"ExitCode=(\S+)", info)
        return (state.group(1) if state else "UNKNOWN", code.group(1) if code else "?")

    def wait_state(self, job_id: str, states: set[str], timeout: float) -> str:
        """Poll (bounded) until the job reaches one of `states`: a real state, not a fixed sleep."""
        def reached() -> str | None:
            state, _ = self.job_state(job_id)
            return state if state in states else None

        return wait_for(reached, timeout, f"job {job_id} to reach {sorted(states)}")


def _skip_or_fail(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"virtual cluster unavailable under CI: {reason}")
    pytest.skip(f"virtual cluster unavailable: {reason}")


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    """The virtual Slurm cluster (nid001-nid004), started if it is not running yet."""
    if os.geteuid() != 0:
        _skip_or_fail("it needs root (slurmd, munged); run the tests as root or in CI")
    if not shutil.which("slurmctld"):
        _skip_or_fail("slurm-wlm is not installed; run 'make setup'")
    up = subprocess.run(
        ["bash", str(CLUSTER_DIR / "cluster-up.sh")],
        capture_output=True, text=True, timeout=180, check=False,
    )
    if up.returncode != 0:
        last_line = up.stderr.strip().splitlines()[-1:] or ["cluster-up failed"]
        _skip_or_fail(last_line[0])
    return Cluster()


# Before xdist's own hook, which reads the xdist_group marks.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that uses the cluster, so `make unit` can leave them out, and put them in
    one xdist group: they share four nodes and break them on purpose, so under `pytest -n 3
    --dist loadgroup` (make test) they run one after another in one worker, while the other
    workers run the host-only tests in the time the cluster tests wait for Slurm.

    The cluster tests come first: their one group is the suite's longest path, and xdist hands
    out work in collection order, so it starts at once rather than after the host-only tests
    whose files sort before the first cluster test (docs/TESTBED.md, "What a test costs")."""
    for item in items:
        if "cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)
            item.add_marker(pytest.mark.xdist_group("cluster"))
    items.sort(key=lambda item: item.get_closest_marker("cluster") is None)  # stable


def pytest_collection_finish(session: pytest.Session) -> None:
    """Under --dist loadgroup, stop before the first test if xdist left a cluster test out of
    the group (it marks the group in the node id, which pytest 9.2 no longer lets it change:
    constraints.txt): two workers would then break each other's nodes."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    loose = [item.nodeid for item in session.items
             if item.get_closest_marker("cluster") and not item.nodeid.endswith("@cluster")]
    if loose:
        raise pytest.UsageError(f"pytest-xdist did not group the cluster tests ({loose[0]}); "
                                "see constraints.txt on the pytest version")


HOST_ONLY_NICENESS = 10
# Linux's scheduler with autogroups (kernel.sched_autogroup_enabled=1) shares the CPU between
# sessions first and applies a process's nice only inside its own session (sched(7)). The ranks
# of each virtual node run in a session of their own (slurmstepd's), pytest's workers in the one
# they were started from: a niced host-only test there would still take a third of the cores
# from two nodes' ranks. So the session's own nice goes to HOST_ONLY_NICENESS for the run, and
# back after.
AUTOGROUP = Path("/proc/self/autogroup")
SESSION_NICE = pytest.StashKey[int | None]()  # the session's nice before the run


def autogroup_nice() -> int | None:
    """This session's autogroup nice ("/autogroup-42 nice 0"); None without autogroups."""
    try:
        return int(AUTOGROUP.read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def set_autogroup_nice(nice: int) -> None:
    try:
        AUTOGROUP.write_text(str(nice))
    except OSError:  # autogroups off, or not ours to change: the per-process nice still holds
        pass


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """Under xdist, the controller lowers the session's priority below the cluster's ranks for
    the run (its workers and their children share the session): see AUTOGROUP."""
    config = session.config
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        config.stash[SESSION_NICE] = autogroup_nice()
        if config.stash[SESSION_NICE] is not None:
            set_autogroup_nice(max(HOST_ONLY_NICENESS, config.stash[SESSION_NICE]))


def pytest_sessionfinish(session: pytest.Session) -> None:
    before = session.config.stash.get(SESSION_NICE, None)
    if before is not None:
        set_autogroup_nice(before)



def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under xdist, a worker running a host-only test gives way to the cluster's ranks: they are
    pinned to cores (--cpu-bind), so a test process beside them at the same priority slows the
    ranks of one core and not the other, which is what a straggler looks like. The ranks are
    slurmstepd's children, not this worker's, and keep their priority; the session's priority is
    lowered too (pytest_sessionstart)."""
    if os.environ.get("PYTEST_XDIST_WORKER") and item.get_closest_marker("cluster") is None:
        os.nice(max(0, HOST_ONLY_NICENESS - os.nice(0)))


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model dir, dataset dir) of the tiny offline GPT-neo and IMDB built in code, once per
    pytest worker: every Hugging Face test reads the same pair."""
    from tests.fixtures.tiny_gpt_neo import build

    return build(tmp_path_factory.mktemp("tiny_gpt_neo"))


@pytest.fixture
def stop_handlers():
    """Stop handlers installed by the test are removed again, and the stop flag cleared."""
    from xscale import lifecycle

    saved = {s: signal.getsignal(s) for s in lifecycle.STOP_SIGNALS}
    lifecycle.reset_stop()
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)
    lifecycle._installed = False
    lifecycle.reset_stop()

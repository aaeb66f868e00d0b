"""Failure handling on the virtual cluster: dead ranks, time limits, caches, shared nodes, bad input.

Each test provokes the failure for real (kill -9, a Slurm signal, a planted directory, a second
job on the node) and checks what a user would see.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.helpers import rank_records

THROWAWAY_USER = "xscale-other"


def job_script(tmp_path: Path, name: str, body: str) -> Path:
    script = tmp_path / name
    script.write_text("#!/bin/bash\nset -euo pipefail\n" + textwrap.dedent(body))
    return script


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

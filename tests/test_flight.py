"""xscale.observe.flight: a trainer that fails in a collective leaves its flight record where the
step supervisor looks (XSCALE_FR_DIR), and waits for the supervisor's release before it exits. One
gloo process here; a rank frozen among four on the test bed is tests/test_failures.py's."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

# A trainer that fails in a collective, in one process.
FAILING_COLLECTIVE_TRAINER = REPO / "tests" / "programs" / "failing_collective_trainer.py"


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_trainer(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {**os.environ, "TORCH_FR_BUFFER_SIZE": "20",
            "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "SLURM_JOB_ID": "42",
            "SLURM_STEP_ID": "0", "SLURMD_NODENAME": "nid007"}
    return subprocess.run([sys.executable, str(FAILING_COLLECTIVE_TRAINER), str(free_port())],
                          env={**base, **env}, capture_output=True, text=True, timeout=120)


def test_a_failed_collective_leaves_the_rank_s_flight_record(tmp_path):
    fr_dir = tmp_path / "attempt0-launch1.fr"
    fr_dir.mkdir()
    (fr_dir / "released").write_text("{}")  # the supervisor has looked already: no wait
    proc = run_trainer(tmp_path, XSCALE_FR_DIR=str(fr_dir))
    assert proc.returncode != 0 and "Timed out waiting" in proc.stderr
    record = pickle.loads((fr_dir / "rank0").read_bytes())
    # torch's own record: the group's last collective, its name and number.
    assert record["pg_status"]["0"]["last_enqueued_collective"] == 1
    assert record["entries"][-1]["profiling_name"] == "gloo:all_reduce"
    assert record["xscale"] == {"error": "Timed out waiting 10000ms for recv operation to "
                                         "complete", "node": "nid007",
                                "pid": record["xscale"]["pid"], "job_step": "42.0"}
    assert not list(fr_dir.glob(".*partial"))


def test_without_a_supervisor_nothing_is_written_and_nothing_waits(tmp_path):
    proc = run_trainer(tmp_path)
    assert proc.returncode != 0 and "Timed out waiting" in proc.stderr
    assert "flight record" not in proc.stdout + proc.stderr
    assert list(tmp_path.iterdir()) == []

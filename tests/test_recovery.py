"""Live recovery (jobs/lib/recovery.py, python/xscale/recovery.py) with three real processes on
a real gloo group and the real coordinator, here, without Slurm: each rank claims a node of its
own (SLURMD_NODENAME), and the coordinator's replace() starts the replacement as the supervisor
would on a spare. The test bed's runs with a crashed and a frozen node are in
tests/test_failures.py and tests/test_own_scripts.py; this one checks what they cannot see:
that the replicas are equal, to the last bit, after the recovery."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO
from tests.helpers import free_port, host_module, rank_env, results_of

PROGRAM = REPO / "tests" / "programs" / "live_ranks.py"
STEPS, DIE_AT = 80, 30


def test_a_lost_rank_is_replaced_and_every_replica_ends_equal(tmp_path: Path):
    recovery = host_module("recovery")
    port, started = free_port(), {}

    def env(rank: int, node: str, **extra: str) -> dict[str, str]:
        return rank_env(rank, 3, port, SLURMD_NODENAME=node, MAX_STEPS=str(STEPS),
                        DIE_AT=str(DIE_AT), DIE_RANK="2", DIE_HOW="kill",
                        XSCALE_RECOVERY=coordinator.address, **extra)

    def start(rank: int, node: str, **extra: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(PROGRAM), str(tmp_path)],
                                env=env(rank, node, **extra), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def replace(nodes: list[str], generation: int) -> list[str]:
        started["replacement"] = start(2, "n3", XSCALE_RECOVERY_JOIN=str(generation))
        return ["n3"]

    coordinator = recovery.Coordinator(3, replace, lambda why: None, heartbeat_s=30.0)
    coordinator.start()
    try:
        ranks = [start(rank, f"n{rank}") for rank in range(3)]
        ranks[2].wait(timeout=120)
        runs = [proc.communicate(timeout=120) for proc in (ranks[0], ranks[1])]
        replacement = started["replacement"]
        runs.append(replacement.communicate(timeout=120))
        codes = [ranks[0].returncode, ranks[1].returncode, replacement.returncode]
    finally:
        coordinator.stop()
        for proc in [*ranks, *started.values()]:
            proc.kill()
    assert ranks[2].returncode == -9
    records = results_of([(code, out, err) for code, (out, err) in zip(codes, runs, strict=True)])
    # The survivors trained from the start, the replacement from where the rank was lost;
    # all to the end, with the same parameters and optimizer state.
    assert [(r["rank"], r["started_at"], r["steps"]) for r in records] == [
        (0, 0, STEPS), (1, 0, STEPS), (2, DIE_AT, STEPS)], records
    assert len({r["digest"] for r in records}) == 1, records
    (entry,) = coordinator.saved()
    assert (entry["lost"], entry["spares"], entry["ranks"]) == (["n2"], ["n3"], [2]), entry
    assert "training goes on at step 30" in runs[0][1] + runs[0][0], runs[0]
    assert coordinator.finished(wait_s=5.0)

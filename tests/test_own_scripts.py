"""Scripts of a user's own, not xscale's trainers, through run.sh and the step supervisor on the
virtual cluster: what they get without a line of xscale in them, and the mistakes carried over
from the job scripts they come with (a stale WORLD_SIZE) stopped before any rank waits."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers import tagged_records

OWN_DDP = "tests/programs/own_ddp.py"
JOB = "tests/programs/own-script-job.sh"
IMAGE = "xscale-test.sif"  # ignored by the shim: the host root plays the image


def in_container(*command: str) -> list[str]:
    return ["singularity", "exec", IMAGE, "/runscripts/run.sh", *command]


def test_a_plain_ddp_script_of_ones_own_runs_as_a_job(cluster, tmp_path: Path):
    """2 nodes x 2 ranks under --cpu-bind=none (the local templates' binding), the script's own
    `--dist-url`, DataLoader workers, the supervisor around the step: every rank trains with one
    thread (two ranks share a two-core node), the banner says the script's rendezvous wins over
    run.sh's, and the job ends with what the supervisor knows without progress notes."""
    output = tmp_path / "job.out"
    job = cluster.sbatch(JOB, OWN_DDP, "--workers", "1", output=output,
                         env={"OUTPUT_DIR": str(tmp_path / "out")})
    assert job.state == "COMPLETED", (job.state, job.output[-4000:])
    ranks = sorted(tagged_records(job.output, "RESULT"), key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3], job.output[-4000:]
    assert [r["node"] for r in ranks] == ["nid001", "nid001", "nid002", "nid002"]
    assert {r["world_size"] for r in ranks} == {4}
    assert all(r["loss_last"] < r["loss_first"] for r in ranks), ranks
    # Each rank's share of its node's two CPUs, not all of them.
    assert [(r["omp_threads"], r["torch_threads"]) for r in ranks] == [("1", 1)] * 4, ranks
    port = 40000 + int(job.job_id) % 20000
    banner = [line for line in job.output.splitlines() if "xscale: launcher=" in line]
    assert len(banner) == 1, banner
    assert re.search(r"master=nid001:\d+ \(not used: the command's own "
                     rf"--dist-url tcp://nid001:{port} wins\)$", banner[0]), banner
    ending = [line for line in job.output.splitlines() if line.startswith("xscale: goodput")]
    assert len(ending) == 2, job.output[-3000:]
    assert re.fullmatch(r"xscale: goodput: unknown, the training noted no progress: "
                        r"[\d.]+ min allocated, 1 launch, 0 failed, 0 restarted, 0 requeued",
                        ending[0]), ending
    assert "docs/FAILURES.md" in ending[1] and "XSCALE_PROGRESS" in ending[1], ending


def test_stale_rank_variables_stop_every_rank_before_it_waits(cluster):
    """LUMI's AI-guide job scripts export WORLD_SIZE=16 LOCAL_WORLD_SIZE=8 for 2 nodes x 8 GPUs;
    kept in a 2 x 2 step they would leave every rank waiting in the rendezvous. Each rank says
    so in one line and exits 2 before its command starts."""
    layout = ("-N2", "--ntasks-per-node=2", "--cpu-bind=none")
    stale = cluster.srun(*layout, *in_container("python", "-c", "print('STARTED')"),
                         env={"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, timeout=60)
    assert stale.returncode == 2, stale.stdout + stale.stderr
    assert "STARTED" not in stale.stdout
    errors = [line for line in stale.stderr.splitlines() if "run.sh: error:" in line]
    assert len(errors) == 4, stale.stderr
    assert all("WORLD_SIZE=16 was set before run.sh, but slurm says 4 (SLURM_NTASKS)" in line
               for line in errors), errors
    assert "Traceback" not in stale.stderr
    # A stale RANK is right on one rank at most; the others stop, and with the templates'
    # --kill-on-bad-exit the step ends instead of leaving that one waiting.
    rank = cluster.srun(*layout, "--kill-on-bad-exit=1",
                        *in_container("python", "-c", "print('STARTED')"),
                        env={"RANK": "0"}, timeout=60)
    assert rank.returncode != 0
    errors = [line for line in rank.stderr.splitlines() if "run.sh: error:" in line]
    assert len(errors) == 3, rank.stderr
    assert all(re.search(r"RANK=0 was set before run.sh, but slurm says [123] \(SLURM_PROCID\)",
                         line) for line in errors), errors

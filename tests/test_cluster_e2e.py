"""End to end on the virtual Slurm cluster: real srun, the singularity shim, run.sh inside."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import block_placed, rank_records

IMAGE = "xscale-test.sif"  # ignored by the shim: the host root plays the image
ALLREDUCE = "tests/programs/allreduce.py"


def in_container(entrypoint: str, *command: str) -> list[str]:
    return ["singularity", "exec", IMAGE, f"/runscripts/{entrypoint}", *command]


def checks(output: str) -> list[dict]:
    return sorted(rank_records(output, "XSCALE_CHECK"), key=lambda r: r["rank"])


def test_four_ranks_over_two_nodes_allreduce(cluster):
    proc = cluster.srun(
        "-N2", "-n4", "--cpu-bind=none",
        *in_container("run.sh", "python", ALLREDUCE, "--rank", r"$SLURM_PROCID"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = checks(proc.stdout)
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert [r["node_rank"] for r in ranks] == [0, 0, 1, 1]
    assert [r["local_rank"] for r in ranks] == [0, 1, 0, 1]
    block_placed(ranks)  # ranks 0-1 on one node, 2-3 on another
    assert all(r["sum"] == r["expected"] == 10 for r in ranks)
    # --cpu-bind=none: every rank's mask is its node's two CPUs, shared by the node's two ranks.
    assert [r["omp_threads"] for r in ranks] == ["1"] * 4
    assert {r["master"] for r in ranks} == {ranks[0]["master"]}
    assert ranks[0]["master"].startswith("nid001:")
    # '\$SLURM_PROCID', escaped as LUMI's workshop scripts write it, arrives as each rank's number.
    assert [r["argv"] for r in ranks] == [["--rank", str(i)] for i in range(4)]
    assert proc.stderr.count("xscale: launcher=slurm site=generic world=4 nodes=2") == 1


def test_omp_threads_follow_srun_cpu_masks(cluster):
    masked = cluster.srun(
        "-N1", "-n2", "--cpu-bind=mask_cpu:0x1,0x2", *in_container("run.sh", "python", ALLREDUCE)
    )
    assert masked.returncode == 0, masked.stderr
    assert [r["omp_threads"] for r in checks(masked.stdout)] == ["1", "1"]
    unbound = cluster.srun(
        "-N1", "-n1", "-c2", *in_container("run.sh", "python", ALLREDUCE)
    )
    assert [r["omp_threads"] for r in checks(unbound.stdout)] == ["2"]


def test_gpu_bind_local_under_slurm_gres(cluster):
    per_node = cluster.srun(
        "-N1", "-n2", "--gpus-per-node=4",
        *in_container("run.sh", "printenv", "SLURM_PROCID", "CUDA_VISIBLE_DEVICES"),
        env={"XSCALE_GPU_BIND": "local"},
    )
    assert per_node.returncode == 0, per_node.stderr
    pairs = sorted(zip(*[iter(per_node.stdout.split())] * 2, strict=True))
    assert pairs == [("0", "0,1"), ("1", "2,3")]
    per_task = cluster.srun(
        "-N1", "-n2", "--gpus-per-task=1",
        *in_container("run.sh", "printenv", "CUDA_VISIBLE_DEVICES"),
        env={"XSCALE_GPU_BIND": "local"},
    )
    assert per_task.returncode == 0, per_task.stderr
    # The scheduler already gave each task one GPU: run.sh leaves that alone.
    assert sorted(per_task.stdout.split()) == ["0", "1"]


def test_run_profile_wraps_exactly_rank_three(cluster, tmp_path: Path):
    profile_dir = tmp_path / "profiles"
    proc = cluster.srun(
        "-N2", "-n4", "--cpu-bind=none",
        *in_container("run-profile.sh", "python", ALLREDUCE),
        env={"PROFILE_RANKS": "3", "PROFILE_DIR": str(profile_dir)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [r["profiled"] for r in checks(proc.stdout)] == [False, False, False, True]
    # The generic site's default profiler is py-spy: rank 3's flame graph, no other.
    assert sorted(p.name for p in profile_dir.glob("rank*.svg")) == ["rank3.svg"]
    assert (profile_dir / "rank3.svg").read_text().lstrip().startswith("<?xml")


def test_malformed_profile_ranks_fails_every_rank_with_one_line(cluster):
    proc = cluster.srun(
        "-N2", "-n2", *in_container("run-profile.sh", "python", ALLREDUCE),
        env={"PROFILE_RANKS": "5-2"},
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "run-profile.sh: error:" in line]
    assert len(errors) == 2 and "PROFILE_RANKS='5-2'" in errors[0]
    assert "Traceback" not in proc.stderr
    assert "XSCALE_CHECK" not in proc.stdout

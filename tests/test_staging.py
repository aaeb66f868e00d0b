"""jobs/lib/stage and jobs/lib/stage-node: an environment or a data set staged once per node;
and the trainers' own `--stage-tar` (xscale.staging), one unpacker per node.

Without the cluster: the user errors stage refuses before anything is broadcast, and what one
node does with a bad archive or a full target (stage-node, run here as one node would run it).
On the cluster: one 4-node job stages a venv-like tree and a data set, stages again, and imports
from the node-local copy on every rank; a second one stages with one node's /tmp full.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest
from xscale import staging
from xscale.lifecycle import UserError

from tests.conftest import REPO, Cluster

STAGE = REPO / "jobs" / "lib" / "stage"
STAGE_NODE = REPO / "jobs" / "lib" / "stage-node"
NOBODY = 65534
WAIT_S = 600  # a 4-node job waits for the whole virtual cluster to be free


def run(*argv: str | Path, env: dict[str, str] | None = None,
        prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PBS_"))}
    return subprocess.run([*prefix, *map(str, argv)], env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=120, check=False)


def one_error_line(proc: subprocess.CompletedProcess[str], prog: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), proc.stderr
    return lines[0]


def make_tree(root: Path) -> Path:
    """A venv-like tree: site-packages with one package in it."""
    package = root / "site-packages" / "xs_staged_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("VALUE = 42\n")
    return root


def make_archive(tmp_path: Path) -> tuple[Path, str]:
    archive = tmp_path / "env.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(make_tree(tmp_path / "tree"), arcname=".")
    return archive, hashlib.sha256(archive.read_bytes()).hexdigest()


# ---- user errors: one line, exit 2, before anything is broadcast --------------------------------


def test_stage_refuses_a_source_that_does_not_exist(tmp_path):
    proc = run(STAGE, tmp_path / "no-such.tar", env={"SLURM_JOB_ID": "1"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert "does not exist" in one_error_line(proc, "stage")


def test_stage_refuses_a_source_it_cannot_read():
    if shutil.which("setpriv") is None or os.geteuid() != 0:
        pytest.skip("needs root and setpriv to run as another user")
    # pytest's own temporary directories are private to root: nobody could not even look in.
    with tempfile.TemporaryDirectory(dir=REPO / "build") as where:
        Path(where).chmod(0o755)
        archive, _ = make_archive(Path(where))
        archive.chmod(0o600)  # root's, unreadable to nobody
        proc = run(STAGE, archive, prefix=("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                                           "--clear-groups"))
    assert proc.returncode == 2 and proc.stdout == ""
    assert "is not readable" in one_error_line(proc, "stage")


def test_stage_outside_a_job_says_so(tmp_path):
    archive, _ = make_archive(tmp_path)
    proc = run(STAGE, archive)
    assert proc.returncode == 2
    assert "not inside a job" in one_error_line(proc, "stage")


# ---- one node: stage-node publish ---------------------------------------------------------------


def publish(archive: Path, dest: Path, sha: str, size: int = 1 << 20,
            *extra: str) -> tuple[str, ...]:
    proc = run(STAGE_NODE, "publish", archive, dest, "env", sha, str(size), *extra,
               env={"SLURMD_NODENAME": "nid007"})
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout
    return tuple(lines[0].split(" ", 2))


def test_stage_node_publishes_once_then_reuses(tmp_path):
    archive, sha = make_archive(tmp_path)
    dest = tmp_path / "dest"
    copy = tmp_path / "copy.tar"
    shutil.copy(archive, copy)
    assert publish(copy, dest, sha) == ("nid007", "ok", f"{dest}/env published")
    assert not copy.exists()  # the node's copy is memory: gone once unpacked
    assert (dest / "env" / "site-packages" / "xs_staged_pkg" / "__init__.py").is_file()
    assert publish(archive, dest, sha, 1 << 20, "--keep-archive") == (
        "nid007", "ok", f"{dest}/env reused")
    assert archive.exists()  # a shared archive read in place stays
    assert sorted(p.name for p in dest.iterdir()) == [".env.id", "env"]


def test_stage_node_rejects_a_checksum_mismatch_and_publishes_nothing(tmp_path):
    archive, sha = make_archive(tmp_path)
    wrong = hashlib.sha256(b"another archive").hexdigest()
    node, verdict, cause = publish(archive, tmp_path / "dest", wrong, 1 << 20, "--keep-archive")
    assert (node, verdict) == ("nid007", "fail")
    assert cause.startswith("checksum mismatch") and wrong in cause and sha in cause
    assert list((tmp_path / "dest").iterdir()) == []


def test_stage_node_without_space_fails_before_unpacking(tmp_path):
    archive, sha = make_archive(tmp_path)
    node, verdict, cause = publish(archive, tmp_path / "dest", sha, 1 << 60, "--keep-archive")
    assert (node, verdict) == ("nid007", "fail")
    assert re.match(r"no space left in \S+ \(needs \d+ MiB, has \d+ MiB\)$", cause), cause
    assert list((tmp_path / "dest").iterdir()) == []


def test_stage_node_leaves_no_partial_directory_when_tar_fails(tmp_path):
    broken = tmp_path / "broken.tar"
    broken.write_bytes(b"not a tar archive at all" * 100)
    sha = hashlib.sha256(broken.read_bytes()).hexdigest()
    node, verdict, cause = publish(broken, tmp_path / "dest", sha, 4096, "--keep-archive")
    assert (node, verdict) == ("nid007", "fail") and cause.startswith("cannot unpack"), cause
    assert list((tmp_path / "dest").iterdir()) == []


# ---- on the cluster: 4 nodes --------------------------------------------------------------------

# Stages a venv-like tree (a directory) and a data set (a compressed tarball), stages the tree
# again, then every rank imports the package from PYTHONPATH at the staged site-packages and
# reports where it came from and what its node's staging directory holds.
STAGE_JOB = r"""#!/bin/bash
set -euo pipefail
VENV=$("$XSCALE_ROOT/jobs/lib/stage" --name venv "$TREE")
DATA=$("$XSCALE_ROOT/jobs/lib/stage" "$DATA_TAR")
AGAIN=$("$XSCALE_ROOT/jobs/lib/stage" --name venv "$TREE")
printf 'VENV=%s\nDATA=%s\nAGAIN=%s\n' "$VENV" "$DATA" "$AGAIN"
PYTHONPATH=$VENV/site-packages srun python "$PROBE" "$VENV" "$DATA"
"$XSCALE_ROOT/jobs/lib/stage" --clean
"""
PROBE = REPO / "tests" / "programs" / "staged_import_probe.py"
FAIL_JOB = r"""#!/bin/bash
set -euo pipefail
status=0
"$XSCALE_ROOT/jobs/lib/stage" --name venv "$TREE" || status=$?
echo "STATUS=$status"
"""


def sbatch(cluster: Cluster, script: str, tmp_path: Path, env: dict[str, str]) -> str:
    job_file = tmp_path / "job.sh"
    job_file.write_text(script)
    job = cluster.sbatch(job_file, output=tmp_path / "job.out",
                         env={"XSCALE_ROOT": str(REPO), **env},
                         sbatch_options=("--partition=debug", "--nodes=4",
                                         "--ntasks-per-node=2", "--time=00:10:00"),
                         timeout=WAIT_S, cwd=tmp_path)
    assert job.state == "COMPLETED", f"job {job.job_id}: {job.state}\n{job.output}"
    return job.output


def staging_dirs(cluster: Cluster) -> dict[str, list[Path]]:
    return {node: sorted(cluster.node_tmp(node).glob("*-xscale-stage-*")) for node in cluster.nodes}


def test_stage_once_per_node_reuse_and_import_from_the_node_local_copy(cluster, tmp_path):
    tree = make_tree(tmp_path / "venv")
    data = tmp_path / "dataset"
    data.mkdir()
    (data / "labels.txt").write_text("cat-dog\n")
    data_tar = tmp_path / "dataset.tar.gz"
    with tarfile.open(data_tar, "w:gz") as tar:
        tar.add(data, arcname=".")
    before = staging_dirs(cluster)
    out = sbatch(cluster, STAGE_JOB, tmp_path,
                 {"TREE": str(tree), "DATA_TAR": str(data_tar), "PROBE": str(PROBE)})
    paths = dict(re.findall(r"^(VENV|DATA|AGAIN)=(\S+)$", out, re.M))
    dest = Path(paths["VENV"]).parent
    assert re.fullmatch(r"/tmp/\S+-xscale-stage-\d+", str(dest)), paths
    assert paths["DATA"] == f"{dest}/dataset" and paths["AGAIN"] == paths["VENV"]
    assert "stage: venv: reused on 4 nodes" in out  # the second call broadcast nothing
    ranks = [line.split()[1:] for line in out.splitlines() if line.startswith("RANK ")]
    assert len(ranks) == 8, out
    assert {node for node, *_ in ranks} == set(cluster.nodes)
    for _node, module_file, listing, labels in ranks:
        # Imported from the node-local copy; exactly one copy of each, nothing half-done.
        assert module_file == f"{paths['VENV']}/site-packages/xs_staged_pkg/__init__.py"
        assert listing == ".dataset.id,.venv.id,dataset,venv"
        assert labels == "cat-dog"  # the data set, read from the node-local copy
    # stage --clean gave every node's memory back.
    assert staging_dirs(cluster) == before


def test_stage_with_one_node_full_fails_that_node_only_by_name(cluster, tmp_path):
    tree = make_tree(tmp_path / "venv")
    full = "nid003"
    cluster.fault("fill-tmp", full)
    try:
        out = sbatch(cluster, FAIL_JOB, tmp_path, {"TREE": str(tree)})
        job_dest = {node: [d for d in dirs if d.name.endswith(f"-{job_id(out, tmp_path)}")]
                    for node, dirs in staging_dirs(cluster).items()}
    finally:
        cluster.fault("free-tmp", full)
    assert "STATUS=1" in out, out
    failures = re.findall(r"^stage: failed on (\S+): (.*)$", out, re.M)
    assert [node for node, _ in failures] == [full], out
    assert re.search(r"no space|No space left", failures[0][1]), failures
    assert re.search(rf"^stage: exclude: {full}$", out, re.M), out
    # The full node has nothing published; every other node has its one complete copy.
    for node, dirs in job_dest.items():
        published = [p.name for d in dirs for p in d.iterdir()]
        expected = [] if node == full else [".venv.id", "venv"]
        assert sorted(published) == expected, (node, published)
        for d in dirs:
            shutil.rmtree(d)


def job_id(out: str, tmp_path: Path) -> str:
    """The job id the failed staging used, from its work directory in the submit directory."""
    works = list(tmp_path.glob(".xscale-stage-*"))
    assert len(works) == 1, (works, out)
    return works[0].name.rsplit("-", 1)[1]


# ---------------------------------------------------------------------------------------------
# staging: one unpacker per node, the others wait for its marker
# ---------------------------------------------------------------------------------------------


def make_tar(tmp_path: Path, files: int = 50) -> Path:
    src = tmp_path / "src" / "dataset"
    for index in range(files):
        (src / "train" / f"c{index % 3}").mkdir(parents=True, exist_ok=True)
        (src / "train" / f"c{index % 3}" / f"{index}.bin").write_bytes(os.urandom(2048))
    tar_path = tmp_path / "dataset.tar"
    with tarfile.open(tar_path, "w") as archive:
        archive.add(src, arcname="dataset")
    return tar_path


def stage_ranks(tar_path: Path, dest: Path, ranks: list[int], timeout_s: float = 60) -> list:
    """Start the waiting ranks first, then local rank 0: they must wait for its marker."""
    env = dict(os.environ)
    program = REPO / "tests" / "programs" / "stage_tar_rank.py"
    procs = [subprocess.Popen([sys.executable, str(program), str(tar_path), str(dest), str(r),
                               str(timeout_s)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env)
             for r in sorted(ranks, reverse=True)]
    return [(p.wait(timeout=120), p.stdout.read(), p.stderr.read()) for p in procs]


def test_staging_unpacks_once_and_every_local_rank_gets_the_directory(tmp_path):
    tar_path, dest = make_tar(tmp_path), tmp_path / "node-local"
    runs = stage_ranks(tar_path, dest, [0, 1, 2, 3])
    assert [code for code, _, _ in runs] == [0, 0, 0, 0], runs
    assert {out.strip() for _, out, _ in runs} == {str(dest / "dataset")}
    staged = sorted(p.relative_to(dest / "dataset").as_posix()
                    for p in (dest / "dataset").rglob("*.bin"))
    assert len(staged) == 50 and staged[0].startswith("dataset/train/")
    assert not list(dest.glob("*.partial"))
    # A second job on the node finds the marker: nothing is unpacked again.
    first_mtime = (dest / "dataset").stat().st_mtime_ns
    assert staging.stage_tar(tar_path, dest, local_rank=0) == dest / "dataset"
    assert (dest / "dataset").stat().st_mtime_ns == first_mtime


def test_two_unpackers_sharing_one_directory_do_not_collide(tmp_path):
    # Two "nodes" with one /tmp (the virtual cluster), or two jobs of one user on a node.
    tar_path, dest = make_tar(tmp_path, files=200), tmp_path / "shared-tmp"
    runs = stage_ranks(tar_path, dest, [0, 0, 1])
    assert [code for code, _, _ in runs] == [0, 0, 0], runs
    assert len(list((dest / "dataset").rglob("*.bin"))) == 200


def test_a_changed_tarball_is_staged_again(tmp_path):
    tar_path, dest = make_tar(tmp_path, files=3), tmp_path / "node-local"
    staging.stage_tar(tar_path, dest, local_rank=0)
    tar_path = make_tar(tmp_path, files=9)
    staging.stage_tar(tar_path, dest, local_rank=0)
    assert len(list((dest / "dataset").rglob("*.bin"))) == 9


def test_staging_errors_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        staging.stage_tar(tmp_path / "missing.tar", tmp_path / "dest", local_rank=0)
    tar_path = make_tar(tmp_path, files=2)
    with pytest.raises(UserError, match="was not staged .* within 0 s"):
        staging.stage_tar(tar_path, tmp_path / "dest", local_rank=1, timeout_s=0.1, poll_s=0.02)
    broken = tmp_path / "broken.tar"
    broken.write_bytes(b"this is not a tarball" * 100)
    runs = stage_ranks(broken, tmp_path / "dest2", [0, 1], timeout_s=60)
    assert [code for code, _, _ in runs] == [2, 2]
    # The waiting rank learns of the failure from the marker, not from its timeout.
    assert all(err.startswith("stage: error:") and len(err.splitlines()) == 1
               for _, _, err in runs), runs
    assert any("local rank 0 failed" in err for _, _, err in runs)

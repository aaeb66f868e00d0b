"""mnist_ddp.py, imagenet.py, imagenet_deepspeed.py: command lines, user errors, resume and
stop locally, and 4 ranks over the two virtual nodes through srun, the shim and run.sh."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from tests.conftest import torch_extensions
from tests.fixtures.imagefolder import write_imagefolder, write_tar
from tests.fixtures.mnist_idx import write_mnist
from tests.helpers import (
    TRAINING_IMPORTS,
    ForkedRanks,
    block_placed,
    hosted_store,
    rank_records,
    run_forked,
    store_client,
    summary,
    tagged_records,
    wait_for,
    whole_summary_lines,
)
from tests.test_failures import goodput_of, job_fields, job_nodes, past_step, trainer_pids
from tests.test_jobs import check_startup_phases, check_summary, lumi, submit, virtual_env
from tests.test_own_scripts import JOB as OWN_SCRIPT_JOB
from tests.test_own_scripts import (
    STRAGGLER_ENV,
    healed_nid002,  # noqa: F401 (a fixture)
)

REPO = Path(__file__).resolve().parent.parent
MNIST = "python/mnist_ddp.py"
IMAGENET = "python/imagenet.py"
DEEPSPEED = "python/imagenet_deepspeed.py"
IMAGE = "xscale-test.sif"  # ignored by the shim: the host root plays the image
CPU_CONFIG = "python/configs/ds_cpu_z1.json"
# Tiny but learnable: the loss falls clearly within these steps on 4 ranks.
MNIST_TINY = ["--batch-size", "32", "--lr", "0.002", "--epochs", "1000", "--log-every", "4"]
VISION_TINY = ["-a", "resnet18", "--image-size", "32", "-b", "32", "-j", "0", "--lr", "0.01",
               "--epochs", "1000", "-p", "4"]
DS_TINY = ["--deepspeed", "--deepspeed_config", CPU_CONFIG, "-a", "resnet18", "--image-size",
           "32", "-b", "32", "-j", "0", "--epochs", "1000", "-p", "4"]
DS_ENV = {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(torch_extensions())}


@pytest.fixture(scope="module")
def mnist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mnist(tmp_path_factory.mktemp("mnist"), train=2048, test=512)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(an ImageFolder named like the LUMI workshop's data-resnet-small, a tarball of it)."""
    root = tmp_path_factory.mktemp("imagenet")
    folder = write_imagefolder(root / "data-resnet-small")
    return folder, write_tar(folder, root / "data-resnet-small.tar")


def clean_env(**extra: str) -> dict[str, str]:
    """No launcher variables (each test says what it wants), one thread per process."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "NNODES",
            "MASTER_ADDR", "MASTER_PORT", "XSCALE_PROFILED", "XSCALE_TORCH_PROFILER")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", XSCALE_TIMEOUT_S="120", **extra)
    return env


def run_one(*args: str, env: dict[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env or clean_env(),
                          capture_output=True, text=True, timeout=timeout, check=False)


# What a rank of these trainers imports before its first step, once for all of a test's ranks.
TRAINER_IMPORTS = (*TRAINING_IMPORTS, "torchvision")


def start_ranks(world: int, *args: str, extra: dict[str, str] | None = None) -> ForkedRanks:
    """`world` ranks on this machine with torchrun's variables set by hand, as forks of one
    interpreter that imported TRAINER_IMPORTS (tests/helpers.ForkedRanks): the trainer's work
    is seconds, its imports as many. The ranks through srun, run.sh and a fresh interpreter each
    are the cluster tests below. The test hosts their store (helpers.hosted_store)."""
    store = hosted_store(world)
    commands = [([*args], clean_env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                                    LOCAL_WORLD_SIZE=str(world), NODE_RANK="0", NNODES="1",
                                    **store_client(store), **(extra or {})))
                for rank in range(world)]
    return ForkedRanks(commands, REPO, TRAINER_IMPORTS, env=clean_env(), store=store)


def finish(ranks: ForkedRanks, timeout: float = 300) -> tuple[list[int], str, str]:
    results = ranks.results(timeout)
    return ([result.returncode for result in results], "".join(r.stdout for r in results),
            "".join(r.stderr for r in results))


def wait_for_file(folder: Path, pattern: str, ranks: ForkedRanks, timeout: float) -> None:
    """A file matching PATTERN appears in FOLDER while every rank runs; else the ranks are
    stopped and their output shown."""
    def found_or_ended() -> bool:
        return any(folder.glob(pattern)) or not ranks.all_running()

    try:
        wait_for(found_or_ended, timeout, pattern, every=0.1)
    except AssertionError:
        pass  # said below, with the ranks' output
    if not any(folder.glob(pattern)):
        ranks.kill()
        codes, stdout, stderr = finish(ranks, timeout=60)
        raise AssertionError(f"no {pattern} (exit codes {codes}):\n{stdout[-3000:]}\n"
                             f"{stderr[-5000:]}")


def run_ranks(world: int, *args: str, extra: dict[str, str] | None = None):
    return finish(start_ranks(world, *args, extra=extra))


def digests(output: str) -> set[str]:
    return {record["param_digest"] for record in rank_records(output)}


# ---------------------------------------------------------------------------------------------
# Command lines
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Mistakes a user can make: one line, status 2, nothing trained
# ---------------------------------------------------------------------------------------------


def user_error_cases(mnist: Path, folder: Path, tmp: Path) -> list[tuple[list[str], dict, str]]:
    empty = tmp / "empty"
    empty.mkdir(exist_ok=True)
    bad_json = tmp / "bad.json"
    bad_json.write_text("{ not json")
    out = ["--output-dir", str(tmp / "out")]  # each case's own: see user_error_runs
    return [
        ([MNIST, "--data", str(tmp / "nowhere"), *out], {},
         f"mnist_ddp.py: error: --data '{tmp / 'nowhere'}': no such directory"),
        ([MNIST, "--data", str(empty), *out], {},
         f"mnist_ddp.py: error: --data '{empty}': no MNIST IDX files"),
        ([MNIST, "--data", str(mnist), *out], {"RANK": "abc", "WORLD_SIZE": "4"},
         "mnist_ddp.py: error: RANK='abc' is not a whole number"),
        # No accelerator on this machine: asking for one, or for its backend, is an error.
        ([MNIST, "--data", str(mnist), "--gpu", *out], {},
         "mnist_ddp.py: error: a GPU was asked for (--gpu) but torch"),
        ([IMAGENET, str(folder), "--dist-backend", "xccl", *out], {},
         "imagenet.py: error: backend xccl needs an Intel GPU (XPU) and this rank runs on cpu"),
        ([DEEPSPEED, "--deepspeed_config", CPU_CONFIG, str(folder), *out],
         {"XSCALE_BACKEND": "nccl"}, "imagenet_deepspeed.py: error: backend nccl needs a CUDA"),
        ([IMAGENET, *out], {}, "imagenet.py: error: the data set DIR is required"),
        ([IMAGENET, str(tmp / "nowhere"), *out], {},
         f"imagenet.py: error: DIR '{tmp / 'nowhere'}': no such directory"),
        ([IMAGENET, str(empty), *out], {}, f"imagenet.py: error: DIR '{empty}' has no train/"),
        ([IMAGENET, "--stage-tar", str(tmp / "missing.tar"), *out], {},
         f"imagenet.py: error: --stage-tar '{tmp / 'missing.tar'}': no such file"),
        ([IMAGENET, str(folder), "--rank", "1", "--world-size", "2", *out],
         {"RANK": "0", "WORLD_SIZE": "2"},
         "imagenet.py: error: --rank 1 disagrees with RANK=0 from the launcher"),
        ([DEEPSPEED, "--deepspeed_config", str(tmp / "missing.json"), str(folder), *out], {},
         f"imagenet_deepspeed.py: error: --deepspeed_config '{tmp / 'missing.json'}': "
         "no such file"),
        ([DEEPSPEED, "--deepspeed_config", str(bad_json), str(folder), *out], {},
         f"imagenet_deepspeed.py: error: --deepspeed_config '{bad_json}': not valid JSON"),
        # The GPU config on a CPU: DeepSpeed's CPU accelerator has no fp16 (xscale.ds.prepare).
        ([DEEPSPEED, "--deepspeed_config", "python/configs/ds_fp16_z1.json", str(folder), *out],
         {}, "imagenet_deepspeed.py: error: the DeepSpeed config's fp16.enabled asks for fp16"),
        ([IMAGENET, str(folder), *out], {"XSCALE_PEAK_TFLOPS": "0"},
         "imagenet.py: error: XSCALE_PEAK_TFLOPS='0' is not a positive number of TFLOPS"),
    ]


CASE_IDS = ["mnist-no-dir", "mnist-no-idx", "mnist-bad-rank", "mnist-gpu-without-one",
            "imagenet-xccl-without-xpu", "ds-nccl-without-gpu", "imagenet-no-data",
            "imagenet-no-dir", "imagenet-no-train", "imagenet-no-tar", "imagenet-rank-conflict",
            "ds-no-config", "ds-bad-config", "ds-fp16-on-cpu", "imagenet-bad-peak"]


def cpu_trains_fp16() -> bool:
    """What DeepSpeed's CPU accelerator asks before it offers fp16 (is_fp16_supported): oneDNN's
    fp16 kernels, on CPUs with AVX512-FP16 or AMX-FP16 (Sapphire Rapids and later)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


# Cases that are no mistake on this machine: on a CPU with fp16 the fp16 config trains (slowly,
# on oneDNN's reference convolutions), so there is no error line to see; test_ds's
# check_precision test keeps the rule on every CPU.
NOT_MISTAKES_HERE = {"ds-fp16-on-cpu"} if cpu_trains_fp16() else set()


@pytest.fixture(scope="module")
def user_error_runs(mnist_dir, images, tmp_path_factory) -> dict[str, tuple]:
    """Every case run once, each in a folder of its own, as forks of one interpreter that
    imported torch and torchvision (tests/helpers.run_forked): a dozen command lines whose own
    work is a fraction of their imports. Per case id: (the run, the expected line, its folder)."""
    ids, cases, folders = [], [], []
    for index, case_id in enumerate(CASE_IDS):
        if case_id in NOT_MISTAKES_HERE:
            continue
        folder = tmp_path_factory.mktemp(case_id)
        ids.append(case_id)
        cases.append(user_error_cases(mnist_dir, images[0], folder)[index])
        folders.append(folder)
    runs = run_forked([(args, clean_env(**env)) for args, env, _ in cases], REPO,
                      preload=("torch", "torchvision"))
    return {case_id: (proc, expected, folder) for case_id, proc, (_, _, expected), folder
            in zip(ids, runs, cases, folders, strict=True)}


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_user_errors_are_one_line_and_train_nothing(case_id, user_error_runs):
    if case_id in NOT_MISTAKES_HERE:
        pytest.skip("this CPU trains fp16 (oneDNN's AVX512-FP16/AMX-FP16): no mistake here")
    proc, expected, folder = user_error_runs[case_id]
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(expected), proc.stderr
    assert "Traceback" not in proc.stderr
    assert "XSCALE_" not in proc.stdout
    assert not (folder / "out").exists()


# ---------------------------------------------------------------------------------------------
# Local runs: one process, two processes by hand (the launcher's variables, no Slurm)
# ---------------------------------------------------------------------------------------------


def test_nodes_with_different_numbers_of_ranks_stop_every_rank_with_one_line(images):
    """--batch-size is per node (pytorch/examples): with 2 ranks on one node and 1 on another
    the ranks would train batches of 16 and 32, their epochs would end at different steps, and
    their collectives stop matching (gloo's size mismatch, seen on the bed with srun -N2 -n3).
    Every rank stops before training, with one line and status 2."""
    folder, _ = images
    store = hosted_store(3)
    layout = [(0, 0, 2, 0), (1, 1, 2, 0), (2, 0, 1, 1)]  # rank, local rank, its node's ranks, node
    commands = [([IMAGENET, *VISION_TINY, "--max-steps", "2", str(folder)],
                 clean_env(RANK=str(rank), WORLD_SIZE="3", LOCAL_RANK=str(local),
                           LOCAL_WORLD_SIZE=str(on_node), NODE_RANK=str(node), NNODES="2",
                           **store_client(store)))
                for rank, local, on_node, node in layout]
    codes, _, stderr = finish(ForkedRanks(commands, REPO, TRAINER_IMPORTS, env=clean_env(),
                                          store=store), timeout=120)
    assert codes == [2, 2, 2], stderr[-3000:]
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert errors == ["imagenet.py: error: --batch-size is per node and divided among its "
                      "ranks, but the nodes hold 1 to 2 ranks: give every node as many (srun "
                      "--ntasks-per-node)"] * 3, stderr[-3000:]
    assert "Traceback" not in stderr


def test_mnist_one_process_reads_gzip_in_torchvision_layout_and_saves_the_model(tmp_path):
    data_dir = tmp_path / "data"
    write_mnist(data_dir, train=512, test=256, compress=True, torchvision_layout=True)
    assert (data_dir / "MNIST" / "raw" / "train-images-idx3-ubyte.gz").is_file()
    proc = run_one(MNIST, "--data", str(data_dir), "--max-steps", "30", "--modelpath",
                   str(tmp_path / "model"), *MNIST_TINY)
    assert proc.returncode == 0, proc.stderr
    record = summary(proc.stdout)
    assert proc.stdout.rstrip().splitlines()[-1].startswith("XSCALE_SUMMARY ")
    assert (record["world_size"], record["nodes"], record["steps"]) == (1, 1, 30)
    assert record["loss_last"] < 0.5 * record["loss_first"]
    assert record["test_samples"] == 256 and record["accuracy"] > 0.8
    weights = torch.load(tmp_path / "model" / "model_cpu.dat", weights_only=True)
    assert "conv1.weight" in weights  # mnist_DDP.py's state_dict file


@pytest.fixture(scope="module")
def mnist_straight_to_20(mnist_dir, tmp_path_factory) -> set[str]:
    """The parameter digests of a 2-rank run of 20 steps that was never interrupted (how its
    checkpoints are written changes nothing in its weights)."""
    straight = run_ranks(2, MNIST, "--data", str(mnist_dir), *MNIST_TINY, "--max-steps", "20",
                         "--output-dir", str(tmp_path_factory.mktemp("straight")))
    assert straight[0] == [0, 0], straight[2]
    assert len(digests(straight[1])) == 1
    return digests(straight[1])


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_mnist_resume_continues_exactly_where_it_stopped(mnist_dir, mnist_straight_to_20,
                                                         tmp_path, mode):
    base = [MNIST, "--data", str(mnist_dir), *MNIST_TINY]
    saves = {"XSCALE_CHECKPOINT_MODE": mode}
    first = run_ranks(2, *base, "--max-steps", "12", "--checkpoint-every", "5", "--output-dir",
                      str(tmp_path / "a"), extra=saves)
    assert first[0] == [0, 0], first[2]
    assert (tmp_path / "a" / "ckpt-000012.pt").is_file()
    assert summary(first[1])["checkpoints_saved"] == 3  # steps 5, 10 and the last, 12
    resumed = run_ranks(2, *base, "--max-steps", "20", "--output-dir", str(tmp_path / "a"),
                        extra=saves)
    assert resumed[0] == [0, 0], resumed[2]
    record = summary(resumed[1])
    assert (record["start_step"], record["steps"]) == (12, 20)
    # Weights, optimizer, data order and random streams all resumed: bit for bit the same
    # model as the run that was never interrupted.
    assert digests(resumed[1]) == mnist_straight_to_20


def test_a_stop_signal_to_one_rank_stops_all_at_the_same_step_with_a_checkpoint(mnist_dir,
                                                                                tmp_path):
    out = tmp_path / "out"
    ranks = start_ranks(2, MNIST, "--data", str(mnist_dir), *MNIST_TINY, "--max-steps",
                        "100000", "--checkpoint-every", "2", "--output-dir", str(out))
    # Training is under way: a checkpoint, whichever (at 80 steps/s, --keep-checkpoints 3
    # removes ckpt-000002.pt within 0.1 s, quicker than a poll may see it).
    wait_for_file(out, "ckpt-*.pt", ranks, 120)
    os.kill(ranks.pids[1], signal.SIGUSR1)  # Slurm's warning, to one rank only
    codes, stdout, stderr = finish(ranks, timeout=120)
    assert codes == [0, 0], stderr
    record = summary(stdout)
    assert record["stopped_early"] is True
    assert 2 <= record["steps"] < 100000
    ranks = rank_records(stdout)
    assert {r["steps"] for r in ranks} == {record["steps"]}
    assert len(digests(stdout)) == 1
    assert (out / f"ckpt-{record['steps']:06d}.pt").is_file()


def test_imagenet_trains_from_a_tarball_staged_once_per_node(images, tmp_path):
    """Staged once per node, trained with random crops and flips by two DataLoader workers a
    rank; then resumed from the step-3 checkpoint with none: each sample draws the crop and
    flip it drew the first time (xscale.data.SeededSamples), and the run ends with the
    uninterrupted run's weights, to the bit."""
    _, tarball = images
    stage, out = tmp_path / "node-local", tmp_path / "out"
    common = [IMAGENET, *VISION_TINY, "--max-steps", "6", "--stage-tar", str(tarball),
              "--stage-dir", str(stage), "--output-dir", str(out)]
    codes, stdout, stderr = run_ranks(2, *common, "-j", "2", "--checkpoint-every", "3")
    assert codes == [0, 0], stderr
    record = summary(stdout)
    assert (record["world_size"], record["steps"]) == (2, 6)
    assert record["val_samples"] == 32
    assert len(list((stage / "data-resnet-small" / "data-resnet-small" / "train").rglob(
        "*.png"))) == 256
    assert (stage / ".data-resnet-small.staged").is_file()
    assert len(digests(stdout)) == 1
    (out / "ckpt-000006.pt").unlink()
    codes, resumed, stderr = run_ranks(2, *common, "-j", "0")
    assert codes == [0, 0], stderr
    assert summary(resumed)["start_step"] == 3
    assert digests(resumed) == digests(stdout)


def test_imagenet_with_fsdp_shards_every_rank_writes_and_one_rank_resumes_the_same_weights(
        tmp_path):
    """--fsdp (FSDP2, torch's fully_shard) on 2 ranks, two micro-batches a step: each rank
    writes its shard of ckpt-STEP.dcp, and one rank alone (another world size) loads the same
    weights from it. 33 validation images: ranks of 17 and 16 run 2 and 1 batches of 16, and
    an evaluation's forwards are collectives of the sharded model (xscale.vision)."""
    folder = write_imagefolder(tmp_path / "data", classes=3, train=32, val=11)
    out = tmp_path / "out"
    common = [IMAGENET, "--fsdp", *VISION_TINY, "--grad-accum-steps", "2", "--output-dir",
              str(out), str(folder)]
    codes, stdout, stderr = run_ranks(2, *common, "--max-steps", "4", "--checkpoint-every", "2")
    assert codes == [0, 0], stderr[-5000:]
    first = summary(stdout)
    assert (first["steps"], first["accumulation"], first["fsdp"]) == (4, 2, True), first
    assert (first["val_samples"], first["checkpoints_saved"]) == (33, 2), first
    assert stdout.count("xscale: the model is sharded (FSDP2): every rank writes its part") == 1
    assert "live recovery" not in stdout  # no spares here: nothing to say
    assert len(digests(stdout)) == 1  # the whole model, gathered, is one on every rank
    saved = out / "ckpt-000004.dcp"
    sizes = {part.relative_path: (saved / part.relative_path).stat().st_size
             for part in FileSystemReader(str(saved)).read_metadata().storage_data.values()}
    assert set(sizes) == {"__0_0.distcp", "__1_0.distcp"}, sizes
    # Each rank wrote about half of the weights and optimizer state: resnet18's 11 M parameters
    # and their momentum, 90 MB, are 45 MB a rank.
    assert all(30e6 < size < 60e6 for size in sizes.values()), sizes
    codes, alone, stderr = run_ranks(1, *common, "--max-steps", "4")
    assert codes == [0], stderr[-5000:]
    resumed = summary(alone)
    assert (resumed["world_size"], resumed["start_step"], resumed["steps"]) == (1, 4, 4)
    assert digests(alone) == digests(stdout)


# ---------------------------------------------------------------------------------------------
# The virtual cluster: 4 ranks over nid001 and nid002, srun -> shim -> run.sh -> trainer
# ---------------------------------------------------------------------------------------------


def check_run(proc: subprocess.CompletedProcess[str], trainer: str, steps: int | None,
              start_step: int) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(whole_summary_lines(proc.stdout)) == 1  # whole under srun --label, and in its file
    record = summary(proc.stdout)
    assert record["trainer"] == trainer
    assert (record["world_size"], record["nodes"]) == (4, 2)
    assert record["start_step"] == start_step
    if steps is not None:
        assert record["steps"] == steps
    ranks = rank_records(proc.stdout)
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3]
    nodes = set(block_placed(ranks))
    assert {r["steps"] for r in ranks} == {record["steps"]}  # every rank stopped at one step
    assert len({r["param_digest"] for r in ranks}) == 1, ranks  # replicas are identical
    return {**record, "rank_nodes": nodes}


# What a signal that reaches a DataLoader worker or the resource tracker leaves in the output.
SIGNAL_DAMAGE = ("killed by signal", "exited unexpectedly", "Traceback", "leaked semaphore",
                 "KeyError")


def check_stopped(proc: subprocess.CompletedProcess[str], trainer: str) -> dict:
    """USR1 to the whole step: every rank stopped at one step, saved, exited 0, and nothing
    else (no worker, no resource tracker) died of the signal."""
    record = check_run(proc, trainer, None, 0)
    assert (record["stopped_early"], record["signal"]) == (True, "SIGUSR1"), record
    for damage in SIGNAL_DAMAGE:
        assert damage not in proc.stdout + proc.stderr, (damage, proc.stderr[-3000:])
    assert Path(record["checkpoint"]).exists(), record
    assert f"stopped by SIGUSR1 at step {record['steps']}" in proc.stdout
    return record


def srun_args(*command: str) -> list[str]:
    """As the job templates run the training step: --label, whose 1024-byte cut the summary
    line must survive."""
    return ["-N2", "-n4", "--cpu-bind=none", "--label", "singularity", "exec", IMAGE,
            "/runscripts/run.sh", "python", *command]


def srun(cluster, *command: str, env: dict[str, str] | None = None):
    return cluster.srun(*srun_args(*command), env=env)


def srun_stopped(cluster, marker: Path, *command: str, env: dict[str, str] | None = None):
    """The command on two nodes with USR1 to the step (scancel) once `marker` exists."""
    return cluster.srun_signalled(*srun_args(*command), ready=marker.exists, env=env)


def test_mnist_on_two_nodes_stops_on_usr1_to_the_step_and_resumes(cluster, mnist_dir, tmp_path):
    """The time-limit path as Slurm drives it, with 2 DataLoader workers per rank: USR1 to
    every process of the step; all ranks stop at one step, save it, exit 0; the next run
    resumes there, learns on, and evaluates."""
    out = tmp_path / "out"
    args = [MNIST, "--data", str(mnist_dir), *MNIST_TINY, "--workers", "2", "--output-dir",
            str(out), "--checkpoint-every", "4"]
    first = check_stopped(srun_stopped(cluster, out / "ckpt-000008.pt", *args, "--max-steps",
                                       "100000"), "mnist_ddp")
    stopped_at = first["steps"]
    assert first["loss_last"] < 0.5 * first["loss_first"]
    assert "accuracy" not in first  # after a stop the time is for the checkpoint only
    assert Path(first["checkpoint"]) == out / f"ckpt-{stopped_at:06d}.pt"
    # The requeued job: jobs/lumi/mnist.sbatch as shipped (CHECKPOINT_EVERY=auto) picks up the
    # stop's checkpoint by itself, learns on, and evaluates.
    steps = stopped_at + 4
    job = submit(cluster, lumi("mnist.sbatch"), tmp_path, 2, "--lr", "0.002", "--epochs", "1000",
                 "--log-every", "4", "--workers", "2",
                 env=virtual_env(tmp_path, DATA=str(mnist_dir), OUTPUT_DIR=str(out),
                                 BATCH_SIZE="32", MAX_STEPS=str(steps)))
    second = check_summary(job.output, "mnist_ddp", 4, steps=steps)
    ranks = rank_records(job.output)
    check_startup_phases(second["startup"], ranks)
    assert second["start_step"] == stopped_at
    block_placed(ranks)  # ranks 0-1 on one node, 2-3 on another
    assert {r["steps"] for r in ranks} == {steps}
    assert len({r["param_digest"] for r in ranks}) == 1, ranks  # replicas are identical
    assert second["loss_first"] < first["loss_first"]  # it went on from the trained weights
    assert second["accuracy"] > 0.5 and second["test_samples"] == 512
    # A timed save at the first log interval, then Young's interval for 2 nodes
    # (docs/CHECKPOINTS.md), said once.
    auto = re.findall(r"xscale: --checkpoint-every auto: every (\d+) steps .* on 2 node\(s\)",
                      job.output)
    assert len(auto) == 1 and int(auto[0]) >= 1, job.output[-3000:]
    assert second["checkpoints_saved"] >= 1 and second["checkpoint_stall_s"] > 0, second


def srun_one_rank_per_node(cluster, *command: str, env: dict[str, str]) -> dict:
    """COMMAND as 2 ranks on 2 nodes; its summary, after the checks that every run passes.
    One thread each: run.sh would give a lone rank its node's two CPUs, but the bed's virtual
    nodes share this machine's two cores (docs/TESTBED.md)."""
    proc = cluster.srun("-N2", "-n2", "--cpu-bind=none", "--label", "singularity", "exec", IMAGE,
                        "/runscripts/run.sh", "python", *command,
                        env={"OMP_NUM_THREADS": "1", **env})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = summary(proc.stdout)
    assert (record["world_size"], record["nodes"]) == (2, 2)
    assert len({r["node"] for r in rank_records(proc.stdout)}) == 2
    assert len(digests(proc.stdout)) == 1, proc.stdout[-3000:]
    return {**record, "digests": digests(proc.stdout)}


def test_mnist_on_two_nodes_with_every_rank_writing_resumes_bit_for_bit(cluster, mnist_dir,
                                                                         tmp_path):
    """XSCALE_CHECKPOINT_WRITERS=all, a rank on each of 2 nodes: both write their part of
    ckpt-STEP.dcp (torch.distributed.checkpoint, in the background), and the run resumed from it
    ends with the same weights as the run that was never interrupted. Two ranks: with 4 over
    these 2 nodes the resumed run's weights differ from the uninterrupted run's in the last bits
    with rank 0's .pt as well (measured; likely gloo summing four gradients in another order
    once DDP's first step after a start has its buckets laid out anew), while a sum of two is
    the same in any order."""
    args = [MNIST, "--data", str(mnist_dir), *MNIST_TINY]
    every_rank = {"XSCALE_CHECKPOINT_WRITERS": "all"}
    # The uninterrupted run goes beside the interrupted one, on the other CPU of each node.
    with ThreadPoolExecutor(max_workers=1) as beside:
        straight = beside.submit(srun_one_rank_per_node, cluster, *args, "--max-steps", "20",
                                 "--output-dir", str(tmp_path / "b"), env=every_rank)
        first = srun_one_rank_per_node(cluster, *args, "--max-steps", "12", "--checkpoint-every",
                                       "5", "--output-dir", str(tmp_path / "a"), env=every_rank)
        assert (first["steps"], first["checkpoints_saved"]) == (12, 3)
        saved = tmp_path / "a" / "ckpt-000012.dcp"
        assert sorted(path.name for path in (tmp_path / "a").glob("*ckpt-*")) == [
            "ckpt-000005.dcp", "ckpt-000010.dcp", saved.name]
        parts = FileSystemReader(str(saved)).read_metadata().storage_data.values()
        assert {part.relative_path for part in parts} == {"__0_0.distcp", "__1_0.distcp"}
        resumed = srun_one_rank_per_node(cluster, *args, "--max-steps", "20", "--output-dir",
                                         str(tmp_path / "a"), env=every_rank)
    assert (resumed["start_step"], resumed["steps"]) == (12, 20)
    assert resumed["digests"] == straight.result()["digests"]


def test_imagenet_on_two_nodes_with_the_seed_command_line_stops_then_resumes(cluster, images,
                                                                             tmp_path):
    folder, tarball = images
    out = tmp_path / "out"
    # The LUMI workshop's pytorch/examples options, with run.sh filling in each rank's values;
    # -j is per node, as in pytorch/examples: 2 workers for each of the node's 2 ranks.
    workshop_style = ["--world-size", "$WORLD_SIZE", "--rank", "$RANK",
                      "--dist-url", "tcp://$MASTER_ADDR:$MASTER_PORT", "--dist-backend", "gloo"]
    common = [IMAGENET, *VISION_TINY, "-j", "4", "--output-dir", str(out),
              "--checkpoint-every", "2"]
    first = check_stopped(srun_stopped(cluster, out / "ckpt-000004.pt", *common,
                                       *workshop_style, "--max-steps", "100000", str(folder)),
                          "imagenet")
    stopped_at = first["steps"]
    assert first["batch_size"] == 16 and first["global_batch_size"] == 64  # 32 per node
    # The resumed run reads the tarball instead, unpacked by python/xscale/staging into the
    # default node-local directory: once on each of the job's nodes, by its local rank 0.
    second = check_run(srun(cluster, *common, "--max-steps", str(stopped_at + 4),
                            "--stage-tar", str(tarball)), "imagenet", stopped_at + 4, stopped_at)
    assert second["loss_first"] < first["loss_first"]
    assert second["val_samples"] == 32
    copies = {node: sorted(cluster.node_tmp(node).glob("*-xscale-data/data-resnet-small"))
              for node in cluster.nodes}
    for node, found in copies.items():
        assert len(found) == (1 if node in second["rank_nodes"] else 0), copies
        if found:
            staged_root = found[0].parent
            assert (staged_root / ".data-resnet-small.staged").is_file()
            assert not list(staged_root.glob("*.partial"))
            shutil.rmtree(staged_root)


def test_imagenet_with_fsdp_names_a_slowed_node(cluster, healed_nid002, images,  # noqa: F811
                                                tmp_path):
    """--fsdp as a batch job on three nodes, one rank each, DataLoader workers on, nid002
    slowed from the first step: the straggler line names its rank though every rank's forward
    waits for it in FSDP's weight gathers (xscale.observe.stragglers). (FSDP2's stop and resume:
    the host-only test above, and the bed's corrupted snapshot below, whose launch resumes from
    its sharded checkpoint.)"""
    folder, _ = images
    out, output = tmp_path / "out", tmp_path / "job.out"
    # A vote at every step (-p 1): the straggler line after three slowed steps, not six.
    job_id = cluster.submit(OWN_SCRIPT_JOB, IMAGENET, "--fsdp", *VISION_TINY, "-j", "2", "-p",
                            "1", "--output-dir", str(out), "--max-steps", "200", str(folder),
                            output=output, sbatch_options=("--nodes=3", "--nodelist=nid[001-003]",
                                                           "--ntasks-per-node=1"),
                            env={"OUTPUT_DIR": str(out), **STRAGGLER_ENV})
    try:
        # Slowed 85%, not 90%: named at 5.5x the median here, in a third of the seconds.
        cluster.slow_once_training("nid002", out / "xscale-records", 85)
        line = wait_for(lambda: re.search(r"xscale: straggler: .*", output.read_text()), 240,
                        "the straggler line")
    finally:
        subprocess.run(["scancel", job_id], timeout=30, check=False)
    assert "rank 1 on nid002" in line[0], line[0]


def test_imagenet_deepspeed_on_two_nodes_stops_on_usr1_and_resumes(cluster, images, tmp_path):
    """DeepSpeed ZeRO-1 on 2 nodes x 2: USR1 to the step stops every rank at one step with its
    checkpoint; then jobs/lumi/imagenet-deepspeed.sbatch, as a requeued job of it would, resumes
    there and ends as every template's run does (tests/test_jobs.py's check_summary)."""
    folder, _ = images
    out = tmp_path / "out"
    common = [DEEPSPEED, *DS_TINY, "-j", "2", "--output-dir", str(out), "--checkpoint-every",
              "2", str(folder)]
    first = check_stopped(srun_stopped(cluster, out / "latest", *common, "--max-steps",
                                       "100000", env=DS_ENV), "imagenet_deepspeed")
    stopped_at = first["steps"]
    assert (first["zero_stage"], first["dtype"], first["global_batch_size"]) == (1, "float32", 64)
    assert (out / "latest").read_text().strip() == f"global_step{stopped_at}"
    # The template's options for the run above: BATCH_SIZE is per node, WORKERS per rank.
    template = virtual_env(tmp_path, DATA=str(folder), OUTPUT_DIR=str(out), **DS_ENV,
                           DS_CONFIG=str(REPO / CPU_CONFIG), ARCH="resnet18", IMAGE_SIZE="32",
                           BATCH_SIZE="32", WORKERS="2", EPOCHS="1000", CHECKPOINT_EVERY="2",
                           MAX_STEPS=str(stopped_at + 4))
    job = submit(cluster, lumi("imagenet-deepspeed.sbatch"), tmp_path, 2, env=template)
    second = check_summary(job.output, "imagenet_deepspeed", 4, steps=stopped_at + 4)
    assert second["start_step"] == stopped_at
    assert second["loss_first"] < first["loss_first"]
    ranks = rank_records(job.output)
    block_placed(ranks)  # ranks 0-1 on one node, 2-3 on another
    assert {r["steps"] for r in ranks} == {stopped_at + 4}
    assert len({r["param_digest"] for r in ranks}) == 1, ranks  # replicas are identical


def test_imagenet_with_fsdp_outlives_a_crashed_node_then_refuses_a_corrupted_snapshot(
        cluster, images, tmp_path):
    """--fsdp on two nodes, one rank each, and two spares: no rank holds another's shard, so
    every 4 steps each rank's shard goes to host memory and to its buddy on the other node
    (XSCALE_SNAPSHOT_EVERY), and every 4 steps a checkpoint is written. The second node crashed
    mid-run: a spare's rank takes the lost shard from its buddy, rank 0 keeps its process and
    rolls back to the snapshot's step (at most 4 steps redone), nobody reads a checkpoint.
    Then, once a later snapshot and checkpoint are there, a byte is flipped in every snapshot
    rank 0 holds in memory (fault.sh corrupt-snapshots: its own and rank 1's), and the node
    that took rank 1 crashes: the copies fail their CRC-32, every rank says so in one line,
    nothing is loaded, that node is blamed, and the launch starts again on the other spare from
    the newest checkpoint, to the end, in the same allocation."""
    folder, _ = images
    steps = 20
    corruption, out = {}, tmp_path / "out"

    def corrupt_then_crash(nodes: list[str], replacement: str, went_on: int) -> str:
        newer = out / f"ckpt-{went_on + 4:06d}.dcp"  # its snapshot's exchange ended before it
        wait_for(newer.exists, 300, "a checkpoint after the recovery")
        corruption["text"] = cluster.fault("corrupt-snapshots", nodes[0])
        cluster.fault("crash", replacement)
        return replacement

    text = crashed_under_snapshots(cluster, tmp_path, IMAGENET, "--fsdp", *VISION_TINY, "-b",
                                   "8", "--checkpoint-every", "4", "--max-steps", str(steps),
                                   str(folder), training_nodes=2, spares=2,
                                   then=corrupt_then_crash)
    assert re.search(r"corrupted the snapshots of steps \[\d+, \d+", corruption["text"]), \
        corruption  # its own and its partner's, of one snapshot or two
    refused = re.search(r"live recovery is not possible \(the snapshot of rank \d at step (\d+) "
                        r"fails its checksum: it is not loaded", text)
    assert refused, text[-4000:]
    assert "lost during the launch; its live recovery fell back" in text, text[-4000:]
    relaunched = text.rpartition("xscale: restart 1 of")[2]
    second = tagged_records(relaunched, "XSCALE_SUMMARY")[-1]
    assert second["start_step"] > 4 and second["start_step"] % 4 == 0, second
    assert second["steps"] == steps and second["world_size"] == 2, second
    print(f"refused the snapshot of step {refused[1]}; resumed from step "
          f"{second['start_step']}: {corruption['text'].strip()}")


def noted(progress: Path, event: str) -> bool:
    """Whether rank 0 noted EVENT in PROGRESS (xscale.observe.progress)."""
    lines = progress.read_text().splitlines() if progress.exists() else []
    return any(f'"event": "{event}"' in line for line in lines)


def test_imagenet_deepspeed_outlives_a_crashed_node_from_peer_snapshots(cluster, images,
                                                                         tmp_path):
    """DeepSpeed ZeRO-1 (ds_cpu_z1.json, the seeds' exercise) on three nodes, one rank each,
    and a spare: each rank holds its own partition of the fp32 weights and of Adam's state,
    copied every 4 steps to its buddy on the next node. nid002 crashed mid-run: as under FSDP2
    above, the spare's rank takes the lost partition from its buddy and the survivors roll back
    in place, the engine's counters and scheduler with them. (That the weights then end as an
    uninterrupted run's, for ZeRO stages 1 and 3: tests/test_recovery.py, on real processes.
    ZeRO-3 ran here too until its 45-60 s on the suite's longest path outweighed what it adds
    to that test: the same kind, snapshots and hand-over, through this trainer and srun.)"""
    folder, _ = images
    steps = 12
    config = ["--deepspeed_config", "python/configs/ds_cpu_z1.json"]
    text = crashed_under_snapshots(cluster, tmp_path, DEEPSPEED, *DS_TINY, *config, "-b", "16",
                                   "-j", "1", "--max-steps", str(steps), str(folder), **DS_ENV)
    summary = tagged_records(text, "XSCALE_SUMMARY")[-1]
    assert summary["steps"] == steps and summary["zero_stage"] == 1, summary


def crashed_under_snapshots(cluster, tmp_path: Path, *command: str, training_nodes: int = 3,
                            spares: int = 1, then: Callable[[list[str], str, int], str] | None
                            = None, **env: str) -> str:
    """COMMAND (a trainer and its arguments, writing to tmp_path/out) as a batch job on
    TRAINING_NODES nodes, one rank each, and SPARES spares, a peer snapshot every 4 steps; the
    second node crashed once training is past the first snapshot. What every sharded kind's
    live recovery must show: the spare in the lost node's place, no checkpoint read, rank 0
    the same process, training gone on from a snapshot's step, the snapshots (and, without
    THEN, at most 4 steps redone) in the goodput ledger, the job completed in its allocation.
    THEN(nodes, the replacement's node, the step gone on from), while the job runs after the
    recovery: a second fault; it returns the node to heal. The job's output."""
    out, output = tmp_path / "out", tmp_path / "job.out"
    job_id = cluster.submit(OWN_SCRIPT_JOB, *command, "--output-dir", str(out), output=output,
                            sbatch_options=(f"--nodes={training_nodes + spares}",
                                            "--ntasks-per-node=1", "--no-kill"),
                            env={"OUTPUT_DIR": str(out), "XSCALE_SPARES": str(spares),
                                 "XSCALE_SNAPSHOT_EVERY": "4", "OMP_NUM_THREADS": "1", **env})
    progress = out / "xscale-records" / "attempt0-launch1.progress"
    crashed: list[str] = []
    try:
        nodes = job_nodes(job_id)  # the last SPARES are the spares
        # Past the first snapshot's step: its exchange, in the background, is over.
        wait_for(lambda: past_step(progress, 5), 300, "training past the first snapshot")
        before = trainer_pids(job_id)
        crashed.append(nodes[1])
        crashed_at = time.monotonic()
        cluster.fault("crash", nodes[1])
        went_on = wait_for(lambda: re.search(r"training goes on at step (\d+)",
                                             output.read_text()), 120, "the live recovery")
        recovered_s = time.monotonic() - crashed_at
        after = trainer_pids(job_id)
        replacement = re.search(rf"xscale: live recovery: (\S+) in place of {nodes[1]}",
                                output.read_text())
        assert replacement and replacement[1] in nodes[training_nodes:], output.read_text()
        if then is not None:
            crashed.append(then(nodes, replacement[1], int(went_on[1])))
        state = cluster.wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, 300)
    finally:
        subprocess.run(["scancel", job_id], timeout=30, check=False)
        if crashed:
            cluster.fault("heal", *crashed)
    text = output.read_text()
    assert state == "COMPLETED" and job_fields(job_id)["Restarts"] == "0", text[-4000:]
    live = text.partition("xscale: restart 1 of")[0]  # the launch that recovered live
    assert "resuming from" not in live and "live recovery is off" not in live, live[-4000:]
    assert int(went_on[1]) % 4 == 0 and int(went_on[1]) >= 4, went_on[0]
    survivors = [rank for rank in before if rank != 1]
    assert all(after[rank] == before[rank] for rank in survivors), (before, after)
    ledger = goodput_of(text)
    assert ledger["snapshots_s"] > 0 and (then or ledger["lost_steps"] <= 4), ledger
    print(f"{nodes[1]} crashed: {went_on[0]}, {recovered_s:.1f} s after the crash; "
          f"goodput: {ledger['text']}")
    return text

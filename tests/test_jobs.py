"""Job templates: jobs/lumi/*.sbatch and jobs/local/*.sbatch on the virtual Slurm cluster, and
jobs/aurora/*.pbs with a stand-in mpiexec.

The LUMI templates run here unchanged. What the virtual cluster lacks is overridden the way a user
would: sbatch options on the command line (they win over #SBATCH lines) for the allocation, and the
templates' parameters from the environment for the rest (CPU masks for 2-CPU nodes, binds that
exist, CPU training, tiny data, a few steps).
"""

from __future__ import annotations

import json
import math
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

from tests.conftest import ENDED, REPO, VENV_BIN, Job, tool_env
from tests.helpers import check_summary_schema, env_lines, rank_records, wait_for

LUMI = sorted((REPO / "jobs" / "lumi").glob("*.sbatch"))
LOCAL = sorted((REPO / "jobs" / "local").glob("*.sbatch"))
AURORA = sorted((REPO / "jobs" / "aurora").glob("*.pbs"))
CPU_MASKS = REPO / "jobs" / "lib" / "cpu-masks"
# ALCF's CPU binding for training with all 12 tiles: four cores per rank ("PyTorch on Aurora").
ALCF_TRAINING_CPU_LIST = "4-7:8-11:12-15:16-19:20-23:24-27:56-59:60-63:64-67:68-71:72-75:76-79"
# Aurora's queues: nodes allowed (ALCF "Running jobs on Aurora").
AURORA_QUEUES = {"debug": (1, 2), "debug-scaling": (2, 256), "prod": (256, 10624),
                 "capacity": (1, 16)}
USER = pwd.getpwuid(os.getuid()).pw_name
MAX_STEPS = 3
# Each real run is bounded twice: by the job's own time limit, and by how long we wait for it.
# Longer than the templates' --signal=B:USR1@300 warning plus Slurm's 30 s checking period: a
# shorter limit gets the warning as the job starts (see jobs/lib/time-limit.sh).
JOB_TIME = "--time=00:10:00"
WAIT_S = 300


def lumi(name: str) -> Path:
    return REPO / "jobs" / "lumi" / name


def ids(path: Path) -> str:
    return f"{path.parent.name}/{path.name}"


# Checks that report and end, with no training to stop at a time limit and requeue: the smoke
# test, and the GPU acceptance test (one task that starts its ranks with torchrun).
ONE_SHOT = {"smoke.sbatch", "gpu-check.sbatch"}


# ---------------------------------------------------------------------------------------------
# What every template must look like (static)
# ---------------------------------------------------------------------------------------------


def test_there_are_the_lumi_templates_the_scenarios_need():
    assert {p.name for p in LUMI} >= {
        "smoke.sbatch", "mnist.sbatch", "gpt-neo-1node.sbatch", "gpt-neo.sbatch",
        "gpt-neo-profile.sbatch", "imagenet.sbatch", "imagenet-deepspeed.sbatch",
        "imagenet-prestage.sbatch", "imagenet-miopen-cache.sbatch", "gpu-check.sbatch",
        "train.sbatch",
    }
    assert AURORA


def sbatch_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("#SBATCH")]


def sbatch_option(text: str, name: str) -> str | None:
    for line in sbatch_lines(text):
        match = re.match(rf"#SBATCH --{name}(?:=(\S+))?(\s|$)", line)
        if match:
            return match.group(1) or ""
    return None


@pytest.mark.parametrize("path", LUMI, ids=ids)
def test_lumi_template_asks_for_lumi_g(path: Path):
    """What sbatch reads from the header: LUMI-G's partitions and layout, a placeholder account,
    and, for the training templates, the time-limit warning that lets them stop and requeue."""
    text = path.read_text()
    assert text.startswith("#!/bin/bash\n")
    assert sbatch_option(text, "partition") in {"standard-g", "small-g"}
    assert sbatch_option(text, "gpus-per-node") == "8"
    assert sbatch_option(text, "ntasks-per-node") == "8"
    assert sbatch_option(text, "account") is not None
    if path.name not in ONE_SHOT:  # a check has no time limit to outlive
        assert re.fullmatch(r"B:USR1@\d+", sbatch_option(text, "signal") or "")
        assert sbatch_option(text, "requeue") == ""
        assert sbatch_option(text, "open-mode") == "append"


# ---------------------------------------------------------------------------------------------
# The LUMI templates run here with stand-ins for srun and scontrol (no cluster): what each srun
# gets, what stops a job before srun, and the time-limit path
# ---------------------------------------------------------------------------------------------

# srun: tests/programs/fake_srun.py (it records each call; the training step can wait for USR1).
FAKE_SRUN = REPO / "tests" / "programs" / "fake_srun.py"
FAKE_SCONTROL = r"""#!/bin/bash
if [[ $1 == show && $2 == hostnames ]]; then printf 'nid001\nnid002\n'; exit 0; fi
printf '%s\n' "$*" >>"$FAKE_LOG/scontrol"
"""
# sbcast to the two nodes: they share this machine's disk, so one copy stands for both.
FAKE_SBCAST = r"""#!/bin/bash
printf '%s\n' "$*" >>"$FAKE_LOG/sbcast"
cp -- "${@: -2:1}" "${@: -1}"
"""
LUMI_HOST_STACK = {"/var/spool/slurmd", "/opt/cray", "/usr/lib64/libcxi.so.1",
                   "/usr/lib64/libjansson.so.4"}
LUMI_FILE_SYSTEMS = {"/pfs", "/scratch", "/projappl", "/project", "/flash", "/appl"}


def stub_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    shutil.copy(FAKE_SRUN, bin_dir / "srun")
    for name, body in (("scontrol", FAKE_SCONTROL), ("sbcast", FAKE_SBCAST)):
        (bin_dir / name).write_text(body)
    for name in ("srun", "scontrol", "sbcast"):
        (bin_dir / name).chmod(0o755)
    (tmp_path / "log").mkdir(exist_ok=True)
    return bin_dir


def template_inputs(tmp_path: Path) -> dict[str, str]:
    """What a user provides: an image, data, a tarball of it."""
    sif = tmp_path / "image.sif"
    sif.write_bytes(b"SIF")
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    tarball = tmp_path / "data.tar"
    with tarfile.open(tarball, "w") as tar:
        tar.add(data, arcname="data-resnet-small")
    return {"SIF": str(sif), "DATA": str(data), "DATA_TAR": str(tarball)}


# The template for a script of one's own runs the command it is given.
COMMANDS = {"train.sbatch": ["python", "-u", "train.py", "--epochs", "3"]}


def run_template(path: Path, tmp_path: Path, command: list[str] | None = None,
                 **extra: str) -> subprocess.Popen[str]:
    env = {
        "PATH": os.pathsep.join([str(stub_bin(tmp_path)), "/usr/bin", "/bin"]),
        "HOME": str(tmp_path), "FAKE_LOG": str(tmp_path / "log"),
        "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_ID": "77", "SLURM_JOB_USER": USER,
        "SLURM_JOB_NODELIST": "nid[001-002]", "SLURM_JOB_NUM_NODES": "2",
        "XSCALE_ROOT": str(REPO), "MIOPEN_CACHE_TAR": str(tmp_path / "miopen.tar"),
        "MIOPEN_USER_DB_PATH": str(tmp_path / "miopen"), "STAGE_DIR": str(tmp_path / "stage"),
        **extra,
    }
    argv = ["bash", str(path), *(COMMANDS.get(path.name, []) if command is None else command)]
    return subprocess.Popen(argv, cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def srun_calls(tmp_path: Path) -> list[dict]:
    log = tmp_path / "log" / "srun"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


@pytest.mark.parametrize("path", LUMI, ids=ids)
def test_lumi_training_step_gets_masks_binds_and_run_sh(path: Path, tmp_path: Path):
    inputs = template_inputs(tmp_path)
    code, err = finish(run_template(path, tmp_path, **inputs))
    assert code == 0, err
    calls = srun_calls(tmp_path)
    steps = [c for c in calls if any(re.search(r"^/runscripts/run(-profile)?\.sh$", a)
                                     for a in c["argv"])]
    assert steps, calls
    lumi_masks = subprocess.run([str(CPU_MASKS), "lumi"], capture_output=True, text=True,
                                check=True).stdout.strip()
    for step in steps:
        argv = step["argv"]
        # A dead rank ends the step; the first node is the rendezvous, found outside.
        assert "--kill-on-bad-exit=1" in argv
        assert step["MASTER_ADDR"] == "nid001"
        exec_at = argv.index("singularity")
        assert argv[exec_at:exec_at + 3] == ["singularity", "exec", "-B"]
        binds = set(argv[exec_at + 3].split(","))
        assert argv[exec_at + 4] == inputs["SIF"]
        assert argv[exec_at + 5] in {"/runscripts/run.sh", "/runscripts/run-profile.sh"}
        assert argv[exec_at + 6] == "python"
        # LUMI's file systems (links into /pfs) and the checkout; across nodes the Slingshot stack.
        assert LUMI_FILE_SYSTEMS | {str(REPO), f"{REPO}/runscripts:/runscripts"} <= binds
        if sbatch_option(path.read_text(), "nodes") != "1":
            assert LUMI_HOST_STACK <= binds
        # Each rank on its GCD's CCD: the masks cpu-masks prints for LUMI (the smoke test's first
        # step runs one task per node, unmasked; the GPU check is one task with the node's cores).
        if f"--cpu-bind=mask_cpu:{lumi_masks}" not in argv:
            assert path.name in ONE_SHOT, argv
            assert {"--ntasks-per-node=1", "--ntasks=1"} & set(argv), argv
    assert "bash" not in {a for c in calls for a in c["argv"]}  # no per-rank `bash -c` strings


@pytest.mark.parametrize("path", LUMI, ids=ids)
def test_lumi_template_without_an_image_stops_before_srun(path: Path, tmp_path: Path):
    inputs = template_inputs(tmp_path)
    del inputs["SIF"]
    code, err = finish(run_template(path, tmp_path, **inputs))
    assert code == 2
    assert err.strip().splitlines() == [err.strip()] and err.startswith("xscale: error: SIF ")
    assert srun_calls(tmp_path) == []


def test_lumi_train_template_runs_the_command_it_is_given_and_none_is_one_line(tmp_path: Path):
    """jobs/lumi/train.sbatch, for a script of one's own: its command on every rank, after
    run.sh, with OUTPUT_DIR exported for xscale.prepare; without a command, one line, exit 2,
    before srun."""
    code, err = finish(run_template(lumi("train.sbatch"), tmp_path, **template_inputs(tmp_path)))
    assert code == 0, err
    step = next(c for c in srun_calls(tmp_path) if "/runscripts/run.sh" in c["argv"])
    run_sh = step["argv"].index("/runscripts/run.sh")
    assert step["argv"][run_sh + 1:] == COMMANDS["train.sbatch"], step["argv"]
    assert step["OUTPUT_DIR"] == f"{tmp_path}/train-output/77", step
    none = tmp_path / "none"
    none.mkdir()
    code, err = finish(run_template(lumi("train.sbatch"), none, [], **template_inputs(none)))
    assert code == 2 and err.strip() == "xscale: error: no command: sbatch train.sbatch python " \
        "-u YOUR_SCRIPT.py ARGS...", err
    assert srun_calls(none) == []


NEEDS_DATA = [p for p in LUMI if p.name in {"mnist.sbatch", "imagenet.sbatch",
                                          "imagenet-deepspeed.sbatch",
                                          "imagenet-miopen-cache.sbatch"}]


@pytest.mark.parametrize("path", NEEDS_DATA, ids=ids)
def test_lumi_data_the_container_cannot_see_stops_before_srun(path: Path, tmp_path: Path):
    # A link in a visible directory (/tmp) to a file system that is not bound: the trainer would
    # find a dangling link inside the container, as with /scratch/<project> without /pfs on LUMI.
    if not Path("/dev/shm").is_dir():
        pytest.skip("needs /dev/shm as a directory outside the binds")
    outside = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="xscale-data-"))
    try:
        link = tmp_path / "data-link"
        link.symlink_to(outside)
        inputs = {**template_inputs(tmp_path), "DATA": str(link)}
        code, err = finish(run_template(path, tmp_path, **inputs))
    finally:
        shutil.rmtree(outside, ignore_errors=True)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "DATA=" in err and "BINDS" in err, err
    assert srun_calls(tmp_path) == []
    # Missing altogether: one line that names the variable.
    inputs = {**template_inputs(tmp_path), "DATA": str(tmp_path / "no-such-data")}
    code, err = finish(run_template(path, tmp_path, **inputs))
    assert code == 2 and "DATA=" in err and "does not exist" in err, err
    assert srun_calls(tmp_path) == []


@pytest.mark.parametrize("path", [p for p in LUMI if p.name not in ONE_SHOT], ids=ids)
def test_lumi_template_stops_and_requeues_at_the_time_limit(path: Path, tmp_path: Path):
    """Slurm's USR1 warning to the batch shell reaches the training step, and after the step's
    clean stop the job requeues itself (jobs/lib/time-limit.sh; for real: test_failures.py)."""
    proc = run_template(path, tmp_path, FAKE_SRUN_WAIT="1", **template_inputs(tmp_path))
    started = tmp_path / "log" / "step-started"
    wait_for(lambda: started.exists() or proc.poll() is not None, 60, "the step to start", 0.05)
    assert started.exists(), finish(proc)
    proc.send_signal(signal.SIGUSR1)
    code, err = finish(proc)
    assert code == 0, err
    assert (tmp_path / "log" / "step-signals").read_text().split() == ["USR1"]
    assert (tmp_path / "log" / "scontrol").read_text().split() == ["requeue", "77"]


def test_lumi_gpu_check_is_one_task_in_the_image_that_writes_into_the_checkout(tmp_path: Path):
    """The GPU acceptance test: one task with all the node's cores (it starts its own ranks),
    run.sh's environment, its results under build/gpu-check/JOBID; a pytorch/examples checkout
    the image cannot see stops it before srun, as data does."""
    examples = tmp_path / "examples"
    (examples / "imagenet").mkdir(parents=True)
    code, err = finish(run_template(lumi("gpu-check.sbatch"), tmp_path,
                                    XSCALE_EXAMPLES_DIR=str(examples), **template_inputs(tmp_path)))
    assert code == 0, err
    [step] = srun_calls(tmp_path)
    argv = step["argv"]
    assert {"--ntasks=1", "--cpus-per-task=56", "--kill-on-bad-exit=1"} <= set(argv), argv
    at = argv.index("/runscripts/run.sh")
    assert argv[at + 1:] == ["python", f"{REPO}/tests/gpu/gpu_check.py",
                             "--out", f"{REPO}/build/gpu-check/77"]
    again = tmp_path / "again"
    again.mkdir()
    code, err = finish(run_template(lumi("gpu-check.sbatch"), again,
                                    XSCALE_EXAMPLES_DIR=str(tmp_path / "nowhere"),
                                    **template_inputs(again)))
    assert code == 2 and "XSCALE_EXAMPLES_DIR=" in err and len(err.strip().splitlines()) == 1, err
    assert srun_calls(again) == []


PRESTAGE = lumi("imagenet-prestage.sbatch")


def training_step(tmp_path: Path) -> dict:
    return next(c for c in srun_calls(tmp_path) if "/runscripts/run.sh" in c["argv"])


def test_lumi_prestage_mounts_a_squashfs_environment_at_user_software(tmp_path: Path):
    """The LUMI AI Guide's form: one squashfs file per environment, mounted by Singularity (the
    test bed's shim cannot mount squashfs, so only what srun receives is checked)."""
    sqsh = tmp_path / "env.sqsh"
    sqsh.write_bytes(b"hsqs")
    code, err = finish(run_template(PRESTAGE, tmp_path, ENV_SQSH=str(sqsh),
                                    **template_inputs(tmp_path)))
    assert code == 0, err
    step = training_step(tmp_path)
    binds = step["argv"][step["argv"].index("-B") + 1].split(",")
    assert f"{sqsh}:/user-software:image-src=/" in binds
    assert step["SINGULARITYENV_PREPEND_PATH"] == "/user-software/bin"


def test_lumi_prestage_stages_a_venv_and_puts_its_site_packages_first(tmp_path: Path):
    site = tmp_path / "venv" / "lib" / "python3.12" / "site-packages"
    site.mkdir(parents=True)
    (site / "extra.py").write_text("")
    code, err = finish(run_template(PRESTAGE, tmp_path, ENV_DIR=str(tmp_path / "venv"),
                                    **template_inputs(tmp_path)))
    assert code == 0, err
    staged = tmp_path / "stage" / "user-env" / "lib" / "python3.12" / "site-packages"
    assert training_step(tmp_path)["SINGULARITYENV_PYTHONPATH"].split(":")[0] == str(staged)
    # The venv and the data, each broadcast once; nothing left on the "nodes" afterwards.
    assert len((tmp_path / "log" / "sbcast").read_text().splitlines()) == 2
    assert not (tmp_path / "stage").exists()


def test_lumi_prestage_with_a_missing_environment_stops_before_srun(tmp_path: Path):
    code, err = finish(run_template(PRESTAGE, tmp_path, ENV_SQSH=str(tmp_path / "no.sqsh"),
                                    **template_inputs(tmp_path)))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "ENV_SQSH=" in err, err
    assert srun_calls(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# sbatch --test-only: the scheduler accepts every template
# ---------------------------------------------------------------------------------------------

# The virtual cluster: partition debug, 2 nodes of 2 CPUs and 4 (fake) GPUs, no accounting.
VIRTUAL = ("--partition=debug", "--account=xscale-test", "--ntasks-per-node=2",
           "--gpus-per-node=4", JOB_TIME)


def sbatch_test_only(path: Path, *options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sbatch", "--test-only", *options, str(path)], cwd=REPO, capture_output=True,
        text=True, timeout=60, check=False,
    )


@pytest.mark.parametrize("path", LUMI, ids=ids)
def test_lumi_template_is_accepted_with_the_virtual_clusters_options(cluster, path: Path):
    nodes = "--nodes=1" if sbatch_option(path.read_text(), "nodes") == "1" else "--nodes=2"
    proc = sbatch_test_only(path, *VIRTUAL, nodes)
    assert proc.returncode == 0, proc.stderr
    assert "to start at" in proc.stderr


@pytest.mark.parametrize("path", LUMI, ids=ids)
def test_lumi_template_asks_for_lumis_partition(cluster, path: Path):
    # Unchanged, the header asks for LUMI-G, which the virtual cluster does not have.
    proc = sbatch_test_only(path)
    assert proc.returncode != 0
    assert "invalid partition" in proc.stderr.lower()


def test_lumi_job_with_data_outside_the_binds_fails_before_any_step(cluster, tmp_path):
    """On the real scheduler: the batch script stops with one line and exit 2, and Slurm ran no
    step (srun never started)."""
    outside = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="xscale-data-"))
    try:
        link = tmp_path / "data-link"
        link.symlink_to(outside)
        output = tmp_path / "mnist.out"
        proc = subprocess.run(
            ["sbatch", "--parsable", "-o", str(output), *VIRTUAL, "--nodes=2",
             str(lumi("mnist.sbatch"))],
            cwd=REPO, env=tool_env(virtual_env(tmp_path, DATA=str(link))),
            capture_output=True, text=True, timeout=60, check=False,
        )
        assert proc.returncode == 0, proc.stderr
        job_id = proc.stdout.strip().split(";")[0]
        cluster.wait_state(job_id, ENDED, WAIT_S)
    finally:
        shutil.rmtree(outside, ignore_errors=True)
    state, exit_code = cluster.job_state(job_id)
    assert (state, exit_code) == ("FAILED", "2:0")
    text = output.read_text()
    errors = [line for line in text.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("xscale: error: DATA="), text
    # Rank 0 announces itself when run.sh starts: no rank ever did.
    assert "xscale: launcher=" not in text


@pytest.mark.parametrize("path", LOCAL, ids=ids)
def test_local_template_is_accepted_as_it_is(cluster, path: Path):
    proc = sbatch_test_only(path)
    assert proc.returncode == 0, proc.stderr
    assert "to start at" in proc.stderr


# ---------------------------------------------------------------------------------------------
# Real runs, one at a time (2 cores): tiny data, a few steps, CPU and gloo
# ---------------------------------------------------------------------------------------------


def virtual_masks(tasks_per_node: int = 2) -> str:
    cores = str(2 // tasks_per_node)
    proc = subprocess.run(
        [str(CPU_MASKS), "--cores-per-task", cores, "--tasks", str(tasks_per_node)],
        capture_output=True, text=True, check=True,
    )
    return proc.stdout.strip()


def virtual_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The templates' parameters for the virtual cluster: what exists here instead of LUMI's."""
    image = tmp_path / "xscale-test.sif"  # the shim ignores the image, but SIF must name a file
    image.touch()
    env = {
        "SIF": str(image),
        "CPU_MASKS": virtual_masks(),
        "BINDS": f"{REPO},{REPO}/runscripts:/runscripts,{tmp_path}",
        "USE_GPU": "0",
        "DIST_BACKEND": "gloo",
        "MAX_STEPS": str(MAX_STEPS),
        "OUTPUT_DIR": str(tmp_path / "output"),
    }
    env.update(extra)
    return env


def submit(cluster, path: Path, tmp_path: Path, nodes: int, *args: str,
           tasks_per_node: int = 2, env: dict[str, str] | None = None) -> Job:
    """Submit PATH with the virtual cluster's options, wait for it to end, expect COMPLETED."""
    job = cluster.sbatch(path, *args, env=env, output=tmp_path / f"{path.stem}.out",
                         sbatch_options=(*VIRTUAL, f"--nodes={nodes}",
                                         f"--ntasks-per-node={tasks_per_node}"),
                         timeout=WAIT_S)
    assert job.state == "COMPLETED", \
        f"job {job.job_id}: {job.state} {job.exit_code}\n{job.output[-6000:]}"
    return job


def check_summary(output: str, trainer: str, world_size: int, steps: int = MAX_STEPS) -> dict:
    # A healthy run: no rank's own work is twice the median's (xscale.observe.stragglers).
    assert "xscale: straggler:" not in output, output[-3000:]
    record = check_summary_schema(output, trainer)
    assert record["world_size"] == world_size
    assert record["steps"] == steps
    for key in ("loss_first", "loss_last", "seconds"):
        assert math.isfinite(float(record[key])), (key, record)
    ranks = rank_records(output)
    assert len(ranks) == world_size, ranks
    return record


@pytest.fixture(scope="module")
def mnist_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mnist")
    subprocess.run([sys.executable, "tests/fixtures/mnist_idx.py", str(out)], cwd=REPO,
                   check=True, capture_output=True, timeout=120)
    return out


@pytest.fixture(scope="module")
def imagenet_data(tmp_path_factory) -> tuple[Path, Path]:
    """(ImageFolder named like the LUMI workshop's data-resnet-small, a tarball of it)."""
    root = tmp_path_factory.mktemp("imagenet")
    folder = root / "data-resnet-small"
    subprocess.run([sys.executable, "tests/fixtures/imagefolder.py", str(folder)], cwd=REPO,
                   check=True, capture_output=True, timeout=120)
    tarball = root / "data-resnet-small.tar"
    with tarfile.open(tarball, "w") as tar:
        tar.add(folder, arcname=folder.name)
    return folder, tarball


# Tiny GPT-neo: short sequences, no evaluation or sample generation, nothing saved mid-run.
GPT_TINY = ("--max-length", "64", "--eval-steps", "1000", "--save-steps", "1000",
            "--sample-reviews", "0")
IMAGENET_TINY = {"ARCH": "resnet18", "BATCH_SIZE": "8", "WORKERS": "0", "EPOCHS": "1",
                 "IMAGE_SIZE": "32"}


def gpt_env(tmp_path: Path, tiny: tuple[Path, Path], **extra: str) -> dict[str, str]:
    model, data = tiny
    return virtual_env(
        tmp_path, PRETRAINED_MODEL=str(model), DATASET=str(data),
        LOGGING_DIR=str(tmp_path / "logging"), NUM_WORKERS="0", BATCH_SIZE="4",
        HF_HUB_OFFLINE="1", **extra,
    )


# jobs/local/mnist.sbatch runs in tests/test_failures.py: its whole run after a requeue is
# checked there as the runs here are (test_time_limit_stops_saves_requeues_and_resumes).


def test_lumi_smoke_runs_the_doctor_then_reports_each_nodes_gpus_and_each_ranks_cores(
        cluster, tmp_path):
    """The doctor first (tests/test_doctor.py covers its faults): on a healthy allocation every
    node check passes, one row per node, nothing to exclude. What the test bed lacks is faked at
    its outermost fact: LUMI detected, its one NIC instead of hsn0..3, an
    aws-ofi-rccl library file, torch reporting the GPUs Slurm gave (tests/fakes/torch-gpus)."""
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    (plugin / "librccl-net.so").touch()
    doctor_dir = tmp_path / "doctor"
    job = submit(cluster, lumi("smoke.sbatch"), tmp_path, 2, env=virtual_env(
        tmp_path, XSCALE_SITE="lumi", NCCL_SOCKET_IFNAME="hsn0", LD_LIBRARY_PATH=str(plugin),
        PYTHONPATH=str(REPO / "tests" / "fakes" / "torch-gpus"), DOCTOR_DIR=str(doctor_dir),
        DOCTOR_ARGS="--quick"))
    verdict = json.loads((doctor_dir / "verdict.json").read_text())
    assert verdict["ok"] and verdict["exclude"] == "", verdict
    assert sorted(verdict["nodes"]) == ["nid001", "nid002"]
    for node, checks in verdict["nodes"].items():
        assert {c: r["status"] for c, r in checks.items()} == {
            "layout": "ok", "gpus": "ok", "cpu-affinity": "skip", "network": "ok",
            "net-plugin": "ok", "storage": "ok", "paths": "skip", "import-torch": "ok"}, node
        # Each rank on its own GPU of the four Slurm gave the node.
        assert checks["gpus"]["message"] in {"GPU 0 of 0,1,2,3", "GPU 1 of 0,1,2,3"}
    table = [line.split()[0] for line in job.output.splitlines()
             if re.match(r"nid\d+(\s+(ok|-))+\s*$", line)]
    assert table == ["nid001", "nid002"], job.output
    assert "doctor: exclude: none" in job.output
    nodes = sorted(re.findall(r"^smoke: node=(\S+) torch_gpus=(\d+) visible=(\S+) ok$",
                              job.output, re.M))
    # One line per node; Slurm gave each node its 4 (fake) GPUs, and torch (faked) sees them.
    assert nodes == [("nid001", "4", "0,1,2,3"), ("nid002", "4", "0,1,2,3")]
    bindings = sorted(re.findall(
        r"^binding: rank=(\d+) local_rank=(\d+) node=(\S+) cpus=(\S+) ok$", job.output, re.M))
    # Local rank i runs on core i of its node: the masks 0x1,0x2 from cpu-masks, applied.
    assert bindings == [("0", "0", "nid001", "0"), ("1", "1", "nid001", "1"),
                        ("2", "0", "nid002", "0"), ("3", "1", "nid002", "1")]


SMOKE_CHECKS = REPO / "jobs" / "lumi" / "smoke_checks.py"


@pytest.mark.parametrize("mask_list, verdict", [
    ("1,2", "ok"), ("0x1", "ok"),
    ("2,1", "FAIL: runs on cores 0, its mask gives 1"),
    ("", "FAIL: no mask given (SLURM_CPU_BIND_LIST is empty: srun ran without "
         "--cpu-bind=mask_cpu)")])
def test_smoke_binding_check_fails_a_rank_off_its_mask(mask_list, verdict):
    """The smoke template's step 3 as a rank runs it: pinned to core 0, local rank 0, against
    the mask list srun exports. A rank on other cores than its mask's is a FAIL and exit 1."""
    env = {**os.environ, "SLURM_CPU_BIND_LIST": mask_list, "RANK": "0", "LOCAL_RANK": "0"}
    result = subprocess.run([sys.executable, str(SMOKE_CHECKS), "binding"], env=env,
                            capture_output=True, text=True,
                            preexec_fn=lambda: os.sched_setaffinity(0, {0}))
    assert result.stdout.strip() == f"binding: rank=0 local_rank=0 node=? cpus=0 {verdict}"
    assert result.returncode == (0 if verdict == "ok" else 1), result.stderr


@pytest.mark.parametrize("torch_gpus, visible, given, problem", [
    (8, "0,1,2,3,4,5,6,7", "8", ""),
    (0, "0,1,2,3,4,5,6,7", "8",
     "torch sees 0 of the 8 visible GPUs (a CPU-only or wrong-vendor torch?)"),
    (4, "0,1,2,3", "8", "4 devices visible of the 8 Slurm gave the node"),
    (0, "", "", "SLURM_GPUS_ON_NODE is not set: submit with --gpus-per-node")])
def test_smoke_gpu_check_compares_torch_with_slurms_gpus(torch_gpus, visible, given, problem):
    """Step 2's verdict from the three counts (this machine has no GPU to show a passing torch;
    the cluster test above passes it through tests/fakes/torch-gpus)."""
    sys.path.insert(0, str(SMOKE_CHECKS.parent))
    try:
        import smoke_checks
    finally:
        sys.path.remove(str(SMOKE_CHECKS.parent))
    devices = [device for device in visible.split(",") if device]
    assert smoke_checks.gpus_problem(torch_gpus, devices, given) == problem


# jobs/lumi/mnist.sbatch runs in tests/test_trainers_cv.py, where it resumes an MNIST run stopped
# by USR1 (test_mnist_on_two_nodes_stops_on_usr1_to_the_step_and_resumes), and in
# tests/test_failures.py.


def check_startup_phases(phases: dict, ranks: list[dict]) -> None:
    """Every start-up phase is known on every rank through the template (its launch time
    too: time-limit.sh gives the step XSCALE_LAUNCH_T), none is negative, and each slowest rank
    is a rank of this job on one of its nodes."""
    nodes = {rank["node"] for rank in ranks}
    assert len(nodes) == 2, ranks
    for name in ("launch", "run_sh", "imports", "group", "first_step", "total"):
        entry = phases[name]
        assert entry["ranks"] == len(ranks), (name, entry)
        assert 0 <= entry["median"] <= entry["slowest"], (name, entry)
        assert entry["node"] in nodes and 0 <= entry["rank"] < len(ranks), (name, entry)
        assert all(rank["startup"][name] >= 0 for rank in ranks), (name, ranks)
    # The phases run end to end: on each rank they add up to its total.
    for rank in ranks:
        parts = sum(rank["startup"][name] for name in ("launch", "run_sh", "imports", "group",
                                                       "first_step"))
        assert abs(parts - rank["startup"]["total"]) < 0.01, rank


def test_lumi_gpt_neo_on_one_node(cluster, tmp_path, tiny):
    job = submit(cluster, lumi("gpt-neo-1node.sbatch"), tmp_path, 1, *GPT_TINY,
                 env=gpt_env(tmp_path, tiny))
    check_summary(job.output, "gpt_neo_imdb", 2)


# jobs/lumi/gpt-neo-profile.sbatch (and gpt-neo.sbatch, which it sources) runs in
# tests/test_gpt_neo.py, where it resumes the run stopped by USR1 with rank 3 under the profiler
# (test_four_ranks_on_two_nodes_stop_on_usr1_to_the_step_and_resume).


# jobs/lumi/imagenet-deepspeed.sbatch runs in tests/test_trainers_cv.py, where it resumes a
# DeepSpeed run stopped by USR1 (test_imagenet_deepspeed_on_two_nodes_stops_on_usr1_and_resumes).


# imagenet.sbatch runs inside the next two templates (they source it): on two nodes from
# staged data, and on one node with DATA as given.
def test_lumi_imagenet_from_data_staged_in_each_nodes_tmp(cluster, tmp_path, imagenet_data):
    _, tarball = imagenet_data
    job = submit(cluster, lumi("imagenet-prestage.sbatch"), tmp_path, 2,
                 env=virtual_env(tmp_path, DATA_TAR=str(tarball), **IMAGENET_TINY))
    check_summary(job.output, "imagenet", 4)
    # The ranks read the job's copy in node-local /tmp (the trainer names its data directory).
    # Each virtual node has a /tmp of its own, so the second node's ranks could only train
    # because that node unpacked its own copy, as every LUMI node must.
    staged = f"{USER}-xscale-data-{job.job_id}"
    assert f"/tmp/{staged}/data-resnet-small" in job.output
    # And every node's copy is gone afterwards: /tmp is the node's memory on LUMI.
    assert [node for node in cluster.nodes if (cluster.node_tmp(node) / staged).exists()] == []


def test_lumi_imagenet_restores_and_saves_the_miopen_cache(cluster, tmp_path, imagenet_data):
    folder, _ = imagenet_data
    cache = tmp_path / "miopen-cache.tar"
    seeded = tmp_path / "seed"
    seeded.mkdir()
    (seeded / "gfx90a_110.ukdb").write_text("kernels of the last job\n")
    with tarfile.open(cache, "w") as tar:
        tar.add(seeded, arcname=".")
    before = cache.stat().st_mtime_ns
    job = submit(cluster, lumi("imagenet-miopen-cache.sbatch"), tmp_path, 1,
                 env=virtual_env(tmp_path, DATA=str(folder), MIOPEN_CACHE_TAR=str(cache),
                                 **IMAGENET_TINY))
    check_summary(job.output, "imagenet", 2)
    # Restored into the node's cache before training, saved from it after: the last job's file
    # survived the round trip in a tarball written by this job.
    assert cache.stat().st_mtime_ns > before
    with tarfile.open(cache) as tar:
        assert "./gfx90a_110.ukdb" in tar.getnames()
    assert not list(tmp_path.glob("miopen-cache.tar.*"))  # no half-written tarball left
    assert not [node for node in cluster.nodes
                if (cluster.node_tmp(node) / f"{USER}-miopen-cache-{job.job_id}").exists()]


# ---------------------------------------------------------------------------------------------
# Aurora (PBS): syntax, and the rank logic with the variables PALS's mpiexec gives each rank
# ---------------------------------------------------------------------------------------------

# Stands in for PALS's mpiexec: records its command line and environment, then starts each rank
# of the payload as `PAYLOAD --print-env` with the variables PALS sets for that rank.
FAKE_MPIEXEC = r"""#!/bin/bash
set -euo pipefail
log=$FAKE_MPI_LOG
if [[ " $* " == *"/stage-node "* ]]; then  # jobs/lib/stage: one process per node
  while [[ $1 != */stage-node ]]; do shift; done
  printf '%s\n' "$*" >>"$log/stage-node"
  while read -r node; do STAGE_NODE_NAME=${node%%.*} "$@"; done <"$PBS_NODEFILE"
  exit 0
fi
printf '%s\n' "$@" >"$log/argv"
printf '%s\n' "${PYTHONPATH:-}" >"$log/pythonpath"
n="" ppn=""
while [[ $1 == -* ]]; do
  case $1 in
    -n | --np) n=$2; shift 2 ;;
    --ppn | -ppn) ppn=$2; shift 2 ;;
    --genv | --env) shift 2 ;;
    *) shift ;;
  esac
done
for ((rank = 0; rank < n; rank++)); do
  PALS_RANKID=$rank PALS_LOCAL_RANKID=$((rank % ppn)) PALS_NODEID=$((rank / ppn)) \
    PALS_LOCAL_SIZE=$ppn PMI_RANK=$rank PMI_SIZE=$n PMI_LOCAL_RANK=$((rank % ppn)) \
    PMI_LOCAL_SIZE=$ppn "$1" --print-env >"$log/rank$rank.env"
done
"""
LOGGER = '#!/bin/bash\nprintf "%s\\n" "${0##*/} $*" >>"$FAKE_MPI_LOG/tools"\n'


@pytest.mark.parametrize("path", AURORA, ids=ids)
def test_pbs_template_parses_and_its_queue_takes_the_node_counts_it_names(path: Path):
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    text = path.read_text()
    assert re.search(r"^#PBS -A \S+$", text, re.M)
    queue = re.search(r"^#PBS -q (\S+)$", text, re.M).group(1)
    low, high = AURORA_QUEUES[queue]
    # The default and every node count the usage text suggests (qsub -l select=N) fit the queue.
    counts = {int(n) for n in re.findall(r"select=(\d+)", text)}
    assert counts and all(low <= n <= high for n in counts), (queue, counts)


def run_pbs(path: Path, tmp_path: Path, nodes: list[str], **extra: str):
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    for name, body in (("mpiexec", FAKE_MPIEXEC), ("module", LOGGER),
                       ("launch_copper.sh", LOGGER), ("stop_copper.sh", LOGGER)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("".join(f"{node}\n" for node in nodes))
    env = {
        "PATH": os.pathsep.join([str(bin_dir), str(VENV_BIN), "/usr/bin", "/bin"]),
        "HOME": str(tmp_path), "USER": "alice", "FAKE_MPI_LOG": str(log),
        "PBS_O_WORKDIR": str(REPO), "PBS_JOBID": "4242.aurora-pbs-0001.hostmgmt.cm.aurora",
        "PBS_NODEFILE": str(nodefile), "XSCALE_CACHE_ROOT": str(tmp_path),
        "COPPER_LOG_DIR": str(tmp_path / "copper-logs"), **extra,
    }
    proc = subprocess.run(["bash", str(path)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return log


@pytest.mark.parametrize("path", AURORA, ids=ids)
def test_pbs_ranks_get_their_place_from_pals(path: Path, tmp_path: Path):
    nodes = ["x4102c5s2b0n0.hostmgmt2102.cm.aurora.alcf.anl.gov", "x4102c5s3b0n0"]
    log = run_pbs(path, tmp_path, nodes, LUS_CONDA_PATH="/lus/flare/projects/p/pkgs")
    argv = (log / "argv").read_text().splitlines()
    # 2 nodes x 12 tiles, ALCF's four-cores-per-rank training list, the environment to every rank.
    assert argv[:6] == ["-n", "24", "--ppn", "12", f"--cpu-bind=list:{ALCF_TRAINING_CPU_LIST}",
                        "--genvall"]
    payload = argv[6:]
    assert payload[:3] == [str(REPO / "runscripts" / "run.sh"), "python", "-u"]
    assert payload[3] == str(REPO / "python" / "mnist_ddp.py")
    ranks = [env_lines((log / f"rank{rank}.env").read_text()) for rank in range(24)]
    port = str(10000 + 16 * 4242 % 22768)
    for rank, env in enumerate(ranks):
        assert env["XSCALE_LAUNCHER"] == "pbs"
        assert (env["RANK"], env["WORLD_SIZE"]) == (str(rank), "24")
        assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (str(rank % 12), "12")
        assert (env["NODE_RANK"], env["NNODES"]) == (str(rank // 12), "2")
        # MASTER_ADDR: the first node of PBS_NODEFILE on the high-speed network, the name ALCF's
        # DDP example builds, set by the job script for every rank.
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == (
            "x4102c5s2b0n0.hsn.cm.aurora.alcf.anl.gov", port)
        assert env["XSCALE_SITE"] == "aurora"
        assert any(key.startswith("CCL_") for key in env), "the aurora site set no oneCCL value"
    # Copper: the frameworks module, then copper, then packages imported from Copper's mirror.
    tools = (log / "tools").read_text().splitlines()
    # Started with a log directory, and stopped with it when the job script ends.
    logs = tmp_path / "copper-logs"
    assert tools == ["module load frameworks", "module load copper",
                     f"launch_copper.sh -d {logs}", f"stop_copper.sh -d {logs}"]
    pythonpath = (log / "pythonpath").read_text().strip()
    assert pythonpath.split(":")[0] == "/tmp/alice/copper/lus/flare/projects/p/pkgs"


@pytest.mark.parametrize("path", AURORA, ids=ids)
def test_pbs_with_an_empty_hsn_domain_takes_the_node_files_name(path: Path, tmp_path: Path):
    """HSN_DOMAIN="" is how a site without ALCF's HSN names says: MASTER_ADDR as PBS wrote it."""
    first = "x4102c5s2b0n0.hostmgmt2102.cm.aurora.alcf.anl.gov"
    log = run_pbs(path, tmp_path, [first, "x4102c5s3b0n0"], HSN_DOMAIN="")
    assert env_lines((log / "rank0.env").read_text())["MASTER_ADDR"] == first


@pytest.mark.parametrize("path", AURORA, ids=ids)
def test_pbs_without_a_user_environment_skips_copper(path: Path, tmp_path: Path):
    log = run_pbs(path, tmp_path, ["x1", "x2", "x3"], RANKS_PER_NODE="2")
    argv = (log / "argv").read_text().splitlines()
    assert argv[:4] == ["-n", "6", "--ppn", "2"]
    assert (log / "tools").read_text().splitlines() == ["module load frameworks"]
    assert (log / "pythonpath").read_text().strip() == ""
    last = env_lines((log / "rank5.env").read_text())
    assert (last["RANK"], last["LOCAL_RANK"], last["NODE_RANK"]) == ("5", "1", "2")



@pytest.mark.parametrize("path", AURORA, ids=ids)
def test_pbs_without_copper_stages_the_packages_once_per_node(path: Path, tmp_path: Path):
    packages = tmp_path / "pkgs" / "xs_extra"
    packages.mkdir(parents=True)
    (packages / "__init__.py").write_text("")
    stage = tmp_path / "stage"
    log = run_pbs(path, tmp_path, ["x4102c5s2b0n0.hostmgmt2102.cm.aurora.alcf.anl.gov",
                                   "x4102c5s3b0n0.hostmgmt2102.cm.aurora.alcf.anl.gov"],
                  LUS_CONDA_PATH=str(tmp_path / "pkgs"), PACKAGE_CACHE="stage",
                  XSCALE_STAGE_DEST=str(stage), XSCALE_STAGE_WORK=str(tmp_path / "work"))
    # No Copper; the ranks import from the node-local copy, first on PYTHONPATH.
    assert (log / "tools").read_text().splitlines() == ["module load frameworks"]
    assert (log / "pythonpath").read_text().split(":")[0].strip() == f"{stage}/user-packages"
    # One unpacking process per node (published once, checked, then removed when the job ended).
    verbs = [line.split()[1] for line in (log / "stage-node").read_text().splitlines()]
    assert verbs == ["publish", "clean"]
    assert not stage.exists() and not (tmp_path / "work").exists()


@pytest.mark.parametrize("path", AURORA, ids=ids)
def test_pbs_ranks_each_take_their_own_tile_with_xccl(path: Path, tmp_path: Path):
    """What every rank's trainer makes of the environment PALS and run.sh give it, on an Aurora
    node as torch describes one (12 tiles as xpu devices, xccl built in): the facts are given,
    the choice is xscale's own code."""
    from xscale.dist import Accelerator, choose_backend, choose_device

    log = run_pbs(path, tmp_path, ["x4102c5s2b0n0", "x4102c5s3b0n0"])
    aurora_node = Accelerator("xpu", 12, xccl=True, xpu_compiled=True)
    places = []
    for rank in range(24):
        env = env_lines((log / f"rank{rank}.env").read_text())
        assert env["ZE_FLAT_DEVICE_HIERARCHY"] == "FLAT"  # tiles are devices
        assert "ZE_AFFINITY_MASK" not in env  # all 12 visible: the rank picks LOCAL_RANK's
        device = choose_device(int(env["LOCAL_RANK"]), require_gpu=True, accel=aurora_node,
                               environ=env)
        assert choose_backend(None, device, aurora_node, environ=env) == "xccl"
        places.append((env["NODE_RANK"], str(device)))
    assert len(set(places)) == 24  # one rank per tile, no tile shared
    assert {device for _, device in places} == {f"xpu:{tile}" for tile in range(12)}


@pytest.mark.parametrize("path", AURORA, ids=ids)
def test_pbs_on_a_torch_without_xpu_stops_each_rank_with_one_line(path: Path, tmp_path: Path):
    """This machine's torch has no XPU support, as a job without the frameworks module would
    have: the trainer, in a rank's environment from the template, refuses at once with one line
    and status 2 rather than training on the CPU, and writes nothing."""
    log = run_pbs(path, tmp_path, ["x4102c5s2b0n0", "x4102c5s3b0n0"])
    env = env_lines((log / "rank13.env").read_text())
    argv = (log / "argv").read_text().splitlines()
    trainer_args = argv[argv.index(str(REPO / "python" / "mnist_ddp.py")) + 1:]
    assert "--gpu" in trainer_args  # the template's default
    output_dir = Path(trainer_args[trainer_args.index("--output-dir") + 1])
    data_dir = tmp_path / "mnist"
    subprocess.run([sys.executable, "tests/fixtures/mnist_idx.py", str(data_dir)], cwd=REPO,
                   check=True, capture_output=True, timeout=120)
    trainer_args[trainer_args.index("--data") + 1] = str(data_dir)
    proc = subprocess.run([sys.executable, str(REPO / "python" / "mnist_ddp.py"), *trainer_args],
                          cwd=tmp_path, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mnist_ddp.py: error: a GPU was asked for"), \
        proc.stderr
    assert "XPU support" in lines[0] or "no XPU is visible" in lines[0]
    assert proc.stdout == "" and not output_dir.exists()

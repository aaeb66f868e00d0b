#!/usr/bin/env python3
"""gpu-check: prove a GPU node with xscale's own code paths, in one command and one table.

    make gpu-check                       # any GPU box (or: python tests/gpu/gpu_check.py)
    sbatch jobs/lumi/gpu-check.sbatch    # one LUMI-G node, all 8 GCDs

Without a GPU it prints one line and exits 0: nothing is claimed. With one, every check runs
through runscripts/run.sh (torchrun in front of it for all the node's GPUs), on the device and
backend xscale.dist chooses, as a training job would:

  trainers      mnist_ddp, imagenet (fp16 AMP), imagenet_deepspeed, gpt_neo_imdb (Hugging Face's
                Trainer, bf16) on their tiny offline fixtures, on 1 GPU and on all; each
                XSCALE_SUMMARY must show the GPU, the native backend, every rank, a falling loss
  doctor        runscripts/doctor on 1 GPU and on all: its GPU checks and all-reduce bandwidth
  profile       runscripts/run-profile.sh on rank 0 with the site's profiler (torch.profiler when
                that is not installed): the trace must exist and not be empty
  throughput    on one GPU, in interleaved rounds: python/imagenet.py against pytorch/examples'
                imagenet/main.py (resnet50, synthetic images, same batch, fp32 as main.py has no
                AMP), and GPT-neo-125M-shaped tokens/s with its MFU
  snapshots     tests/bench/snapshots.py on one GPU: a peer snapshot copied on its side stream
                while the next step is queued must be the state of its step; its stall against
                the synchronize it replaced, and its share of the step time at `auto` K

A failing check does not stop the others. The table goes to stdout, the same as JSON to
OUT/result.json, each run's output to OUT/logs/. Exit status: 0 when nothing failed, 1 when a
check failed, 2 for a bad option. docs/GPU-CHECK.md explains every row.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The fixtures (tests/), as pytest's pythonpath has them; xscale is installed (`make setup`).
sys.path[:0] = [str(REPO)]

from xscale.observe import peaks  # noqa: E402
from xscale.shared import settings  # noqa: E402

from tests.gpu import figures  # noqa: E402
from tests.gpu.verdict import (  # noqa: E402
    FAIL,
    PASS,
    SKIP,
    Check,
    Expected,
    judge_snapshots,
    judge_training,
    render_table,
    summary_of,
    telling_line,
    write_result,
)

PROG = "gpu-check"
RUN_SH = REPO / "runscripts" / "run.sh"
RUN_PROFILE = REPO / "runscripts" / "run-profile.sh"
DOCTOR = REPO / "runscripts" / "doctor"
# What an outer run.sh exported (the LUMI job runs this program under run.sh) would make each run
# below a rank of that one (run.sh keeps a variable already set): every run gets its own. Without
# OMP_NUM_THREADS, run.sh counts the rank's CPUs, and torchrun gives its ranks 1 thread each.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
                      "NNODES", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "ROLE_RANK",
                      "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "XSCALE_LAUNCHER",
                      "OMP_NUM_THREADS")
STEPS = 40  # the trainers' tiny runs: the loss falls clearly within them
TIMEOUT_S = 1200  # per run: DeepSpeed JIT-builds its fused Adam on first use
# Throughput runs: the first steps are left out (imagenet.py's summary leaves out min(5, steps/10)).
BENCH_STEPS, BENCH_WARMUP = 50, 5
GPT_SEQ_LEN, GPT_BATCH = 1024, 8
SNAPSHOT_ROUNDS = 8  # the stall is milliseconds in a round of tenths of a second: medians
COMPILE_GAIN = 1.2  # the compiled GPT-neo's least speed-up over eager (2.5x on an H200)


class UsageError(Exception):
    """A bad option or setting: one line, exit 2."""


# ---------------------------------------------------------------------------------------------
# The node: xscale.dist's own answer, nothing else
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    device: str  # the device type the trainers will use: "cuda" (CUDA and ROCm) or "xpu"
    backend: str  # the backend xscale.dist chooses for it (XSCALE_BACKEND wins, as for them)
    count: int
    name: str
    stack: str  # CUDA x.y, ROCm (HIP) x.y, or XPU
    torch: str

    def facts(self) -> dict[str, object]:
        return {"device": self.device, "backend": self.backend, "gpus": self.count,
                "name": self.name, "stack": self.stack, "torch": self.torch}


def detect() -> Node | str:
    """The node's accelerator as the trainers see it (xscale.dist.probe_accelerator,
    choose_device, choose_backend), or why there is none."""
    import torch
    from xscale import dist

    accel = dist.probe_accelerator()
    if accel.type is None:  # the reason is the one a trainer asked for --gpu would give
        return (f"torch {torch.__version__} sees no CUDA, ROCm or XPU device: "
                f"{dist.no_gpu_reason(accel)}")
    device = dist.choose_device(0, accel=accel)
    backend = dist.choose_backend(None, device, accel)
    if torch.version.hip:
        stack = f"ROCm (HIP {torch.version.hip})"
    elif device.type == "cuda":
        stack = f"CUDA {torch.version.cuda}"
    else:
        stack = "XPU"
    name = torch.get_device_module(device).get_device_name(device.index)
    return Node(device.type, backend, accel.count, name, stack, torch.__version__)


# ---------------------------------------------------------------------------------------------
# Running one command: through run.sh, on 1 GPU or on all of them, logged
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Launch:
    """One rank (run.sh alone: the launcher it detects is none, or the outer srun task), or one
    rank per GPU of the node (torchrun --standalone in front of run.sh: a free port, this node)."""

    ranks: int

    @property
    def label(self) -> str:
        return "1 GPU" if self.ranks == 1 else f"{self.ranks} GPUs"

    def command(self, entry: Path, *argv: str) -> list[str]:
        if self.ranks == 1:
            return [str(entry), *argv]
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={self.ranks}", "--no-python", str(entry), *argv]


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["PYTHONUNBUFFERED"] = "1"  # main.py's lines arrive as it prints them
    # This interpreter's directory first (the venv's under make): the doctor starts `python3`
    # from PATH for its torch child, and it must be the torch the trainers run on.
    env["PATH"] = os.pathsep.join(filter(None, [str(Path(sys.executable).parent),
                                                env.get("PATH", "")]))
    env.update(extra or {})
    return env


@dataclass
class Outcome:
    exit_code: int
    output: str
    timed_out: bool = False


class Runner:
    """Runs each command in its own process group (so that a timeout ends torchrun's ranks and
    DataLoader workers too), its output merged into OUT/logs/NAME.log."""

    def __init__(self, logs: Path, timeout_s: float) -> None:
        self.logs = logs
        self.timeout_s = timeout_s
        logs.mkdir(parents=True, exist_ok=True)

    def run(self, name: str, command: list[str], env: dict[str, str],
            enough: Callable[[str], bool] | None = None) -> Outcome:
        """Run COMMAND to its end; with `enough`, end it (SIGTERM) at the first output line for
        which enough(line) is true (pytorch/examples' main.py has no --max-steps)."""
        log = self.logs / f"{name}.log"
        print(f"{PROG}: {name}: {' '.join(command)}", file=sys.stderr, flush=True)
        with log.open("w") as out:
            proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, errors="replace",
                                    start_new_session=True)
            expired = threading.Event()
            timer = threading.Timer(self.timeout_s, lambda: (expired.set(), self._end(proc)))
            timer.start()
            try:
                stopped = self._copy(proc, out, enough)
                code = proc.wait()
            except BaseException:
                self._end(proc)
                raise
            finally:
                timer.cancel()
        output = log.read_text(errors="replace")
        if stopped:
            code = 0  # ended by us, after it printed what we wanted
        return Outcome(code, output, expired.is_set())

    def _copy(self, proc: subprocess.Popen, out, enough: Callable[[str], bool] | None) -> bool:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            if enough is not None and enough(line):
                self._end(proc, signal.SIGTERM)
                proc.stdout.read()
                return True
        return False

    @staticmethod
    def _end(proc: subprocess.Popen, how: int = signal.SIGKILL) -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, how)
            except ProcessLookupError:
                pass


def fresh_dir(path: Path) -> None:
    """PATH, empty: a directory of this check's own output (under --out)."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


def failed_run(name: str, outcome: Outcome, timeout_s: float) -> Check | None:
    """A run that timed out is a failure with that reason (its summary, if any, is not judged)."""
    if outcome.timed_out:
        return Check(name, FAIL, f"timed out after {timeout_s:.0f} s")
    return None


# ---------------------------------------------------------------------------------------------
# Fixtures: built once, offline, into OUT/fixtures
# ---------------------------------------------------------------------------------------------


class Fixtures:
    def __init__(self, root: Path) -> None:
        self.root = root

    def mnist(self) -> Path:
        from tests.fixtures.mnist_idx import write_mnist
        return write_mnist(self.root / "mnist", train=2048, test=512)

    def images(self) -> Path:
        from tests.fixtures.imagefolder import write_imagefolder
        folder = self.root / "imagefolder"
        return folder if (folder / "train").is_dir() else write_imagefolder(folder)

    def gpt_neo(self, shape: str) -> tuple[Path, Path]:
        """(model, dataset): "tiny" to train, "125m" (texts of 140 reviews, so that every
        sequence is full length) to measure."""
        from tests.fixtures.tiny_gpt_neo import build
        folder = self.root / f"gpt-neo-{shape}"
        if (folder / "imdb").is_dir():
            return folder / "model", folder / "imdb"
        if shape == "tiny":
            return build(folder)
        return build(folder, train_size=16000, test_size=280, shape=shape, reviews_per_text=140)


# ---------------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Trainer:
    name: str
    script: str
    args: Callable[[Fixtures, Path, int], list[str]]  # (fixtures, its output dir, ranks)


def mnist_args(fx: Fixtures, out: Path, ranks: int, steps: int = STEPS) -> list[str]:
    return ["--data", str(fx.mnist()), "--gpu", "--batch-size", "32", "--lr", "0.002",
            "--epochs", "1000", "--log-every", "4", "--max-steps", str(steps)]


def vision_args(fx: Fixtures, ranks: int) -> list[str]:
    """pytorch/examples' -b and -j are per node: 32 images and 2 workers per rank."""
    return [str(fx.images()), "-a", "resnet18", "--image-size", "32", "-b", str(32 * ranks),
            "-j", str(2 * ranks), "--epochs", "1000", "-p", "4", "--max-steps", str(STEPS)]


def imagenet_args(fx: Fixtures, out: Path, ranks: int) -> list[str]:
    return [*vision_args(fx, ranks), "--lr", "0.01", "--amp", "fp16"]  # fp16: the GradScaler too


def deepspeed_args(fx: Fixtures, out: Path, ranks: int) -> list[str]:
    return ["--deepspeed", *vision_args(fx, ranks)]  # its GPU default: configs/ds_fp16_z1.json


def gpt_neo_args(fx: Fixtures, out: Path, ranks: int) -> list[str]:
    model, data = fx.gpt_neo("tiny")
    return ["--pretrained-model", str(model), "--dataset", str(data), "--model-name", "tiny",
            "--output-path", str(out), "--logging-path", str(out / "logs"), "--no-resume",
            "--max-steps", str(STEPS), "--num-workers", "0", "--batch-size", "8",
            "--max-length", "64", "--learning-rate", "1e-3", "--logging-steps", "5",
            "--save-steps", "1000", "--eval-steps", "1000", "--eval-batch-size", "32",
            "--sample-reviews", "0"]


TRAINERS = (
    Trainer("mnist_ddp", "python/mnist_ddp.py", mnist_args),
    Trainer("imagenet", "python/imagenet.py", imagenet_args),
    Trainer("imagenet_deepspeed", "python/imagenet_deepspeed.py", deepspeed_args),
    Trainer("gpt_neo_imdb", "python/gpt_neo_imdb.py", gpt_neo_args),
)


@dataclass
class Context:
    node: Node
    out: Path
    fixtures: Fixtures
    runner: Runner
    examples: Path | None
    rounds: int
    batch_size: int

    def launches(self) -> list[Launch]:
        return [Launch(1)] + ([Launch(self.node.count)] if self.node.count > 1 else [])


def check_trainer(ctx: Context, trainer: Trainer, launch: Launch) -> Check:
    name = f"{trainer.name} {launch.label}"
    run_dir = ctx.out / "runs" / f"{trainer.name}-{launch.ranks}"
    args = trainer.args(ctx.fixtures, run_dir, launch.ranks)
    outcome = ctx.runner.run(name.replace(" ", "-"), launch.command(
        RUN_SH, sys.executable, "-u", str(REPO / trainer.script), *args), child_env())
    # Every trainer joins the group its launcher describes, a lone one too (a group of one:
    # the lone-rank rule, xscale.hf.ddp_arguments): the node's backend at every size.
    expected = Expected(ctx.node.device, ctx.node.backend, launch.ranks)
    return failed_run(name, outcome, ctx.runner.timeout_s) or judge_training(
        name, outcome.output, outcome.exit_code, expected)


def check_doctor(ctx: Context, launch: Launch) -> Check:
    """The doctor's verdict (its exit status and JSON), with the all-reduce's bus bandwidth."""
    name = f"doctor {launch.label}"
    verdict = ctx.out / f"doctor-{launch.ranks}" / "verdict.json"
    fresh_dir(verdict.parent)  # an earlier check's verdict must not pass for this one's
    outcome = ctx.runner.run(name.replace(" ", "-"), launch.command(
        DOCTOR, "--json", str(verdict), "--timeout", "300"), child_env())
    return failed_run(name, outcome, ctx.runner.timeout_s) or judge_doctor(
        name, outcome.exit_code, verdict, verdict.parent / "verdict.ranks" / "rank-0.json")


def judge_doctor(name: str, exit_code: int, verdict_path: Path, rank0_path: Path) -> Check:
    if not verdict_path.is_file():
        return Check(name, FAIL, f"exit status {exit_code}, no verdict written")
    verdict = json.loads(verdict_path.read_text())
    problems = [f"{node} {check}: {cell['message']}" for node, cells in verdict["nodes"].items()
                for check, cell in cells.items() if cell["status"] == "fail"]
    problems += [f"job {r['check']}: {r['message']}" for r in verdict["job"]
                 if r["status"] == "fail"]
    facts = json.loads(rank0_path.read_text()).get("facts", {}) if rank0_path.is_file() else {}
    figures_ = {"gpus_seen": facts.get("torch_gpus"), "backend": facts.get("backend")}
    alone = verdict.get("world_size") == 1  # one rank's all-reduce moves nothing: no figure
    for sweep in [] if alone else facts.get("bandwidth") or []:
        figures_[f"busbw_{sweep['bytes'] >> 20}MiB_GBps"] = sweep["busbw_gbps"]
    if exit_code != 0 or problems:
        return Check(name, FAIL, "; ".join(problems) or f"exit status {exit_code}", figures_)
    return Check(name, PASS, "", figures_)


def check_profile(ctx: Context) -> Check:
    """run-profile.sh on rank 0 with the site's PROFILER; PROFILER=torch when the site's tool is
    not installed here (run-profile.sh says so in one line and exits 2 before anything runs)."""
    name = "profile rank 0"
    trace_dir = ctx.out / "profile"
    fresh_dir(trace_dir)  # an earlier check's trace must not pass for this one's
    window = {"PROFILE_RANKS": "0", "PROFILE_DIR": str(trace_dir), "PROFILE_STEP_START": "5",
              "PROFILE_STEPS": "10"}
    trainer = [sys.executable, "-u", str(REPO / "python/mnist_ddp.py"),
               *mnist_args(ctx.fixtures, trace_dir, 1, steps=20)]  # 20 steps hold the window
    outcome = ctx.runner.run("profile-site", [str(RUN_PROFILE), *trainer], child_env(window))
    profiler = "the site's PROFILER"
    if outcome.exit_code == 2 and "is not installed" in outcome.output:
        profiler = f"torch.profiler ({outcome.output.strip().splitlines()[-1]})"
        outcome = ctx.runner.run("profile-torch", [str(RUN_PROFILE), *trainer],
                                 child_env({**window, "PROFILER": "torch"}))
    if failed := failed_run(name, outcome, ctx.runner.timeout_s):
        return failed
    return judge_trace(name, outcome, trace_dir, profiler)


def judge_trace(name: str, outcome: Outcome, trace_dir: Path, profiler: str) -> Check:
    """A finished training (its summary: a profiler such as py-spy exits 0 whatever the program
    did) and rank 0's trace: a non-empty file named rank0* or inside rank0/ (rocprof's CSVs,
    nsys' .nsys-rep, py-spy's .svg, torch.profiler's .pt.trace.json)."""
    found = [path for path in trace_dir.glob("rank0*") if path.is_file()]
    found += [path for path in trace_dir.glob("rank0/**/*") if path.is_file()]
    found = [path for path in found if path.stat().st_size > 0]
    if outcome.exit_code != 0 or summary_of(outcome.output) is None:
        return Check(name, FAIL, f"exit status {outcome.exit_code} under {profiler}, no "
                                 f"XSCALE_SUMMARY; {telling_line(outcome.output)}")
    if not found:
        return Check(name, FAIL, f"no non-empty trace of rank 0 in {trace_dir} ({profiler})")
    largest = max(found, key=lambda path: path.stat().st_size)
    figures = {"trace": str(largest), "bytes": largest.stat().st_size}
    verdicts = [line for line in outcome.output.splitlines() if "(rank 0's trace; " in line]
    if verdicts:  # torch.profiler's summary, printed at the end of the run
        figures["trace verdict"] = verdicts[-1].split("xscale: ", 1)[-1]
    return Check(name, PASS, f"with {profiler}", figures)


# ---- throughput: one GPU, interleaved rounds ---------------------------------------------------


def one_gpu_env(node: Node) -> dict[str, str]:
    """Only the first visible device: main.py wraps a model in DataParallel over every GPU it
    sees. Both sides get the same, so they compare on the same device."""
    name = {"cuda": "HIP_VISIBLE_DEVICES" if "ROCm" in node.stack else "CUDA_VISIBLE_DEVICES",
            "xpu": "ZE_AFFINITY_MASK"}[node.device]
    current = os.environ.get(name, "")
    return child_env({name: current.split(",")[0] if current else "0"})


def imagenet_run(ctx: Context, round_: int) -> dict | None:
    """The summary of one round of python/imagenet.py (None: it failed)."""
    outcome = ctx.runner.run(f"resnet50-xscale-r{round_}", [
        str(RUN_SH), sys.executable, "-u", str(REPO / "python/imagenet.py"), "--dummy",
        "-a", "resnet50", "-b", str(ctx.batch_size), "-j", "8", "--amp", "none", "--epochs", "1",
        "--max-steps", str(BENCH_STEPS), "-p", "10"], one_gpu_env(ctx.node))
    return summary_of(outcome.output) if outcome.exit_code == 0 else None


def examples_rate(ctx: Context, round_: int) -> float | None:
    assert ctx.examples is not None
    outcome = ctx.runner.run(f"resnet50-examples-r{round_}", [
        str(RUN_SH), sys.executable, "-u", str(ctx.examples / "imagenet" / "main.py"), "--dummy",
        "-a", "resnet50", "-b", str(ctx.batch_size), "-j", "8", "--epochs", "1", "-p", "1"],
        one_gpu_env(ctx.node), enough=lambda line: any(
            number >= BENCH_STEPS for number, _ in figures.examples_batch_times([line])))
    times = figures.examples_batch_times(outcome.output.splitlines())
    return figures.examples_images_per_s(times, ctx.batch_size, BENCH_WARMUP,
                                         BENCH_STEPS - BENCH_WARMUP)


def gpt_neo_run(ctx: Context, round_: int, compiled: bool) -> dict | None:
    """The summary of one round of gpt_neo_imdb.py, eager or compiled (None: it failed)."""
    model, data = ctx.fixtures.gpt_neo("125m")
    name = f"gpt-neo-125m{'-compiled' if compiled else ''}-r{round_}"
    out = ctx.out / "runs" / name
    outcome = ctx.runner.run(name, [
        str(RUN_SH), sys.executable, "-u", str(REPO / "python/gpt_neo_imdb.py"),
        "--pretrained-model", str(model), "--dataset", str(data), "--model-name", "bench",
        "--output-path", str(out), "--logging-path", str(out / "logs"), "--no-resume",
        "--max-steps", str(BENCH_STEPS), "--batch-size", str(GPT_BATCH), "--max-length",
        str(GPT_SEQ_LEN), "--num-workers", "2", "--logging-steps", "10", "--save-steps", "100000",
        "--eval-steps", "100000", "--eval-batch-size", str(GPT_BATCH), "--sample-reviews", "0",
        *(["--compile"] if compiled else [])], one_gpu_env(ctx.node))
    return summary_of(outcome.output) if outcome.exit_code == 0 else None


def gpt_neo_shape() -> figures.TransformerShape:
    """The 125M fixture's shape at the measured sequence length."""
    from tests.fixtures.tiny_gpt_neo import SHAPES
    return figures.gpt_neo_shape(SHAPES["125m"], GPT_SEQ_LEN)


def check_throughput(ctx: Context) -> list[Check]:
    ours, theirs, eager, compiled = [], [], [], []
    for round_ in range(1, ctx.rounds + 1):  # A B C D, A B C D: a drift hits every side alike
        ours.append(imagenet_run(ctx, round_))
        if ctx.examples is not None:
            theirs.append(examples_rate(ctx, round_))
        eager.append(gpt_neo_run(ctx, round_, compiled=False))
        compiled.append(gpt_neo_run(ctx, round_, compiled=True))
    eager_row = gpt_neo_row(ctx, eager, compiled=False)
    return [resnet_row(ctx, ours, theirs), eager_row,
            gpt_neo_row(ctx, compiled, compiled=True, eager_rate=eager_row.figures["tokens_s"])]


def check_snapshots(ctx: Context) -> Check:
    name = "snapshots side stream"
    outcome = ctx.runner.run("snapshots", [
        sys.executable, str(REPO / "tests" / "bench" / "snapshots.py"), "--device",
        ctx.node.device, "--rounds", str(SNAPSHOT_ROUNDS), "--steps", "10"], child_env())
    return failed_run(name, outcome, ctx.runner.timeout_s) or judge_snapshots(name,
                                                                             outcome.output)


def median_of(summaries: list[dict | None], key: str) -> float | None:
    """The median of KEY over the rounds' summaries that have it."""
    return median([summary[key] for summary in summaries
                   if summary and summary.get(key) is not None])


def resnet_row(ctx: Context, ours: list[dict | None], theirs: list[float | None]) -> Check:
    name = "throughput resnet50"
    mine = [summary["samples_per_s"] for summary in ours
            if summary and summary.get("samples_per_s")]
    other = [rate for rate in theirs if rate]
    shown = {"batch": ctx.batch_size, "precision": "fp32", "compile": "off",
             "xscale_img_s": median(mine), "examples_img_s": median(other),
             "ratio": figures.ratio_of_medians(mine, other),
             "verdict_mfu": median_of(ours, "mfu")}
    if len(mine) < len(ours):
        return Check(name, FAIL, "python/imagenet.py gave no throughput in a round (its log in "
                                 "logs/resnet50-xscale-r*.log)", shown)
    if ctx.examples is None:
        return Check(name, SKIP, "no pytorch/examples checkout: git clone https://github.com/"
                                 "pytorch/examples and pass --examples DIR (or "
                                 "XSCALE_EXAMPLES_DIR)", shown)
    if len(other) < len(theirs):
        return Check(name, FAIL, "pytorch/examples' main.py gave no throughput in a round (its "
                                 "log in logs/resnet50-examples-r*.log)", shown)
    return Check(name, PASS, f"ratio = xscale / pytorch-examples, medians of {ctx.rounds} "
                             "interleaved rounds, fp32", shown)


def gpt_neo_row(ctx: Context, summaries: list[dict | None], compiled: bool,
                eager_rate: float | None = None) -> Check:
    """Tokens/s and two MFUs: the formula's (6N + attention, below) and the verdict's (the run's
    own count of its first step, xscale.observe.flops), with what the run used. The compiled
    row also fails when it is not COMPILE_GAIN times as fast as the eager one (EAGER_RATE): on
    an H200 the compiled step took 38 ms against 94, and a compile that never took effect (the
    FLOP count once kept it from compiling) would otherwise pass unseen."""
    name = f"throughput gpt-neo-125m{' compiled' if compiled else ''}"
    rates = [summary["tokens_per_s"] for summary in summaries
             if summary and summary.get("tokens_per_s")]
    shape = gpt_neo_shape()
    peak = peaks.peak_for(ctx.node.name, "bf16")
    rate = median(rates)
    attention = {summary.get("attention") for summary in summaries if summary}
    shown = {"attention": ",".join(sorted(map(str, attention))) or None,
             "compile": "on" if compiled else "off", "precision": "bf16", "tokens_s": rate,
             "flops_per_token": figures.flops_per_token(shape), "peak_tflops": peak.tflops,
             "mfu": figures.mfu(rate, shape, peak) if rate else None,
             "verdict_mfu": median_of(summaries, "mfu")}
    if len(rates) < len(summaries):
        logs = f"logs/gpt-neo-125m{'-compiled' if compiled else ''}-r*.log"
        return Check(name, FAIL, f"gpt_neo_imdb.py gave no tokens/s in a round (its log in "
                                 f"{logs})", shown)
    if compiled and eager_rate:
        shown["speed_up"] = rate / eager_rate
        if rate < COMPILE_GAIN * eager_rate:
            return Check(name, FAIL, f"compiled, {rate:,.0f} tokens/s: not {COMPILE_GAIN}x the "
                                     f"eager {eager_rate:,.0f}; did the model compile? (logs/"
                                     "gpt-neo-125m-compiled-r*.log)", shown)
    if peak.tflops is None:
        return Check(name, PASS, f"MFU unknown: {peak.source}", shown)
    return Check(name, PASS, f"bf16, {GPT_BATCH} x {GPT_SEQ_LEN} tokens per step; peak: "
                             f"{peak.source}", shown)


def median(values: list[float]) -> float | None:
    import statistics
    return statistics.median(values) if values else None


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def guarded(name: str, check: Callable[[], Check | list[Check]]) -> list[Check]:
    """A check that crashes (a fixture that cannot be built, a JSON it cannot read) is that
    check's failure, with the exception in one line; the others still run."""
    try:
        result = check()
    except Exception as error:  # noqa: BLE001  (reported as the row's failure)
        first_line = (str(error).strip().splitlines() or [""])[0][:200]
        return [Check(name, FAIL, f"{type(error).__name__}: {first_line}")]
    return result if isinstance(result, list) else [result]


def run_checks(ctx: Context, groups: set[str]) -> list[Check]:
    checks: list[Check] = []
    if ctx.node.count == 1:
        checks.append(Check("all GPUs", SKIP, "this node has 1 GPU: the runs on 1 GPU are all"))
    for launch in ctx.launches():
        if "trainers" in groups:
            for trainer in TRAINERS:
                checks += guarded(f"{trainer.name} {launch.label}",
                                  lambda t=trainer, la=launch: check_trainer(ctx, t, la))
        if "doctor" in groups:
            checks += guarded(f"doctor {launch.label}", lambda la=launch: check_doctor(ctx, la))
    if "profile" in groups:
        checks += guarded("profile rank 0", lambda: check_profile(ctx))
    if "throughput" in groups:
        checks += guarded("throughput", lambda: check_throughput(ctx))
    if "snapshots" in groups:
        checks += guarded("snapshots", lambda: check_snapshots(ctx))
    return checks


GROUPS = ("trainers", "doctor", "profile", "throughput", "snapshots")


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not argparse's usage and message
        raise UsageError(message)


def parse_args(argv: list[str], environ: Mapping[str, str]) -> argparse.Namespace:
    parser = Parser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "build" / "gpu-check",
                        help="result.json, logs/, fixtures/ and the runs' files (default "
                             "build/gpu-check)")
    parser.add_argument("--examples", type=Path,
                        default=Path(environ["XSCALE_EXAMPLES_DIR"])
                        if environ.get("XSCALE_EXAMPLES_DIR") else None,
                        help="a checkout of github.com/pytorch/examples for the resnet50 "
                             "comparison (default $XSCALE_EXAMPLES_DIR; without it that row is "
                             "skipped)")
    parser.add_argument("--only", default=",".join(GROUPS),
                        help=f"comma-separated groups of checks (default: all of {GROUPS})")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved throughput rounds")
    parser.add_argument("--batch-size", type=int, default=128,
                        help="resnet50's images per step on the one GPU (both programs)")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per run")
    args = parser.parse_args(argv)
    groups = set(filter(None, args.only.split(",")))
    if not groups or groups - set(GROUPS):
        raise UsageError(f"--only '{args.only}': expected some of {','.join(GROUPS)}")
    args.only = groups
    if args.rounds < 1 or args.batch_size < 1 or args.timeout <= 0:
        raise UsageError("--rounds, --batch-size and --timeout must be positive")
    if args.examples is not None and not (args.examples / "imagenet" / "main.py").is_file():
        raise UsageError(f"--examples '{args.examples}' has no imagenet/main.py (a checkout of "
                         "github.com/pytorch/examples)")
    try:
        settings.value(peaks.PEAK_VARIABLE, environ)
    except settings.UserError as error:
        raise UsageError(str(error)) from None
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv, os.environ)
    found = detect()
    if isinstance(found, str):
        print(f"{PROG}: no GPU found ({found}); nothing checked", flush=True)
        return 0
    node = found
    print(f"{PROG}: {node.count} x {node.name}, {node.stack}, backend {node.backend}, "
          f"torch {node.torch}", flush=True)
    ctx = Context(node, args.out, Fixtures(args.out / "fixtures"),
                  Runner(args.out / "logs", args.timeout), args.examples, args.rounds,
                  args.batch_size)
    checks = run_checks(ctx, args.only)
    print(render_table(checks), flush=True)
    result = args.out / "result.json"
    write_result(result, checks, node.facts())
    print(f"{PROG}: {result}", flush=True)
    return 1 if any(check.status == FAIL for check in checks) else 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        sys.exit(2)

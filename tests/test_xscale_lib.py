"""python/xscale: unit tests, and the cross-rank parts on a 2-process gloo group started here."""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
import types
from pathlib import Path

import pytest
import torch
from torch import nn
from xscale import (
    accounting,
    checkpoint,
    data,
    dist,
    ds,
    lifecycle,
    profiling,
    runtime,
    staging,
    startup,
)
from xscale.accounting import Throughput
from xscale.lifecycle import UserError

REPO = Path(__file__).resolve().parent.parent
PYTHON_DIR = REPO / "python"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               OMP_NUM_THREADS="1", PYTHONPATH=str(PYTHON_DIR), XSCALE_TIMEOUT_S="60", **extra)
    return env


# ---------------------------------------------------------------------------------------------
# cli: a UserError is one line and exit status 2
# ---------------------------------------------------------------------------------------------


def test_user_error_becomes_one_line_and_status_2(capsys):
    def main() -> int:
        raise UserError("--data '/nowhere': no such directory")

    assert lifecycle.run(main, prog="trainer.py") == 2
    err = capsys.readouterr().err
    assert err == "trainer.py: error: --data '/nowhere': no such directory\n"


def test_cli_run_passes_statuses_through():
    assert lifecycle.run(lambda: None, prog="t") == 0
    assert lifecycle.run(lambda: 3, prog="t") == 3

    def exits() -> int:
        raise SystemExit(2)

    assert lifecycle.run(exits, prog="t") == 2


def test_user_error_in_a_real_process_has_no_traceback(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(
        "from xscale import lifecycle\n"
        "from xscale.lifecycle import UserError\n"
        "def main():\n    raise UserError('bad value')\n"
        "lifecycle.main_entry(main, prog='prog.py')\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(PYTHON_DIR)}, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == "prog.py: error: bad value\n"
    assert proc.stdout == ""


# ---------------------------------------------------------------------------------------------
# dist: the rank variables, checked
# ---------------------------------------------------------------------------------------------


def test_no_rank_variables_is_one_process():
    assert dist.read_placement({}) == dist.Placement(0, 1, 0, 1, 0, 1)


def test_placement_from_torchrun_names():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "NODE_RANK": "1", "NNODES": "2"}
    assert dist.read_placement(env) == dist.Placement(3, 4, 1, 2, 1, 2)


def test_placement_defaults_when_only_rank_and_world_are_set():
    assert dist.read_placement({"RANK": "2", "WORLD_SIZE": "4", "NNODES": "2"}) == \
        dist.Placement(2, 4, 0, 2, 1, 2)


@pytest.mark.parametrize("env, message", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not a whole number"),
    ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not a whole number"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is outside 0..1"),
    ({"RANK": "0"}, "WORLD_SIZE (--world-size) is not set"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be at least 1"),
    ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
     "LOCAL_RANK=2 is outside 0..1"),
    ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "8"}, "LOCAL_WORLD_SIZE=8"),
    ({"RANK": "1", "WORLD_SIZE": "4", "NODE_RANK": "3", "NNODES": "2"}, "NODE_RANK=3"),
])
def test_bad_rank_variables_are_user_errors(env, message):
    with pytest.raises(UserError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        dist.read_placement(env)


def test_command_line_rank_must_agree_with_the_launcher():
    env = {"RANK": "1", "WORLD_SIZE": "4"}
    assert dist.read_placement(env, rank=1, world_size=4).rank == 1
    with pytest.raises(UserError, match="--rank 2 disagrees with RANK=1"):
        dist.read_placement(env, rank=2)
    with pytest.raises(UserError, match="--world-size 8 disagrees with WORLD_SIZE=4"):
        dist.read_placement(env, world_size=8)
    # pytorch/examples style, no launcher variables: the command line alone.
    assert dist.read_placement({}, rank=1, world_size=2).world_size == 2


def test_timeout_from_the_environment():
    assert dist.timeout_from_env({}).total_seconds() == 600
    assert dist.timeout_from_env({"XSCALE_TIMEOUT_S": "30"}).total_seconds() == 30
    with pytest.raises(UserError, match="XSCALE_TIMEOUT_S='soon'"):
        dist.timeout_from_env({"XSCALE_TIMEOUT_S": "soon"})


@pytest.fixture
def fake_machine(monkeypatch):
    """Fake only the outermost facts torch reports (which accelerator, how many devices are
    visible, whether xccl is built in, whether oneccl_bindings_for_pytorch is installed, HIP's
    version); everything xscale derives from them runs for real."""

    def install(kind: str | None, count: int = 0, *, xccl: bool = False, ccl: bool = False,
                hip: bool = False) -> None:
        device = None if kind is None else torch.device(kind)
        monkeypatch.setattr(torch.accelerator, "current_accelerator",
                            lambda check_available=False: device)
        monkeypatch.setattr(torch.accelerator, "device_count", lambda: count)
        monkeypatch.setattr(torch.distributed, "is_xccl_available", lambda: xccl)
        monkeypatch.setattr(torch.version, "hip", "6.2.41134" if hip else None)
        monkeypatch.delitem(sys.modules, "oneccl_bindings_for_pytorch", raising=False)
        if ccl:
            bindings = types.ModuleType("oneccl_bindings_for_pytorch")
            bindings.__spec__ = importlib.machinery.ModuleSpec(bindings.__name__, None)
            monkeypatch.setitem(sys.modules, bindings.__name__, bindings)

    return install


# (machine, LOCAL_RANK, --gpu, --dist-backend, environment) -> (device, backend)
SELECTION = {
    "cuda": (("cuda", 8), 3, None, None, {}, ("cuda:3", "nccl")),
    "rocm, one GCD per rank": (("cuda", 1, {"hip": True}), 5, None, None, {}, ("cuda:0", "nccl")),
    "rocm, --gpu SLURM_LOCALID": (("cuda", 8, {"hip": True}), 0, 6, None, {}, ("cuda:6", "nccl")),
    "xpu with xccl": (("xpu", 12, {"xccl": True}), 11, None, None, {}, ("xpu:11", "xccl")),
    "xpu with xccl and ccl": (("xpu", 12, {"xccl": True, "ccl": True}), 4, None, None, {},
                              ("xpu:4", "xccl")),
    "xpu, older module: ccl": (("xpu", 12, {"ccl": True}), 2, None, None, {}, ("xpu:2", "ccl")),
    "cpu": ((None, 0), 0, None, None, {}, ("cpu", "gloo")),
    "user: --dist-backend wins": (("cuda", 4), 1, None, "gloo", {"XSCALE_BACKEND": "nccl"},
                                  ("cuda:1", "gloo")),
    "user: XSCALE_BACKEND": (("xpu", 12, {"xccl": True, "ccl": True}), 0, None, None,
                             {"XSCALE_BACKEND": "CCL"}, ("xpu:0", "ccl")),
}


@pytest.mark.parametrize("case", SELECTION, ids=list(SELECTION))
def test_device_and_backend_follow_the_accelerator(fake_machine, case):
    machine, local_rank, gpu, requested, environ, (device, backend) = SELECTION[case]
    fake_machine(*machine[:2], **(machine[2] if len(machine) > 2 else {}))
    accel = dist.probe_accelerator()
    chosen = dist.choose_device(local_rank, gpu, accel=accel, environ=environ)
    assert str(chosen) == device
    assert dist.choose_backend(requested, chosen, accel, environ=environ) == backend


# (machine, LOCAL_RANK, --gpu required, --dist-backend, environment) -> the one error line
BAD_SELECTION = {
    "xccl without an XPU": ((None, 0), 0, False, "xccl", {},
                            "backend xccl needs an Intel GPU (XPU) and this rank runs on cpu"),
    "nccl on the CPU": ((None, 0), 0, False, None, {"XSCALE_BACKEND": "nccl"},
                        "backend nccl needs a CUDA or ROCm GPU"),
    "--gpu without any accelerator": ((None, 0), 0, True, None, {},
                                      "a GPU was asked for (--gpu) but torch"),
    "LOCAL_RANK beyond the visible": (("cuda", 4), 6, False, None,
                                      {"CUDA_VISIBLE_DEVICES": "0,1,2,3"},
                                      "cuda device 6 asked for (LOCAL_RANK or --gpu) but only 4 "
                                      "are visible (CUDA_VISIBLE_DEVICES=0,1,2,3)"),
    "xpu without any oneCCL": (("xpu", 12), 0, False, None, {},
                               "sees Intel GPUs but has no collective backend"),
    "xccl asked, only ccl": (("xpu", 12, {"ccl": True}), 0, False, "xccl", {},
                             "backend xccl is not built into torch"),
    "a misspelt backend": (("cuda", 4), 0, False, "ncl", {}, "backend 'ncl' is not one of"),
}


@pytest.mark.parametrize("case", BAD_SELECTION, ids=list(BAD_SELECTION))
def test_impossible_device_or_backend_is_a_user_error(fake_machine, case):
    machine, local_rank, require_gpu, requested, environ, message = BAD_SELECTION[case]
    fake_machine(*machine[:2], **(machine[2] if len(machine) > 2 else {}))
    accel = dist.probe_accelerator()
    with pytest.raises(UserError) as error:
        chosen = dist.choose_device(local_rank, require_gpu=require_gpu, accel=accel,
                                    environ=environ)
        dist.choose_backend(requested, chosen, accel, environ=environ)
    assert message in str(error.value), str(error.value)
    assert "\n" not in str(error.value)


def test_this_machine_for_real_is_the_cpu_with_gloo():
    """No fakes: what this CPU-only test machine reports, and a process group on it."""
    accel = dist.probe_accelerator()
    if accel.type is not None:
        pytest.skip(f"this machine has a {accel.type} accelerator")
    assert dist.choose_device(0, environ={}) == torch.device("cpu")
    assert dist.choose_backend(None, torch.device("cpu"), environ={}) == "gloo"
    with pytest.raises(UserError, match="a GPU was asked for"):
        dist.choose_device(0, require_gpu=True)


# ---------------------------------------------------------------------------------------------
# checkpoint: atomic, found by step, the last K kept
# ---------------------------------------------------------------------------------------------


def test_checkpoints_are_found_by_step_not_by_name_or_time(tmp_path):
    for step in (5, 100, 12):  # written out of order: the newest file is not the newest step
        checkpoint.save(tmp_path, step, {"step": step, "payload": torch.tensor([step])}, keep=10)
    checkpoint.save(tmp_path, 1000000, {"step": 1000000}, keep=10)  # past the zero padding
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [5, 12, 100, 1000000]
    assert checkpoint.load_latest(tmp_path)["step"] == 1000000
    assert checkpoint.checkpoint_path(tmp_path, 123).name == "ckpt-000123.pt"


def test_only_the_newest_k_are_kept(tmp_path):
    for step in range(1, 7):
        checkpoint.save(tmp_path, step * 10, {"step": step * 10}, keep=3)
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [40, 50, 60]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-000040.pt", "ckpt-000050.pt", "ckpt-000060.pt"]


def test_a_save_that_dies_midway_leaves_the_previous_checkpoint_intact(tmp_path):
    checkpoint.save(tmp_path, 10, {"step": 10, "weights": torch.ones(4)})

    def dies_midway(obj, handle):
        handle.write(b"half a checkpoint")
        raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space left"):
        checkpoint.atomic_save({"step": 20}, checkpoint.checkpoint_path(tmp_path, 20),
                               writer=dies_midway)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-000010.pt"]  # no temp, no ckpt-20
    assert checkpoint.load_latest(tmp_path)["step"] == 10


def test_leftover_temporaries_are_ignored_and_cleaned(tmp_path):
    (tmp_path / ".ckpt-abc.tmp").write_bytes(b"killed during a save")
    assert checkpoint.load_latest(tmp_path) is None
    checkpoint.save(tmp_path, 1, {"step": 1})
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-000001.pt"]


def test_an_unreadable_newest_checkpoint_falls_back_to_the_previous(tmp_path, capsys):
    checkpoint.save(tmp_path, 10, {"step": 10})
    checkpoint.checkpoint_path(tmp_path, 20).write_bytes(b"not a torch file")
    assert checkpoint.load_latest(tmp_path)["step"] == 10
    assert "cannot read" in capsys.readouterr().err


def test_no_directory_means_no_checkpoint(tmp_path):
    assert checkpoint.load_latest(tmp_path / "missing") is None


def test_a_background_save_is_published_whole_and_holds_the_state_it_was_given(tmp_path,
                                                                            monkeypatch):
    """XSCALE_CHECKPOINT_MODE=async: the call returns with the write under way (held here at its
    fsync, as slow storage holds it); until it is published the previous checkpoint is the
    newest, and training that changes the weights meanwhile does not change what is written."""
    checkpoint.save(tmp_path, 10, {"step": 10})
    durable, real_fsync = threading.Event(), os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (durable.wait(30), real_fsync(fd)))
    model = nn.Linear(3, 2)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    saver = checkpoint.TrainingSaver(tmp_path, model, optimizer, None, is_main=True, keep=3,
                                     mode="async", extra={})
    assert saver(20, 0) == checkpoint.checkpoint_path(tmp_path, 20)
    with torch.no_grad():
        model.weight.add_(1.0)  # the next steps train on
    assert [step for step, _ in checkpoint.list_checkpoints(tmp_path)] == [10]
    assert list(tmp_path.glob(".ckpt-*.tmp"))  # being written
    durable.set()
    saver.wait()
    state = checkpoint.load_latest(tmp_path)
    assert state["step"] == 20
    assert all(torch.equal(state["model"][name], before[name]) for name in before)


def test_a_background_write_that_failed_fails_the_next_save(tmp_path):
    writer = checkpoint.BackgroundWriter()

    def full_disk():
        raise OSError("No space left on device")

    writer.start(full_disk)
    with pytest.raises(OSError, match="No space left"):
        writer.wait()
    writer.wait()  # reported once


def test_auto_takes_youngs_interval_from_the_save_cost_and_the_jobs_failure_rate():
    # 1,024 nodes of Meta's Llama 3 rate: a failure every 6.2 hours. A save that stops training
    # 2 s: sqrt(2 x 2 s x 22,270 s) = 298 s, at 0.5 s a step 597 steps.
    job_mtbf_s = checkpoint.NODE_MTBF_H * 3600 / 1024
    every, seconds, mtbf = checkpoint.auto_interval(2.0, 1.0, 0.5, 1024, checkpoint.NODE_MTBF_H)
    assert mtbf == pytest.approx(job_mtbf_s)
    assert seconds == pytest.approx(math.sqrt(2 * 2.0 * job_mtbf_s))
    assert every == math.ceil(seconds / 0.5) == 597
    # A background write longer than that sets the floor; one step is the least.
    assert checkpoint.auto_interval(0.01, 400.0, 0.5, 1024, checkpoint.NODE_MTBF_H)[:2] == (
        800, 400.0)
    assert checkpoint.auto_interval(0.0, 0.0, 10.0, 1, 1.0)[0] == 1


@pytest.mark.parametrize("text, expected", [("auto", "auto"), ("0", 0), ("250", 250)])
def test_checkpoint_every_is_a_whole_number_or_auto(text, expected):
    assert checkpoint.every_argument(text) == expected


@pytest.mark.parametrize("text", ["-1", "1.5", "often", ""])
def test_checkpoint_every_rejects_anything_else(text):
    with pytest.raises(argparse.ArgumentTypeError, match="neither a whole number nor auto"):
        checkpoint.every_argument(text)


def test_checkpoint_settings_are_checked():
    assert checkpoint.checkpoint_mode({}) == "async"
    assert checkpoint.checkpoint_mode({"XSCALE_CHECKPOINT_MODE": "sync"}) == "sync"
    with pytest.raises(UserError, match="XSCALE_CHECKPOINT_MODE='Async' is neither"):
        checkpoint.checkpoint_mode({"XSCALE_CHECKPOINT_MODE": "Async"})
    assert checkpoint.node_mtbf_hours({}) == checkpoint.NODE_MTBF_H
    assert checkpoint.node_mtbf_hours({"XSCALE_NODE_MTBF_H": "5000"}) == 5000.0
    for bad in ("0", "-2", "nan", "inf", "many"):
        with pytest.raises(UserError, match="not a positive number of hours"):
            checkpoint.node_mtbf_hours({"XSCALE_NODE_MTBF_H": bad})


def test_training_state_round_trip_restores_weights_optimizer_and_random_stream(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    state = checkpoint.training_state(model, optimizer, step=7, epoch=1)
    checkpoint.save(tmp_path, 7, state)
    expected_draw = torch.rand(3)  # what the stream gives right after the save

    fresh = nn.Linear(3, 2)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.1)
    torch.manual_seed(123)  # a different stream, to be replaced
    step, epoch = checkpoint.restore_training_state(
        checkpoint.load_latest(tmp_path), fresh, fresh_optimizer)
    assert (step, epoch) == (7, 1)
    assert accounting.param_digest(fresh) == accounting.param_digest(model)
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 1
    assert torch.equal(torch.rand(3), expected_draw)


# ---------------------------------------------------------------------------------------------
# summary: the digest that proves replicas are identical
# ---------------------------------------------------------------------------------------------


class Wrapper(nn.Module):
    """Stands in for DDP / a DeepSpeed engine: the real model in `.module`."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(2))


def test_param_digest_is_stable_and_sees_one_ulp():
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    first = accounting.param_digest(model)
    assert first == accounting.param_digest(model)
    assert len(first) == 64 and int(first, 16) >= 0
    with torch.no_grad():
        weight = model[0].weight
        weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(float("inf")))
    assert accounting.param_digest(model) != first


def test_param_digest_ignores_wrappers_and_buffers_but_not_dtype():
    model = small_net()
    model(torch.randn(2, 3, 5, 5))  # materialise the lazy layer
    digest = accounting.param_digest(model)
    assert accounting.param_digest(Wrapper(model)) == digest
    model[1].running_mean.add_(1.0)  # BatchNorm statistics differ per rank by design
    assert accounting.param_digest(model) == digest
    assert accounting.param_digest(model.to(torch.bfloat16)) != digest


def test_summary_lines_are_json(capsys):
    accounting.rank_record(rank=1, steps=3, param_digest="ab")
    accounting.emit(trainer="t", world_size=2, loss_first=float("nan"), loss_last=torch.tensor(0.5))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == 'XSCALE_RANK {"rank": 1, "steps": 3, "param_digest": "ab"}'
    assert lines[1].startswith("XSCALE_SUMMARY ")
    record = json.loads(lines[1].split(" ", 1)[1])
    assert record == {"trainer": "t", "world_size": 2, "loss_first": None, "loss_last": 0.5}


# ---------------------------------------------------------------------------------------------
# signals: the handler only sets a flag
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def stop_handlers():
    saved = {s: signal.getsignal(s) for s in lifecycle.STOP_SIGNALS}
    lifecycle.reset_stop()
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)
    lifecycle._installed = False
    lifecycle.reset_stop()


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM])
def test_stop_signal_sets_the_flag_and_the_vote_sees_it(stop_handlers, signum):
    lifecycle.install_stop_handlers()
    assert lifecycle.stop_received() is None
    assert runtime.vote_to_stop() is False
    os.kill(os.getpid(), signum)
    deadline = time.monotonic() + 5
    while lifecycle.stop_received() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # the handler runs between bytecodes of the main thread
    assert lifecycle.stop_received() == signum
    assert runtime.vote_to_stop() is True
    assert lifecycle.signal_name(lifecycle.stop_received()) == signal.Signals(signum).name


# ---------------------------------------------------------------------------------------------
# Two ranks on a real gloo group: reductions, agreement, clean exit
# ---------------------------------------------------------------------------------------------

TWO_RANKS = r'''
import json, os, sys
from pathlib import Path
import torch
from torch import nn
from xscale import accounting, checkpoint, lifecycle, runtime
from xscale.accounting import Throughput
from xscale.lifecycle import UserError
from xscale.dist import init_distributed

ctx = init_distributed()
out = {"rank": ctx.rank, "world": ctx.world_size, "backend": ctx.backend}
# Uneven shards: rank 0 has 3 samples of loss 1.0, rank 1 one sample of loss 5.0. The job's
# mean is 8/4 = 2.0; the mean of the two ranks' means would be 3.0.
if ctx.rank == 0:
    sums = accounting.all_reduce_sums({"loss_sum": 3.0, "samples": 3})
else:
    sums = accounting.all_reduce_sums({"loss_sum": 5.0, "samples": 1})
out["mean_loss"] = accounting.mean(sums, "loss_sum", "samples")
# Accuracy over uneven shards: a model that predicts class 0; rank 0's targets are all 0
# (3 right), rank 1's are [1, 1, 1, 0, 1] (1 right of 5): 4 / 8, not (1.0 + 0.2) / 2.
class Zero(nn.Module):
    def forward(self, x):
        return torch.stack([torch.ones(len(x)), torch.zeros(len(x))], dim=1)
targets = torch.tensor([0, 0, 0]) if ctx.rank == 0 else torch.tensor([1, 1, 1, 0, 1])
result = accounting.evaluate_classifier(Zero(), [(torch.zeros(len(targets), 1), targets)],
                                     ctx.device)
out["accuracy"], out["eval_samples"] = result["accuracy"], result["samples"]
# A stop signal seen by rank 1 only stops both, at the same call.
if ctx.rank == 1:
    lifecycle.request_stop()
out["stop"] = runtime.vote_to_stop()
meter = Throughput(ctx.device, warmup_steps=0)
meter.start(); meter.step(10 * (ctx.rank + 1)); meter.stop()
rates = meter.reduced()
out["rates_sum_ok"] = abs(rates["samples_per_s"] - 2 * rates["samples_per_s_per_rank"]) < 1e-6
# Checkpoints in different directories per rank (node-local storage): refused.
mine = Path(sys.argv[1]) / f"rank{ctx.rank}"
if ctx.rank == 0:
    checkpoint.save(mine, 4, {"step": 4})
try:
    checkpoint.load_latest(mine)
    out["disagreement"] = None
except UserError as error:
    out["disagreement"] = str(error)
# The same directory: every rank resumes from the same step.
shared = Path(sys.argv[1]) / "shared"
if ctx.rank == 0:
    checkpoint.save(shared, 9, {"step": 9})
torch.distributed.barrier()
out["shared_step"] = checkpoint.load_latest(shared)["step"]
rng = checkpoint.gather_rng_states()
out["rng_states"] = len(rng)
print("RESULT " + json.dumps(out), flush=True)
lifecycle.exit_cleanly(int(os.environ.get("EXIT_WITH", "0")))
'''


def run_two_ranks(tmp_path: Path, program: str, *args: str, **extra: str) -> list:
    script = tmp_path / "two_ranks.py"
    script.write_text(program)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=rank_env(rank, 2, port, **extra))
             for rank in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        results.append((proc.returncode, out, err))
    return results


def results_of(runs: list) -> list[dict]:
    records = []
    for code, out, err in runs:
        assert code == 0, err
        line = next(x for x in out.splitlines() if x.startswith("RESULT "))
        records.append(json.loads(line.split(" ", 1)[1]))
    return records


def test_two_ranks_reduce_sums_not_averages_and_agree(tmp_path):
    records = results_of(run_two_ranks(tmp_path, TWO_RANKS, str(tmp_path)))
    for record in records:
        assert record["world"] == 2 and record["backend"] == "gloo"
        assert record["mean_loss"] == pytest.approx(2.0)
        assert record["accuracy"] == pytest.approx(0.5)
        assert record["eval_samples"] == 8
        assert record["stop"] is True
        assert record["rates_sum_ok"] is True
        assert "different newest checkpoints" in record["disagreement"]
        assert record["shared_step"] == 9
        assert record["rng_states"] == 2


def test_exit_cleanly_keeps_the_status_every_time(tmp_path):
    """The gloo abort at interpreter exit (pytorch/pytorch issue 190489) must never replace the
    chosen status."""
    program = ("from xscale import lifecycle\nfrom xscale.dist import init_distributed\n"
               "import os, torch\nctx = init_distributed()\n"
               "torch.distributed.all_reduce(torch.ones(1))\nprint('done', flush=True)\n"
               "lifecycle.exit_cleanly(int(os.environ['EXIT_WITH']))\n")
    for status in (0, 0, 0, 3):
        runs = run_two_ranks(tmp_path, program, EXIT_WITH=str(status))
        assert [code for code, _, _ in runs] == [status, status], runs
        assert all(out == "done\n" for _, out, _ in runs)


def test_single_process_needs_no_master_addr(tmp_path):
    program = ("from xscale import lifecycle\nfrom xscale.dist import init_distributed\n"
               "import torch\nctx = init_distributed()\nt = torch.ones(1)\n"
               "torch.distributed.all_reduce(t)\nprint(ctx.rank, ctx.world_size, t.item())\n"
               "lifecycle.exit_cleanly(0)\n")
    script = tmp_path / "one.py"
    script.write_text(program)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env={**env, "PYTHONPATH": str(PYTHON_DIR)}, timeout=60)
    assert (proc.returncode, proc.stdout) == (0, "0 1 1.0\n"), proc.stderr


def test_missing_master_addr_is_a_user_error(tmp_path):
    script = tmp_path / "p.py"
    script.write_text("from xscale import lifecycle\nfrom xscale.dist import init_distributed\n"
                      "lifecycle.main_entry(init_distributed, prog='p.py')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MASTER_")}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env={**env, "RANK": "0", "WORLD_SIZE": "2",
                               "PYTHONPATH": str(PYTHON_DIR)}, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("p.py: error: MASTER_ADDR is not set")
    assert len(proc.stderr.splitlines()) == 1


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


STAGE = ("import sys, json\nfrom xscale import lifecycle, staging\n"
         "def main():\n"
         "    path = staging.stage_tar(sys.argv[1], sys.argv[2], local_rank=int(sys.argv[3]),\n"
         "                             timeout_s=float(sys.argv[4]), poll_s=0.02)\n"
         "    print(path)\n"
         "sys.exit(lifecycle.run(main, prog='stage'))\n")


def stage_ranks(tar_path: Path, dest: Path, ranks: list[int], timeout_s: float = 60) -> list:
    """Start the waiting ranks first, then local rank 0: they must wait for its marker."""
    env = {**os.environ, "PYTHONPATH": str(PYTHON_DIR)}
    procs = [subprocess.Popen([sys.executable, "-c", STAGE, str(tar_path), str(dest), str(r),
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


# ---------------------------------------------------------------------------------------------
# data: resumable epochs and exact evaluation shards
# ---------------------------------------------------------------------------------------------


def test_shards_cover_each_sample_exactly_once():
    dataset = list(range(10))
    shards = [list(data.ShardSampler(dataset, 4, rank)) for rank in range(4)]
    assert sorted(i for shard in shards for i in shard) == dataset
    assert [len(s) for s in shards] == [3, 3, 2, 2]


def test_a_resumed_run_sees_the_batches_the_uninterrupted_run_would_have():
    dataset = torch.utils.data.TensorDataset(torch.arange(40))

    def batches(start: int, stop: int) -> list[tuple[int, int, list[int]]]:
        sampler = data.ResumableSampler(dataset, num_replicas=2, rank=1, seed=3)
        loader = data.make_loader(dataset, sampler, batch_size=4, workers=0,
                                  device=torch.device("cpu"), drop_last=True)
        return [(step, epoch, batch[0].tolist()) for step, epoch, batch in
                data.train_batches(loader, sampler, start_step=start, epochs=None,
                                   max_steps=stop)]

    whole = batches(0, 12)
    assert [step for step, _, _ in whole] == list(range(12))
    assert [epoch for _, epoch, _ in whole] == [0] * 5 + [1] * 5 + [2] * 2
    assert batches(0, 7) + batches(7, 12) == whole
    assert whole[0][2] != whole[5][2]  # each epoch reshuffled


def test_accumulated_steps_resume_at_the_same_micro_batch():
    dataset = torch.utils.data.TensorDataset(torch.arange(40))

    def batches(start: int, stop: int) -> list[tuple[int, int, list[int]]]:
        sampler = data.ResumableSampler(dataset, num_replicas=2, rank=0, seed=3)
        loader = data.make_loader(dataset, sampler, batch_size=3, workers=0,
                                  device=torch.device("cpu"), drop_last=True)
        return [(step, epoch, batch[0].tolist()) for step, epoch, batch in
                data.train_batches(loader, sampler, start_step=start, epochs=None,
                                   max_steps=stop, accumulation=2)]

    # 20 samples per rank: 6 batches of 3, 3 steps of 2 batches per epoch (2 samples left over).
    whole = batches(0, 7)
    assert [step for step, _, _ in whole] == [s for s in range(7) for _ in (0, 1)]
    assert [epoch for _, epoch, _ in whole] == [0] * 6 + [1] * 6 + [2] * 2
    assert batches(0, 4) + batches(4, 7) == whole


def loop_for_test(save, sync_every: int, accumulation: int = 1) -> runtime.Loop:
    ctx = dist.DistContext(0, 1, 0, 1, 0, 1, torch.device("cpu"), "gloo")
    return runtime.Loop(ctx, "t", "t.py", start_step=0, end_step=None, per_epoch=1000,
                        sync_every=sync_every, save=save, checkpoint_every=4,
                        accumulation=accumulation, batch_size=2)


def test_the_stop_is_voted_every_n_steps_then_saved_once(stop_handlers, capsys):
    """A signal at step 6 stops the loop at the next vote (step 10 with a vote every 5), not
    at once: no collective per step. The checkpoint cadence saved 4 and 8; the stop saves 10,
    once."""
    saved = []
    loop = loop_for_test(lambda step, epoch: saved.append(step) or f"ckpt-{step}", 5)
    dataset = torch.utils.data.TensorDataset(torch.zeros(400, 1))
    sampler = data.ResumableSampler(dataset, num_replicas=1, rank=0)
    loader = data.make_loader(dataset, sampler, batch_size=2, workers=0,
                              device=torch.device("cpu"))
    for _ in loop.batches(loader, sampler):
        loop.record(torch.tensor(1.0), 2)
        if loop.step == 6:
            lifecycle.request_stop()
    loop.finish()
    assert (loop.stopped, loop.step, saved) == (True, 10, [4, 8, 10])
    assert "t.py: stopped by SIGUSR1 at step 10; checkpoint ckpt-10" in capsys.readouterr().out


def test_with_accumulation_a_step_is_n_micro_batches(stop_handlers):
    loop = loop_for_test(None, 3, accumulation=3)
    boundaries = []
    for _ in range(9):
        boundaries.append(loop.boundary)
        loop.record(torch.tensor(1.0), 2)
    assert boundaries == [False, False, True] * 3
    assert loop.step == 3 and loop.meter.steps == 3


WORKERS_AND_SIGNALS = r"""
import os, signal, sys, torch
from torch.utils.data import DataLoader, TensorDataset
from xscale import data, lifecycle
if __name__ == "__main__":
    lifecycle.install_stop_handlers()
    dataset = TensorDataset(torch.arange(64))
    sampler = torch.utils.data.SequentialSampler(dataset)
    if sys.argv[1] == "xscale":  # make_loader: spawn on GPUs, fork on CPUs
        loader = data.make_loader(dataset, sampler, batch_size=4, workers=2,
                                  device=torch.device(sys.argv[2]))
    else:  # a plain DataLoader with the same start method
        method = "spawn" if sys.argv[2] != "cpu" else "fork"
        loader = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=2,
                            persistent_workers=True, multiprocessing_context=method)
    seen = 0
    for epoch in range(2):
        for index, batch in enumerate(loader):
            seen += len(batch[0])
            if epoch == 0 and index == 1:  # workers are up: Slurm signals the whole task
                os.killpg(os.getpgid(0), signal.SIGUSR1)
    print(seen, lifecycle.stop_received() == signal.SIGUSR1, flush=True)
    lifecycle.exit_cleanly(0)
"""


@pytest.mark.parametrize("how, start, survives", [
    ("xscale", "spawn", True), ("xscale", "fork", True),
    # The control: spawned workers start with SIGUSR1's default action, which kills them.
    # (Forked ones inherit the parent's handler, so a plain forked loader proves nothing.)
    ("plain", "spawn", False),
])
def test_loader_workers_survive_slurms_warning_signal(tmp_path, how, start, survives):
    """SIGUSR1 to the whole process group, as Slurm signals a step: make_loader's workers (and
    the resource tracker spawn uses) live on; a plain DataLoader's die of it. The device is
    only the choice of start method here: "cuda" stands for a GPU rank."""
    device = "cuda" if start == "spawn" else "cpu"  # only a name here: no GPU is touched
    script = tmp_path / "workers.py"
    script.write_text(WORKERS_AND_SIGNALS)
    proc = subprocess.run([sys.executable, str(script), how, device], capture_output=True,
                          text=True, timeout=120, start_new_session=True,
                          env={**os.environ, "PYTHONPATH": str(PYTHON_DIR)})
    if survives:
        assert (proc.returncode, proc.stdout) == (0, "128 True\n"), proc.stderr
        for symptom in ("killed by signal", "exited unexpectedly", "Traceback", "leaked"):
            assert symptom not in proc.stderr, proc.stderr
    else:
        # The workers die; how the main process learns it varies (a worker-killed error, or a
        # reset connection while a batch was in flight), but the run always fails.
        assert proc.returncode != 0 and proc.stdout == "", proc.stderr


def test_a_batch_larger_than_a_ranks_share_is_a_user_error():
    sampler = data.ResumableSampler(list(range(10)), num_replicas=4, rank=0)
    with pytest.raises(UserError, match="lower --batch-size"):
        data.steps_per_epoch(sampler, 8)


# ---------------------------------------------------------------------------------------------
# profiling: the window opens and closes at the configured steps
# ---------------------------------------------------------------------------------------------


def test_no_profiling_variables_means_no_window():
    window = profiling.window_from_env(0, torch.device("cpu"), {})
    assert window.mode == "off"
    for step in range(5):
        window.step(step)
    assert not window.active


def test_external_window_is_active_exactly_for_its_steps():
    env = {"XSCALE_PROFILED": "1", "PROFILE_STEP_START": "2", "PROFILE_STEPS": "3"}
    window = profiling.window_from_env(0, torch.device("cpu"), env)
    active = []
    for step in range(8):
        window.step(step)
        active.append(window.active)
    assert active == [False, False, True, True, True, False, False, False]


def test_torch_profiler_writes_this_ranks_trace(tmp_path):
    env = {"XSCALE_TORCH_PROFILER": "1", "PROFILE_STEP_START": "2", "PROFILE_STEPS": "2",
           "PROFILE_DIR": str(tmp_path)}
    window = profiling.window_from_env(3, torch.device("cpu"), env)
    model = nn.Linear(8, 8)
    for step in range(6):
        window.step(step)
        model(torch.randn(4, 8)).sum().backward()
    window.close()
    traces = list((tmp_path / "rank3").glob("rank3*.json"))
    assert len(traces) == 1
    text = traces[0].read_text()
    assert "ProfilerStep#2" in text and "ProfilerStep#3" in text
    assert "ProfilerStep#4" not in text and "ProfilerStep#1" not in text


@pytest.mark.parametrize("name, value", [("PROFILE_STEPS", "0"), ("PROFILE_STEP_START", "ten")])
def test_bad_profile_variables_are_user_errors(name, value):
    with pytest.raises(UserError, match=name):
        profiling.window_from_env(0, torch.device("cpu"), {"XSCALE_PROFILED": "1", name: value})


# ---------------------------------------------------------------------------------------------
# throughput
# ---------------------------------------------------------------------------------------------


def test_throughput_counts_after_the_warmup():
    meter = Throughput(torch.device("cpu"), warmup_steps=1)
    meter.start()
    meter.step(1000)  # the slow first step: not counted
    for _ in range(3):
        meter.step(10, tokens=100)
    meter.stop()
    rates = meter.local()
    assert rates.steps == 4
    assert rates.tokens_per_s == pytest.approx(rates.samples_per_s * 10)
    assert meter.reduced()["samples_per_s"] == pytest.approx(rates.samples_per_s)


# ---------------------------------------------------------------------------------------------
# ds: the DeepSpeed config against the command line (no DeepSpeed needed)
# ---------------------------------------------------------------------------------------------


def test_shipped_deepspeed_configs_parse_and_scale_to_any_world_size():
    configs = REPO / "python" / "configs"
    fp16 = ds.load_config(configs / "ds_fp16_z1.json")
    assert fp16["zero_optimization"]["stage"] == 1 and fp16["fp16"]["enabled"] is True
    assert ds.load_config(configs / "ds_bf16_z2.json")["bf16"]["enabled"] is True
    cpu = ds.load_config(configs / "ds_cpu_z1.json")
    assert cpu["optimizer"]["params"]["torch_adam"] is True
    # The example's 256 on 8 GCDs is 32 each; the same file on 16 ranks keeps 16 each.
    assert ds.batch_sizes(fp16, 8, None)["train_micro_batch_size_per_gpu"] == 32
    scaled = ds.batch_sizes(fp16, 16, None)
    assert (scaled["train_micro_batch_size_per_gpu"], scaled["train_batch_size"]) == (16, 256)
    # --batch-size (already divided per rank) wins, and the total follows the world size.
    given = ds.batch_sizes(cpu, 4, 512)
    assert (given["train_micro_batch_size_per_gpu"], given["train_batch_size"]) == (512, 2048)
    assert ds.set_learning_rate(cpu, 0.5)["optimizer"]["params"] == {**cpu["optimizer"]["params"],
                                                                     "lr": 0.5}
    assert ds.set_learning_rate(cpu, None) is cpu
    with pytest.raises(UserError, match="less than one sample per rank"):
        ds.batch_sizes({"train_batch_size": 4}, 8, None)


def test_bad_deepspeed_configs_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        ds.load_config(tmp_path / "missing.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="expected a JSON object"):
        ds.load_config(tmp_path / "list.json")


# ---------------------------------------------------------------------------------------------
# report: the readable summary of a job's output
# ---------------------------------------------------------------------------------------------


def test_report_reads_a_run_that_resumed_and_took_no_step(tmp_path):
    """A requeued job whose checkpoint was already at the last step logs no loss: the
    summary's losses are null, and the report says so instead of crashing."""
    record = {"trainer": "mnist_ddp", "world_size": 4, "nodes": 2, "start_step": 60,
              "steps": 60, "samples_per_s": 0.0, "tokens_per_s": None, "loss_first": None,
              "loss_last": None, "seconds": 3.5, "stopped_early": False, "accuracy": 0.97}
    output = tmp_path / "job.out"
    output.write_text("xscale: launcher=slurm site=generic nodes=2 master=nid001:29500\n"
                      'XSCALE_RANK {"rank": 0, "node": "nid001"}\n'
                      'XSCALE_RANK {"rank": 2, "node": "nid002"}\n'
                      f"XSCALE_SUMMARY {json.dumps(record)}\n")
    proc = subprocess.run([sys.executable, "-m", "xscale.report", str(output)],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(PYTHON_DIR)})
    assert proc.returncode == 0, proc.stderr
    assert "none logged (0 steps taken, at step 60)" in proc.stdout
    assert "4 ranks on 2 nodes (nid001, nid002)" in proc.stdout
    assert "0 samples/s" in proc.stdout  # tokens_per_s null: the samples' rate instead


# ---------------------------------------------------------------------------------------------
# start-up phases: per rank, their aggregate, the report's table and picture
# ---------------------------------------------------------------------------------------------


def test_bash_clocks_parse_in_any_locale_and_absent_ones_are_unknown():
    assert startup.parse_clock("1700000000.250000") == 1700000000.25
    assert startup.parse_clock("1700000000,250000") == 1700000000.25  # de_DE, fr_FR
    assert startup.parse_clock("") is None  # bash before 5 has no EPOCHREALTIME
    assert startup.parse_clock(None) is None
    assert startup.parse_clock("soon") is None


def test_phases_are_differences_of_moments_and_a_missing_one_is_unknown():
    moments = {"launch": None, "run_sh": 100.0, "exec": 100.012, "imports": 103.0,
               "group": 103.5, "first_step": 105.25}
    assert startup.durations(moments) == {"launch": None, "run_sh": 0.012, "imports": 2.988,
                                          "group": 0.5, "first_step": 1.75, "total": None}
    launched = startup.durations({**moments, "launch": 99.5})
    assert (launched["launch"], launched["total"]) == (0.5, 5.75)


def test_moments_come_from_run_sh_and_the_batch_script(monkeypatch):
    environ = {"XSCALE_LAUNCH_T": "10.5", "XSCALE_T_RUNSH": "11,0", "XSCALE_T_EXEC": "11.25"}
    found = startup.moments(environ)
    assert (found["launch"], found["run_sh"], found["exec"]) == (10.5, 11.0, 11.25)
    assert found["imports"] is not None  # importing xscale marked it
    assert startup.moments({})["launch"] is None


def phases_of(launch, run_sh, imports, group, first_step):
    known = [launch, run_sh, imports, group, first_step]
    total = None if None in known else round(sum(known), 3)
    return {"launch": launch, "run_sh": run_sh, "imports": imports, "group": group,
            "first_step": first_step, "total": total}


RANKS = [
    startup.RankPhases(0, "nid001", phases_of(0.4, 0.01, 2.5, 0.3, 1.2)),
    startup.RankPhases(1, "nid001", phases_of(0.5, 0.01, 2.7, 0.2, 1.2)),
    startup.RankPhases(2, "nid002", phases_of(0.6, 0.01, 6.1, 0.1, 1.1)),
    startup.RankPhases(3, "nid002", phases_of(None, 0.01, 2.1, 0.1, 1.1)),
]


def test_the_aggregate_is_the_median_and_the_slowest_rank_with_its_node():
    summary = startup.aggregate(RANKS)
    assert tuple(summary) == startup.NAMES
    assert summary["imports"] == {"median": 2.6, "slowest": 6.1, "rank": 2, "node": "nid002",
                                  "ranks": 4}
    # Rank 3 has no launch time: the launch phase is over the three ranks that know it.
    assert summary["launch"] == {"median": 0.5, "slowest": 0.6, "rank": 2, "node": "nid002",
                                 "ranks": 3}
    assert summary["run_sh"]["rank"] == 0  # a tie: the lowest rank
    unknown = startup.aggregate([startup.RankPhases(0, "n", phases_of(None, None, 1, 1, 1))])
    assert unknown["launch"] == {"median": None, "slowest": None, "rank": None, "node": None,
                                 "ranks": 0}
    lines = startup.table(unknown)
    assert "unknown" in next(line for line in lines if line.split()[0] == "launch")


def test_each_node_is_drawn_as_its_slowest_rank():
    rows = startup.slowest_per_node(RANKS)
    assert [(row.node, row.rank) for row in rows] == [("nid001", 1), ("nid002", 2)]


def job_output(tmp_path: Path, ranks: list[startup.RankPhases]) -> Path:
    summary = {"trainer": "mnist_ddp", "world_size": len(ranks), "nodes": 2, "start_step": 0,
               "steps": 3, "samples_per_s": 10.0, "tokens_per_s": None, "loss_first": 2.3,
               "loss_last": 2.1, "seconds": 9.5, "stopped_early": False}
    lines = [f"XSCALE_RANK {json.dumps({'rank': r.rank, 'node': r.node, 'startup': r.phases})}"
             for r in ranks]
    output = tmp_path / "job.out"
    output.write_text("\n".join([*lines, f"XSCALE_SUMMARY {json.dumps(summary)}"]) + "\n")
    return output


def report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "xscale.report", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(PYTHON_DIR)})


def colour_rows(image, colour) -> set[int]:
    """The pixel rows where `colour` appears (the legend's included)."""
    width, height = image.size
    pixels = image.load()
    return {y for y in range(height) for x in range(width) if pixels[x, y] == colour}


def test_report_prints_the_phase_table_and_draws_one_row_per_node(tmp_path):
    from PIL import Image
    from xscale import picture

    proc = report(str(job_output(tmp_path, RANKS)), "--png")
    assert proc.returncode == 0, proc.stderr
    imports = next(line for line in proc.stdout.splitlines() if line.split()[:1] == ["imports"])
    assert imports.split()[1:4] == ["2.600s", "6.100s", "2@nid002"]
    image = Image.open(tmp_path / "job.out.startup.png")
    assert image.format == "PNG" and image.size[0] == picture.WIDTH
    height = picture.row_height(2)
    bars = range(picture.HEADER, picture.HEADER + 2 * height)
    for phase, colour in picture.COLOURS.items():
        rows = colour_rows(image.convert("RGB"), colour) & set(bars)
        # Every phase is drawn on both nodes' rows (run.sh's 10 ms is a pixel wide at least).
        assert {(y - picture.HEADER) // height for y in rows} == {0, 1}, phase


def test_a_phase_no_rank_recorded_is_left_out_of_the_picture(tmp_path):
    from PIL import Image
    from xscale import picture

    unlaunched = [startup.RankPhases(r.rank, r.node, {**r.phases, "launch": None, "total": None})
                  for r in RANKS]
    proc = report(str(job_output(tmp_path, unlaunched)), "--png")
    assert proc.returncode == 0, proc.stderr
    assert "unknown" in next(line for line in proc.stdout.splitlines()
                             if line.split()[:1] == ["launch"])
    image = Image.open(tmp_path / "job.out.startup.png").convert("RGB")
    bars = set(range(picture.HEADER, image.size[1] - picture.FOOTER))
    assert not colour_rows(image, picture.COLOURS["launch"]) & bars
    assert colour_rows(image, picture.COLOURS["imports"]) & bars


@pytest.mark.parametrize("case", ["no file", "no phases"])
def test_report_input_errors_are_one_line_and_status_2(tmp_path, case):
    if case == "no file":
        proc = report(str(tmp_path / "missing.out"))
    else:  # an output from before the phases were recorded: fine as text, no picture
        output = tmp_path / "old.out"
        output.write_text('XSCALE_RANK {"rank": 0, "node": "nid001"}\nXSCALE_SUMMARY '
                          '{"trainer": "t", "world_size": 1, "steps": 1, "loss_first": 1.0, '
                          '"loss_last": 1.0, "seconds": 1.0, "samples_per_s": 1.0}\n')
        assert report(str(output)).returncode == 0
        proc = report(str(output), "--png")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("xscale.report: error:")


def test_report_joins_the_lines_srun_label_cut_after_1024_bytes():
    """`srun --label python -c "print('A' * 3000)"` prints 1024, 1024 and 952 bytes, each piece
    labelled (Slurm 22.05, on the virtual cluster); a summary that long must still parse."""
    from xscale import records  # the one reader of these lines: report's, and the batch host's
    summary = json.dumps({"steps": 7, "pad": "x" * 2500})
    line = f"XSCALE_SUMMARY {summary}"
    pieces = [line[i:i + records.SRUN_LABEL_CUT] for i in range(0, len(line), 1024)]
    lines = ["1: other rank"] + [f"0: {piece}" for piece in pieces[:2]] + ["1: between"] + \
        [f"0: {piece}" for piece in pieces[2:]] + ["srun: done"]
    assert records.tagged(lines, "XSCALE_SUMMARY") == [json.loads(summary)]
    assert records.unsplit(lines) == ["1: other rank", f"0: {line}", "1: between", "srun: done"]


def test_a_staged_state_keeps_tied_weights_one_tensor():
    shared = torch.ones(3)
    copy = checkpoint.staged({"embedding": shared, "output": shared, "step": 7})
    assert copy["embedding"] is copy["output"] and copy["embedding"] is not shared
    shared.add_(1.0)
    assert torch.equal(copy["output"], torch.ones(3)) and copy["step"] == 7

"""xscale.dist: the rank variables, the device and backend, the process group's rendezvous."""

from __future__ import annotations

import copy
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import types

import pytest
import torch
from xscale import dist
from xscale.lifecycle import UserError

from tests.conftest import REPO

PROGRAMS = REPO / "tests" / "programs"

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


def test_single_process_needs_no_master_addr():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, str(PROGRAMS / "single_process_group.py")],
                          capture_output=True, text=True, env=env, timeout=60)
    assert (proc.returncode, proc.stdout) == (0, "0 1 1.0\n"), proc.stderr


def test_missing_master_addr_is_a_user_error():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MASTER_")}
    proc = subprocess.run([sys.executable, str(PROGRAMS / "missing_master_addr.py")],
                          capture_output=True, text=True,
                          env={**env, "RANK": "0", "WORLD_SIZE": "2"}, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("p.py: error: MASTER_ADDR is not set")
    assert len(proc.stderr.splitlines()) == 1


# ---------------------------------------------------------------------------------------------
# the doctor's torch child takes the trainers' choice, with the oneCCL import where needed
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def doctor_torch(request):
    """runscripts/lib/doctor_torch.py as doctor.py starts it (by path), and the backend
    registry as it was before the test."""
    backend = torch.distributed.Backend
    saved = {name: copy.copy(getattr(backend, name)) for name in (
        "backend_list", "backend_type_map", "backend_capability", "default_device_backend_map",
        "_plugins")}
    had_ccl = hasattr(backend, "CCL")

    def restore() -> None:
        for name, value in saved.items():
            setattr(backend, name, value)
        if not had_ccl and hasattr(backend, "CCL"):
            delattr(backend, "CCL")

    request.addfinalizer(restore)
    path = REPO / "runscripts" / "lib" / "doctor_torch.py"
    spec = importlib.util.spec_from_file_location("doctor_torch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_doctor_on_an_old_aurora_module_imports_oneccl_and_takes_ccl(
        fake_machine, doctor_torch, tmp_path, monkeypatch):
    """Aurora's frameworks modules before 2025.3.1: torch sees the XPUs but has no xccl; ccl
    comes from oneccl_bindings_for_pytorch, which must be imported to exist. The doctor's child
    makes the trainers' choice (xscale.dist) and imports it, as a trainer does."""
    fake_machine("xpu", 12)  # no xccl, and no bindings module already imported
    shutil.copy(PROGRAMS / "fake_oneccl_bindings_for_pytorch.py",
                tmp_path / "oneccl_bindings_for_pytorch.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.delenv("XSCALE_BACKEND", raising=False)
    xdist = doctor_torch.xscale_dist()
    assert xdist is dist  # the trainers' module, not a copy of its table
    device, backend = doctor_torch.device_and_backend(xdist, xdist.probe_accelerator())
    assert (str(device), backend) == ("xpu:2", "ccl")
    assert "oneccl_bindings_for_pytorch" in sys.modules
    assert "ccl" in torch.distributed.Backend.backend_list

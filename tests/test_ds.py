"""xscale.ds: the DeepSpeed config against the command line (no DeepSpeed needed) and against
the node (prepare: precision, BatchNorm's buffers, the JIT build's arch list, with DeepSpeed's
own engine and builder on this CPU); DeepSpeed's CPU op, which the DeepSpeed runs on the test
bed need, built against this torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn
from xscale import ds
from xscale.lifecycle import UserError

from tests.conftest import REPO, VENV_BIN, tool_env, torch_extensions

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
    assert ds.load_config(configs / "ds_cpu_z3.json") == {
        **cpu, "zero_optimization": {"stage": 3}}  # ZeRO 3 on CPUs: the same but the stage
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


def test_deepspeeds_cpu_op_builds_against_this_torch():
    """DeepSpeed's CPU collectives build in the venv the jobs run in (its C++ against torch's
    headers and libraries), into the directory the bed's DeepSpeed runs share: under make test
    this host-only test usually builds it while the cluster tests run, so theirs is a load."""
    proc = subprocess.run(
        [str(VENV_BIN / "python"), str(REPO / "tests" / "programs" / "deepspeed_shm_op.py")],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
        env=tool_env({"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(torch_extensions())}))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# ds.prepare: the config against the node
# ---------------------------------------------------------------------------------------------


def batchnorm_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 6 * 6, 4))


def test_batchnorm_buffers_are_cast_with_the_weights_under_half_precision_only():
    bf16 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}
    config, line = ds.buffer_cast(bf16, batchnorm_model())
    assert config["data_types"] == {"buffer_dtype": "bf16"}
    assert line.startswith("bf16: BatchNorm's running statistics are cast with the weights")
    fp16, _ = ds.buffer_cast({"fp16": {"enabled": True}}, batchnorm_model())
    assert fp16["data_types"] == {"buffer_dtype": "fp16"}
    # fp32, a model without running statistics, a buffer_dtype of the user's: as they are.
    for config in ({"bf16": {"enabled": False}}, {"fp16": {"enabled": True},
                                                  "data_types": {"buffer_dtype": "fp32"}}):
        assert ds.buffer_cast(config, batchnorm_model()) == (config, None)
    plain = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    assert ds.buffer_cast(bf16, plain) == (bf16, None)


def test_a_precision_the_device_cannot_train_in_names_its_key():
    with pytest.raises(UserError, match=r"config's fp16.enabled asks for fp16, which DeepSpeed's "
                                        r"cpu accelerator cannot train in here: use bf16 or fp32"):
        ds.check_precision(("fp16", "fp16"), {"fp16": False, "bf16": True}, "cpu")
    with pytest.raises(UserError, match=r"bfloat16.enabled asks for bf16.*: use fp16 or fp32"):
        ds.check_precision(("bfloat16", "bf16"), {"fp16": True, "bf16": False}, "cuda")
    ds.check_precision(("bf16", "bf16"), {"fp16": False, "bf16": True}, "cpu")  # no error
    assert ds.half_precision({"bfloat16": {"enabled": True}}) == ("bfloat16", "bf16")
    assert ds.half_precision({"fp16": {"enabled": False}}) is None


DEEPSPEED_BUILDER = """
import os, sys
from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder
builder = FusedAdamBuilder()
builder.jit_mode = True  # as jit_load() sets it before the build
os.environ["TORCH_CUDA_ARCH_LIST"] = sys.argv[1]
try:
    builder.compute_capability_args()
    print("read", os.environ["TORCH_CUDA_ARCH_LIST"])
except ValueError as error:
    print("ValueError", error)
"""


def deepspeed_reads(arch_list: str) -> str:
    """What DeepSpeed's own JIT builder makes of ARCH_LIST (its parse needs no GPU)."""
    proc = subprocess.run([sys.executable, "-c", DEEPSPEED_BUILDER, arch_list],
                          capture_output=True, text=True, timeout=120, check=False,
                          env=tool_env({"DS_ACCELERATOR": "cpu"}))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]


def test_an_arch_list_deepspeed_cannot_read_is_replaced_by_the_nodes_own():
    """NVIDIA's images set TORCH_CUDA_ARCH_LIST=9.0a (PyTorch's name for Hopper with its own
    instructions): DeepSpeed's builder fails on it before compiling anything; the node's own
    architectures build, and faster than a long list."""
    assert deepspeed_reads("9.0a") == "ValueError invalid literal for int() with base 10: '0a'"
    replaced = ds.arch_list_for_deepspeed("9.0a", [(9, 0)])
    assert replaced == "9.0" and deepspeed_reads(replaced).startswith("read 9.0")
    assert ds.arch_list_for_deepspeed("8.0 9.0a;10.0a", [(10, 0), (9, 0), (9, 0)]) == "9.0;10.0"
    assert ds.arch_list_for_deepspeed("8.0;9.0+PTX", [(9, 0)]) is None  # read as it is
    # Only NVIDIA GPUs build from it: nothing to change on this CPU.
    environ = {"TORCH_CUDA_ARCH_LIST": "9.0a"}
    assert ds.fix_arch_list(torch.device("cpu"), environ) is None
    assert environ == {"TORCH_CUDA_ARCH_LIST": "9.0a"}


ENGINE_STEPS = """
import os, sys, json
import torch, deepspeed
from torch import nn
from xscale import ds
from xscale.dist import DistContext, Placement
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[2])
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                      nn.Linear(8 * 6 * 6, 4))
config = {"train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": 1},
          "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
          sys.argv[1]: {"enabled": True}}
ctx = DistContext.at(Placement(0, 1, 0, 1, 0, 1), torch.device("cpu"), None)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                  config=ds.prepare(config, model, ctx))
dtype = next(engine.module.parameters()).dtype
images, labels = torch.randn(16, 3, 8, 8).to(dtype), torch.randint(0, 4, (16,))
losses = []
for _ in range(5):
    loss = nn.functional.cross_entropy(engine(images).float(), labels)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
buffers = engine.module[1].running_mean.dtype
print("RESULT", json.dumps({"params": str(dtype), "buffers": str(buffers), "losses": losses}))
"""


def test_deepspeed_trains_a_batchnorm_model_in_bf16_after_prepare():
    """DeepSpeed 0.19's own engine on this CPU, the seed's BatchNorm case in bf16 (the CPU's
    half precision; fp16 is the same cast on a GPU): without ds.prepare its forward fails on
    float32 running statistics."""
    from tests.helpers import free_port

    proc = subprocess.run([sys.executable, "-c", ENGINE_STEPS, "bf16", str(free_port())],
                          capture_output=True, text=True, timeout=300, check=False,
                          env=tool_env({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "xscale: DeepSpeed: bf16: BatchNorm's running statistics are cast" in proc.stdout
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert (result["params"], result["buffers"]) == ("torch.bfloat16", "torch.bfloat16")
    assert result["losses"][-1] < result["losses"][0], result

"""xscale.ds: the DeepSpeed config against the command line (no DeepSpeed needed); DeepSpeed's
CPU op, which the DeepSpeed runs on the test bed need, built against this torch."""

from __future__ import annotations

import subprocess

import pytest
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

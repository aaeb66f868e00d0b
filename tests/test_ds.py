"""xscale.ds: the DeepSpeed config against the command line (no DeepSpeed needed)."""

from __future__ import annotations

import pytest
from xscale import ds
from xscale.lifecycle import UserError

from tests.conftest import REPO

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

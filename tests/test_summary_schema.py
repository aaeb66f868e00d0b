"""Every trainer ends with the same summary schema (xscale.runlog.SUMMARY_FIELDS, in that order,
then the trainer's own fields), whole in OUTPUT_DIR/xscale-summary.json and, less the per-phase
start-up detail, in its last line `XSCALE_SUMMARY {json}`: what xscale.report, the benchmarks
and the job templates' users read, whichever trainer wrote it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from xscale.runlog import FILE_ONLY, SUMMARY_FIELDS
from xscale.startup import NAMES

from tests.fixtures.imagefolder import write_imagefolder
from tests.fixtures.mnist_idx import write_mnist

REPO = Path(__file__).resolve().parent.parent
EXTENSIONS = REPO / "build" / "torch-extensions"
# The type every common field has in every trainer's summary (None: it may be null).
TYPES = {
    "trainer": str, "world_size": int, "nodes": int, "device": str, "backend": (str, None),
    "start_step": int, "steps": int, "batch_size": int, "global_batch_size": int,
    "accumulation": int, "samples_per_s": float, "samples_per_s_per_rank": float,
    "tokens_per_s": (float, None), "loss_first": float, "loss_last": float, "seconds": float,
    "train_seconds": float, "stopped_early": bool, "signal": (str, None),
    "checkpoint": (str, None), "checkpoint_stall_s": float, "checkpoints_saved": int,
    "startup": dict, "straggler": (dict, None), "summary_file": str,
}


TRAINERS = ("mnist_ddp", "imagenet", "imagenet_deepspeed", "gpt_neo_imdb")


@pytest.fixture(scope="module")
def output_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("schema")


@pytest.fixture(scope="module")
def commands(output_root: Path) -> dict[str, list[str]]:
    from tests.fixtures.tiny_gpt_neo import build

    root = output_root
    mnist = write_mnist(root / "mnist", train=512, test=128)
    images = write_imagefolder(root / "images")
    model, imdb = build(root / "gpt")
    vision = ["-a", "resnet18", "--image-size", "32", "-b", "16", "-j", "0", "--max-steps", "3",
              "--output-dir", str(root / "{name}"), str(images)]
    return {
        "mnist_ddp": ["python/mnist_ddp.py", "--data", str(mnist), "--max-steps", "3",
                      "--grad-accum-steps", "2", "--output-dir", str(root / "{name}")],
        "imagenet": ["python/imagenet.py", *vision],
        "imagenet_deepspeed": ["python/imagenet_deepspeed.py", "--deepspeed_config",
                               "python/configs/ds_cpu_z1.json", *vision],
        "gpt_neo_imdb": ["python/gpt_neo_imdb.py", "--pretrained-model", str(model),
                         "--dataset", str(imdb), "--output-path", str(root / "{name}"),
                         "--logging-path", str(root / "gpt-logs"), "--max-steps", "3",
                         "--batch-size", "4", "--max-length", "32", "--num-workers", "0",
                         "--logging-steps", "1", "--save-steps", "1000", "--eval-steps",
                         "1000", "--sample-reviews", "0"],
    }


@pytest.mark.parametrize("trainer", TRAINERS)
def test_every_trainer_writes_the_one_summary_schema(trainer, commands, output_root):
    EXTENSIONS.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu",
           "TORCH_EXTENSIONS_DIR": str(EXTENSIONS)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    args = [arg.replace("{name}", trainer) for arg in commands[trainer]]
    # As run.sh would leave it (no srun here: the launch and run.sh phases stay unknown).
    env["XSCALE_T_EXEC"] = repr(time.time())
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.rstrip().splitlines()[-1]
    assert last.startswith("XSCALE_SUMMARY "), last  # the last line, always
    line = json.loads(last.removeprefix("XSCALE_SUMMARY "))
    record = json.loads(Path(line["summary_file"]).read_text())
    assert tuple(record)[:len(SUMMARY_FIELDS)] == SUMMARY_FIELDS, list(record)
    # In the run's output directory (GPT-neo's: --output-path/MODEL_NAME, Trainer's).
    assert Path(line["summary_file"]).is_relative_to((output_root / trainer).resolve()), line
    assert line == {name: value for name, value in record.items() if name not in FILE_ONLY}
    for field, kind in TYPES.items():
        kinds = kind if isinstance(kind, tuple) else (kind,)
        value = record[field]
        assert (value is None and None in kinds) or isinstance(
            value, tuple(k for k in kinds if k is not None)), (field, value)
    assert (record["trainer"], record["steps"], record["stopped_early"]) == (trainer, 3, False)
    assert Path(record["checkpoint"]).exists(), record["checkpoint"]
    # The last step's save, at least; what it held training up is part of the run's time.
    assert record["checkpoints_saved"] >= 1, record
    assert 0 <= record["checkpoint_stall_s"] <= record["seconds"], record
    assert (record["tokens_per_s"] is not None) == (trainer == "gpt_neo_imdb")
    assert record["global_batch_size"] == record["batch_size"] * record["accumulation"]
    check_startup(trainer, record["startup"])
    # One rank is its own median: the slowest, at 1.0x (None: no interval after the warm-up).
    straggler = record["straggler"]
    assert straggler is None or (straggler["rank"], straggler["factor"]) == (0, 1.0), straggler


def check_startup(trainer: str, phases: dict) -> None:
    """Every trainer marks the end of its imports, the group and the first step: those phases
    are known, the ones before the exec (no srun, no run.sh here) are not, and none is made up."""
    assert tuple(phases) == NAMES, (trainer, phases)
    for name in ("imports", "group", "first_step"):
        entry = phases[name]
        assert entry["ranks"] == 1 and entry["slowest"] >= 0, (trainer, name, entry)
        assert entry["median"] == entry["slowest"] and entry["rank"] == 0, (trainer, name, entry)
    for name in ("launch", "run_sh", "total"):
        assert phases[name]["median"] is None and phases[name]["ranks"] == 0, (trainer, name)
    assert set(TYPES) == set(SUMMARY_FIELDS)

"""Glue between xscale and DeepSpeed: the JSON config against the command line, and
checkpoints through DeepSpeed's own save_checkpoint/load_checkpoint (ZeRO shards the optimizer
state over ranks, so every rank writes and reads its own part).

DeepSpeed is imported by the trainer, not here: this module only shapes what it is given.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from xscale import checkpoint
from xscale.lifecycle import UserError

TAG = re.compile(r"^global_step(\d+)$")


def load_config(path: Path) -> dict[str, Any]:
    """The DeepSpeed JSON config at PATH; a missing or malformed file is a UserError."""
    if not path.is_file():
        raise UserError(f"--deepspeed_config '{path}': no such file")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"--deepspeed_config '{path}': not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise UserError(f"--deepspeed_config '{path}': expected a JSON object")
    return config


def batch_sizes(config: dict[str, Any], world_size: int, per_rank: int | None) -> dict[str, Any]:
    """The config with a batch DeepSpeed accepts for this world size.

    per_rank (from --batch-size) wins when given; else the config's
    train_micro_batch_size_per_gpu, else its train_batch_size divided over the ranks.
    DeepSpeed insists on train_batch_size = micro batch x accumulation x ranks, so a config
    written for 256 on one node would refuse to start on four nodes unless it is recomputed.
    """
    config = dict(config)
    accumulation = int(config.get("gradient_accumulation_steps", 1))
    if per_rank is None:
        per_rank = config.get("train_micro_batch_size_per_gpu")
    if per_rank is None:
        total = config.get("train_batch_size")
        if total is None:
            raise UserError("the DeepSpeed config sets no batch size and --batch-size is not given")
        per_rank = int(total) // (accumulation * world_size)
        if per_rank < 1:
            raise UserError(f"train_batch_size {total} is less than one sample per rank on "
                            f"{world_size} ranks: set --batch-size")
    config["train_micro_batch_size_per_gpu"] = int(per_rank)
    config["gradient_accumulation_steps"] = accumulation
    config["train_batch_size"] = int(per_rank) * accumulation * world_size
    return config


def set_learning_rate(config: dict[str, Any], lr: float | None) -> dict[str, Any]:
    """The config with its optimizer's learning rate set to LR (None: as it is)."""
    if lr is None:
        return config
    config = dict(config)
    optimizer = dict(config.get("optimizer") or {"type": "Adam"})
    optimizer["params"] = {**optimizer.get("params", {}), "lr": lr}
    config["optimizer"] = optimizer
    return config


def tag(step: int) -> str:
    """The checkpoint tag of STEP: DeepSpeed's own naming, global_stepN."""
    return f"global_step{step}"


def saved_steps(output_dir: Path) -> list[int]:
    """The steps of the checkpoints in OUTPUT_DIR, oldest first."""
    if not output_dir.is_dir():
        return []
    return sorted(int(m.group(1)) for p in output_dir.iterdir()
                  if p.is_dir() and (m := TAG.match(p.name)))


def save(engine: Any, output_dir: Path, step: int, epoch: int, keep: int) -> Path:
    """Every rank: DeepSpeed's checkpoint of step `step`, plus xscale's position and every
    rank's random generators; then rank 0 keeps only the newest `keep`."""
    client_state = {"step": step, "epoch": epoch, "rng": checkpoint.gather_rng_states()}
    engine.save_checkpoint(str(output_dir), tag=tag(step), client_state=client_state)
    if dist.is_initialized():
        dist.barrier()  # every rank's shard is written before old ones go
    if not dist.is_initialized() or dist.get_rank() == 0:
        for old in saved_steps(output_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(output_dir / tag(old), ignore_errors=True)
    return output_dir / tag(step)


def load(engine: Any, output_dir: Path, rank: int) -> tuple[int, int] | None:
    """Resume from the checkpoint DeepSpeed's `latest` names: (step, epoch), or None."""
    if not (output_dir / "latest").is_file():
        found = None
    else:
        path, client_state = engine.load_checkpoint(str(output_dir))
        found = None if path is None else client_state
    steps: list[Any] = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    mine = None if found is None else int(found["step"])
    if dist.is_initialized() and len(steps) > 1:
        dist.all_gather_object(steps, mine)
        if len(set(steps)) > 1:
            raise UserError(f"the ranks found different checkpoints in {output_dir} ({steps}); "
                            "--output-dir must be on storage all nodes share")
    if found is None:
        return None
    streams = found.get("rng") or []
    if len(streams) == len(steps):
        checkpoint.set_rng_state(streams[rank])
    return int(found["step"]), int(found.get("epoch", 0))


def resume(engine: Any, output_dir: Path | None, rank: int, enabled: bool = True) -> int | None:
    """The step a run resumes from after DeepSpeed restored its newest checkpoint, or None."""
    if output_dir is None or not enabled:
        return None
    position = load(engine, output_dir, rank)
    return None if position is None else position[0]


def saver(engine: Any, output_dir: Path | None, keep: int) -> Callable[[int, int], Path] | None:
    """save(step, epoch) for xscale.Loop (every rank writes its shard); None without an output
    directory. xscale.Loop makes it itself when its model is an engine."""
    if output_dir is None:
        return None
    return lambda step, epoch: save(engine, output_dir, step, epoch, keep)

"""A DeepSpeed engine's checkpoints, through its own save_checkpoint/load_checkpoint (ZeRO
shards the optimizer state over ranks, so every rank writes and reads its own part), with
xscale's position and every rank's random generators: what xscale.Loop saves and resumes when
its model is an engine. Duck-typed on the engine: DeepSpeed is not imported here.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from xscale.checkpoints import contents, generators, savers
from xscale.lifecycle import UserError

TAG = re.compile(r"^global_step(\d+)$")


def is_engine(model: Any) -> bool:
    """Whether MODEL checkpoints itself, as a DeepSpeed engine does (every rank its shards)."""
    return hasattr(model, "save_checkpoint") and hasattr(model, "load_checkpoint")


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
    client_state = {"step": step, "epoch": epoch, "rng": contents.gather_rng_states()}
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
        generators.set_rng_state(streams[rank])
    return int(found["step"]), int(found.get("epoch", 0))


def resume(engine: Any, output_dir: Path | None, rank: int, enabled: bool = True) -> int | None:
    """The step a run resumes from after DeepSpeed restored its newest checkpoint, or None."""
    if output_dir is None or not enabled:
        return None
    position = load(engine, output_dir, rank)
    return None if position is None else position[0]


def saver(engine: Any, output_dir: Path | None, keep: int) -> savers.Saver | None:
    """xscale.Loop's saver for an engine (every rank writes its shard, before it returns); None
    without an output directory."""
    if output_dir is None:
        return None
    return savers.ForegroundSaver(lambda step, epoch: save(engine, output_dir, step, epoch,
                                                                keep))

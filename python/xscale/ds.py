"""Glue between xscale and DeepSpeed: the JSON config against the command line and the node
(prepare: the precision the device can do, the buffers cast with the weights, an arch list
DeepSpeed's JIT builder can read). An engine's checkpoints are xscale.checkpoints.engine's, which
xscale.Loop uses for a model that is an engine.

DeepSpeed is imported by the trainer before it calls this module; prepare() asks DeepSpeed's
accelerator what the device supports, once.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from xscale.dist import DistContext
from xscale.lifecycle import UserError

# The half precisions a DeepSpeed config can enable, by the section that enables each
# ("bfloat16" is DeepSpeed's older name for "bf16").
HALF_PRECISIONS = {"fp16": "fp16", "bf16": "bf16", "bfloat16": "bf16"}
# An entry of TORCH_CUDA_ARCH_LIST that DeepSpeed's JIT builder reads (MAJOR.MINOR, +PTX
# allowed): it takes each part after the dot as a number, so PyTorch's own Hopper and Blackwell
# names with a letter (9.0a, 10.0a, set by NVIDIA's images) stop every JIT build.
DEEPSPEED_ARCH = re.compile(r"\d+\.\d+(\+PTX)?")


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


def prepare(config: dict[str, Any], model: nn.Module, ctx: DistContext) -> dict[str, Any]:
    """The config to give deepspeed.initialize for MODEL on this rank's device, with one line on
    rank 0 for each thing changed: a half precision the device cannot train in is a UserError
    naming its key; BatchNorm's running statistics are cast with the weights under fp16/bf16
    (buffer_cast); an arch list DeepSpeed cannot read is replaced by the node's own
    (arch_list_for_deepspeed). Call it after importing deepspeed, before initialize."""
    from deepspeed.accelerator import get_accelerator  # the trainer has imported DeepSpeed

    accelerator = get_accelerator()
    precision = half_precision(config)
    if precision is not None:
        supported = {"fp16": accelerator.is_fp16_supported(),
                     "bf16": accelerator.is_bf16_supported()}
        check_precision(precision, supported, accelerator.device_name())
    config, cast = buffer_cast(config, model)
    fixed = fix_arch_list(ctx.device)
    if ctx.is_main:
        for line in (cast, fixed):
            if line:
                print(f"xscale: DeepSpeed: {line}", flush=True)
    return config


def half_precision(config: dict[str, Any]) -> tuple[str, str] | None:
    """(the config's key, fp16 or bf16) of the half precision it enables, or None."""
    for key, precision in HALF_PRECISIONS.items():
        section = config.get(key)
        if isinstance(section, dict) and section.get("enabled") is True:
            return key, precision
    return None


def check_precision(precision: tuple[str, str], supported: dict[str, bool],
                    device_name: str) -> None:
    """A UserError naming the key when the device cannot train in that precision (DeepSpeed's
    CPU accelerator has no fp16, GPUs before Ampere no bf16): one line before initialize, not
    DeepSpeed's traceback on every rank."""
    key, name = precision
    if not supported[name]:
        other = [other for other, can in supported.items() if can and other != name]
        instead = f"use {other[0]} or fp32" if other else "use fp32"
        raise UserError(f"the DeepSpeed config's {key}.enabled asks for {name}, which "
                        f"DeepSpeed's {device_name} accelerator cannot train in here: {instead} "
                        "(python/configs/ds_cpu_z1.json is fp32)")


def buffer_cast(config: dict[str, Any], model: nn.Module) -> tuple[dict[str, Any], str | None]:
    """The config with data_types.buffer_dtype set to its half precision when MODEL keeps
    running statistics (BatchNorm), and the line that says so; the config as it is otherwise.
    DeepSpeed 0.19 casts only the parameters to fp16/bf16 and keeps the buffers in float32
    unless told ("Cast params only; preserve fp32 buffers", runtime/engine.py), so BatchNorm's
    forward fails: "Expected running_mean to have type Half but got Float". A buffer_dtype the
    config sets itself is kept."""
    precision = half_precision(config)
    data_types = config.get("data_types") or {}
    if precision is None or data_types.get("buffer_dtype") is not None \
            or not _keeps_running_statistics(model):
        return config, None
    name = precision[1]
    config = dict(config, data_types=dict(data_types, buffer_dtype=name))
    return config, (f"{name}: BatchNorm's running statistics are cast with the weights "
                    f"(data_types.buffer_dtype={name}); DeepSpeed keeps buffers in float32, and "
                    "BatchNorm then fails on the mixed types")


def _keeps_running_statistics(model: nn.Module) -> bool:
    return any(isinstance(getattr(module, "running_mean", None), torch.Tensor)
               for module in model.modules())


def fix_arch_list(device: torch.device, environ: dict[str, str] | None = None) -> str | None:
    """On an NVIDIA GPU, TORCH_CUDA_ARCH_LIST replaced by the node's own architectures when
    DeepSpeed's JIT builder cannot read it; the line that says so, or None. (ROCm builds read
    PYTORCH_ROCM_ARCH instead.)"""
    env = os.environ if environ is None else environ
    listed = env.get("TORCH_CUDA_ARCH_LIST", "")
    if device.type != "cuda" or torch.version.hip or not listed.strip():
        return None
    own = {torch.cuda.get_device_capability(index) for index in range(torch.cuda.device_count())}
    readable = arch_list_for_deepspeed(listed, own)
    if readable is None:
        return None
    env["TORCH_CUDA_ARCH_LIST"] = readable
    return (f"TORCH_CUDA_ARCH_LIST={listed!r} is not DeepSpeed's MAJOR.MINOR form; its JIT "
            f"builds are for this node's GPUs, {readable!r}")


def arch_list_for_deepspeed(listed: str, capabilities: Iterable[tuple[int, int]]) -> str | None:
    """An arch list for DeepSpeed's JIT builds in place of LISTED, from the node's devices'
    CAPABILITIES ((major, minor) each), or None when DeepSpeed reads LISTED as it is. The node's
    own architectures also build faster than a list for every GPU there is."""
    entries = listed.replace(" ", ";").split(";")
    if all(DEEPSPEED_ARCH.fullmatch(entry) for entry in entries if entry):
        return None
    return ";".join(f"{major}.{minor}" for major, minor in sorted(set(capabilities)))


def set_learning_rate(config: dict[str, Any], lr: float | None) -> dict[str, Any]:
    """The config with its optimizer's learning rate set to LR (None: as it is)."""
    if lr is None:
        return config
    config = dict(config)
    optimizer = dict(config.get("optimizer") or {"type": "Adam"})
    optimizer["params"] = {**optimizer.get("params", {}), "lr": lr}
    config["optimizer"] = optimizer
    return config

"""ImageNet-style classification with DeepSpeed (the LUMI AI workshop's
cv_example_ds.py, E09 "Extreme scale AI"; DeepSpeedExamples'
training/imagenet), sharing imagenet.py's data, models and command line.

    srun ... singularity exec $SIF /runscripts/run.sh python -u python/imagenet_deepspeed.py \\
        --deepspeed --deepspeed_config python/configs/ds_fp16_z1.json -a resnet50 \\
        --batch-size $((8*512)) --workers 7 --epochs 2 DIR

DeepSpeed joins the process group that xscale opened from run.sh's RANK/WORLD_SIZE/LOCAL_RANK/
MASTER_* (without them it would look for mpi4py). Precision, ZeRO stage and optimizer come from
the JSON config; --batch-size (per node, divided among its ranks) and --lr override it. On a CPU
(DS_ACCELERATOR=cpu) use python/configs/ds_cpu_z1.json: fp32, ZeRO-1, torch's Adam
(ds_cpu_z3.json: the same with ZeRO-3, the weights sharded too). DataLoader workers are per rank
here (-j 7: the 7 cores of a GCD's CCD).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F
import xscale
from xscale import ds, vision

TRAINER = "imagenet_deepspeed"
PROG = "imagenet_deepspeed.py"
CONFIGS = Path(__file__).resolve().parent / "configs"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Train a torchvision classifier on an ImageFolder with DeepSpeed.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    vision.add_arguments(parser, workers_per="rank")
    parser.set_defaults(batch_size=None)
    parser.add_argument("--lr", "--learning-rate", type=float, default=None, dest="lr",
                        help="override the config's optimizer learning rate")
    parser.add_argument("--channels-last", action="store_true", help="NHWC memory format")
    parser.add_argument("--deepspeed", action="store_true",
                        help="accepted for DeepSpeed's launchers; DeepSpeed is always used")
    parser.add_argument("--deepspeed_config", "--deepspeed-config", type=Path, default=None,
                        help="DeepSpeed JSON (default: configs/ds_fp16_z1.json on GPUs, "
                             "configs/ds_cpu_z1.json on CPUs)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help="accepted for DeepSpeed's launcher; LOCAL_RANK from the "
                             "environment wins")
    args = parser.parse_args(argv)
    vision.check_arguments(parser, args)
    return args


def evaluate(engine: torch.nn.Module, val_set: torch.utils.data.Dataset, ctx: xscale.Context,
             batch_size: int, dtype: torch.dtype) -> dict[str, float]:
    """Top-1 accuracy and loss over every rank's shard (images in the engine's precision)."""
    loader = xscale.eval_loader(val_set, ctx, batch_size=batch_size)
    batches = ((images.to(dtype), labels) for images, labels in loader)
    return vision.evaluate_classifier(engine, batches, ctx.device)


def train(args: argparse.Namespace, ctx: xscale.Context, config: dict) -> int:
    import deepspeed  # slow to import; after the cheap checks

    root = vision.resolve_data(args, ctx)
    train_set, val_set, classes = vision.datasets_for(root, args.image_size)
    per_rank = (None if args.batch_size is None
                else vision.per_rank(args.batch_size, ctx, "--batch-size"))
    config = ds.set_learning_rate(ds.batch_sizes(config, ctx.world_size, per_rank), args.lr)
    batch_size = config["train_micro_batch_size_per_gpu"]
    accumulation = config["gradient_accumulation_steps"]  # DeepSpeed steps at the boundaries

    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model = vision.build_model(args.arch, classes, args.channels_last)
    config = ds.prepare(config, model, ctx)  # BatchNorm under fp16/bf16, the JIT build's archs
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    dtype = next(engine.module.parameters()).dtype  # fp16/bf16 configs cast the weights
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format

    torch.manual_seed(args.seed + ctx.rank)  # each rank its own augmentation stream
    loader = xscale.loader(train_set, ctx, batch_size=batch_size, workers=args.workers,
                           seed=args.seed)
    # The engine is the model: the loop saves and resumes through DeepSpeed's checkpoints.
    loop = xscale.Loop.from_args(ctx, loader, args, model=engine, accumulation=accumulation,
                                 warmup_steps=None, name=TRAINER)
    loop.message(f"{PROG}: {args.arch} on {root or 'random images'} ({classes} classes); "
                 f"{ctx.world_size} ranks, {ctx.device.type}, {ctx.backend}; ZeRO stage "
                 f"{engine.zero_optimization_stage()}, {dtype}; {batch_size} images per rank, "
                 f"{config['train_batch_size']} per step")

    engine.train()
    for _, (images, labels) in loop.batches():
        images = images.to(ctx.device, dtype=dtype, non_blocking=True,
                           memory_format=memory_format)
        labels = labels.to(ctx.device, non_blocking=True)
        loss = F.cross_entropy(engine(images).float(), labels)
        engine.backward(loss)  # scaled by 1/accumulation, reduced at the boundary
        engine.step()
        loop.record(loss, len(labels))
    loop.finish()

    results = {}
    if not loop.stopped and val_set is not None:  # after a stop: time for the checkpoint
        results = evaluate(engine, val_set, ctx, batch_size, dtype)
    loop.report(accuracy=results.get("accuracy"), val_loss=results.get("loss"),
                val_samples=results.get("samples"), epoch=loop.epoch, arch=args.arch,
                image_size=args.image_size, zero_stage=engine.zero_optimization_stage(),
                dtype=str(dtype).removeprefix("torch."))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    on_gpu = torch.accelerator.is_available()
    if args.deepspeed_config is None:
        args.deepspeed_config = CONFIGS / ("ds_fp16_z1.json" if on_gpu else "ds_cpu_z1.json")
    config = ds.load_config(args.deepspeed_config)
    vision.check_data(args)  # before joining the group: a bad path trains nothing
    if args.local_rank is not None and not os.environ.get("LOCAL_RANK"):
        os.environ["LOCAL_RANK"] = str(args.local_rank)
    ctx = xscale.start(backend=args.dist_backend, init_method=args.dist_url, rank=args.rank,
                       world_size=args.world_size, gpu=args.gpu)
    # DeepSpeed reads the torch names itself; a single process or a --dist-url launch has none.
    for name, value in (("RANK", ctx.rank), ("WORLD_SIZE", ctx.world_size),
                        ("LOCAL_RANK", ctx.local_rank), ("LOCAL_WORLD_SIZE", ctx.local_world_size)):
        os.environ.setdefault(name, str(value))
    if not ctx.is_main:  # one copy of DeepSpeed's INFO lines, not one per rank
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return train(args, ctx, config)


if __name__ == "__main__":
    xscale.run_and_exit(main, prog=PROG)

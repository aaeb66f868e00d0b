"""ImageNet-style classification with DistributedDataParallel (the LUMI AI
workshop's cv_example.py, E09 "Extreme scale AI").

The command line is pytorch/examples/imagenet's, so the workshop's line works as it is:

    srun ... singularity exec $SIF /runscripts/run.sh python -u python/imagenet.py \\
        -a resnet50 --batch-size $((8*512)) --workers $((8*7)) --gpu \\$SLURM_LOCALID \\
        --world-size \\$SLURM_NPROCS --rank \\$SLURM_PROCID --dist-url tcp://$MASTER:45678 \\
        --dist-backend nccl --epochs 2 /flash/project_465002178/data-sets/data-resnet-small

and so does the same without the rank options, from run.sh's RANK/WORLD_SIZE/MASTER_* (when
both are given they must agree). As in pytorch/examples, --batch-size and --workers are per
node and divided among the node's ranks (LOCAL_WORLD_SIZE): 8*512 on 8 GCDs is 512 per GCD.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from xscale import checkpoint, cli, data, metrics, profiling, shutdown, signals, summary, vision
from xscale.dist import DistContext, init_distributed
from xscale.progress import TrainLog
from xscale.throughput import Throughput

TRAINER = "imagenet"
PROG = "imagenet.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Train a torchvision classifier on an ImageFolder with DDP.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    vision.add_arguments(parser, workers_per="node (divided among its ranks)")
    parser.add_argument("--lr", "--learning-rate", type=float, default=0.1, dest="lr",
                        help="SGD learning rate (pytorch/examples' 0.1 suits 256 images per "
                             "step; divided by 10 every 30 epochs)")
    parser.add_argument("--amp", choices=tuple(vision.AMP_DTYPES), default="none",
                        help="autocast dtype (fp16 adds loss scaling)")
    parser.add_argument("--channels-last", action="store_true",
                        help="NHWC memory format (faster convolutions on recent GPUs)")
    args = parser.parse_args(argv)
    vision.check_arguments(parser, args)
    return args


def save(args: argparse.Namespace, ctx: DistContext, model: nn.Module,
         optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, step: int,
         epoch: int) -> Path:
    state = checkpoint.training_state(model, optimizer, step, epoch, scaler, arch=args.arch)
    if ctx.is_main:
        checkpoint.save(args.output_dir, step, state, keep=args.keep_checkpoints)
    return checkpoint.checkpoint_path(args.output_dir, step)




def train(args: argparse.Namespace, ctx: DistContext, started: float) -> int:
    root = vision.resolve_data(args, ctx)
    train_set, val_set, classes = vision.datasets_for(root, args.image_size)
    batch_size = vision.per_rank(args.batch_size, ctx.local_world_size, "--batch-size")
    workers = -(-args.workers // ctx.local_world_size)  # pytorch/examples rounds up

    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model = vision.build_model(args.arch, classes, args.channels_last).to(ctx.device)
    if ctx.distributed:
        model = DistributedDataParallel(
            model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=args.amp == "fp16")
    amp = vision.autocast(ctx.device, args.amp)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format

    torch.manual_seed(args.seed + ctx.rank)  # each rank its own augmentation stream
    start_step = 0
    state = checkpoint.load_latest(args.output_dir) if args.output_dir and args.resume else None
    if state is not None:
        start_step, _ = checkpoint.restore_training_state(state, model, optimizer, scaler,
                                                          rank=ctx.rank)
    resumed, state = state is not None, None

    sampler = data.ResumableSampler(train_set, ctx.world_size, ctx.rank, seed=args.seed)
    loader = data.make_loader(train_set, sampler, batch_size=batch_size, workers=workers,
                              device=ctx.device, drop_last=True)
    per_epoch = data.steps_per_epoch(sampler, batch_size)
    end_step = data.last_step(per_epoch, args.epochs, args.max_steps)
    val_loader = None if val_set is None else data.make_loader(
        val_set, data.ShardSampler(val_set, ctx.world_size, ctx.rank), batch_size=batch_size,
        workers=min(workers, 2), device=ctx.device)
    tb_dir = args.logging_dir or (args.output_dir / "tb" if args.output_dir else None)
    log = TrainLog(is_main=ctx.is_main, start_step=start_step, total_steps=end_step,
                   log_every=args.print_freq, tensorboard_dir=tb_dir, desc=TRAINER)
    log.message(f"{PROG}: {args.arch} on {root or 'random images'} ({classes} classes, "
                f"{len(train_set)} training images); {ctx.world_size} ranks on {ctx.nnodes} "
                f"nodes, {ctx.device.type}, {ctx.backend}; {batch_size} images per rank, "
                f"{batch_size * ctx.world_size} per step; {workers} workers per rank")
    if resumed:
        log.message(f"{PROG}: resuming from step {start_step} in {args.output_dir}")

    window = profiling.window_from_env(ctx.rank, ctx.device)
    meter = Throughput(ctx.device, warmup_steps=min(5, max(1, (end_step or 10) // 10)))
    step, epoch, stopped, last_saved, results = start_step, start_step // per_epoch, False, \
        (start_step if resumed else None), {}
    model.train()
    meter.start()
    for step_index, epoch, (images, labels) in data.train_batches(
            loader, sampler, start_step=start_step, epochs=args.epochs, max_steps=args.max_steps):
        window.step(step_index)
        for group in optimizer.param_groups:
            group["lr"] = vision.step_lr(args.lr, epoch)
        images = images.to(ctx.device, non_blocking=True, memory_format=memory_format)
        labels = labels.to(ctx.device, non_blocking=True)
        with amp():
            loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        step = step_index + 1
        meter.step(len(labels))
        log.step(step, loss, len(labels))
        if args.output_dir and args.checkpoint_every and step % args.checkpoint_every == 0:
            save(args, ctx, model, optimizer, scaler, step, epoch)
            last_saved = step
        if signals.should_stop():
            stopped = True
            break
        if step % per_epoch == 0 and val_loader is not None and step != end_step:
            results = metrics.evaluate_classifier(model, val_loader, ctx.device, amp())
            log.message(f"{PROG}: epoch {epoch} accuracy {results['accuracy']:.4f}")
            log.scalar("val/accuracy", results["accuracy"], step)
    meter.stop()
    window.close()
    log.close()

    if args.output_dir and last_saved != step:
        save(args, ctx, model, optimizer, scaler, step, epoch)
    if stopped and ctx.is_main:
        saved = checkpoint.checkpoint_path(args.output_dir, step) if args.output_dir else None
        print(signals.stop_message(PROG, step, saved), flush=True)
    if not stopped and val_loader is not None:
        results = metrics.evaluate_classifier(model, val_loader, ctx.device, amp())
    summary.report(ctx, model, trainer=TRAINER, step=step, started=started, log=log, meter=meter,
                   stopped=stopped, epoch=epoch, arch=args.arch, image_size=args.image_size,
                   amp=args.amp, batch_size=batch_size,
                   global_batch_size=batch_size * ctx.world_size,
                   accuracy=results.get("accuracy"), val_loss=results.get("loss"),
                   val_samples=results.get("samples"))
    return 0


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    vision.check_data(args)  # before joining the group: a bad path trains nothing
    signals.install()
    ctx = init_distributed(backend=args.dist_backend, init_method=args.dist_url,
                           rank=args.rank, world_size=args.world_size, gpu=args.gpu)
    if args.output_dir and ctx.is_main:
        args.output_dir.mkdir(parents=True, exist_ok=True)
    return train(args, ctx, started)


if __name__ == "__main__":
    shutdown.exit_cleanly(cli.run(main, prog=PROG))

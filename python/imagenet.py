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
Every node must then hold as many ranks (one line and exit 2 otherwise).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import xscale
from torch.nn.parallel import DistributedDataParallel
from xscale import vision

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
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the model (fused kernels; the first steps compile)")
    parser.add_argument("--grad-accum-steps", type=int, default=1, metavar="N",
                        help="micro-batches per optimizer step (the batch per step is N times "
                             "--batch-size)")
    parser.add_argument("--fsdp", action="store_true",
                        help="shard the weights, gradients and optimizer state over the ranks "
                             "(FSDP2, torch's fully_shard) instead of replicating them (DDP)")
    args = parser.parse_args(argv)
    vision.check_arguments(parser, args)
    if args.grad_accum_steps < 1:
        parser.error("--grad-accum-steps must be positive")
    if args.fsdp and args.amp == "fp16":
        parser.error("--fsdp trains in fp32 or with --amp bf16: fp16's loss scaling "
                     "(GradScaler) is not set up for sharded gradients here")
    return args


def shard(model: torch.nn.Module, ctx: xscale.Context) -> torch.nn.Module:
    """FSDP2: each top-level part of the network that has weights (a ResNet's first
    convolution and its norm, its four stages, its classifier) is a unit whose weights are
    gathered for its forward and backward and freed after, then the whole model, which holds
    what is left. Each rank keeps 1/N of every unit's weights, gradients and optimizer state."""
    # Imported here: half a second of start-up that a DDP run does not pay.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    for part in model.children():
        if any(True for _ in part.parameters()):
            fully_shard(part, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def train(args: argparse.Namespace, ctx: xscale.Context) -> int:
    root = vision.resolve_data(args, ctx)
    train_set, val_set, classes = vision.datasets_for(root, args.image_size)
    batch_size = vision.per_rank(args.batch_size, ctx, "--batch-size")
    workers = -(-args.workers // ctx.local_world_size)  # pytorch/examples rounds up

    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model = vision.build_model(args.arch, classes, args.channels_last).to(ctx.device)
    if args.compile:
        model.compile()  # in place: DDP wraps it and its checkpoints keep their keys
    if args.fsdp:
        model = shard(model, ctx)
    elif ctx.distributed:
        model = DistributedDataParallel(
            model, device_ids=None if ctx.device.type == "cpu" else [ctx.device.index])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=args.amp == "fp16")
    amp = vision.autocast(ctx.device, args.amp)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format

    torch.manual_seed(args.seed + ctx.rank)  # each rank its own augmentation stream
    loader = xscale.loader(train_set, ctx, batch_size=batch_size, workers=workers,
                           seed=args.seed)
    val_loader = None if val_set is None else xscale.eval_loader(
        val_set, ctx, batch_size=batch_size, workers=min(workers, 2))
    loop = xscale.Loop.from_args(ctx, loader, args, model=model, optimizer=optimizer,
                                 scaler=scaler, checkpoint_fields={"arch": args.arch},
                                 warmup_steps=None, name=TRAINER)
    loop.message(f"{PROG}: {args.arch} on {root or 'random images'} ({classes} classes, "
                 f"{len(train_set)} training images); {ctx.world_size} ranks on "
                 f"{ctx.nnodes} nodes, {ctx.device.type}, {ctx.backend}; {batch_size} images "
                 f"per rank, {workers} workers per rank")

    results: dict[str, float] = {}
    model.train()
    for epoch, (images, labels) in loop.batches():
        for group in optimizer.param_groups:
            group["lr"] = vision.step_lr(args.lr, epoch)
        images = images.to(ctx.device, non_blocking=True, memory_format=memory_format)
        labels = labels.to(ctx.device, non_blocking=True)
        with loop.sync_gradients(model):  # the forward too: DDP prepares its reduction there
            with amp():
                loss = F.cross_entropy(model(images), labels)
            scaler.scale(loss / loop.accumulation).backward()
        if loop.boundary:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        loop.record(loss, len(labels))
        if loop.epoch_ended and val_loader is not None:
            results = vision.evaluate_classifier(model, val_loader, ctx.device, amp())
            loop.message(f"{PROG}: epoch {epoch} accuracy {results['accuracy']:.4f}")
            loop.scalar("val/accuracy", results["accuracy"])
    loop.finish()

    if not loop.stopped and val_loader is not None:  # after a stop: time for the checkpoint
        results = vision.evaluate_classifier(model, val_loader, ctx.device, amp())
    loop.report(accuracy=results.get("accuracy"), val_loss=results.get("loss"),
                val_samples=results.get("samples"), epoch=loop.epoch, arch=args.arch,
                image_size=args.image_size, amp=args.amp, compiled=args.compile,
                fsdp=args.fsdp)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    vision.check_data(args)  # before joining the group: a bad path trains nothing
    ctx = xscale.start(backend=args.dist_backend, init_method=args.dist_url, rank=args.rank,
                       world_size=args.world_size, gpu=args.gpu)
    return train(args, ctx)


if __name__ == "__main__":
    xscale.run_and_exit(main, prog=PROG)

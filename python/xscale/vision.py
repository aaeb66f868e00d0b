"""Image classification pieces shared by the trainers: the pytorch/examples command line,
ImageFolder data (optionally pre-staged) and torchvision models of imagenet.py and
imagenet_deepspeed.py, and the evaluation of any classifier over every rank's shard (mnist_ddp.py
too).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from xscale import staging
from xscale.checkpoints import cadence
from xscale.dist import DistContext, is_sharded
from xscale.lifecycle import UserError
from xscale.recovery import link as links
from xscale.reductions import SumMeter, all_reduce_max, mean

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
AMP_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


# torchvision is imported in the functions that use it: about a second of start-up that
# mnist_ddp.py, which takes only evaluate_classifier from here, never needs.


def architectures() -> list[str]:
    """The torchvision classifiers -a/--arch accepts."""
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def add_arguments(parser: argparse.ArgumentParser, *, workers_per: str) -> None:
    """pytorch/examples/imagenet's options (as LUMI's AI workshop passes them) plus xscale's."""
    parser.add_argument("data", metavar="DIR", nargs="?", type=Path, default=None,
                        help="ImageFolder root with train/ (and val/): DIR/train/CLASS/*.jpg")
    parser.add_argument("-a", "--arch", metavar="ARCH", default="resnet18",
                        help="any torchvision classification model, e.g. resnet18, resnet50")
    parser.add_argument("-j", "--workers", type=int, default=4, metavar="N",
                        help=f"DataLoader workers per {workers_per}")
    parser.add_argument("--epochs", type=int, default=90, metavar="N")
    parser.add_argument("-b", "--batch-size", type=int, default=256, metavar="N",
                        help="images per step on each node, divided among its ranks "
                             "(pytorch/examples' meaning: LUMI's workshop passes 8*512 for 512 per "
                             "GCD)")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--wd", "--weight-decay", type=float, default=1e-4, dest="weight_decay")
    parser.add_argument("-p", "--print-freq", "--log-every", type=int, default=10, metavar="N",
                        dest="log_every", help="reduce and log the loss every N steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=None,
                        help="number of ranks in the job (default: WORLD_SIZE from run.sh)")
    parser.add_argument("--rank", type=int, default=None,
                        help="this process's rank (default: RANK from run.sh)")
    parser.add_argument("--dist-url", default="env://",
                        help="env:// (MASTER_ADDR/MASTER_PORT) or tcp://HOST:PORT")
    parser.add_argument("--dist-backend", default=None,
                        help="nccl (RCCL on ROCm) or gloo (default: XSCALE_BACKEND, else by "
                             "device)")
    parser.add_argument("--gpu", type=int, default=None, metavar="ID",
                        help="GPU id to use (LUMI's workshop passes $SLURM_LOCALID; default "
                             "LOCAL_RANK)")
    parser.add_argument("--multiprocessing-distributed", action="store_true",
                        help=argparse.SUPPRESS)
    parser.add_argument("--image-size", type=int, default=224, metavar="PX",
                        help="training crop size (32 for tiny CPU runs)")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="stop after this many steps in total (counting steps before a resume)")
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="checkpoints go here; a run resumes from the newest")
    parser.add_argument("--no-resume", dest="resume", action="store_false",
                        help="start from scratch even if --output-dir has checkpoints")
    parser.add_argument("--checkpoint-every", type=cadence.checkpoint_interval, default=0,
                        metavar="N", help="also save every N steps (0: at the end and on a stop "
                        "signal; auto: Young's interval from the first save's cost)")
    parser.add_argument("--keep-checkpoints", type=int, default=3, metavar="K")
    parser.add_argument("--logging-dir", type=Path, default=None,
                        help="TensorBoard directory (default: OUTPUT_DIR/tb)")
    parser.add_argument("--stage-tar", type=Path, default=None, metavar="TAR",
                        help="unpack this tarball once per node into --stage-dir and train from "
                             "there (DIR, if given, is then a path inside the tarball)")
    parser.add_argument("--stage-dir", type=Path, default=None,
                        help="node-local directory for --stage-tar (default: $XSCALE_STAGE_DIR, "
                             "else /tmp/$USER-xscale-data: RAM on LUMI-G nodes)")
    parser.add_argument("--dummy", action="store_true",
                        help="random images instead of DIR (benchmarks without data)")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """argparse's checks of the common command line: parser.error() on a bad value."""
    if args.arch not in architectures():
        parser.error(f"--arch '{args.arch}' is not a torchvision model (e.g. resnet18, "
                     "resnet50, mobilenet_v3_small)")
    for name, option in (("batch_size", "--batch-size"), ("epochs", "--epochs"),
                         ("image_size", "--image-size"), ("keep_checkpoints", "--keep-checkpoints"),
                         ("log_every", "--print-freq")):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"{option} must be positive")
    if args.workers < 0 or (args.max_steps is not None and args.max_steps < 1):
        parser.error("--workers must be >= 0 and --max-steps positive")
    if args.multiprocessing_distributed:
        raise UserError("--multiprocessing-distributed is not supported: start one process "
                        "per GPU (srun ... runscripts/run.sh, or torchrun)")
    if args.world_size is not None and args.world_size < 0:
        args.world_size = None  # pytorch/examples' "unset" value
    if args.rank is not None and args.rank < 0:
        args.rank = None


def default_stage_dir() -> Path:
    """Where --stage puts the data on each node: XSCALE_STAGE_DIR or /tmp/USER-xscale-data."""
    if os.environ.get("XSCALE_STAGE_DIR"):
        return Path(os.environ["XSCALE_STAGE_DIR"])
    user = os.environ.get("USER") or f"uid{os.getuid()}"
    return Path("/tmp") / f"{user}-xscale-data"


def find_imagefolder(root: Path, what: str) -> Path:
    """`root` if it has train/, else its only subdirectory that has (a tarball of a folder)."""
    if (root / "train").is_dir():
        return root
    subdirs = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")] \
        if root.is_dir() else []
    if len(subdirs) == 1 and (subdirs[0] / "train").is_dir():
        return subdirs[0]
    raise UserError(f"{what} '{root}' has no train/ directory (expected DIR/train/CLASS/*.jpg)")


def check_data(args: argparse.Namespace) -> None:
    """Fail on a bad path before any rank joins the group (nothing is trained)."""
    if args.dummy:
        return
    if args.stage_tar is not None:
        if not args.stage_tar.is_file():
            raise UserError(f"--stage-tar '{args.stage_tar}': no such file")
        return
    if args.data is None:
        raise UserError("the data set DIR is required (or --stage-tar TAR, or --dummy)")
    if not args.data.is_dir():
        raise UserError(f"DIR '{args.data}': no such directory")
    args.data = find_imagefolder(args.data, "DIR")


def resolve_data(args: argparse.Namespace, ctx: DistContext) -> Path | None:
    """The ImageFolder root to train from, staging the tarball first if asked (None: --dummy)."""
    if args.dummy:
        return None
    if args.stage_tar is None:
        return args.data
    staged = staging.stage_tar(args.stage_tar, args.stage_dir or default_stage_dir(),
                               local_rank=ctx.local_rank)
    root = staged / args.data if args.data is not None else staged
    return find_imagefolder(root, "the staged data")


def datasets_for(root: Path | None, image_size: int,
                 classes: int = 10) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset
                                             | None, int]:
    """(train set, validation set or None, number of classes): pytorch/examples' transforms."""
    from torchvision import datasets, transforms

    normalize = transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    train_tf = transforms.Compose([transforms.RandomResizedCrop(image_size),
                                   transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                                   normalize])
    val_tf = transforms.Compose([transforms.Resize(round(image_size * 256 / 224)),
                                 transforms.CenterCrop(image_size), transforms.ToTensor(),
                                 normalize])
    if root is None:
        train = datasets.FakeData(1281 * classes, (3, image_size, image_size), classes,
                                  transforms.ToTensor())
        val = datasets.FakeData(50 * classes, (3, image_size, image_size), classes,
                                transforms.ToTensor(), random_offset=1)
        return train, val, classes
    train = datasets.ImageFolder(str(root / "train"), train_tf)
    val = datasets.ImageFolder(str(root / "val"), val_tf) if (root / "val").is_dir() else None
    if val is not None and val.classes != train.classes:
        raise UserError(f"{root}: val/ has classes {val.classes[:5]}... unlike train/")
    return train, val, len(train.classes)


def build_model(arch: str, num_classes: int, channels_last: bool = False) -> nn.Module:
    """A freshly initialised torchvision model (no weights are downloaded)."""
    import torchvision

    model = torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def per_rank(total: int, ctx: DistContext, option: str) -> int:
    """pytorch/examples' division of a per-node amount among the node's ranks. Every node must
    hold as many ranks: else the ranks train batches of different sizes, their epochs end at
    different steps, and their collectives stop matching (a hang or gloo's size mismatch). The
    ranks compare in one all-reduce, so all of them stop alike."""
    fewest, most = _ranks_per_node_range(ctx)
    if fewest != most:
        raise UserError(f"{option} is per node and divided among its ranks, but the nodes hold "
                        f"{fewest} to {most} ranks: give every node as many (srun "
                        "--ntasks-per-node)")
    share = total // ctx.local_world_size
    if share < 1:
        raise UserError(f"{option} {total} is less than one per rank ({ctx.local_world_size} "
                        "ranks on each node)")
    return share


def _ranks_per_node_range(ctx: DistContext) -> tuple[int, int]:
    """(fewest, most) ranks on any node of the job. A live recovery's replacement takes the
    lost ranks' places, which passed the check: it asks nobody (the survivors are in their
    recovery, whose collectives come first)."""
    if links.joining():
        return ctx.local_world_size, ctx.local_world_size
    minus_fewest, most = all_reduce_max([-ctx.local_world_size, ctx.local_world_size])
    return -minus_fewest, most


def autocast(device: torch.device, amp: str) -> Callable[[], AbstractContextManager]:
    """A factory of autocast contexts for --amp (bf16 needs no loss scaling; fp16 does)."""
    dtype = AMP_DTYPES[amp]
    if dtype is None:
        return nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def step_lr(base_lr: float, epoch: int) -> float:
    """pytorch/examples' schedule: divide by 10 every 30 epochs (a function of the epoch, so a
    resumed run needs no scheduler state)."""
    return base_lr * (0.1 ** (epoch // 30))


def _forwards_of_the_busiest(batches: Iterable) -> int:
    """The most batches any rank has in BATCHES (a DataLoader: its len), agreed before the
    first: a sharded model's forward is a collective (FSDP2 gathers each unit's weights from
    every rank), and the ranks' shares of a data set differ by up to a batch, so a rank that
    runs out goes on with forwards on an empty batch until it has run as many."""
    return all_reduce_max([len(batches)])[0]


def _cut_short() -> dict[str, float]:
    """A rank was lost while the others evaluated between two steps of a run with live
    recovery: this evaluation is lost, and xscale.Loop recovers before its next batch."""
    if dist.get_rank() == 0:
        print("xscale: an evaluation was cut short by a lost rank: its loss and accuracy are "
              "NaN, and live recovery follows (docs/FAILURES.md)", flush=True)
    return {"loss": float("nan"), "accuracy": float("nan"), "samples": 0}


def evaluate_classifier(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    autocast: AbstractContextManager | None = None,
) -> dict[str, float]:
    """Mean cross-entropy loss and top-1 accuracy over every rank's share of the data set.

    Returns loss, accuracy and samples (the total over ranks), identical on every rank. For a
    sharded model BATCHES must have a len (a DataLoader's): every rank runs as many forwards.
    Under live recovery, during the training, a rank lost meanwhile gives NaN and 0 samples
    (_cut_short).
    """
    was_training = model.training
    model.eval()
    meter = SumMeter()
    meter.add(loss_sum=0.0, correct=0.0, samples=0.0)  # a rank with an empty shard still reduces
    owed = _forwards_of_the_busiest(batches) if is_sharded(model) else 0  # to the others
    empty = None
    with torch.no_grad():
        for inputs, targets in batches:
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            with autocast or nullcontext():
                logits = model(inputs)
            owed, empty = owed - 1, inputs[:0]
            loss = nn.functional.cross_entropy(logits.float(), targets, reduction="sum")
            correct = (logits.argmax(dim=1) == targets).sum()
            meter.add(loss_sum=loss, correct=correct, samples=targets.numel())
        if owed > 0 and empty is None:  # no batch here: the first sample's shape
            empty = torch.as_tensor(batches.dataset[0][0])[None][:0].to(device)
        for _ in range(owed):
            model(empty)
    model.train(was_training)
    try:
        sums = meter.reduce()
    except links.GroupBroken:
        if not links.recovering():
            raise  # after the training, or in a loop live recovery cannot serve: the end
        return _cut_short()
    return {
        "loss": mean(sums, "loss_sum", "samples"),
        "accuracy": mean(sums, "correct", "samples"),
        "samples": int(sums["samples"]),
    }

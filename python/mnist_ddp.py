"""MNIST with DistributedDataParallel: the LUMI container smoke test (mnist_DDP.py
from Lumi-supercomputer/lumi-reframe-tests, used in LUMI's distributed-learning container demo).

Runs unchanged from one CPU process to many GPU nodes: start it through runscripts/run.sh (or
torchrun), which exports RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.

    srun ... singularity exec $SIF /runscripts/run.sh python -u python/mnist_ddp.py \\
        --data /scratch/$PROJECT/mnist --gpu --modelpath model

The IDX files are read from --data (DIR itself or torchvision's DIR/MNIST/raw/, plain or .gz);
nothing is downloaded: every rank fetching MNIST at once gets the server to throttle them.
"""

from __future__ import annotations

import argparse
import gzip
import struct
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import xscale
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset
from xscale import UserError, vision

TRAINER = "mnist_ddp"
PROG = "mnist_ddp.py"
IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
MEAN, STD = 0.1307, 0.3081  # MNIST's pixel statistics, as torchvision's examples use


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Train a small CNN on MNIST with DDP (xscale's smoke test).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--data", type=Path, required=True,
                        help="directory with the MNIST IDX files (or DIR/MNIST/raw/ in it)")
    parser.add_argument("--epochs", type=int, default=3, help="passes over the training set")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="stop after this many optimizer steps in total (counting steps "
                             "done before a resume)")
    parser.add_argument("--batch-size", type=int, default=64, help="images per rank per step")
    parser.add_argument("--grad-accum-steps", type=int, default=1, metavar="N",
                        help="micro-batches of --batch-size per optimizer step")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    parser.add_argument("--workers", type=int, default=0,
                        help="DataLoader workers per rank (MNIST is in memory: 0 is fine)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="checkpoints (ckpt-STEP.pt, or ckpt-STEP.dcp with "
                        "XSCALE_CHECKPOINT_WRITERS=all) go here; a run resumes from the newest")
    parser.add_argument("--no-resume", dest="resume", action="store_false",
                        help="start from scratch even if --output-dir has checkpoints")
    parser.add_argument("--checkpoint-every", type=xscale.checkpoint_interval, default=0,
                        metavar="N", help="also save every N steps (0: only at the end and on a "
                        "stop signal; auto: Young's interval from the first save's cost)")
    parser.add_argument("--keep-checkpoints", type=int, default=3, metavar="K",
                        help="keep the newest K checkpoints")
    parser.add_argument("--log-every", type=int, default=10, metavar="N",
                        help="reduce and log the loss every N steps")
    parser.add_argument("--logging-dir", type=Path, default=None,
                        help="TensorBoard directory (default: OUTPUT_DIR/tb; none without either)")
    parser.add_argument("--gpu", action="store_true",
                        help="require a GPU: CUDA, ROCm or Intel XPU (as lumi-reframe-tests' "
                             "mnist_DDP.py); GPUs are used anyway when torch sees them")
    parser.add_argument("--modelpath", type=Path, default=None,
                        help="save the trained weights as MODELPATH/model_{gpu,cpu}.dat, as "
                             "lumi-reframe-tests' mnist_DDP.py does")
    args = parser.parse_args(argv)
    for name in ("batch_size", "epochs", "workers", "keep_checkpoints", "log_every",
                 "grad_accum_steps"):
        if getattr(args, name) < (0 if name == "workers" else 1):
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.max_steps is not None and args.max_steps < 1:
        parser.error("--max-steps must be positive")
    return args


# ---- data ---------------------------------------------------------------------------------------


def find_idx_dir(root: Path) -> Path:
    """The directory holding the IDX files: DIR itself, or torchvision's DIR/MNIST/raw."""
    if not root.is_dir():
        raise UserError(f"--data '{root}': no such directory")
    for candidate in (root, root / "MNIST" / "raw", root / "raw"):
        if all(_idx_file(candidate, name) for pair in IDX_FILES.values() for name in pair):
            return candidate
    wanted = ", ".join(name for pair in IDX_FILES.values() for name in pair)
    raise UserError(f"--data '{root}': no MNIST IDX files there or in {root}/MNIST/raw "
                    f"(need {wanted}, plain or .gz)")


def _idx_file(folder: Path, name: str) -> Path | None:
    for path in (folder / name, folder / f"{name}.gz"):
        if path.is_file():
            return path
    return None


def read_idx(path: Path) -> np.ndarray:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    if len(raw) < 4:
        raise UserError(f"{path}: not an IDX file (too short)")
    zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype_code != 0x08:
        raise UserError(f"{path}: not an unsigned-byte IDX file")
    shape = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    body = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(shape)):
        raise UserError(f"{path}: {body.size} bytes of data for shape {shape}")
    return body.reshape(shape)


class MnistTensors(Dataset):
    """Images (uint8, 1x28x28) and labels, all in memory: 47 MB for the real training set."""

    def __init__(self, folder: Path, split: str) -> None:
        image_name, label_name = IDX_FILES[split]
        images = read_idx(_idx_file(folder, image_name))  # type: ignore[arg-type]
        labels = read_idx(_idx_file(folder, label_name))  # type: ignore[arg-type]
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise UserError(f"{folder}: {split} images {images.shape} and labels "
                            f"{labels.shape} do not match")
        self.images = torch.from_numpy(images.copy()).unsqueeze(1)
        self.labels = torch.from_numpy(labels.astype(np.int64))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]


# ---- model ----------------------------------------------------------------------------------


class Net(nn.Module):
    """Two conv layers and two linear ones; takes raw uint8 images and normalises them itself,
    so training, evaluation and a saved model agree on the input."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=5)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=5)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = (images.float() / 255.0 - MEAN) / STD
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


# ---- training -------------------------------------------------------------------------------


def save_model(model: nn.Module, modelpath: Path, device: torch.device) -> Path:
    """mnist_DDP.py's output: the state_dict as MODELPATH/model_gpu.dat (or model_cpu.dat)."""
    path = modelpath / f"model_{'cpu' if device.type == 'cpu' else 'gpu'}.dat"
    xscale.atomic_save(getattr(model, "module", model).state_dict(), path)  # DDP's inner one
    return path


def train(args: argparse.Namespace, ctx: xscale.Context, folder: Path) -> int:
    torch.manual_seed(args.seed)  # identical initial weights everywhere (DDP broadcasts anyway)
    train_set, test_set = MnistTensors(folder, "train"), MnistTensors(folder, "test")
    model = Net().to(ctx.device)
    if ctx.distributed:
        model = DistributedDataParallel(
            model, device_ids=None if ctx.device.type == "cpu" else [ctx.device.index])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    torch.manual_seed(args.seed + ctx.rank)  # each rank its own stream from here on
    loader = xscale.loader(train_set, ctx, batch_size=args.batch_size, workers=args.workers,
                           seed=args.seed)
    loop = xscale.Loop.from_args(ctx, loader, args, model=model, optimizer=optimizer,
                                 name=TRAINER)  # resumes from the newest checkpoint
    loop.message(f"{PROG}: {ctx.world_size} ranks on {ctx.nnodes} nodes, {ctx.device.type}, "
                 f"{ctx.backend}; {args.batch_size} images per rank, {loop.per_epoch} steps per "
                 "epoch")

    model.train()
    for _, (images, labels) in loop.batches():
        images = images.to(ctx.device, non_blocking=True)
        labels = labels.to(ctx.device, non_blocking=True)
        with loop.sync_gradients(model):
            loss = F.cross_entropy(model(images), labels)
            (loss / loop.accumulation).backward()
        if loop.boundary:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        loop.record(loss, len(labels))
    loop.finish()

    results: dict[str, float] = {}
    if not loop.stopped:  # after a stop signal the time left is for the checkpoint only
        test_loader = xscale.eval_loader(test_set, ctx, batch_size=256)
        evaluation = vision.evaluate_classifier(model, test_loader, ctx.device)
        results = {"accuracy": evaluation["accuracy"], "test_loss": evaluation["loss"],
                   "test_samples": evaluation["samples"]}
        if ctx.is_main and args.modelpath:
            print(f"{PROG}: model saved as {save_model(model, args.modelpath, ctx.device)}",
                  flush=True)
    loop.report(epoch=loop.epoch, **results)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    folder = find_idx_dir(args.data)  # before joining the group: a bad path trains nothing
    ctx = xscale.start(require_gpu=args.gpu)
    return train(args, ctx, folder)


if __name__ == "__main__":
    xscale.run_and_exit(main, prog=PROG)

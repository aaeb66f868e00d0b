"""Feeding each rank its share of the data: samplers, loaders, and resumable epochs.

Training uses a DistributedSampler (every rank the same number of batches, so no rank waits in
an all-reduce for one that ran out) that can start mid-epoch, so a resumed run sees the rest of
the epoch instead of its beginning again. Evaluation uses ShardSampler: no padding with
repeated samples, so counts summed over ranks are exactly the data set.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from xscale.dist import DistContext
from xscale.lifecycle import UserError, worker_context


class ResumableSampler(DistributedSampler):
    """DistributedSampler whose epoch can start after its first `skip` samples."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, shuffle: bool = True,
                 seed: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=True)
        self.skip = 0

    def set_position(self, epoch: int, skip: int = 0) -> None:
        self.set_epoch(epoch)
        self.skip = min(max(skip, 0), self.num_samples)

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.skip:])

    def __len__(self) -> int:
        return self.num_samples - self.skip


class ShardSampler(Sampler[int]):
    """Every world_size-th index from `rank`, in order: each sample on exactly one rank."""

    def __init__(self, dataset: Sized, num_replicas: int, rank: int) -> None:
        self.indices = range(rank, len(dataset), num_replicas)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def make_loader(dataset: Dataset, sampler: Sampler, *, batch_size: int, workers: int,
                device: torch.device, drop_last: bool = False, **extra: Any) -> DataLoader:
    """A DataLoader tuned for training from files: pinned memory on GPUs (asynchronous copies),
    persistent workers (no re-spawn each epoch), started out of reach of Slurm's warning signal
    (xscale.lifecycle.worker_context: spawned on GPUs, forked on the CPU)."""
    on_gpu = device.type != "cpu"
    options: dict[str, Any] = dict(extra)
    if workers > 0:
        options["persistent_workers"] = True
        options["prefetch_factor"] = 4
        options["multiprocessing_context"] = worker_context(spawn=on_gpu)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                      pin_memory=on_gpu, drop_last=drop_last, **options)


def loader(dataset: Dataset, ctx: DistContext, *, batch_size: int, workers: int = 0,
           shuffle: bool = True, seed: int = 0, **options: Any) -> DataLoader:
    """A training DataLoader over this rank's share of `dataset` for xscale.Loop: every rank the
    same number of batches, an epoch that resumes mid-way, workers that Slurm's warning does
    not kill, pinned memory on GPUs (make_loader). `options`: DataLoader's others (collate_fn,
    ...)."""
    sampler = ResumableSampler(dataset, ctx.world_size, ctx.rank, shuffle=shuffle, seed=seed)
    return make_loader(dataset, sampler, batch_size=batch_size, workers=workers,
                       device=ctx.device, drop_last=True, **options)


def eval_loader(dataset: Dataset, ctx: DistContext, *, batch_size: int, workers: int = 0,
                **options: Any) -> DataLoader:
    """An evaluation DataLoader: each sample on exactly one rank, none repeated, so counts and
    sums over the ranks are the data set's (ShardSampler)."""
    return make_loader(dataset, ShardSampler(dataset, ctx.world_size, ctx.rank),
                       batch_size=batch_size, workers=workers, device=ctx.device, **options)


def steps_per_epoch(sampler: ResumableSampler, batch_size: int, accumulation: int = 1) -> int:
    """Optimizer steps per rank per epoch, each of `accumulation` full batches (what is left
    over at the end of an epoch is dropped)."""
    steps = sampler.num_samples // (batch_size * accumulation)
    if steps < 1:
        raise UserError(f"{sampler.total_size} samples cannot make one step of {accumulation} "
                        f"batch(es) of {batch_size} on each of {sampler.num_replicas} ranks: "
                        "lower --batch-size")
    return steps


def train_batches(loader: DataLoader, sampler: ResumableSampler, *, start_step: int,
                  epochs: int | None, max_steps: int | None,
                  accumulation: int = 1) -> Iterator[tuple[int, int, Any]]:
    """(global step, epoch, micro-batch) from `start_step` until `epochs` or `max_steps` ends
    it; `accumulation` micro-batches per step.

    The epoch and the place in it follow from the step, so a resumed run continues the
    interrupted epoch with the same shuffled order.
    """
    batch_size = loader.batch_size or 1
    per_epoch = steps_per_epoch(sampler, batch_size, accumulation)
    step = start_step
    epoch = step // per_epoch
    while (epochs is None or epoch < epochs) and (max_steps is None or step < max_steps):
        sampler.set_position(epoch, (step - epoch * per_epoch) * accumulation * batch_size)
        for index, batch in enumerate(loader):
            if (max_steps is not None and step >= max_steps) or step >= (epoch + 1) * per_epoch:
                break
            yield step, epoch, batch
            if (index + 1) % accumulation == 0:
                step += 1
        if max_steps is not None and step >= max_steps:
            return
        epoch += 1


def last_step(per_epoch: int, epochs: int | None, max_steps: int | None) -> int | None:
    """The global step training ends at (None: unbounded)."""
    ends = [n for n in (max_steps, None if epochs is None else epochs * per_epoch) if n is not None]
    return min(ends) if ends else None

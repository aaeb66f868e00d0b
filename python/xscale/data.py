"""Feeding each rank its share of the data: samplers, loaders, and resumable epochs.

Training uses a DistributedSampler (every rank the same number of batches, so no rank waits in
an all-reduce for one that ran out) that can start mid-epoch, so a resumed run sees the rest of
the epoch instead of its beginning again. Evaluation uses ShardSampler: no padding with
repeated samples, so counts summed over ranks are exactly the data set.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from xscale.cli import UserError


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


def ignore_stop_signal(worker_id: int) -> None:
    """DataLoader worker start: leave Slurm's SIGUSR1 to the training process.

    Slurm signals every process of a task, workers included. A spawned worker would die of
    SIGUSR1's default action and take the run down ("DataLoader worker killed") instead of
    letting the trainer checkpoint at the end of the step. SIGTERM keeps its default: it is how
    multiprocessing ends the workers at exit.
    """
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def shield_resource_tracker() -> None:
    """Start multiprocessing's resource tracker (spawned workers use it) with SIGUSR1 blocked,
    so that Slurm's warning signal does not kill it too (a blocked signal stays blocked across
    exec; only this call's thread has it blocked, and only for the call)."""
    from multiprocessing import resource_tracker

    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def make_loader(dataset: Dataset, sampler: Sampler, *, batch_size: int, workers: int,
                device: torch.device, drop_last: bool = False) -> DataLoader:
    """A DataLoader tuned for training from files: pinned memory on GPUs (asynchronous copies),
    persistent workers (no re-spawn each epoch)."""
    on_gpu = device.type == "cuda"
    options: dict[str, Any] = {}
    if workers > 0:
        options["worker_init_fn"] = ignore_stop_signal
        options["persistent_workers"] = True
        options["prefetch_factor"] = 4
        if on_gpu:
            # Workers are spawned, not forked, on GPUs: forking a process whose ROCm/CUDA
            # runtime already runs threads can leave a worker hanging or crashing on a lock
            # held by a thread that does not exist in the child (pytorch/pytorch#119845; the
            # LUMI workshop's `set_start_method('spawn')`). Per loader, so the CPU path keeps
            # fork's cheap start.
            options["multiprocessing_context"] = "spawn"
            shield_resource_tracker()
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                      pin_memory=on_gpu, drop_last=drop_last, **options)


def steps_per_epoch(sampler: ResumableSampler, batch_size: int) -> int:
    """Full batches per rank per epoch (the last partial batch is dropped)."""
    steps = sampler.num_samples // batch_size
    if steps < 1:
        raise UserError(f"{sampler.total_size} samples cannot make one batch of {batch_size} "
                        f"on each of {sampler.num_replicas} ranks: lower --batch-size")
    return steps


def train_batches(loader: DataLoader, sampler: ResumableSampler, *, start_step: int,
                  epochs: int | None, max_steps: int | None) -> Iterator[tuple[int, int, Any]]:
    """(global step, epoch, batch) from `start_step` until `epochs` or `max_steps` ends it.

    The epoch and the place in it follow from the step, so a resumed run continues the
    interrupted epoch with the same shuffled order.
    """
    per_epoch = steps_per_epoch(sampler, loader.batch_size or 1)
    step = start_step
    epoch = step // per_epoch
    while (epochs is None or epoch < epochs) and (max_steps is None or step < max_steps):
        sampler.set_position(epoch, (step - epoch * per_epoch) * (loader.batch_size or 1))
        for batch in loader:
            if max_steps is not None and step >= max_steps:
                return
            yield step, epoch, batch
            step += 1
        epoch += 1


def last_step(per_epoch: int, epochs: int | None, max_steps: int | None) -> int | None:
    """The global step training ends at (None: unbounded)."""
    ends = [n for n in (max_steps, None if epochs is None else epochs * per_epoch) if n is not None]
    return min(ends) if ends else None

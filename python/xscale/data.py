"""Feeding each rank its share of the data: samplers, loaders, and resumable epochs.

Training uses a DistributedSampler (every rank the same number of batches, so no rank waits in
an all-reduce for one that ran out) that can start mid-epoch, so a resumed run sees the rest of
the epoch instead of its beginning again. Evaluation uses ShardSampler: no padding with
repeated samples, so counts summed over ranks are exactly the data set.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, get_worker_info

from xscale.dist import DistContext
from xscale.lifecycle import UserError, worker_context


@dataclass(frozen=True)
class Share:
    """This rank's part of every step's global batch once the world is smaller than the one the
    batch was laid out for (live recovery without a spare, docs/FAILURES.md): the launch's
    `world` ranks drew `accumulation` micro-batches of `batch_size` each per step; those
    world x accumulation micro-batches are dealt in turn to the ranks left, and this rank
    trains on the ones numbered `micro_batches` (rank x accumulation + m, in the launch's
    layout). The epoch's order and the steps stay the launch's: no sample is seen twice or
    skipped, and each step's gradient is the mean over the same samples."""

    world: int
    accumulation: int
    batch_size: int
    micro_batches: tuple[int, ...]

    @classmethod
    def dealt(cls, world: int, accumulation: int, batch_size: int, rank: int,
              ranks: int) -> Share:
        """RANK's share among RANKS ranks, of a batch laid out for WORLD."""
        return cls(world, accumulation, batch_size,
                   tuple(range(rank, world * accumulation, ranks)))

    def indices(self, order: Sequence[int], first_step: int, steps: int) -> Iterator[int]:
        """This rank's samples of the epoch's ORDER from FIRST_STEP up to STEPS, micro-batch by
        micro-batch: micro-batch m of the launch's rank r at step s is what r drew then (it
        took every world-th sample of the order from its own, accumulation x batch_size a
        step)."""
        for step in range(first_step, steps):
            for number in self.micro_batches:
                owner, micro = divmod(number, self.accumulation)
                start = owner + self.world * (step * self.accumulation + micro) * self.batch_size
                yield from order[start:start + self.world * self.batch_size:self.world]

    def batches(self, drawn: Mapping[int, Sequence[Any]], steps: int) -> Iterator[Any]:
        """This rank's micro-batches of STEPS steps, for a loader that deals whole batches to
        the ranks (accelerate's, under Hugging Face's Trainer): DRAWN[r] is what the launch's
        rank r drew in the epoch, `accumulation` a step, for each r in `owners`."""
        for step in range(steps):
            for number in self.micro_batches:
                owner, micro = divmod(number, self.accumulation)
                yield drawn[owner][step * self.accumulation + micro]

    @property
    def owners(self) -> list[int]:
        """The launch's ranks whose micro-batches this rank trains on."""
        return sorted({number // self.accumulation for number in self.micro_batches})

    @property
    def per_step(self) -> int:
        """The samples one of the launch's ranks drew a step."""
        return self.accumulation * self.batch_size


class ResumableSampler(DistributedSampler):
    """DistributedSampler whose epoch can start after its first `skip` samples, and whose rank
    can take a Share of each step's batch after the world shrank (`share`)."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, shuffle: bool = True,
                 seed: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=True)
        self.skip = 0
        self.share: Share | None = None
        self.keyed = False  # yield (index, the sample's seed), for SeededSamples

    def set_position(self, epoch: int, skip: int = 0) -> None:
        """EPOCH, after SKIP samples of this rank's (of the launch's rank's, under a share:
        whole steps of it)."""
        self.set_epoch(epoch)
        self.skip = min(max(skip, 0), self.num_samples)

    def micro_batches(self, accumulation: int) -> int:
        """How many micro-batches this rank trains on per optimizer step."""
        return accumulation if self.share is None else len(self.share.micro_batches)

    def epoch_order(self) -> list[int]:
        """The epoch's samples as every rank orders them, DistributedSampler's way: shuffled
        by seed + epoch, cut to a multiple of the launch's world; rank r takes every
        num_replicas-th from r."""
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=generator).tolist()
        else:
            order = list(range(len(self.dataset)))
        return order[:self.total_size]

    def __iter__(self) -> Iterator[int] | Iterator[tuple[int, int]]:
        indices = self._indices()
        return with_seeds(indices, self.seed, self.epoch) if self.keyed else indices

    def _indices(self) -> Iterator[int]:
        order = self.epoch_order()
        if self.share is None:
            return iter(order[self.rank::self.num_replicas][self.skip:])
        share = self.share
        return share.indices(order, self.skip // share.per_step,
                             self.num_samples // share.per_step)

    def __len__(self) -> int:
        if self.share is None:
            return self.num_samples - self.skip
        share = self.share
        steps = self.num_samples // share.per_step - self.skip // share.per_step
        return steps * len(share.micro_batches) * share.batch_size


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of what sample INDEX draws in EPOCH of a run seeded SEED (a 63-bit mix: nearby
    indices and epochs get unrelated seeds)."""
    mixed = seed * 0x9E3779B97F4A7C15 ^ epoch * 0xBF58476D1CE4E5B9 ^ index * 0x94D049BB133111EB
    return mixed % (1 << 63)


def with_seeds(indices: Iterable[int], seed: int, epoch: int) -> Iterator[tuple[int, int]]:
    """Each of INDICES with the seed its sample draws from in EPOCH: SeededSamples' keys."""
    return ((index, sample_seed(seed, epoch, index)) for index in indices)


class SeededSamples(Dataset):
    """DATASET whose every training sample draws its randomness (a random crop, a flip) from
    a seed of its own, which follows from the run's seed, the epoch and the sample's index
    (ResumableSampler's keys, `keyed`): a sample draws the same in a resumed run, after a live
    recovery's rollback, in a smaller world and with any number of DataLoader workers, where a
    worker's generators would otherwise go on from a seed drawn as it started; a new epoch
    draws anew. torch's (on the CPU), Python's and NumPy's generators are seeded, as torch
    seeds a worker's; in the main process (no workers) torch's is put back after the sample,
    so that the training's own draws (dropout) do not move."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        index, seed = key
        if get_worker_info() is not None:  # a worker's generators serve nothing else
            _seed_generators(seed)
            return self.dataset[index]
        kept = torch.get_rng_state()
        _seed_generators(seed)
        try:
            return self.dataset[index]
        finally:
            torch.set_rng_state(kept)

    def __getattr__(self, name: str) -> Any:
        """The data set's own attributes (an ImageFolder's `classes`), but none of its special
        methods: its `__getitems__` (a Subset's) would be given the keys, which are ours."""
        if name == "dataset" or name.startswith("__"):  # `dataset`: not yet set (unpickling)
            raise AttributeError(name)
        return getattr(self.dataset, name)


def read_as_stored(dataset: Dataset) -> bool:
    """Whether DATASET is a Hugging Face data set read as it is stored, with no transform set
    on it (a format's conversion to tensors draws nothing): its samples need no seed of their
    own (SeededSamples), and it keeps its batched reads (29 us a sample here, against 91 for a
    row at a time with its seed)."""
    datasets = sys.modules.get("datasets")  # where a script made one, it is imported
    return datasets is not None and isinstance(dataset, datasets.Dataset) \
        and dataset.format["type"] != "custom"


def _seed_generators(seed: int) -> None:
    """About 14 us: torch.manual_seed would take 130 (it seeds every accelerator too)."""
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")  # only where something imported it
    if numpy is not None:
        numpy.random.seed(seed % (1 << 32))


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
    (xscale.lifecycle.worker_context: forks of a fork server on GPUs, of this process on the
    CPU); under a ResumableSampler, each sample seeded by its epoch and index (SeededSamples),
    but where the data set draws nothing (read_as_stored)."""
    on_gpu = device.type != "cpu"
    options: dict[str, Any] = dict(extra)
    if isinstance(sampler, ResumableSampler) and not read_as_stored(dataset):
        sampler.keyed = True  # training: each sample's randomness its own
        if not isinstance(dataset, SeededSamples):  # xscale.prepare given xscale.loader's
            dataset = SeededSamples(dataset)
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
    it; `accumulation` micro-batches per step (the sampler's share of them, after the world
    shrank).

    The epoch and the place in it follow from the step, so a resumed run continues the
    interrupted epoch with the same shuffled order.
    """
    batch_size = loader.batch_size or 1
    per_epoch = steps_per_epoch(sampler, batch_size, accumulation)
    micro_batches = sampler.micro_batches(accumulation)  # this rank's, per step
    step = start_step
    epoch = step // per_epoch
    while (epochs is None or epoch < epochs) and (max_steps is None or step < max_steps):
        sampler.set_position(epoch, (step - epoch * per_epoch) * accumulation * batch_size)
        for index, batch in enumerate(_iterate(loader)):
            if (max_steps is not None and step >= max_steps) or step >= (epoch + 1) * per_epoch:
                break
            yield step, epoch, batch
            if (index + 1) % micro_batches == 0:
                step += 1
        if max_steps is not None and step >= max_steps:
            return
        epoch += 1


def _iterate(loader: DataLoader) -> Iterator[Any]:
    """LOADER's iterator, made without moving torch's default generator. Making one draws its
    workers' base seed from there (the first only, under persistent workers), so a run that
    makes one mid-epoch (a resume, a live recovery's rollback) would draw its dropout masks one
    number later than an uninterrupted run; its generators, set again, would not serve it."""
    with torch.random.fork_rng(devices=[]):
        return iter(loader)


def last_step(per_epoch: int, epochs: int | None, max_steps: int | None) -> int | None:
    """The global step training ends at (None: unbounded)."""
    ends = [n for n in (max_steps, None if epochs is None else epochs * per_epoch) if n is not None]
    return min(ends) if ends else None

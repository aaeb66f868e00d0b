"""xscale.data: resumable epochs, exact evaluation shards, loader workers that survive
Slurm's warning signal."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import numpy
import pytest
import torch
from xscale import data
from xscale.lifecycle import UserError

from tests.conftest import REPO

PROGRAMS = REPO / "tests" / "programs"

# ---------------------------------------------------------------------------------------------
# data: resumable epochs and exact evaluation shards
# ---------------------------------------------------------------------------------------------


def test_shards_cover_each_sample_exactly_once():
    dataset = list(range(10))
    shards = [list(data.ShardSampler(dataset, 4, rank)) for rank in range(4)]
    assert sorted(i for shard in shards for i in shard) == dataset
    assert [len(s) for s in shards] == [3, 3, 2, 2]


def test_a_resumed_run_sees_the_batches_the_uninterrupted_run_would_have():
    """The same batches, and the same numbers from torch's generator at each (a dropout mask):
    the resumed run's new loader iterator draws nothing from it (xscale.data._iterate), so the
    generator a checkpoint or a peer snapshot sets back serves it."""
    dataset = torch.utils.data.TensorDataset(torch.arange(40))

    def batches(start: int, stop: int) -> list[tuple[int, int, list[int], float]]:
        sampler = data.ResumableSampler(dataset, num_replicas=2, rank=1, seed=3)
        loader = data.make_loader(dataset, sampler, batch_size=4, workers=0,
                                  device=torch.device("cpu"), drop_last=True)
        return [(step, epoch, batch[0].tolist(), torch.rand(1).item())
                for step, epoch, batch in data.train_batches(
                    loader, sampler, start_step=start, epochs=None, max_steps=stop)]

    torch.manual_seed(9)
    whole = batches(0, 12)
    assert [step for step, _, _, _ in whole] == list(range(12))
    assert [epoch for _, epoch, _, _ in whole] == [0] * 5 + [1] * 5 + [2] * 2
    torch.manual_seed(9)
    assert batches(0, 7) + batches(7, 12) == whole
    assert whole[0][2] != whole[5][2]  # each epoch reshuffled


class Augmented(torch.utils.data.Dataset):
    """Each sample with what an augmentation draws from torch's, Python's and NumPy's
    generators."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, index: int) -> list[float]:
        return [index, torch.rand(()).item(), random.random(), numpy.random.rand()]


def test_a_sample_draws_the_same_after_a_resume_with_any_workers_and_anew_each_epoch():
    """What a training sample draws (xscale.data.SeededSamples) follows from the run's seed,
    the epoch and the sample: a run resumed mid-epoch, with two workers or none, draws what
    the uninterrupted run with one worker drew, the next epoch draws anew, and in the main
    process (no workers) the training's own generator does not move. The data set is a Subset,
    as random_split makes: one with a batch-wise __getitems__."""
    dataset = torch.utils.data.Subset(Augmented(), range(48))

    def drawn(start: int, stop: int, workers: int) -> list[list[float]]:
        sampler = data.ResumableSampler(dataset, num_replicas=2, rank=1, seed=3)
        loader = data.make_loader(dataset, sampler, batch_size=4, workers=workers,
                                  device=torch.device("cpu"), drop_last=True)
        return [sample for _, _, batch in data.train_batches(
                    loader, sampler, start_step=start, epochs=None, max_steps=stop)
                for sample in torch.stack(batch, dim=1).tolist()]

    whole = drawn(0, 12, workers=1)  # 6 steps an epoch
    assert drawn(0, 4, workers=0) + drawn(4, 12, workers=2) == whole
    by_epoch = [{sample[0]: sample[1:] for sample in whole[start:start + 24]}
                for start in (0, 24)]
    again = by_epoch[0].keys() & by_epoch[1].keys()  # in this rank's half both times
    assert len(again) >= 6, by_epoch
    assert all(by_epoch[0][index][i] != by_epoch[1][index][i] for index in again for i in range(3))
    torch.manual_seed(9)
    expected = torch.rand(1)
    torch.manual_seed(9)
    drawn(0, 2, workers=0)
    assert torch.rand(1) == expected


def test_a_hugging_face_data_set_read_as_stored_keeps_its_batched_reads():
    """A Hugging Face data set with no transform draws nothing: the loader reads it as it is
    (its batched __getitems__, the sampler yielding plain indices), the same batches; one with
    a transform (with_transform) has each sample seeded (SeededSamples)."""
    import datasets

    stored = datasets.Dataset.from_dict({"x": list(range(16))}).with_format("torch")
    transformed = datasets.Dataset.from_dict({"x": list(range(16))}).with_transform(
        lambda rows: {"x": [value + random.random() for value in rows["x"]]})

    def made(dataset) -> tuple[torch.utils.data.DataLoader, data.ResumableSampler]:
        sampler = data.ResumableSampler(dataset, num_replicas=2, rank=0, seed=3)
        return data.make_loader(dataset, sampler, batch_size=4, workers=0,
                                device=torch.device("cpu"), drop_last=True), sampler

    loader, sampler = made(stored)
    assert loader.dataset is stored and not sampler.keyed
    assert [batch["x"].tolist() for batch in loader] == [
        [int(index) for index in indices] for indices in zip(*[iter(list(sampler))] * 4,
                                                             strict=True)]
    loader, sampler = made(transformed)
    assert isinstance(loader.dataset, data.SeededSamples) and sampler.keyed
    assert len([batch["x"] for batch in loader]) == 2


def test_accumulated_steps_resume_at_the_same_micro_batch():
    dataset = torch.utils.data.TensorDataset(torch.arange(40))

    def batches(start: int, stop: int) -> list[tuple[int, int, list[int]]]:
        sampler = data.ResumableSampler(dataset, num_replicas=2, rank=0, seed=3)
        loader = data.make_loader(dataset, sampler, batch_size=3, workers=0,
                                  device=torch.device("cpu"), drop_last=True)
        return [(step, epoch, batch[0].tolist()) for step, epoch, batch in
                data.train_batches(loader, sampler, start_step=start, epochs=None,
                                   max_steps=stop, accumulation=2)]

    # 20 samples per rank: 6 batches of 3, 3 steps of 2 batches per epoch (2 samples left over).
    whole = batches(0, 7)
    assert [step for step, _, _ in whole] == [s for s in range(7) for _ in (0, 1)]
    assert [epoch for _, epoch, _ in whole] == [0] * 6 + [1] * 6 + [2] * 2
    assert batches(0, 4) + batches(4, 7) == whole


def test_the_ranks_left_share_each_step_and_the_epoch_as_the_launchs_ranks_drew_them():
    """Six ranks laid out the batches (two micro-batches of three a step); from step 1 of the
    epoch five ranks go on, across an epoch boundary: each step, the five together train the
    samples the six would have, none twice (their twelve micro-batches dealt 3, 3, 2, 2, 2), the
    steps end where the six's would (xscale.data.Share). At full size the sampler draws what
    torch's DistributedSampler draws."""
    dataset = torch.utils.data.TensorDataset(torch.arange(100))
    world, accumulation, size, ranks = 6, 2, 3, 5

    def steps(rank: int, share: data.Share | None, start: int) -> dict[int, list[int]]:
        sampler = data.ResumableSampler(dataset, num_replicas=world, rank=rank, seed=5)
        sampler.share = share
        loader = data.make_loader(dataset, sampler, batch_size=size, workers=0,
                                  device=torch.device("cpu"), drop_last=True)
        drawn: dict[int, list[int]] = {}
        for step, _, batch in data.train_batches(loader, sampler, start_step=start, epochs=None,
                                                 max_steps=4, accumulation=accumulation):
            drawn.setdefault(step, []).extend(batch[0].tolist())
        return drawn

    launch = [steps(rank, None, 0) for rank in range(world)]
    left = [steps(rank, data.Share.dealt(world, accumulation, size, rank, ranks), 1)
            for rank in range(ranks)]
    assert all(set(drawn) == {1, 2, 3} for drawn in left), left
    for step in range(1, 4):  # 16 samples a rank: 2 steps an epoch
        assert sorted(sum((drawn[step] for drawn in left), [])) == \
            sorted(sum((drawn[step] for drawn in launch), [])), step
    assert [len(left[rank][1]) for rank in range(ranks)] == [9, 9, 6, 6, 6]
    torch_sampler = torch.utils.data.DistributedSampler(dataset, world, 1, seed=5,
                                                        drop_last=True)
    assert list(data.ResumableSampler(dataset, world, 1, seed=5)) == list(torch_sampler)


@pytest.mark.parametrize("how, start, survives", [
    ("xscale", "spawn", True), ("xscale", "fork", True),
    # The control: spawned workers start with SIGUSR1's default action, which kills them.
    # (Forked ones inherit the parent's handler, so a plain forked loader proves nothing.)
    ("plain", "spawn", False),
])
def test_loader_workers_survive_slurms_warning_signal(how, start, survives):
    """SIGUSR1 to the whole process group, as Slurm signals a step: make_loader's workers (and
    the fork server and resource tracker a GPU rank's use) live on; a plain DataLoader's die
    of it. The device is only the choice of start method here: "cuda" stands for a GPU rank."""
    device = "cuda" if start == "spawn" else "cpu"  # only a name here: no GPU is touched
    program = PROGRAMS / "loader_workers_under_sigusr1.py"
    proc = subprocess.run([sys.executable, str(program), how, device], capture_output=True,
                          text=True, timeout=120, start_new_session=True,
                          env=dict(os.environ))
    if survives:
        assert (proc.returncode, proc.stdout) == (0, "128 True\n"), proc.stderr
        for symptom in ("killed by signal", "exited unexpectedly", "Traceback", "leaked"):
            assert symptom not in proc.stderr, proc.stderr
        # The script ran its imports in the trainer. On a GPU its two workers run its top level
        # again, as forks of a fork server that imported torch: not importing it each.
        assert proc.stderr.count("torch not imported") == 1, proc.stderr
        assert proc.stderr.count("torch already imported") == (2 if start == "spawn" else 0)
    else:
        # The workers die; how the main process learns it varies (a worker-killed error, or a
        # reset connection while a batch was in flight), but the run always fails.
        assert proc.returncode != 0 and proc.stdout == "", proc.stderr


def test_a_batch_larger_than_a_ranks_share_is_a_user_error():
    sampler = data.ResumableSampler(list(range(10)), num_replicas=4, rank=0)
    with pytest.raises(UserError, match="lower --batch-size"):
        data.steps_per_epoch(sampler, 8)

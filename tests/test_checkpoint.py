"""xscale.checkpoints: atomic checkpoints found by step, background writes, the cadence
settings, the training state."""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.nn.parallel import DistributedDataParallel
from xscale.checkpoints import cadence, contents, every_rank, files, savers
from xscale.lifecycle import UserError
from xscale.observe import runlog

# ---------------------------------------------------------------------------------------------
# checkpoint: atomic, found by step, the last K kept
# ---------------------------------------------------------------------------------------------


def test_checkpoints_are_found_by_step_not_by_name_or_time(tmp_path):
    for step in (5, 100, 12):  # written out of order: the newest file is not the newest step
        files.save(tmp_path, step, {"step": step, "payload": torch.tensor([step])}, keep=10)
    files.save(tmp_path, 1000000, {"step": 1000000}, keep=10)  # past the zero padding
    assert [s for s, _ in files.list_checkpoints(tmp_path)] == [5, 12, 100, 1000000]
    assert files.load_latest(tmp_path)["step"] == 1000000
    assert files.checkpoint_path(tmp_path, 123).name == "ckpt-000123.pt"


def test_only_the_newest_k_are_kept(tmp_path):
    for step in range(1, 7):
        files.save(tmp_path, step * 10, {"step": step * 10}, keep=3)
    assert [s for s, _ in files.list_checkpoints(tmp_path)] == [40, 50, 60]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-000040.pt", "ckpt-000050.pt", "ckpt-000060.pt"]


def test_a_save_that_dies_midway_leaves_the_previous_checkpoint_intact(tmp_path):
    files.save(tmp_path, 10, {"step": 10, "weights": torch.ones(4)})

    def dies_midway(obj, handle):
        handle.write(b"half a checkpoint")
        raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space left"):
        files.atomic_save({"step": 20}, files.checkpoint_path(tmp_path, 20),
                               writer=dies_midway)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-000010.pt"]  # no temp, no ckpt-20
    assert files.load_latest(tmp_path)["step"] == 10


def test_leftover_temporaries_are_ignored_and_cleaned(tmp_path):
    (tmp_path / ".ckpt-abc.tmp").write_bytes(b"killed during a save")
    assert files.load_latest(tmp_path) is None
    files.save(tmp_path, 1, {"step": 1})
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-000001.pt"]


def test_an_unreadable_newest_checkpoint_falls_back_to_the_previous(tmp_path, capsys):
    files.save(tmp_path, 10, {"step": 10})
    files.checkpoint_path(tmp_path, 20).write_bytes(b"not a torch file")
    assert files.load_latest(tmp_path)["step"] == 10
    assert "cannot read" in capsys.readouterr().err


def test_no_directory_means_no_checkpoint(tmp_path):
    assert files.load_latest(tmp_path / "missing") is None


def test_a_background_save_is_published_whole_and_holds_the_state_it_was_given(tmp_path,
                                                                            monkeypatch):
    """XSCALE_CHECKPOINT_MODE=async: the call returns with the write under way (held here at its
    fsync, as slow storage holds it); until it is published the previous checkpoint is the
    newest, and training that changes the weights meanwhile does not change what is written."""
    files.save(tmp_path, 10, {"step": 10})
    durable, real_fsync, at_fsync = threading.Event(), os.fsync, threading.Event()
    monkeypatch.setattr(os, "fsync",
                        lambda fd: (at_fsync.set(), durable.wait(30), real_fsync(fd)))
    model = nn.Linear(3, 2)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    saver = savers.TrainingSaver(tmp_path, model, optimizer, None, is_main=True, keep=3,
                                     mode="async", extra={})
    assert saver(20, 0) == files.checkpoint_path(tmp_path, 20)
    with torch.no_grad():
        model.weight.add_(1.0)  # the next steps train on
    assert [step for step, _ in files.list_checkpoints(tmp_path)] == [10]
    assert at_fsync.wait(30)  # the writer thread has its temporary file open by then
    assert list(tmp_path.glob(".ckpt-*.tmp"))  # being written
    durable.set()
    saver.wait()
    state = files.load_latest(tmp_path)
    assert state["step"] == 20
    assert all(torch.equal(state["model"][name], before[name]) for name in before)


def test_a_background_write_that_failed_fails_the_next_save(tmp_path):
    writer = savers.BackgroundWriter()

    def full_disk():
        raise OSError("No space left on device")

    writer.start(full_disk)
    with pytest.raises(OSError, match="No space left"):
        writer.wait()
    writer.wait()  # reported once


def test_auto_takes_youngs_interval_from_the_save_cost_and_the_jobs_failure_rate():
    # 1,024 nodes of Meta's Llama 3 rate: a failure every 6.2 hours. A save that stops training
    # 2 s: sqrt(2 x 2 s x 22,270 s) = 298 s, at 0.5 s a step 597 steps.
    job_mtbf_s = cadence.NODE_MTBF_H * 3600 / 1024
    every, seconds, mtbf = cadence.auto_interval(2.0, 1.0, 0.5, 1024, cadence.NODE_MTBF_H)
    assert mtbf == pytest.approx(job_mtbf_s)
    assert seconds == pytest.approx(math.sqrt(2 * 2.0 * job_mtbf_s))
    assert every == math.ceil(seconds / 0.5) == 597
    # A background write longer than that sets the floor; one step is the least.
    assert cadence.auto_interval(0.01, 400.0, 0.5, 1024, cadence.NODE_MTBF_H)[:2] == (
        800, 400.0)
    assert cadence.auto_interval(0.0, 0.0, 10.0, 1, 1.0)[0] == 1


@pytest.mark.parametrize("text, expected", [("auto", "auto"), ("0", 0), ("250", 250)])
def test_checkpoint_every_is_a_whole_number_or_auto(text, expected):
    assert cadence.checkpoint_interval(text) == expected


@pytest.mark.parametrize("text", ["-1", "1.5", "often", ""])
def test_checkpoint_every_rejects_anything_else(text):
    with pytest.raises(argparse.ArgumentTypeError, match="neither a whole number nor auto"):
        cadence.checkpoint_interval(text)


def test_checkpoint_settings_are_checked():
    assert savers.checkpoint_mode({}) == "async"
    assert savers.checkpoint_mode({"XSCALE_CHECKPOINT_MODE": "sync"}) == "sync"
    with pytest.raises(UserError, match="XSCALE_CHECKPOINT_MODE='Async' is neither"):
        savers.checkpoint_mode({"XSCALE_CHECKPOINT_MODE": "Async"})
    assert savers.checkpoint_writers({}) == "rank0"
    assert savers.checkpoint_writers({"XSCALE_CHECKPOINT_WRITERS": "all"}) == "all"
    for bad in ("every", "ALL", "rank1", ""):
        with pytest.raises(UserError, match=f"XSCALE_CHECKPOINT_WRITERS='{bad}' is neither"):
            savers.checkpoint_writers({"XSCALE_CHECKPOINT_WRITERS": bad})
    assert cadence.node_mtbf_hours({}) == cadence.NODE_MTBF_H
    assert cadence.node_mtbf_hours({"XSCALE_NODE_MTBF_H": "5000"}) == 5000.0
    for bad in ("0", "-2", "nan", "inf", "many"):
        with pytest.raises(UserError, match="not a positive number of hours"):
            cadence.node_mtbf_hours({"XSCALE_NODE_MTBF_H": bad})


def test_training_state_round_trip_restores_weights_optimizer_and_random_stream(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    state = contents.training_state(model, optimizer, step=7, epoch=1)
    files.save(tmp_path, 7, state)
    expected_draw = torch.rand(3)  # what the stream gives right after the save

    fresh = nn.Linear(3, 2)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.1)
    torch.manual_seed(123)  # a different stream, to be replaced
    step, epoch = contents.restore_training_state(
        files.load_latest(tmp_path), fresh, fresh_optimizer)
    assert (step, epoch) == (7, 1)
    assert runlog.param_digest(fresh) == runlog.param_digest(model)
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 1
    assert torch.equal(torch.rand(3), expected_draw)


def test_a_staged_state_keeps_tied_weights_one_tensor():
    shared = torch.ones(3)
    copy = contents.host_copies({"embedding": shared, "output": shared, "step": 7})
    assert copy["embedding"] is copy["output"] and copy["embedding"] is not shared
    shared.add_(1.0)
    assert torch.equal(copy["output"], torch.ones(3)) and copy["step"] == 7


# ---------------------------------------------------------------------------------------------
# XSCALE_CHECKPOINT_WRITERS=all: every rank writes its part of ckpt-STEP.dcp
# ---------------------------------------------------------------------------------------------


def small_net() -> nn.Module:
    """Four tensors of different sizes: enough for DCP's planner to give each of 2 ranks some."""
    return nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 2))


def trained(model: nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return optimizer


def every_rank_round_trip(rank: int, world: int, rendezvous: str, out: str, mode: str) -> None:
    """One rank of test_every_rank_writes_a_part_and_resumes_bit_for_bit: save at step 7 while
    training goes on, then resume into a fresh model and optimizer with a reseeded stream."""
    os.environ.update(XSCALE_CHECKPOINT_WRITERS="all", XSCALE_CHECKPOINT_MODE=mode)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DistributedDataParallel(small_net())
    optimizer = trained(model)
    weights = {name: tensor.clone() for name, tensor in model.module.state_dict().items()}
    torch.manual_seed(100 + rank)  # each rank its own stream, as the trainers seed them
    saver = savers.training_saver(Path(out), model, optimizer, is_main=rank == 0, keep=3,
                                      arch="small")
    assert saver(7, 2) == Path(out) / "ckpt-000007.dcp"
    draw = torch.rand(5)  # what this rank's stream gives right after the save
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)  # training goes on while the write is under way
    saver.wait()

    fresh = DistributedDataParallel(small_net())
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.1)
    torch.manual_seed(999)
    assert contents.resume_training(Path(out), fresh, fresh_optimizer, rank=rank) == 7
    assert torch.equal(torch.rand(5), draw), f"rank {rank} did not get its own stream back"
    restored = fresh.module.state_dict()
    assert all(torch.equal(restored[name], weights[name]) for name in weights)
    expected, got = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    assert expected.keys() == got.keys()
    for index, moments in expected.items():
        assert all(torch.equal(got[index][key], moments[key]) for key in moments), index
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads may abort the interpreter's own exit (docs/TESTBED.md)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_every_rank_writes_a_part_and_resumes_bit_for_bit(tmp_path, mode):
    """2 gloo processes: each writes its own file of the checkpoint, rank 0 publishes it whole;
    a fresh model and optimizer get the weights and Adam's moments back, each rank its own
    random stream (asserted in every_rank_round_trip), the run's fields too."""
    out = tmp_path / "out"
    rendezvous = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(every_rank_round_trip, args=(2, rendezvous, str(out), mode), nprocs=2)
    path = out / "ckpt-000007.dcp"
    assert [entry.name for entry in out.iterdir()] == [path.name]  # nothing temporary left
    files = {index.fqn: info.relative_path
             for index, info in FileSystemReader(str(path)).read_metadata().storage_data.items()}
    # DDP's replicas deduplicated and spread: both ranks wrote some of the weights.
    assert {name for fqn, name in files.items() if fqn.startswith("model.")} == {
        "__0_0.distcp", "__1_0.distcp"}
    assert (files["rng/rank0"], files["rng/rank1"]) == ("__0_0.distcp", "__1_0.distcp")
    head = {every_rank.RUN_KEY: None}
    dcp.load(head, checkpoint_id=path, no_dist=True)
    assert every_rank.unpack(head[every_rank.RUN_KEY]) == {
        "step": 7, "epoch": 2, "world_size": 2, "arch": "small"}


def every_rank_saver(out: Path, keep: int = 3, mode: str = "sync") -> savers.EveryRankSaver:
    """One process, no process group: DCP writes the one part; the publication is the same."""
    model = small_net()
    return savers.EveryRankSaver(out, model, trained(model), None, is_main=True, keep=keep,
                                     mode=mode, extra={})


def test_a_killed_every_rank_write_is_ignored_on_resume_and_cleaned_later(tmp_path, capsys):
    """A job killed before rank 0's rename leaves a temporary directory, whole or not; the
    resume takes the published checkpoint before it, and the next publication removes it."""
    every_rank_saver(tmp_path)(10, 0)
    model = small_net()
    state = every_rank.state_dict(model, trained(model), {"step": 20}, b"", 0)
    killed = every_rank.partial_path(tmp_path, 20, "0ldrun00")
    every_rank.save(state, killed, None)  # every part and .metadata, never renamed
    half = every_rank.partial_path(tmp_path, 30, "0ldrun00")
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"half a part")
    assert [step for step, _ in files.list_checkpoints(tmp_path)] == [10]
    model = small_net()
    assert contents.resume_training(tmp_path, model, trained(model), rank=0) == 10
    saver = every_rank_saver(tmp_path)
    saver(11, 0)
    assert sorted(entry.name for entry in tmp_path.iterdir()) == [
        "ckpt-000010.dcp", "ckpt-000011.dcp"]
    assert "warning" not in capsys.readouterr().err


def test_this_runs_own_temporary_directories_are_not_pruned(tmp_path):
    """The other ranks may start the next save before rank 0 prunes after the last one."""
    mine = every_rank.partial_path(tmp_path, 40, "thisrun0")
    theirs = every_rank.partial_path(tmp_path, 40, "0ldrun00")
    for folder in (mine, theirs):
        folder.mkdir()
    files.prune(tmp_path, 3, writing="thisrun0")
    assert mine.is_dir() and not theirs.exists()


def test_pruning_and_resume_take_pt_files_and_dcp_directories_together(tmp_path):
    """A run that switched XSCALE_CHECKPOINT_WRITERS keeps the newest K of both kinds and
    resumes from the newest step, whichever kind it is."""
    torch.manual_seed(0)
    files.save(tmp_path, 10, {"step": 10}, keep=3)
    every_rank_saver(tmp_path)(20, 0)
    files.save(tmp_path, 30, {"step": 30}, keep=3)
    saver = every_rank_saver(tmp_path, mode="async")
    saver(40, 1)
    saver.wait()
    assert [path.name for _, path in files.list_checkpoints(tmp_path)] == [
        "ckpt-000020.dcp", "ckpt-000030.pt", "ckpt-000040.dcp"]
    model = small_net()
    optimizer = trained(model)
    assert contents.resume_training(tmp_path, model, optimizer, rank=0) == 40
    assert runlog.param_digest(model) == runlog.param_digest(saver.model)
    state = contents.training_state(model, optimizer, step=50, epoch=1)
    files.save(tmp_path, 50, state, keep=2)
    assert sorted(entry.name for entry in tmp_path.iterdir()) == [
        "ckpt-000040.dcp", "ckpt-000050.pt"]  # the removed directory too
    model = small_net()
    assert contents.resume_training(tmp_path, model, trained(model), rank=0) == 50


@pytest.mark.parametrize("damage", ["truncated part", "no metadata"])
def test_an_unreadable_newest_directory_falls_back_to_the_previous(tmp_path, capsys, damage):
    every_rank_saver(tmp_path)(10, 0)
    every_rank_saver(tmp_path)(20, 0)
    newest = tmp_path / "ckpt-000020.dcp"
    if damage == "no metadata":
        (newest / every_rank.METADATA).unlink()
    else:
        part = newest / "__0_0.distcp"
        part.write_bytes(part.read_bytes()[:100])
    model = small_net()
    assert contents.resume_training(tmp_path, model, trained(model), rank=0) == 10
    assert f"cannot read {newest}" in capsys.readouterr().err

"""xscale.checkpoint: atomic checkpoints found by step, background writes, the cadence
settings, the training state."""

from __future__ import annotations

import argparse
import math
import os
import threading

import pytest
import torch
from torch import nn
from xscale import checkpoint, runlog
from xscale.lifecycle import UserError

# ---------------------------------------------------------------------------------------------
# checkpoint: atomic, found by step, the last K kept
# ---------------------------------------------------------------------------------------------


def test_checkpoints_are_found_by_step_not_by_name_or_time(tmp_path):
    for step in (5, 100, 12):  # written out of order: the newest file is not the newest step
        checkpoint.save(tmp_path, step, {"step": step, "payload": torch.tensor([step])}, keep=10)
    checkpoint.save(tmp_path, 1000000, {"step": 1000000}, keep=10)  # past the zero padding
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [5, 12, 100, 1000000]
    assert checkpoint.load_latest(tmp_path)["step"] == 1000000
    assert checkpoint.checkpoint_path(tmp_path, 123).name == "ckpt-000123.pt"


def test_only_the_newest_k_are_kept(tmp_path):
    for step in range(1, 7):
        checkpoint.save(tmp_path, step * 10, {"step": step * 10}, keep=3)
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [40, 50, 60]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-000040.pt", "ckpt-000050.pt", "ckpt-000060.pt"]


def test_a_save_that_dies_midway_leaves_the_previous_checkpoint_intact(tmp_path):
    checkpoint.save(tmp_path, 10, {"step": 10, "weights": torch.ones(4)})

    def dies_midway(obj, handle):
        handle.write(b"half a checkpoint")
        raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space left"):
        checkpoint.atomic_save({"step": 20}, checkpoint.checkpoint_path(tmp_path, 20),
                               writer=dies_midway)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-000010.pt"]  # no temp, no ckpt-20
    assert checkpoint.load_latest(tmp_path)["step"] == 10


def test_leftover_temporaries_are_ignored_and_cleaned(tmp_path):
    (tmp_path / ".ckpt-abc.tmp").write_bytes(b"killed during a save")
    assert checkpoint.load_latest(tmp_path) is None
    checkpoint.save(tmp_path, 1, {"step": 1})
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-000001.pt"]


def test_an_unreadable_newest_checkpoint_falls_back_to_the_previous(tmp_path, capsys):
    checkpoint.save(tmp_path, 10, {"step": 10})
    checkpoint.checkpoint_path(tmp_path, 20).write_bytes(b"not a torch file")
    assert checkpoint.load_latest(tmp_path)["step"] == 10
    assert "cannot read" in capsys.readouterr().err


def test_no_directory_means_no_checkpoint(tmp_path):
    assert checkpoint.load_latest(tmp_path / "missing") is None


def test_a_background_save_is_published_whole_and_holds_the_state_it_was_given(tmp_path,
                                                                            monkeypatch):
    """XSCALE_CHECKPOINT_MODE=async: the call returns with the write under way (held here at its
    fsync, as slow storage holds it); until it is published the previous checkpoint is the
    newest, and training that changes the weights meanwhile does not change what is written."""
    checkpoint.save(tmp_path, 10, {"step": 10})
    durable, real_fsync, at_fsync = threading.Event(), os.fsync, threading.Event()
    monkeypatch.setattr(os, "fsync",
                        lambda fd: (at_fsync.set(), durable.wait(30), real_fsync(fd)))
    model = nn.Linear(3, 2)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    saver = checkpoint.TrainingSaver(tmp_path, model, optimizer, None, is_main=True, keep=3,
                                     mode="async", extra={})
    assert saver(20, 0) == checkpoint.checkpoint_path(tmp_path, 20)
    with torch.no_grad():
        model.weight.add_(1.0)  # the next steps train on
    assert [step for step, _ in checkpoint.list_checkpoints(tmp_path)] == [10]
    assert at_fsync.wait(30)  # the writer thread has its temporary file open by then
    assert list(tmp_path.glob(".ckpt-*.tmp"))  # being written
    durable.set()
    saver.wait()
    state = checkpoint.load_latest(tmp_path)
    assert state["step"] == 20
    assert all(torch.equal(state["model"][name], before[name]) for name in before)


def test_a_background_write_that_failed_fails_the_next_save(tmp_path):
    writer = checkpoint.BackgroundWriter()

    def full_disk():
        raise OSError("No space left on device")

    writer.start(full_disk)
    with pytest.raises(OSError, match="No space left"):
        writer.wait()
    writer.wait()  # reported once


def test_auto_takes_youngs_interval_from_the_save_cost_and_the_jobs_failure_rate():
    # 1,024 nodes of Meta's Llama 3 rate: a failure every 6.2 hours. A save that stops training
    # 2 s: sqrt(2 x 2 s x 22,270 s) = 298 s, at 0.5 s a step 597 steps.
    job_mtbf_s = checkpoint.NODE_MTBF_H * 3600 / 1024
    every, seconds, mtbf = checkpoint.auto_interval(2.0, 1.0, 0.5, 1024, checkpoint.NODE_MTBF_H)
    assert mtbf == pytest.approx(job_mtbf_s)
    assert seconds == pytest.approx(math.sqrt(2 * 2.0 * job_mtbf_s))
    assert every == math.ceil(seconds / 0.5) == 597
    # A background write longer than that sets the floor; one step is the least.
    assert checkpoint.auto_interval(0.01, 400.0, 0.5, 1024, checkpoint.NODE_MTBF_H)[:2] == (
        800, 400.0)
    assert checkpoint.auto_interval(0.0, 0.0, 10.0, 1, 1.0)[0] == 1


@pytest.mark.parametrize("text, expected", [("auto", "auto"), ("0", 0), ("250", 250)])
def test_checkpoint_every_is_a_whole_number_or_auto(text, expected):
    assert checkpoint.every_argument(text) == expected


@pytest.mark.parametrize("text", ["-1", "1.5", "often", ""])
def test_checkpoint_every_rejects_anything_else(text):
    with pytest.raises(argparse.ArgumentTypeError, match="neither a whole number nor auto"):
        checkpoint.every_argument(text)


def test_checkpoint_settings_are_checked():
    assert checkpoint.checkpoint_mode({}) == "async"
    assert checkpoint.checkpoint_mode({"XSCALE_CHECKPOINT_MODE": "sync"}) == "sync"
    with pytest.raises(UserError, match="XSCALE_CHECKPOINT_MODE='Async' is neither"):
        checkpoint.checkpoint_mode({"XSCALE_CHECKPOINT_MODE": "Async"})
    assert checkpoint.node_mtbf_hours({}) == checkpoint.NODE_MTBF_H
    assert checkpoint.node_mtbf_hours({"XSCALE_NODE_MTBF_H": "5000"}) == 5000.0
    for bad in ("0", "-2", "nan", "inf", "many"):
        with pytest.raises(UserError, match="not a positive number of hours"):
            checkpoint.node_mtbf_hours({"XSCALE_NODE_MTBF_H": bad})


def test_training_state_round_trip_restores_weights_optimizer_and_random_stream(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    state = checkpoint.training_state(model, optimizer, step=7, epoch=1)
    checkpoint.save(tmp_path, 7, state)
    expected_draw = torch.rand(3)  # what the stream gives right after the save

    fresh = nn.Linear(3, 2)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.1)
    torch.manual_seed(123)  # a different stream, to be replaced
    step, epoch = checkpoint.restore_training_state(
        checkpoint.load_latest(tmp_path), fresh, fresh_optimizer)
    assert (step, epoch) == (7, 1)
    assert runlog.param_digest(fresh) == runlog.param_digest(model)
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 1
    assert torch.equal(torch.rand(3), expected_draw)


def test_a_staged_state_keeps_tied_weights_one_tensor():
    shared = torch.ones(3)
    copy = checkpoint.staged({"embedding": shared, "output": shared, "step": 7})
    assert copy["embedding"] is copy["output"] and copy["embedding"] is not shared
    shared.add_(1.0)
    assert torch.equal(copy["output"], torch.ones(3)) and copy["step"] == 7

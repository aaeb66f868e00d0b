"""xscale.observe.runlog: the digest that proves replicas are identical, and the lines a run
leaves."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn
from xscale.observe import runlog, startup, steptime
from xscale.shared import taglines

# ---------------------------------------------------------------------------------------------
# summary: the digest that proves replicas are identical
# ---------------------------------------------------------------------------------------------


class Wrapper(nn.Module):
    """Stands in for DDP / a DeepSpeed engine: the real model in `.module`."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(2))


def test_param_digest_is_stable_and_sees_one_ulp():
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    first = runlog.param_digest(model)
    assert first == runlog.param_digest(model)
    # What the docstring says it is: sha256 over each parameter's name, dtype, shape and bytes,
    # in name order.
    expected = hashlib.sha256()
    for name in ("0.bias", "0.weight", "2.bias", "2.weight"):
        tensor = model.get_parameter(name).detach()
        expected.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        expected.update(tensor.numpy().tobytes())
    assert first == expected.hexdigest()
    with torch.no_grad():
        weight = model[0].weight
        weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(float("inf")))
    assert runlog.param_digest(model) != first


def test_param_digest_ignores_wrappers_and_buffers_but_not_dtype():
    model = small_net()
    model(torch.randn(2, 3, 5, 5))  # materialise the lazy layer
    digest = runlog.param_digest(model)
    assert runlog.param_digest(Wrapper(model)) == digest
    model[1].running_mean.add_(1.0)  # BatchNorm statistics differ per rank by design
    assert runlog.param_digest(model) == digest
    assert runlog.param_digest(model.to(torch.bfloat16)) != digest


# ---------------------------------------------------------------------------------------------
# the summary: whole in its file, and one line that srun --label never cuts
# ---------------------------------------------------------------------------------------------


def common_fields(**changes) -> dict:
    """The common fields of a finished run; CHANGES replace some."""
    fields = {
        "trainer": "mnist_ddp", "world_size": 4, "nodes": 2, "device": "cpu", "backend": "gloo",
        "start_step": 0, "steps": 60, "batch_size": 32, "global_batch_size": 128,
        "accumulation": 1, "samples_per_s": 554.726, "samples_per_s_per_rank": 138.682,
        "tokens_per_s": None, "loss_first": 2.30177, "loss_last": 0.017384, "seconds": 14.424,
        "train_seconds": 11.151, "stopped_early": False, "signal": None,
        "checkpoint": "/scratch/project/run/ckpt-000060.pt", "checkpoint_stall_s": 0.012,
        "checkpoints_saved": 3, "startup": {}, "straggler": {"rank": 3, "node": "nid002",
                                                              "factor": 1.04},
        "step_time": {"seconds": 0.02601, "data": 0.01, "compute": 0.8, "communication": 0.15,
                      "checkpoint": 0.02, "other": 0.02},
        "bound": "compute", "tflops": 0.02, "mfu": None,
        "step_time_ranks": {"rank": 1, "spread": {}}, "flops": {"per_step": 10**9},
        "shrinks": None, "summary_file": None,
    }
    return {**fields, **changes}


def test_the_summary_goes_whole_into_its_file_and_the_line_names_it(tmp_path, capsys):
    path = runlog.summary_path(tmp_path / "run")
    startup_ = {"total": {"median": 6.4, "slowest": 6.5, "rank": 3, "node": "nid002", "ranks": 4}}
    record = runlog.summary_record(
        common_fields(summary_file=path, startup=startup_, loss_first=float("nan"),
                      loss_last=torch.tensor(0.5)),
        {"accuracy": 0.97})
    runlog.rank_record(rank=1, steps=3, param_digest="ab")
    runlog.emit_summary(record)
    lines = capsys.readouterr().out.splitlines()
    assert json.loads(lines[0].removeprefix("XSCALE_RANK ")) == {"rank": 1, "steps": 3,
                                                                 "param_digest": "ab"}
    assert lines[1].startswith("XSCALE_SUMMARY ")
    line = json.loads(lines[1].removeprefix("XSCALE_SUMMARY "))
    whole = json.loads(path.read_text())
    assert list(whole) == [*runlog.SUMMARY_FIELDS, "accuracy"]
    assert (whole["loss_first"], whole["loss_last"], whole["startup"]) == (None, 0.5, startup_)
    assert line == {name: value for name, value in whole.items() if name not in runlog.FILE_ONLY}
    assert line["summary_file"] == str(path) and path.is_absolute()
    assert taglines.whole_summary(line) == whole
    assert not list(path.parent.glob(".*"))  # no temporary left behind


def largest_realistic_summary(tmp_path: Path) -> dict:
    """A full-machine run as large as LUMI's (2,978 nodes, 8 GCDs each): 23,824 ranks, nodes
    named nid00NNNN, the rank with the most digits slowest in every phase, a run of a day with
    millions of steps, DeepSpeed's trainer (the most fields of its own), and output paths as
    long as a LUMI project's scratch gives."""
    ranks = [startup.RankPhases(rank, f"nid00{5000 + rank // 8:04d}",
                                {name: 1234.567 + rank / 1e4 for name in startup.NAMES})
             for rank in range(23824)]
    output = Path("/scratch/project_465002178/a_long_user_name/runs/imagenet-resnet152-bs65536")
    common = common_fields(
        trainer="imagenet_deepspeed", world_size=23824, nodes=2978, device="cuda",
        backend="nccl", start_step=1234567, steps=2345678, batch_size=512,
        global_batch_size=512 * 16 * 23824, accumulation=16, samples_per_s=1234567.891,
        samples_per_s_per_rank=51.82, tokens_per_s=None, loss_first=6.90776,
        loss_last=0.0173841, seconds=86399.123, train_seconds=86000.988, stopped_early=True,
        signal="SIGUSR1", checkpoint=str(output / "global_step2345678"),
        checkpoint_stall_s=12345.678, checkpoints_saved=12345,
        startup=startup.aggregate(ranks),
        straggler={"rank": 23823, "node": "nid007977", "factor": 12.34},
        **step_time_fields([(rank, steptime.Breakdown(0.123456789, 0.0123456, 0.0987654, None,
                                                      0.00123456, 0.0109876 + rank / 1e9))
                            for rank in range(23824)]),
        tflops=0.0001234, mfu=0.1234,  # their widest: four digits of a figure far below one
        summary_file=runlog.summary_path(output))
    own = {"accuracy": 0.761235, "val_loss": 0.987654, "val_samples": 50000,
           "epoch": 89, "arch": "efficientnet_v2_l", "image_size": 224, "zero_stage": 3,
           "dtype": "bfloat16"}
    return runlog.summary_record(common, own)


def step_time_fields(breakdowns: list[tuple[int, steptime.Breakdown]]) -> dict:
    """The summary's step-time fields, as write_summary makes them."""
    step_time = steptime.summarise(breakdowns)
    return {"step_time": step_time.field(), "bound": step_time.bound,
            "step_time_ranks": step_time.ranks()}


def test_in_a_jobs_output_the_bar_is_drawn_as_lines_that_srun_label_never_cuts(capsys):
    # capsys's stderr is not a terminal, as a batch job's is not. Drawn in place, a run's drawings
    # made one line, which srun --label cut inside a character (CI, 2026-11-30).
    log = runlog.TrainLog(is_main=True, start_step=0, total_steps=200)
    for _ in range(200):
        log.advance()
    log.message("checkpoint saved")
    log.close()
    err = capsys.readouterr().err
    assert "\r" not in err and err.isascii(), repr(err[:200])
    lines = err.splitlines()
    assert "checkpoint saved" in lines
    assert "200/200" in lines[-1], lines
    assert all(len(labelled(line, 100_000).encode()) < taglines.SRUN_LABEL_CUT for line in lines)


def labelled(line: str, ranks: int) -> str:
    """The line as srun --label prints it: rank 0, as wide as the job's largest rank."""
    return f"{0:>{len(str(ranks - 1))}}: {line}"


def test_the_largest_realistic_summary_line_stays_whole_under_srun_label_but_its_checkpoint(
        tmp_path):
    record = largest_realistic_summary(tmp_path)
    text = runlog.line(runlog.SUMMARY_TAG, runlog.line_record(record))
    out = labelled(text, record["world_size"])
    assert len(out.encode()) <= taglines.SRUN_LABEL_CUT, len(out.encode())
    # A user's `grep XSCALE_SUMMARY | cut -d' ' -f3-` (after srun's label) is JSON as it is.
    found = json.loads(out.split("XSCALE_SUMMARY ", 1)[1])
    # The checkpoint's path is the one field left to the file; the trainer's fields stay.
    assert list(found) == [name for name in record
                           if name not in (*runlog.FILE_ONLY, *runlog.LEFT_OUT_FIRST)]
    assert len(json.dumps(record["startup"])) > 500  # what the file keeps for the line


def test_a_summary_too_long_for_the_line_leaves_the_trainers_fields_to_the_file(tmp_path):
    record = largest_realistic_summary(tmp_path)
    record.update(notes="x" * 2000)  # a trainer's own field of unusual size
    fields = runlog.line_record(record)
    assert len(runlog.encode(fields)) <= runlog.LINE_BUDGET
    assert "notes" not in fields and fields["stopped_early"] is True
    assert set(fields) >= (set(runlog.SUMMARY_FIELDS) - set(runlog.FILE_ONLY)
                           - set(runlog.LEFT_OUT_FIRST))

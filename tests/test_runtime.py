"""xscale.runtime: the loop's stop vote, checkpoint cadence and accumulation; and the
pieces a run reduces over two ranks on a real gloo group."""

from __future__ import annotations

import pytest
import torch
from xscale import data, dist, lifecycle, runtime

from tests.helpers import results_of, run_two_ranks

# ---------------------------------------------------------------------------------------------
# Two ranks on a real gloo group: reductions, agreement, clean exit
# ---------------------------------------------------------------------------------------------

TWO_RANKS = r'''
import json, os, sys
from pathlib import Path
import torch
from torch import nn
from xscale import checkpoint, lifecycle, reductions, runtime, vision
from xscale.throughput import Throughput
from xscale.lifecycle import UserError
from xscale.dist import init_distributed

ctx = init_distributed()
out = {"rank": ctx.rank, "world": ctx.world_size, "backend": ctx.backend}
# Uneven shards: rank 0 has 3 samples of loss 1.0, rank 1 one sample of loss 5.0. The job's
# mean is 8/4 = 2.0; the mean of the two ranks' means would be 3.0.
if ctx.rank == 0:
    sums = reductions.all_reduce_sums({"loss_sum": 3.0, "samples": 3})
else:
    sums = reductions.all_reduce_sums({"loss_sum": 5.0, "samples": 1})
out["mean_loss"] = reductions.mean(sums, "loss_sum", "samples")
# Accuracy over uneven shards: a model that predicts class 0; rank 0's targets are all 0
# (3 right), rank 1's are [1, 1, 1, 0, 1] (1 right of 5): 4 / 8, not (1.0 + 0.2) / 2.
class Zero(nn.Module):
    def forward(self, x):
        return torch.stack([torch.ones(len(x)), torch.zeros(len(x))], dim=1)
targets = torch.tensor([0, 0, 0]) if ctx.rank == 0 else torch.tensor([1, 1, 1, 0, 1])
result = vision.evaluate_classifier(Zero(), [(torch.zeros(len(targets), 1), targets)],
                                   ctx.device)
out["accuracy"], out["eval_samples"] = result["accuracy"], result["samples"]
# A stop signal seen by rank 1 only stops both, at the same call.
if ctx.rank == 1:
    lifecycle.request_stop()
out["stop"] = runtime.vote()[0]
meter = Throughput(ctx.device, warmup_steps=0)
meter.start(); meter.step(10 * (ctx.rank + 1)); meter.stop()
rates = meter.reduced()
out["rates_sum_ok"] = abs(rates["samples_per_s"] - 2 * rates["samples_per_s_per_rank"]) < 1e-6
# Checkpoints in different directories per rank (node-local storage): refused.
mine = Path(sys.argv[1]) / f"rank{ctx.rank}"
if ctx.rank == 0:
    checkpoint.save(mine, 4, {"step": 4})
try:
    checkpoint.load_latest(mine)
    out["disagreement"] = None
except UserError as error:
    out["disagreement"] = str(error)
# The same directory: every rank resumes from the same step.
shared = Path(sys.argv[1]) / "shared"
if ctx.rank == 0:
    checkpoint.save(shared, 9, {"step": 9})
torch.distributed.barrier()
out["shared_step"] = checkpoint.load_latest(shared)["step"]
rng = checkpoint.gather_rng_states()
out["rng_states"] = len(rng)
print("RESULT " + json.dumps(out), flush=True)
lifecycle.exit_cleanly(int(os.environ.get("EXIT_WITH", "0")))
'''


def test_two_ranks_reduce_sums_not_averages_and_agree(tmp_path):
    records = results_of(run_two_ranks(tmp_path, TWO_RANKS, str(tmp_path)))
    for record in records:
        assert record["world"] == 2 and record["backend"] == "gloo"
        assert record["mean_loss"] == pytest.approx(2.0)
        assert record["accuracy"] == pytest.approx(0.5)
        assert record["eval_samples"] == 8
        assert record["stop"] is True
        assert record["rates_sum_ok"] is True
        assert "different newest checkpoints" in record["disagreement"]
        assert record["shared_step"] == 9
        assert record["rng_states"] == 2


def loop_for_test(save, log_every: int, accumulation: int = 1) -> runtime.Loop:
    """A Loop over 400 samples in batches of 2, its checkpoints by `save(step, epoch)`."""
    ctx = dist.DistContext(0, 1, 0, 1, 0, 1, torch.device("cpu"), "gloo")
    dataset = torch.utils.data.TensorDataset(torch.zeros(400, 1))
    return runtime.Loop(ctx, data.loader(dataset, ctx, batch_size=2),
                        model=torch.nn.Linear(1, 1), log_every=log_every, checkpoint_every=4,
                        accumulation=accumulation, save=save)


def test_the_stop_is_voted_every_n_steps_then_saved_once(stop_handlers, capsys):
    """A signal at step 6 stops the loop at the next vote (step 10 with a vote every 5), not
    at once: no collective per step. The checkpoint cadence saved 4 and 8; the stop saves 10,
    once."""
    saved = []
    loop = loop_for_test(lambda step, epoch: saved.append(step) or f"ckpt-{step}", 5)
    for _ in loop.batches():
        loop.record(torch.tensor(1.0), 2)
        if loop.step == 6:
            lifecycle.request_stop()
    loop.finish()
    assert (loop.stopped, loop.step, saved) == (True, 10, [4, 8, 10])
    assert f"{loop.prog}: stopped by SIGUSR1 at step 10; checkpoint ckpt-10" in \
        capsys.readouterr().out


def test_with_accumulation_a_step_is_n_micro_batches(stop_handlers):
    loop = loop_for_test(None, 3, accumulation=3)
    boundaries = []
    for _ in range(9):
        boundaries.append(loop.boundary)
        loop.record(torch.tensor(1.0), 2)
    assert boundaries == [False, False, True] * 3
    assert loop.step == 3 and loop.meter.steps == 3

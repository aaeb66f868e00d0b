"""xscale.runtime: the loop's stop vote, checkpoint cadence and accumulation; and the
pieces a run reduces over two ranks on a real gloo group."""

from __future__ import annotations

import pytest
import torch
from xscale import data, dist, lifecycle, runtime

from tests.conftest import REPO
from tests.helpers import results_of, run_two_ranks

PROGRAMS = REPO / "tests" / "programs"

# ---------------------------------------------------------------------------------------------
# Two ranks on a real gloo group: reductions, agreement, clean exit
# ---------------------------------------------------------------------------------------------

def test_two_ranks_reduce_sums_not_averages_and_agree(tmp_path):
    program = (PROGRAMS / "two_ranks_reductions.py").read_text()
    records = results_of(run_two_ranks(tmp_path, program, str(tmp_path)))
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

"""The short form (xscale.prepare) in one process: the script's own epoch loop trains exactly
the run's steps, whatever it counts (a pass is the rest of the current epoch), a peek at the
loader takes no batch away, a stop ends every pass after the checkpoint, the requeued run trains
only what was left, and what prepare() cannot serve is one line and exit 2. Across ranks and
nodes, with Slurm's warning and a lost node: tests/test_own_scripts.py."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import REPO
from tests.helpers import TRAINING_IMPORTS, run_forked, tagged_records

SCRIPT = str(REPO / "tests" / "programs" / "prepared_passes.py")
PYTHONPATH = str(REPO / "python")
EPOCH = 16  # 64 samples, batches of 4, one rank


def trained(result) -> dict:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return tagged_records(result.stdout, "TRAINED")[0]


def summary(result) -> dict:
    return tagged_records(result.stdout, "XSCALE_SUMMARY")[0]


def test_the_scripts_loop_trains_the_runs_steps_exactly(tmp_path: Path):
    def run(out: str, *args: str) -> tuple[list[str], dict[str, str]]:
        return [SCRIPT, *args], {"OUTPUT_DIR": str(tmp_path / out), "PYTHONPATH": PYTHONPATH}

    runs = [run("whole"), run("peeked", "--peek"), run("stopped", "--stop-at", "23"),
            run("stopped"), run("whole"), run("scaled", "--scaler"), run("own", "--own-group")]
    results = run_forked(runs, tmp_path, preload=(*TRAINING_IMPORTS, "xscale"))
    whole, peeked, stopped, resumed, again, scaled, own = results
    reference = trained(whole)
    assert reference["passes"] == [EPOCH] * 3 and reference["batches_per_epoch"] == EPOCH
    assert len(set(reference["first_indices"][:EPOCH])) == EPOCH  # a shuffled epoch
    assert summary(whole)["steps"] == 3 * EPOCH and summary(whole)["loss_last"] is not None
    # pytorch/examples' `next(iter(loader))` before each epoch takes nothing away.
    assert trained(peeked)["first_indices"] == reference["first_indices"]
    # The stop, in epoch 1 at the vote after step 23 (every 10 steps): every later pass is
    # empty, the checkpoint is of step 30, and the summary was written before the script's loop
    # ended.
    first = trained(stopped)
    assert first["passes"] == [EPOCH, 30 - EPOCH, 0], first
    assert first["first_indices"] == reference["first_indices"][:30]
    assert (summary(stopped)["stopped_early"], summary(stopped)["steps"]) == (True, 30)
    assert summary(stopped)["checkpoint"].endswith("ckpt-000030.pt")
    assert stopped.stdout.index("XSCALE_SUMMARY") < stopped.stdout.index("TRAINED")
    # The requeued run starts its epochs at 0 again: its first pass is the rest of epoch 1, its
    # second epoch 2, its third none (the run is over), so both runs together trained the
    # uninterrupted run's batches, at its learning rates (the StepLR restored, and stepped
    # after each pass as before).
    second = trained(resumed)
    assert second["passes"] == [2 * EPOCH - 30, EPOCH, 0], second
    assert first["first_indices"] + second["first_indices"] == reference["first_indices"]
    assert first["rates"] + second["rates"] == reference["rates"]
    assert reference["rates"][::EPOCH] == [1e-4, 5e-5, 2.5e-5]
    assert (summary(resumed)["start_step"], summary(resumed)["steps"]) == (30, 3 * EPOCH)
    # A run over already: every pass is empty.
    assert trained(again)["passes"] == [0, 0, 0]
    assert trained(peeked)["rates"] == reference["rates"]
    # Steps a GradScaler skipped (no optimizer.step(), so no hook) are counted all the same:
    # the run ends where its data does, and their overflowed losses stay out of the log.
    assert trained(scaled)["first_indices"] == reference["first_indices"]
    assert trained(scaled)["skipped"] > 0, trained(scaled)
    assert summary(scaled)["steps"] == 3 * EPOCH and summary(scaled)["loss_first"] is not None
    assert "xscale: step" in scaled.stdout + scaled.stderr  # the verdict: the run ended in full
    # A script that joins its group itself (no live recovery then) gets the rest alike.
    assert trained(own)["first_indices"] == reference["first_indices"]
    assert (summary(own)["backend"], summary(own)["steps"]) == ("gloo", 3 * EPOCH)


def test_what_prepare_cannot_serve_is_one_line_and_exit_2(tmp_path: Path):
    mistakes = {
        "no-end": "xscale.prepare needs epochs= or max_steps=",
        "stream": "the loader reads an IterableDataset",
        "engine": "an engine of its own: use xscale.Loop",
        "batch-sampler": "xscale.prepare replaces only DistributedSampler",
    }
    env = {"OUTPUT_DIR": str(tmp_path), "PYTHONPATH": PYTHONPATH}
    results = run_forked([([SCRIPT, "--mistake", kind], env) for kind in mistakes], tmp_path,
                         preload=(*TRAINING_IMPORTS, "xscale"))
    for (kind, words), result in zip(mistakes.items(), results, strict=True):
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2, (kind, result.stderr[-2000:])
        assert len(lines) == 1 and lines[0].startswith("prepared_passes.py: error: "), lines
        assert words in lines[0], (kind, lines)
        assert "TRAINED" not in result.stdout

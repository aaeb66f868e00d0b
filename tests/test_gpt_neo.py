"""gpt_neo_imdb.py: the LUMI workshop's command line, its error paths, and Trainer DDP over two
nodes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.helpers import rank_records, summary

REPO = Path(__file__).resolve().parent.parent
TRAINER = "python/gpt_neo_imdb.py"
IMAGE = "xscale-test.sif"  # ignored by the shim: the host root plays the image
SEED_ARGS = ["--model-name", "gpt-imdb-model", "--output-path", "/workdir/train-output",
             "--logging-path", "/workdir/train-logging", "--num-workers", "7"]
# Small enough for 4 ranks on 2 cores, large enough that the loss falls clearly in 30 steps.
TINY_ARGS = ["--num-workers", "0", "--batch-size", "8", "--max-length", "64",
             "--learning-rate", "1e-3", "--logging-steps", "5", "--save-steps", "10",
             "--eval-steps", "1000", "--eval-batch-size", "32", "--sample-reviews", "0"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model dir, dataset dir) of the tiny offline GPT-neo and IMDB built in code."""
    from tests.fixtures.tiny_gpt_neo import build

    return build(tmp_path_factory.mktemp("tiny_gpt_neo"))


def run_trainer(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """One process, no launcher: the trainer as a user would start it on a laptop."""
    return subprocess.run(
        [sys.executable, TRAINER, *args], cwd=REPO, capture_output=True, text=True,
        timeout=300, check=False, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )


def test_seed_command_line_parses_with_the_workshop_defaults():
    import gpt_neo_imdb

    args = gpt_neo_imdb.parse_args(SEED_ARGS)
    assert args.model_name == "gpt-imdb-model"
    assert args.output_path == "/workdir/train-output"
    assert args.logging_path == "/workdir/train-logging"
    assert args.num_workers == 7
    # The workshop script's values when the command line does not say.
    assert args.pretrained_model == "EleutherAI/gpt-neo-1.3B"
    assert args.dataset == "imdb"
    assert (args.batch_size, args.max_steps, args.max_length) == (32, 1000, 256)
    assert args.resume is None  # automatic: resume when a checkpoint exists
    assert gpt_neo_imdb.parse_args(["--output-dir", "x", "--no-resume"]).output_path == "x"
    assert gpt_neo_imdb.parse_args(["--resume"]).resume is True


def assert_one_error_line(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpt_neo_imdb.py: error: "), proc.stderr
    assert all(word in lines[0] for word in words), lines[0]
    assert "XSCALE_SUMMARY" not in proc.stdout


def test_seed_command_without_the_model_in_the_cache_is_one_error_line(tmp_path: Path):
    proc = run_trainer(*SEED_ARGS, env={"HF_HOME": str(tmp_path / "empty-hf-home")})
    assert_one_error_line(proc, "EleutherAI/gpt-neo-1.3B", "Hugging Face cache")


def test_missing_dataset_is_one_error_line(tiny, tmp_path: Path):
    model, _ = tiny
    hf_home = {"HF_HOME": str(tmp_path / "empty-hf-home")}
    not_cached = run_trainer("--pretrained-model", str(model), env=hf_home)
    assert_one_error_line(not_cached, "--dataset 'imdb'", "Hugging Face cache")
    empty_dir = run_trainer("--pretrained-model", str(model), "--dataset", str(tmp_path),
                            env=hf_home)
    assert_one_error_line(empty_dir, "train.*")


def test_missing_model_directory_is_one_error_line(tiny, tmp_path: Path):
    _, data = tiny
    proc = run_trainer("--pretrained-model", str(tmp_path / "nope"), "--dataset", str(data))
    assert_one_error_line(proc, "no such directory")


def test_sigusr1_saves_a_checkpoint_and_ends_the_run_with_0(tiny, tmp_path: Path):
    """Slurm's `--signal=USR1@N` before the time limit: checkpoint, exit 0, requeue resumes."""
    model, data = tiny
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-u", TRAINER, "--pretrained-model", str(model), "--dataset", str(data),
         "--output-path", str(out), "--logging-path", str(tmp_path / "logs"),
         "--max-steps", "100000", *TINY_ARGS],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    watchdog = threading.Timer(240, proc.kill)
    watchdog.start()
    try:
        seen = []
        for line in proc.stdout:  # the first logged loss: training is under way
            seen.append(line)
            if "'loss'" in line:
                break
        proc.send_signal(signal.SIGUSR1)
        output = "".join(seen) + proc.stdout.read()
        code = proc.wait()
    finally:
        watchdog.cancel()
    assert code == 0, output[-3000:]
    result = summary(output)
    assert result["stopped"] is True and result["signal"] == "SIGUSR1", result
    assert 0 < result["steps"] < 100000
    saved = out / "gpt-imdb-model" / f"checkpoint-{result['steps']}"
    assert (saved / "trainer_state.json").is_file()
    assert "Perplexity" not in output  # the time left after the signal is for the checkpoint


def in_container(*command: str) -> list[str]:
    return ["singularity", "exec", IMAGE, "/runscripts/run.sh", *command]


def test_four_ranks_on_two_nodes_learn_agree_and_resume(cluster, tiny, tmp_path: Path):
    model, data = tiny
    out, logs = tmp_path / "out", tmp_path / "logs"

    def srun(max_steps: int) -> subprocess.CompletedProcess:
        return cluster.srun(
            "-N2", "-n4", "--cpu-bind=none",
            *in_container("python", "-u", TRAINER, "--model-name", "tiny",
                          "--output-path", str(out), "--logging-path", str(logs),
                          "--pretrained-model", str(model), "--dataset", str(data),
                          "--max-steps", str(max_steps), *TINY_ARGS),
            # The two virtual nodes share this machine's cores: one thread per rank, or four
            # ranks with run.sh's per-node default of all cores fight over them (10x slower).
            env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}, timeout=300,
        )

    first = srun(30)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run1 = summary(first.stdout)
    assert run1["trainer"] == "gpt_neo_imdb"
    assert (run1["world_size"], run1["start_step"], run1["steps"]) == (4, 0, 30)
    assert run1["loss_last"] < 0.9 * run1["loss_first"], run1
    assert run1["tokens_per_s"] > 0 and run1["perplexity"] > 1
    ranks = sorted(rank_records(first.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert [r["node"] for r in ranks] == ["nid001", "nid001", "nid002", "nid002"]
    assert len({r["param_digest"] for r in ranks}) == 1, ranks  # DDP kept the replicas equal
    assert (out / "tiny" / "checkpoint-30" / "trainer_state.json").is_file()
    assert list((logs / "tiny").glob("events.out.tfevents.*")), "no TensorBoard events"
    assert first.stdout.count("XSCALE_SUMMARY") == 1

    # Same command with more steps: picks up checkpoint-30 by itself (a requeued job).
    second = srun(40)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    run2 = summary(second.stdout)
    assert (run2["start_step"], run2["steps"]) == (30, 40)
    # The weights came back too, not just the step counter: it starts where run 1 ended.
    assert run2["loss_first"] < run1["loss_first"] - 0.5, (run1, run2)
    digests = {r["param_digest"] for r in rank_records(second.stdout)}
    assert len(digests) == 1 and digests != {ranks[0]["param_digest"]}


def test_newest_checkpoint_passes_over_a_save_that_was_cut_off(tmp_path: Path):
    from xscale.hf import newest_checkpoint

    assert newest_checkpoint(str(tmp_path / "absent")) is None
    for step in (10, 20, 100):
        (tmp_path / f"checkpoint-{step}").mkdir()
    for step in (10, 20):  # checkpoint-100 has no trainer_state.json: cut off mid-save
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-x").mkdir()
    assert newest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-20")


def test_stop_on_signal_asks_for_a_checkpoint_and_the_end(monkeypatch: pytest.MonkeyPatch):
    from transformers import TrainerControl, TrainerState
    from xscale import hf

    callback, state = hf.StopOnSignal(), TrainerState(global_step=7)
    monkeypatch.setattr(hf.signals, "should_stop", lambda: False)
    control = callback.on_step_end(None, state, TrainerControl())
    assert not control.should_save and not control.should_training_stop
    monkeypatch.setattr(hf.signals, "should_stop", lambda: True)
    control = callback.on_step_end(None, state, TrainerControl())
    assert control.should_save and control.should_training_stop and callback.stopped_at == 7

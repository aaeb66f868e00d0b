"""gpt_neo_imdb.py: the LUMI workshop's command line, its error paths, and Trainer DDP over two
nodes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import VENV_BIN
from tests.helpers import (
    block_placed,
    rank_records,
    run_forked,
    summary,
    tagged_records,
    trainer_module,
)
from tests.test_jobs import check_summary, lumi, submit, virtual_env

REPO = Path(__file__).resolve().parent.parent
TRAINER = "python/gpt_neo_imdb.py"
IMAGE = "xscale-test.sif"  # ignored by the shim: the host root plays the image
SEED_ARGS = ["--model-name", "gpt-imdb-model", "--output-path", "/workdir/train-output",
             "--logging-path", "/workdir/train-logging", "--num-workers", "7"]
# Small enough for 4 ranks on 2 cores, large enough that the loss falls clearly in 30 steps.
TINY_ARGS = ["--num-workers", "0", "--batch-size", "8", "--max-length", "64",
             "--learning-rate", "1e-3", "--logging-steps", "5", "--save-steps", "auto",
             "--eval-steps", "1000", "--eval-batch-size", "32", "--sample-reviews", "0"]


def test_seed_command_line_parses_with_the_workshop_defaults():
    gpt_neo_imdb = trainer_module("gpt_neo_imdb")
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


@pytest.fixture(scope="module")
def error_runs(tiny, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Each mistake's command line as its own process, forked from one interpreter that
    imported torch and the Hugging Face libraries once (tests/helpers.run_forked), all with an
    empty HF_HOME (read when they are imported) and HF_HUB_OFFLINE=1: the trainer as a user
    would start it on a laptop, without a launcher."""
    (model, data), tmp = tiny, tmp_path_factory.mktemp("gpt-neo-errors")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp / "empty-hf-home")}
    commands = {
        "seed command": [*SEED_ARGS],
        "dataset not cached": ["--pretrained-model", str(model)],
        "dataset folder empty": ["--pretrained-model", str(model), "--dataset", str(tmp)],
        "model folder missing": ["--pretrained-model", str(tmp / "nope"), "--dataset", str(data)],
        "xccl on a cpu": ["--pretrained-model", str(model), "--dataset", str(data)],
        # GPT-neo has eager and flash attention in transformers 4.x, no SDPA.
        "attention it lacks": ["--pretrained-model", str(model), "--dataset", str(data),
                               "--attention", "sdpa"],
    }
    backend = {"xccl on a cpu": {"XSCALE_BACKEND": "xccl"}}
    runs = run_forked([([TRAINER, *args], {**env, **backend.get(name, {})})
                       for name, args in commands.items()], REPO, env=env,
                      preload=("torch", "datasets", "transformers", "xscale.hf"))
    return dict(zip(commands, runs, strict=True))


def test_seed_command_without_the_model_in_the_cache_is_one_error_line(error_runs):
    assert_one_error_line(error_runs["seed command"], "EleutherAI/gpt-neo-1.3B",
                          "Hugging Face cache")


def test_missing_dataset_is_one_error_line(error_runs):
    assert_one_error_line(error_runs["dataset not cached"], "--dataset 'imdb'",
                          "Hugging Face cache")
    assert_one_error_line(error_runs["dataset folder empty"], "train.*")


def test_missing_model_directory_is_one_error_line(error_runs):
    assert_one_error_line(error_runs["model folder missing"], "no such directory")


def test_a_backend_the_device_cannot_use_is_one_error_line(error_runs):
    assert_one_error_line(error_runs["xccl on a cpu"], "backend xccl needs an Intel GPU (XPU)")


def test_an_attention_the_model_lacks_is_one_error_line(error_runs):
    assert_one_error_line(error_runs["attention it lacks"], "--attention sdpa: ")


def test_auto_attention_is_flash_only_where_it_can_run_and_compile_is_an_option():
    gpt_neo_imdb = trainer_module("gpt_neo_imdb")
    neo = gpt_neo_imdb.MODEL_FOR_CAUSAL_LM_MAPPING[gpt_neo_imdb.AutoConfig.for_model("gpt_neo")
                                                   .__class__]
    assert gpt_neo_imdb.attention_implementation("eager", neo) == "eager"
    # No CUDA GPU and no flash_attn package here: Hugging Face's own default for the model.
    assert gpt_neo_imdb.attention_implementation("auto", neo) is None
    args = gpt_neo_imdb.parse_args(["--compile", "--output-dir", "x"])
    assert args.compile and args.attention == "auto"


def in_container(*command: str) -> list[str]:
    return ["singularity", "exec", IMAGE, "/runscripts/run.sh", *command]


# What a signal that reaches a DataLoader worker or the resource tracker leaves in the output.
SIGNAL_DAMAGE = ("killed by signal", "exited unexpectedly", "Traceback", "leaked semaphore",
                 "KeyError")


def test_four_ranks_on_two_nodes_stop_on_usr1_to_the_step_and_resume(cluster, tiny,
                                                                      tmp_path: Path):
    """The LUMI templates' path: a DataLoader worker per rank (spawned, as on GPUs; one, not the
    templates' seven: each spawned worker imports transformers again, seconds of CPU) and USR1
    to every process of the step (`scancel --signal=USR1 JOB.0`, what `--signal=B:USR1@300`
    and the template's forwarding do): all ranks stop at one step, Trainer saves it, exit 0,
    no worker or resource tracker dies of the signal; the next run, the profile template's,
    resumes there with rank 3 under the profiler. With --save-steps auto, the first save comes
    at the first vote (step 10) and the interval at the next, for 2 nodes."""
    model, data = tiny
    out, logs = tmp_path / "out", tmp_path / "logs"

    # run.sh gives each of a node's two ranks one of its two CPUs (--cpu-bind=none).
    env = {"HF_HUB_OFFLINE": "1"}
    first = cluster.srun_signalled(
        "-N2", "-n4", "--cpu-bind=none",
        *in_container("python", "-u", TRAINER, "--model-name", "tiny", "--output-path", str(out),
                      "--logging-path", str(logs), "--pretrained-model", str(model),
                      "--dataset", str(data), "--max-steps", "100000", *TINY_ARGS,
                      "--num-workers", "1"), env=env,
        ready=(out / "tiny" / "checkpoint-10" / "trainer_state.json").exists)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    for damage in SIGNAL_DAMAGE:
        assert damage not in first.stdout + first.stderr, (damage, first.stderr[-3000:])
    # No bar drawn in place (srun --label cuts a line every 1024 bytes): Trainer's are drawn
    # as lines, map()'s are off.
    drawn = [line for line in first.stderr.splitlines() if "it/s]" in line]
    assert drawn and "\r" not in first.stdout + first.stderr, drawn[:3]
    run1 = summary(first.stdout)
    stopped_at = run1["steps"]
    assert run1["trainer"] == "gpt_neo_imdb"
    assert (run1["world_size"], run1["start_step"]) == (4, 0)
    assert (run1["stopped_early"], run1["signal"]) == (True, "SIGUSR1"), run1
    assert stopped_at >= 10 and run1["loss_last"] < run1["loss_first"], run1
    assert run1["checkpoint"] == str(out / "tiny" / f"checkpoint-{stopped_at}")
    assert (out / "tiny" / f"checkpoint-{stopped_at}" / "trainer_state.json").is_file()
    assert "Perplexity" not in first.stdout  # the time left after the signal is for the save
    ranks = sorted(rank_records(first.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    block_placed(ranks)  # ranks 0-1 on one node, 2-3 on another
    assert {r["steps"] for r in ranks} == {stopped_at}
    assert len({r["param_digest"] for r in ranks}) == 1, ranks  # DDP kept the replicas equal
    assert list((logs / "tiny").glob("events.out.tfevents.*")), "no TensorBoard events"
    assert first.stdout.count("XSCALE_SUMMARY") == 1
    auto = re.findall(r"xscale: --save-steps auto: every (\d+) steps .* a save stops training "
                      r"([\d.]+) s .* on 2 node\(s\)", first.stdout)
    assert len(auto) == 1 and int(auto[0][0]) >= 1, first.stdout[-3000:]
    assert run1["checkpoints_saved"] >= 2 and run1["checkpoint_stall_s"] > 0, run1

    # The requeued job: jobs/lumi/gpt-neo-profile.sbatch (gpt-neo.sbatch, which it sources,
    # under run-profile.sh) with more steps picks up the stop's checkpoint by itself. Without
    # workers: each spawned one imports transformers again, and their part is done.
    profiles, steps = tmp_path / "profiles", stopped_at + 10
    job = submit(cluster, lumi("gpt-neo-profile.sbatch"), tmp_path, 2, *TINY_ARGS,
                 env=virtual_env(tmp_path, MODEL_NAME="tiny", PRETRAINED_MODEL=str(model),
                                 DATASET=str(data), OUTPUT_DIR=str(out), LOGGING_DIR=str(logs),
                                 NUM_WORKERS="0", MAX_STEPS=str(steps), PROFILE_RANKS="3",
                                 PROFILE_DIR=str(profiles), **env))
    run2 = check_summary(job.output, "gpt_neo_imdb", 4, steps=steps)
    assert (run2["start_step"], run2["steps"]) == (stopped_at, steps)
    assert run2["stopped_early"] is False and run2["perplexity"] > 1
    assert run2["tokens_per_s"] > 0
    # The weights came back too, not just the step counter: it starts where run 1 ended.
    assert run2["loss_first"] < run1["loss_first"] - 0.5, (run1, run2)
    digests = {r["param_digest"] for r in rank_records(job.output)}
    assert len(digests) == 1 and digests != {ranks[0]["param_digest"]}
    # The generic site's profiler is py-spy: one flame graph, rank 3's, and none of the others.
    assert sorted(p.name for p in profiles.glob("rank*.svg")) == ["rank3.svg"]
    assert (profiles / "rank3.svg").read_text().lstrip().startswith("<?xml")
    # Rank 3 said where it goes, and the report says what opens it.
    assert f"xscale: rank 3: the profiler writes its files under {profiles} " in job.output
    listing = subprocess.run([str(VENV_BIN / "xscale"), "report", "--profile", str(profiles)],
                             capture_output=True, text=True, timeout=60)
    assert f"{profiles / 'rank3.svg'}: a py-spy flame graph; open it with a web browser" \
        in listing.stdout, listing.stdout + listing.stderr


# The resource tracker's signal mask, read as a script that imported xscale.hf sees it.
TRACKER_MASK = """
import xscale.hf
from multiprocessing import resource_tracker
status = open(f"/proc/{resource_tracker._resource_tracker._pid}/status").read()
print(next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:")))
"""


def test_importing_xscale_hf_starts_the_resource_tracker_out_of_the_warnings_reach():
    """Under the LUMI workshop's set_start_method('spawn'), the first data set loaded starts
    multiprocessing's resource tracker (datasets' progress bars take a multiprocessing lock),
    before XscaleTrainer exists; Slurm's warning then killed it on every rank (78 warnings and
    69 KeyError tracebacks in a 3-rank job on the bed). xscale.hf starts it first, with the
    warning blocked."""
    proc = subprocess.run([sys.executable, "-c", TRACKER_MASK], capture_output=True, text=True,
                          timeout=120, check=False, env={**os.environ, "PYTHONPATH": str(
                              REPO / "python")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.strip(), 16) & (1 << (signal.SIGUSR1 - 1)), proc.stdout


def test_newest_checkpoint_passes_over_a_save_that_was_cut_off(tmp_path: Path):
    from xscale.hf import newest_checkpoint

    assert newest_checkpoint(str(tmp_path / "absent")) is None
    for step in (10, 20, 100):
        (tmp_path / f"checkpoint-{step}").mkdir()
    for step in (10, 20):  # checkpoint-100 has no trainer_state.json: cut off mid-save
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-x").mkdir()
    assert newest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-20")


def cpu_tally(is_main: bool = True, nodes: int = 2):
    """The tally of rank 0 (or 1) of a CPU run on NODES nodes, one rank each."""
    import torch
    from xscale import dist, runtime

    rank = 0 if is_main else 1
    return runtime.RunTally(dist.DistContext(rank, nodes, 0, 1, rank, nodes,
                                             torch.device("cpu"), "gloo"))


def test_stop_on_signal_votes_every_n_steps_and_asks_for_a_checkpoint_and_the_end(
        monkeypatch: pytest.MonkeyPatch):
    from transformers import TrainerControl, TrainerState
    from xscale import hf, runtime

    votes = []

    def vote(*_, **__):  # no stop at the call's first step, a stop from then on
        votes.append(1)
        return runtime.Vote(stop=len(votes) > 1, every=None)

    monkeypatch.setattr(hf.runtime, "vote", vote)
    callback = hf._StopOnSignal(cpu_tally(), every=5)
    control = callback.on_step_end(None, TrainerState(global_step=1, max_steps=100),
                                   TrainerControl())
    assert votes == [1] and not control.should_training_stop  # the first step votes too
    control = callback.on_step_end(None, TrainerState(global_step=7, max_steps=100),
                                   TrainerControl())
    assert votes == [1] and not control.should_training_stop  # no vote between the 5s
    control = callback.on_step_end(None, TrainerState(global_step=10, max_steps=100),
                                   TrainerControl())
    assert votes == [1, 1] and control.should_save and control.should_training_stop
    assert callback.stopped_at == 10
    # No signal anywhere: the last step is saved (the runtime's cadence), training goes on to
    # its natural end.
    monkeypatch.setattr(hf.runtime, "vote", lambda *_, **__: runtime.Vote(stop=False, every=None))
    callback = hf._StopOnSignal(cpu_tally(), every=5)
    control = callback.on_step_end(None, TrainerState(global_step=100, max_steps=100),
                                   TrainerControl())
    assert control.should_save and not control.should_training_stop
    assert callback.stopped_at is None


def test_the_summarys_losses_and_tokens_are_counted_whatever_trainer_logs():
    """The losses and tokens come from each micro-batch (XscaleTrainer.training_step) and travel
    in the stop votes, not from Trainer's log: a run that logs nothing (the LUMI workshop's
    logging_steps=500 on a shorter run) still has both. Two micro-batches a step, whose losses
    add up to the step's."""
    import torch
    from torch import nn
    from transformers import BatchEncoding, TrainerControl, TrainerState, TrainingArguments
    from xscale import hf

    call = hf._TrainCall(cpu_tally(), wrapped=lambda: nn.Linear(1, 1))
    vote = hf._StopOnSignal(call.tally, every=2, reduce=call.reduce_losses)
    args = TrainingArguments(output_dir="unused", per_device_train_batch_size=4, use_cpu=True,
                             gradient_accumulation_steps=2, report_to=[])
    state = TrainerState(global_step=0, max_steps=4)
    call.on_train_begin(args, state, None)
    for step, loss in enumerate([3.0, 2.0, 1.0, 0.5], start=1):
        for _ in range(2):
            # What Trainer hands training_step: the collator's BatchEncoding, no dict.
            inputs = BatchEncoding({"input_ids": torch.zeros(4, 16)})
            call.micro_batch(torch.tensor(loss / 2), inputs)
        state.global_step = step
        call.on_step_end(args, state, None)
        vote.on_step_end(args, state, TrainerControl())
    # Votes at step 1 (the first), 2 and 4: the first window is step 1 alone, the last 3 and 4.
    assert (call.loss_first, call.loss_last) == (3.0, 0.75)
    call.on_train_end(args, state, None)
    rates = call.throughput.local()  # 16 tokens a sample, padding included
    assert rates.tokens_per_s == pytest.approx(16 * rates.samples_per_s) and rates.tokens_per_s


def test_trainers_ranks_left_draw_each_step_the_batches_the_launchs_ranks_would_have():
    """A smaller world under Trainer (XscaleTrainer.take_world): six ranks drew two batches a
    step as accelerate deals them (BatchSamplerShard, the last round filled from the epoch's
    start); four go on, each drawing its share of every step (3, 3, 3, 3 of the twelve), from
    accelerate's own shuffled order, in two epochs: together the launch's batches of each step,
    none twice, the steps ending where the six's did."""
    import torch
    from accelerate.data_loader import BatchSamplerShard, SeedableRandomSampler
    from torch.utils.data import BatchSampler
    from xscale import data, hf

    world, accumulation, size, ranks = 6, 2, 3, 4
    sampler = SeedableRandomSampler(data_source=range(100), data_seed=7,
                                    generator=torch.Generator())
    batches = BatchSampler(sampler, size, drop_last=False)  # 34 batches, the last of one

    def epochs(draw) -> list[list[int]]:
        drawn = []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            drawn.append(list(draw()))
        return drawn

    launch = [epochs(lambda rank=rank: BatchSamplerShard(batches, world, rank))
              for rank in range(world)]
    left = []
    for rank in range(ranks):
        shared = hf._SharedBatches(BatchSamplerShard(batches, ranks, rank),
                                   data.Share.dealt(world, accumulation, size, rank, ranks))
        left.append(epochs(lambda shared=shared: shared))
        assert len(shared) == 3 * 3 and all(len(epoch) == len(shared) for epoch in left[-1])
    for epoch in range(2):
        for step in range(3):  # 6 rounds of six batches: 3 steps of 2
            theirs = [batch for drawn in launch
                      for batch in drawn[epoch][step * accumulation:(step + 1) * accumulation]]
            ours = [batch for drawn in left for batch in drawn[epoch][step * 3:(step + 1) * 3]]
            assert sorted(ours) == sorted(theirs), (epoch, step)
    assert launch[0][0] != launch[0][1]  # the epochs are shuffled apart


def test_trainers_ranks_left_draw_the_next_epoch_as_the_launch_does_with_workers():
    """A smaller world's loader as Trainer drives it, with a DataLoader worker (which calls
    iter() on the batch sampler twice and uses the second): the epoch it resumed mid-way (its
    first batches skipped), then set_epoch and the next. Each step's batches are the launch's
    four ranks' in both epochs. (An eager _SharedBatches drew each epoch when iter() was
    called, moving accelerate's sampler on: the second epoch came in the third's order, seen
    on the bed as a Trainer run leaving the uninterrupted one's course at the epoch's end.)"""
    import torch
    from accelerate.data_loader import prepare_data_loader, skip_first_batches
    from torch.utils.data import DataLoader, RandomSampler
    from xscale import data, hf

    samples, world, size, ranks, resumed_at = list(range(192)), 4, 4, 2, 4  # 12 steps an epoch

    def loader(processes: int, rank: int, workers: int = 0) -> DataLoader:
        torch.manual_seed(42)  # accelerate's sampler takes its seed from torch's
        plain = DataLoader(samples, batch_size=size, sampler=RandomSampler(samples),
                           collate_fn=tuple, num_workers=workers)
        return prepare_data_loader(plain, num_processes=processes, process_index=rank,
                                   put_on_device=False, use_seedable_sampler=True)

    def epochs(drawn: DataLoader, skip: int = 0) -> list[list[tuple]]:
        passes = []
        for epoch in range(2):
            drawn.set_epoch(epoch)
            passes.append(list(skip_first_batches(drawn, skip) if epoch == 0 and skip
                               else drawn))
        return passes

    launch = [epochs(loader(world, rank)) for rank in range(world)]
    left = []
    for rank in range(ranks):
        accelerates = loader(ranks, rank, workers=1)
        shared = hf._SharedBatches(accelerates.batch_sampler,
                                   data.Share.dealt(world, 1, size, rank, ranks))
        left.append(epochs(hf._drawing(accelerates, shared), skip=resumed_at * 2))
    for epoch, first in ((0, resumed_at), (1, 0)):
        for step in range(first, 12):
            theirs = sorted(drawn[epoch][step] for drawn in launch)
            ours = sorted(drawn[epoch][(step - first) * 2 + micro]
                          for drawn in left for micro in range(2))
            assert ours == theirs, (epoch, step)
    assert launch[0][0] != launch[0][1]  # the epochs are shuffled apart


def test_trainers_keyed_batches_are_accelerates_each_index_with_its_epochs_seed():
    """XscaleTrainer's batch sampler on one of two ranks (hf._KeyedBatches): the batches
    accelerate deals that rank, each index with its seed for the epoch the loader sets, which
    still reaches accelerate's sampler and orders its pass."""
    import torch
    from accelerate.data_loader import BatchSamplerShard, DataLoaderShard, SeedableRandomSampler
    from torch.utils.data import BatchSampler
    from xscale import data, hf

    def shard(rank: int) -> tuple[SeedableRandomSampler, BatchSamplerShard]:
        sampler = SeedableRandomSampler(data_source=range(20), data_seed=7,
                                        generator=torch.Generator())
        return sampler, BatchSamplerShard(BatchSampler(sampler, 3, drop_last=False), 2, rank)

    for rank in range(2):
        sampler, dealt = shard(rank)
        keyed = hf._KeyedBatches(shard(rank)[1], seed=11)
        loader = DataLoaderShard(data.SeededSamples(list(range(20))), batch_sampler=keyed)
        for epoch in range(2):
            loader.set_epoch(epoch)  # as Trainer does at each epoch, and the loader each pass
            sampler.set_epoch(epoch)
            assert keyed.batch_sampler.sampler.epoch == epoch
            assert list(keyed) == [[(index, data.sample_seed(11, epoch, index)) for index in batch]
                                   for batch in dealt]
        assert loader.total_batch_size == 6 and len(loader) == len(dealt)


def test_a_trainer_run_says_why_it_cannot_go_on_in_a_smaller_world():
    """What rank 0 prints at the start of a live-recovered Trainer run that could not go on
    without a lost node (xscale.hf._cannot_shrink), and None where it can: accelerate's dealing
    of whole batches (launched on 4 ranks: 34 batches, 9 a rank), whole steps, one gather a
    step, and a loss averaged over every rank's tokens."""
    from types import SimpleNamespace

    from accelerate.data_loader import BatchSamplerShard, DataLoaderShard
    from torch.utils.data import BatchSampler, SequentialSampler
    from xscale import hf

    def loader(**dealing: bool) -> DataLoaderShard:
        batches = BatchSampler(SequentialSampler(range(100)), 3, drop_last=False)
        return DataLoaderShard(range(100), batch_sampler=BatchSamplerShard(batches, 2, 1,
                                                                           **dealing))

    def why(accumulation: int = 3, dealing: dict | None = None, **args: object) -> str | None:
        trainer = SimpleNamespace(model_accepts_loss_kwargs=True, args=SimpleNamespace(
            gradient_accumulation_steps=accumulation, include_num_input_tokens_seen="no",
            average_tokens_across_devices=True))
        vars(trainer.args).update(args)
        return hf._cannot_shrink(trainer, loader(**(dealing or {})), launch_world=4)

    assert why() is None
    assert why(accumulation=2) == ("an epoch's 9 batches per rank are not whole steps of 2 "
                                   "(gradient_accumulation_steps)")
    assert why(dealing={"even_batches": False}).startswith("its training batches are not dealt")
    assert why(include_num_input_tokens_seen=True) == \
        "include_num_input_tokens_seen gathers at every micro-batch, not at every step"
    assert why(average_tokens_across_devices=False) == \
        "each rank averages its loss over its own tokens (average_tokens_across_devices)"


def test_a_trainer_run_again_after_its_last_step_trains_no_step_more(tmp_path: Path):
    """Trainer begun at its last step trains one more before it checks the count (transformers
    4.57 resumed from checkpoint-2 of max_steps=2 ends at step 3). XscaleTrainer, run again over
    a finished run's directory (a finished job submitted again; a live recovery after the last
    step begins the loop there too), leaves its loop first: still step 2, the saved weights,
    and a summary of no step trained (tests/programs/trainer_run_again.py)."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "XSCALE_BACKEND")}
    run = subprocess.run([sys.executable, str(REPO / "tests/programs/trainer_run_again.py"),
                          str(tmp_path / "out")], capture_output=True, text=True, env=env,
                         timeout=300, check=False)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert tagged_records(output, "RESULT") == [{"steps": [2, 2], "weights_changed": False}]
    first, again = tagged_records(output, "XSCALE_SUMMARY")
    assert (first["start_step"], first["steps"]) == (0, 2), first
    assert (again["start_step"], again["steps"], again["loss_last"]) == (2, 2, None), again


def test_trainers_samples_draw_the_same_after_a_resume_with_any_workers(tmp_path: Path):
    """A sample's augmentation, drawn in Trainer's DataLoader workers from torch's and Python's
    generators, is the same when the run resumes from a checkpoint with no workers, and the
    weights too, to the bit; Trainer alone draws others (its workers' generators go on from
    seeds drawn as they start). Each epoch draws anew. A Hugging Face data set with no transform
    draws nothing and is read as before (tests/programs/trainer_seeded_samples.py)."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "XSCALE_BACKEND")}
    run = subprocess.run([sys.executable, str(REPO / "tests/programs/trainer_seeded_samples.py"),
                          str(tmp_path)], capture_output=True, text=True, env=env, timeout=300,
                         check=False)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    [result] = tagged_records(output, "RESULT")
    resumed = {"resumed_steps": [3, 4, 5, 6, 7], "anew_each_epoch": True}
    assert result["XscaleTrainer"] == {**resumed, "same_draws": True, "same_weights": True}
    assert result["Trainer"] == {**resumed, "same_draws": False, "same_weights": False}
    assert result["seeded"] == {"torch": True, "hf_stored": False, "hf_transformed": True}


def test_save_steps_auto_asks_for_a_timed_save_then_hands_rank_0s_interval_to_every_rank(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    """Steps 1..30 of a run at 0.25 s a step, votes every 10: the first vote after a timed step
    asks Trainer for a save; once the tally has timed it, the next vote carries rank 0's Young
    interval to every rank, which sets Trainer's save_steps there."""
    from transformers import TrainerControl, TrainerState
    from xscale import hf, runtime

    now = [0.0]
    monkeypatch.setattr(runtime.time, "perf_counter", lambda: now[0])
    monkeypatch.setenv("XSCALE_NODE_MTBF_H", "100")
    proposals = []

    def vote(reduce=None, watch=None, proposal=None):
        proposals.append(proposal)  # the sum at the third vote: rank 0's 1200, the others' 0
        return runtime.Vote(stop=False, every=1200 if len(proposals) == 3 else None)

    monkeypatch.setattr(hf.runtime, "vote", vote)
    for is_main in (True, False):
        proposals.clear()
        tally = cpu_tally(is_main, nodes=4)
        auto = hf._AutoSaveSteps(tally)
        callback = hf._StopOnSignal(tally, every=10, auto=auto)
        state, asked = TrainerState(max_steps=30, save_steps=30), []
        for step in range(1, 31):
            state.global_step, now[0] = step, step * 0.25
            if step == 1:
                tally.first_step(step)  # the call's first step: the warm-up, not timed
            if callback.on_step_end(None, state, TrainerControl()).should_save:
                asked.append(step)
                tally.saved(step, 0.5)  # Trainer's save, timed by _TrainCall
        assert asked == [10, 30]  # the timed save, and the last step's
        # Young: sqrt(2 x 0.5 s x 100 h / 4 nodes) = 300 s, at 0.25 s a step 1200 steps.
        # Votes at steps 1 (the first), 10 (asks for the timed save), 20 and 30; a rank with
        # no proposal puts 0 to the vote, so that its size is every rank's.
        none = runtime.Proposal(0.0)
        assert proposals == [none, none, runtime.Proposal(1200.0 if is_main else 0.0), none], \
            proposals
        assert state.save_steps == auto.every == 1200  # what the vote handed back
    lines = [line for line in capsys.readouterr().out.splitlines() if "auto" in line]
    assert lines == ["xscale: --save-steps auto: every 1200 steps (300.0 s): a save stops "
                     "training 0.500 s and writes for 0.000 s, a step takes 0.250 s, a failure "
                     "comes every 25 h on 4 node(s) (100 h per node)"]


def test_trainers_checkpoint_stall_is_the_save_alone_not_an_evaluation_due_at_its_step(
        monkeypatch: pytest.MonkeyPatch):
    """Trainer logs and evaluates before it saves at the same step (the last step always
    evaluates): the stall is timed from the last of them, as the summary's
    checkpoint_stall_s promises."""
    from torch import nn
    from transformers import TrainerState, TrainingArguments
    from xscale import hf

    now = [0.0]
    monkeypatch.setattr(hf.time, "perf_counter", lambda: now[0])
    tally = cpu_tally()
    call = hf._TrainCall(tally, wrapped=lambda: nn.Linear(1, 1))
    args = TrainingArguments(output_dir="unused", per_device_train_batch_size=1, use_cpu=True,
                             report_to=[])
    state = TrainerState(global_step=1, max_steps=10)
    call.on_train_begin(args, state, None)
    state.global_step = 10
    call.on_step_end(args, state, None)
    for event, seconds in (("on_log", 0.5), ("on_evaluate", 3.0), ("on_save", 0.25)):
        now[0] += seconds
        getattr(call, event)(args, state, None, logs={})
    assert (tally.last_stall_s, tally.stall_s, tally.saves) == (0.25, 0.25, 1)


def test_save_steps_auto_starts_from_the_interval_its_checkpoint_was_saved_with(tmp_path: Path):
    """Trainer restores save_steps from the checkpoint's trainer_state.json (and warns when the
    arguments differ): a resumed auto run starts with that interval until it decides anew."""
    from xscale.hf import _initial_save_steps

    saved = tmp_path / "checkpoint-25"
    saved.mkdir()
    (saved / "trainer_state.json").write_text('{"global_step": 25, "save_steps": 70}')
    assert _initial_save_steps(1000, str(saved)) == 70
    assert _initial_save_steps(1000, None) == 1000  # none but the last step's


WORKSHOP_SCRIPT = "tests/programs/workshop_gpt_neo.py"


def test_a_workshop_script_on_transformers_4x_api_trains_unchanged_on_two_nodes(cluster, tiny,
                                                                                 tmp_path: Path):
    """A script written as the LUMI AI workshop writes its GPT-neo fine-tuning, for the images
    LUMI ships: `TrainingArguments(logging_dir=...)` and `Trainer(tokenizer=...)`, which
    transformers 5 removed, run on xscale's pins (constraints.txt) through run.sh, one rank on
    each of two nodes; TensorBoard writes where logging_dir says. Without a DataLoader worker:
    a spawned one imports the script's libraries again (the four-rank test above has them)."""
    model, data = tiny
    out, logs = tmp_path / "out", tmp_path / "logs"
    proc = cluster.srun(
        "-N2", "-n2", "--cpu-bind=none",
        *in_container("python", "-u", WORKSHOP_SCRIPT, "--model-name", "tiny",
                      "--output-path", str(out), "--logging-path", str(logs),
                      "--num-workers", "0", "--pretrained-model", str(model),
                      "--dataset", str(data), "--max-steps", "20"),
        # One thread each: the bed's two virtual nodes share this machine's two cores.
        env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}, timeout=300)
    output = proc.stdout + proc.stderr
    assert "TypeError" not in output and "unexpected keyword" not in output, output[-3000:]
    results = tagged_records(proc.stdout, "RESULT")
    assert len(results) == 1, output[-3000:]
    result = results[0]
    # One data-parallel job, as on GPUs: run.sh tells accelerate the CPU is meant (a script
    # for GPUs says no use_cpu), else each rank would train alone.
    assert (result["world_size"], result["steps"], result["process_group"]) == (2, 20, True), \
        result
    assert result["losses"][-1] < result["losses"][0], result
    assert list((logs / "tiny").glob("events.out.tfevents.*")), "no events in logging_dir"
    assert (out / "tiny" / "checkpoint-20" / "trainer_state.json").is_file()
    # The script is the user's, unmodified: it does not leave the way docs/FAILURES.md shows,
    # so gloo may abort its exit after training (exit 134, pytorch#190489), never before.
    aborted = "terminate called without an active exception" in proc.stderr
    assert proc.returncode == 0 or aborted, output[-3000:]


@pytest.mark.parametrize("placed", [True, False], ids=["run.sh-alone", "by-hand"])
def test_the_lone_rank_rule_a_placed_process_joins_a_group_of_one(monkeypatch, placed: bool):
    """Under a launcher's RANK/WORLD_SIZE, one process too gets the device's backend (a group
    of one, like every xscale trainer); started by hand, none (Trainer joins no group)."""
    from xscale import hf

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "XSCALE_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    if placed:
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
    arguments = hf.ddp_arguments()
    assert arguments["use_cpu"] is True
    assert arguments["ddp_backend"] == ("gloo" if placed else None)

"""`make gpu-check` (tests/gpu/): what can be checked without a GPU. Its table and JSON, a real
trainer's and a real doctor's output judged, the MFU arithmetic and the peak table, how it runs
and ends commands, and the whole command on this machine, which has no GPU: one line, exit 0.
Nothing here fakes a device; the GPU runs themselves are docs/GPU-CHECK.md's to do on a GPU node.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.fixtures.mnist_idx import write_mnist
from tests.gpu import figures
from tests.gpu.gpu_check import (
    LAUNCHER_VARIABLES,
    TRAINERS,
    Context,
    Fixtures,
    Launch,
    Node,
    Outcome,
    Runner,
    check_trainer,
    child_env,
    gpt_neo_row,
    judge_doctor,
    judge_trace,
    resnet_row,
)
from tests.gpu.verdict import (
    FAIL,
    PASS,
    SKIP,
    Check,
    Expected,
    judge_snapshots,
    judge_training,
    mismatches,
    render_table,
    result_json,
    summary_of,
    write_result,
)

REPO = Path(__file__).resolve().parent.parent
GPU_CHECK = REPO / "tests" / "gpu" / "gpu_check.py"

# ---------------------------------------------------------------------------------------------
# A real trainer's summary (mnist_ddp on this CPU), judged against what a GPU node should give
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    data = write_mnist(tmp_path_factory.mktemp("mnist"), train=512, test=128)
    env = child_env({"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    proc = subprocess.run(
        [sys.executable, "python/mnist_ddp.py", "--data", str(data), "--max-steps", "12",
         "--batch-size", "32", "--lr", "0.002", "--log-every", "4", "--epochs", "100"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_a_summary_that_matches_the_node_passes_with_its_figures(cpu_run):
    check = judge_training("mnist_ddp 1 GPU", cpu_run.stdout, 0, Expected("cpu", "gloo", 1))
    assert (check.status, check.reason) == (PASS, "")
    assert check.figures["device"] == "cpu" and check.figures["world_size"] == 1
    assert check.figures["loss_last"] < check.figures["loss_first"]
    assert check.figures["samples_per_s"] > 0


def test_the_wrong_device_backend_and_world_size_each_fail_with_the_reason(cpu_run):
    check = judge_training("mnist_ddp 8 GPUs", cpu_run.stdout, 0, Expected("cuda", "nccl", 8))
    assert check.status == FAIL
    assert check.reason.split("; ") == ["device cpu, expected cuda", "backend gloo, expected nccl",
                                        "world_size 1, expected 8"]


def test_a_lone_trainer_rank_is_judged_by_gpu_checks_own_rule_on_this_cpu(tmp_path: Path):
    """The lone-rank rule (xscale.hf.ddp_arguments): Hugging Face's Trainer alone under run.sh,
    as gpu-check's 1-GPU row runs it, joins a group of one with the device's backend, like every
    other trainer; gpu-check's own check, on this CPU as the node, passes its summary."""
    node = Node("cpu", "gloo", 1, "this CPU", "none", torch.__version__)
    trainer = next(trainer for trainer in TRAINERS if trainer.name == "gpt_neo_imdb")
    ctx = Context(node, tmp_path, Fixtures(tmp_path / "fixtures"),
                  Runner(tmp_path / "logs", timeout_s=600), None, 1, 8)
    check = check_trainer(ctx, trainer, Launch(1))
    logs = "".join(log.read_text()[-2000:] for log in (tmp_path / "logs").iterdir())
    assert (check.status, check.reason) == (PASS, ""), logs
    assert (check.figures["backend"], check.figures["world_size"]) == ("gloo", 1)


def test_a_failed_exit_fails_even_with_a_good_summary(cpu_run):
    check = judge_training("mnist_ddp 1 GPU", cpu_run.stdout, 134, Expected("cpu", "gloo", 1))
    assert check.status == FAIL and check.reason == "exit status 134"


def test_a_run_without_a_summary_fails_with_its_error_line_else_its_last_line():
    # Under torchrun the rank's one-line error comes before torchrun's own report of the failure.
    output = ("loading...\nmnist_ddp.py: error: a GPU was asked for (--gpu) but torch sees none\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
              "============================================================\n")
    check = judge_training("mnist_ddp 2 GPUs", output, 1, Expected("cuda", "nccl", 2))
    assert check.status == FAIL
    assert check.reason == ("exit status 1, no XSCALE_SUMMARY; mnist_ddp.py: error: a GPU was "
                            "asked for (--gpu) but torch sees none")
    check = judge_training("mnist_ddp 1 GPU", "Segmentation fault\n", 139,
                           Expected("cuda", "nccl", 1))
    assert check.reason == "exit status 139, no XSCALE_SUMMARY; last line: Segmentation fault"
    assert judge_training("x", "", 137, Expected("cuda", "nccl", 1)).reason.endswith("no output")


def test_a_loss_that_did_not_fall_or_was_never_logged_fails(cpu_run):
    summary = summary_of(cpu_run.stdout)
    assert summary is not None
    expected = Expected("cpu", "gloo", 1)
    flat = {**summary, "loss_first": 2.0, "loss_last": 2.0}
    assert mismatches(flat, expected) == ["loss did not fall (2 -> 2)"]
    assert mismatches({**summary, "loss_last": None}, expected) == ["no loss logged"]
    # Hugging Face's Trainer alone joins no group: its summary's backend is null.
    assert mismatches({**summary, "backend": None}, Expected("cpu", None, 1)) == []
    assert mismatches({**summary, "backend": None}, expected) == ["backend None, expected gloo"]


# ---------------------------------------------------------------------------------------------
# The table and the JSON
# ---------------------------------------------------------------------------------------------

CHECKS = [
    Check("mnist_ddp 1 GPU", PASS, "", {"loss_first": 2.3, "loss_last": 0.41,
                                         "samples_per_s": 12345.6, "tokens_per_s": None}),
    Check("doctor 8 GPUs", FAIL, "nid001 gpus: torch sees 4 of 8 GPUs"),
    Check("throughput resnet50", SKIP, "no pytorch/examples checkout", {"xscale_img_s": 812.0}),
]


def test_the_table_has_a_row_per_check_with_its_result_figures_and_reason():
    lines = render_table(CHECKS).splitlines()
    assert lines[0].split() == ["check", "result", "figures", "/", "reason"]
    assert lines[1].split("  ")[0] == "mnist_ddp 1 GPU"
    assert "PASS" in lines[1] and "loss_first=2.3, loss_last=0.41, samples_per_s=12,346" in lines[1]
    assert "tokens_per_s" not in lines[1]  # no value, no figure
    assert "FAIL" in lines[2] and lines[2].endswith("nid001 gpus: torch sees 4 of 8 GPUs")
    assert "SKIP" in lines[3]
    assert lines[3].endswith("xscale_img_s=812; no pytorch/examples checkout")
    assert lines[-1] == "gpu-check: 1 passed, 1 failed, 1 skipped"
    # The columns line up: every result starts where the header's does.
    column = lines[0].index("result")
    assert [line[column:column + 4] for line in lines[1:-1]] == ["PASS", "FAIL", "SKIP"]


def test_the_json_holds_the_node_every_check_and_the_verdict(tmp_path: Path):
    path = tmp_path / "gpu-check" / "result.json"
    write_result(path, CHECKS, {"name": "AMD Instinct MI250X", "gpus": 8})
    written = json.loads(path.read_text())
    assert written == result_json(CHECKS, {"name": "AMD Instinct MI250X", "gpus": 8})
    assert written["ok"] is False and written["node"]["gpus"] == 8
    assert [c["status"] for c in written["checks"]] == [PASS, FAIL, SKIP]
    assert written["checks"][0]["figures"]["loss_last"] == 0.41
    assert result_json(CHECKS[:1], {})["ok"] is True
    assert result_json([CHECKS[0], CHECKS[2]], {})["ok"] is True  # a skip is no failure


# ---------------------------------------------------------------------------------------------
# MFU, the peaks, pytorch/examples' log, ratios
# ---------------------------------------------------------------------------------------------

GPT_NEO_125M = {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "vocab_size": 50257,
                "intermediate_size": None}


def test_flops_per_token_and_mfu_for_gpt_neo_125m_by_hand():
    shape = figures.gpt_neo_shape(GPT_NEO_125M, seq_len=1024)
    # 125,198,592 weights (EleutherAI/gpt-neo-125M) less 2,048 x 768 position embeddings.
    assert shape.params == 125_198_592 - 2048 * 768 == 123_625_728
    assert (shape.layers, shape.heads, shape.head_dim, shape.seq_len) == (12, 12, 64, 1024)
    # 6N + 12 L H Q T = 741,754,368 + 113,246,208
    assert figures.flops_per_token(shape) == 855_000_576
    peak = figures.Peak(191.5, "MI250X per GCD")
    assert figures.mfu(50_000, shape, peak) == pytest.approx(50_000 * 855_000_576 / 191.5e12)
    assert figures.mfu(50_000, shape, figures.Peak(None, "unknown")) is None


@pytest.mark.parametrize("shape", ["tiny", "125m"])
def test_the_parameter_count_is_the_fixture_models(shape: str):
    from tests.fixtures.tiny_gpt_neo import SHAPES, build_model, build_tokenizer, reviews

    tokenizer = build_tokenizer(reviews(seed=1, count=50)["text"])
    model = build_model(tokenizer, shape)
    config = {"vocab_size": len(tokenizer), **SHAPES[shape]}
    counted = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()
    assert figures.gpt_neo_shape(config, seq_len=64).params == counted


# As pytorch/examples' imagenet/main.py prints them (ProgressMeter.display, AverageMeter's
# '{name} {val:6.3f} ({avg:6.3f})'), --print-freq 1, 10009 batches of 128 images an epoch.
EXAMPLES_LOG = """Using device: cuda
=> creating model 'resnet50'
=> Dummy data is used!
Epoch: [0][    1/10009]\tTime  3.100 ( 3.100)\tData  0.900 ( 0.900)\tLoss 6.9e+00 (6.9e+00)
Epoch: [0][    2/10009]\tTime  0.400 ( 1.750)\tData  0.001 ( 0.450)\tLoss 6.9e+00 (6.9e+00)
Epoch: [0][    3/10009]\tTime  0.250 ( 1.250)\tData  0.001 ( 0.301)\tLoss 6.9e+00 (6.9e+00)
Epoch: [0][    4/10009]\tTime  0.270 ( 1.005)\tData  0.001 ( 0.226)\tLoss 6.9e+00 (6.9e+00)
"""


def test_examples_throughput_leaves_out_the_warmup_batches():
    times = figures.examples_batch_times(EXAMPLES_LOG.splitlines())
    assert times == [(1, 3.1), (2, 0.4), (3, 0.25), (4, 0.27)]
    assert figures.examples_images_per_s(times, 128, warmup=2, steps=2) == pytest.approx(
        2 * 128 / 0.52)
    assert figures.examples_images_per_s(times, 128, warmup=2, steps=3) is None  # not enough


def test_the_ratio_is_of_the_medians():
    assert figures.ratio_of_medians([900.0, 1000.0, 950.0], [1000.0, 980.0, 990.0]) == \
        pytest.approx(950.0 / 990.0)
    assert figures.ratio_of_medians([900.0], []) is None


# ---------------------------------------------------------------------------------------------
# The doctor's verdict and the profile's trace, from real files
# ---------------------------------------------------------------------------------------------


def run_doctor(tmp_path: Path, *options: str) -> tuple[int, Path]:
    verdict = tmp_path / "verdict.json"
    proc = subprocess.run([str(REPO / "runscripts" / "doctor"), "--json", str(verdict),
                           "--checks", "layout,storage,bandwidth", "--quick", *options],
                          cwd=tmp_path, env=child_env(), capture_output=True, text=True,
                          timeout=120, check=False)
    return proc.returncode, verdict


def test_the_doctors_verdict_passes_and_its_failure_names_the_check(tmp_path: Path):
    code, verdict = run_doctor(tmp_path)
    check = judge_doctor("doctor 1 GPU", code, verdict, tmp_path / "verdict.ranks/rank-0.json")
    assert check.status == PASS, check
    assert not any(name.startswith("busbw") for name in check.figures)  # one rank: no all-reduce
    code, verdict = run_doctor(tmp_path, "--min-free-gb", "1e9")
    check = judge_doctor("doctor 1 GPU", code, verdict, tmp_path / "verdict.ranks/rank-0.json")
    assert check.status == FAIL and " storage: /tmp has " in check.reason, check
    assert judge_doctor("doctor", 2, tmp_path / "none.json", tmp_path / "none").reason == \
        "exit status 2, no verdict written"


def test_the_profile_needs_a_finished_run_and_a_non_empty_trace_of_rank_0(tmp_path: Path,
                                                                           cpu_run):
    finished = Outcome(0, cpu_run.stdout)
    (tmp_path / "rank0").mkdir()
    (tmp_path / "rank1.svg").write_text("<svg/>")
    assert judge_trace("profile", finished, tmp_path, "py-spy").status == FAIL  # rank 1's only
    (tmp_path / "rank0" / "results.csv").write_text("")
    assert judge_trace("profile", finished, tmp_path, "rocprof").status == FAIL  # empty
    (tmp_path / "rank0" / "vm_1.pt.trace.json").write_text('{"traceEvents": []}')
    check = judge_trace("profile", finished, tmp_path, "torch.profiler")
    assert check.status == PASS and check.figures["bytes"] == 19
    # py-spy exits 0 when the program it records failed: no summary, no pass.
    crashed = Outcome(0, "mnist_ddp.py: error: a GPU was asked for\npy-spy> Wrote flamegraph\n")
    check = judge_trace("profile", crashed, tmp_path, "py-spy")
    assert check.status == FAIL and check.reason == (
        "exit status 0 under py-spy, no XSCALE_SUMMARY; mnist_ddp.py: error: a GPU was asked for")
    assert judge_trace("profile", Outcome(1, cpu_run.stdout), tmp_path, "rocprof").status == FAIL


# ---------------------------------------------------------------------------------------------
# How commands start and end
# ---------------------------------------------------------------------------------------------


def test_one_gpu_is_run_sh_alone_and_all_gpus_are_torchrun_in_front_of_it():
    run_sh = REPO / "runscripts" / "run.sh"
    assert Launch(1).command(run_sh, "python", "t.py") == [str(run_sh), "python", "t.py"]
    assert Launch(8).command(run_sh, "python", "t.py") == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8",
        "--no-python", str(run_sh), "python", "t.py"]
    assert (Launch(1).label, Launch(8).label) == ("1 GPU", "8 GPUs")


def test_an_outer_launchers_variables_do_not_reach_the_runs(monkeypatch):
    for name in LAUNCHER_VARIABLES:
        monkeypatch.setenv(name, "3")
    monkeypatch.setenv("SIF", "image.sif")
    env = child_env({"PROFILE_RANKS": "0"})
    assert not set(LAUNCHER_VARIABLES) & set(env)
    assert env["SIF"] == "image.sif" and env["PROFILE_RANKS"] == "0"


def test_the_runs_python3_is_the_checks_own(monkeypatch):
    """The doctor's torch child is `python3` from PATH: the interpreter (and torch) of the check."""
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    proc = subprocess.run(["python3", "-c", "import sys; print(sys.prefix)"], env=child_env(),
                          capture_output=True, text=True, timeout=60, check=True)
    assert proc.stdout.strip() == sys.prefix


def test_a_run_is_ended_once_it_printed_enough(tmp_path: Path):
    runner = Runner(tmp_path, timeout_s=300)
    counting = [sys.executable, "-u", "-c",
                "import itertools\nfor i in itertools.count(1): print('batch', i)"]
    outcome = runner.run("count", counting, child_env(), enough=lambda line: line == "batch 5\n")
    assert outcome.exit_code == 0 and not outcome.timed_out
    assert outcome.output.splitlines()[:5] == [f"batch {i}" for i in range(1, 6)]
    assert (tmp_path / "count.log").read_text() == outcome.output


def test_a_run_past_its_time_is_killed_with_its_children(tmp_path: Path):
    runner = Runner(tmp_path, timeout_s=1)
    # A child that outlives its parent's death would keep the pipe open: the group is killed.
    hang = [sys.executable, "-c", "import subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "print('started', flush=True)\ntime.sleep(600)"]
    outcome = runner.run("hang", hang, child_env())
    assert outcome.timed_out and outcome.exit_code != 0
    assert outcome.output == "started\n"


# ---------------------------------------------------------------------------------------------
# The whole command, on this machine
# ---------------------------------------------------------------------------------------------


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(tmp_path: Path):
    if torch.accelerator.is_available():
        pytest.skip("this machine has a GPU: run `make gpu-check` itself (docs/GPU-CHECK.md)")
    proc = subprocess.run([sys.executable, str(GPU_CHECK), "--out", str(tmp_path / "out")],
                          cwd=tmp_path, env=child_env(), capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    [line] = proc.stdout.splitlines()
    assert line.startswith("gpu-check: no GPU found (torch ") and line.endswith("nothing checked")
    assert not (tmp_path / "out").exists()  # nothing claimed, nothing written


@pytest.mark.parametrize("args, env, says", [
    (["--only", "trainers,bogus"], {}, "--only 'trainers,bogus'"),
    (["--rounds", "0"], {}, "must be positive"),
    (["--examples", "."], {}, "has no imagenet/main.py"),
    (["--rounds", "x"], {}, "invalid int value"),
    ([], {"XSCALE_PEAK_TFLOPS": "fast"}, "XSCALE_PEAK_TFLOPS='fast'"),
    ([], {"XSCALE_EXAMPLES_DIR": "/nonexistent"}, "has no imagenet/main.py"),
])
def test_a_bad_option_is_one_line_and_status_2(tmp_path: Path, args, env, says):
    proc = subprocess.run([sys.executable, str(GPU_CHECK), *args], cwd=tmp_path,
                          env=child_env(env), capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 2
    assert proc.stdout == ""
    [line] = proc.stderr.splitlines()
    assert line.startswith("gpu-check: error: ") and says in line


def test_the_throughput_rows_say_what_ran_and_put_the_verdicts_mfu_beside_the_formulas():
    ctx = SimpleNamespace(node=SimpleNamespace(name="NVIDIA H200"), batch_size=128,
                          examples=Path("examples"), rounds=2)
    rounds = [{"tokens_per_s": 56_000.0, "mfu": 0.05, "attention": "eager"},
              {"tokens_per_s": 58_000.0, "mfu": 0.052, "attention": "eager"}]
    row = gpt_neo_row(ctx, rounds, compiled=True, eager_rate=20_000.0)
    assert (row.name, row.status) == ("throughput gpt-neo-125m compiled", PASS)
    assert row.figures["speed_up"] == pytest.approx(57_000 / 20_000)
    no_gain = gpt_neo_row(ctx, rounds, compiled=True, eager_rate=56_000.0)
    assert no_gain.status == FAIL and "not 1.2x the eager 56,000" in no_gain.reason
    assert {key: row.figures[key] for key in ("attention", "compile", "precision")} == {
        "attention": "eager", "compile": "on", "precision": "bf16"}
    assert row.figures["verdict_mfu"] == pytest.approx(0.051)
    assert row.figures["mfu"] == pytest.approx(57_000 * 855_000_576 / 989.5e12)
    failed = gpt_neo_row(ctx, [rounds[0], None], compiled=False)
    assert failed.status == FAIL and "logs/gpt-neo-125m-r*.log" in failed.reason
    resnet = resnet_row(ctx, [{"samples_per_s": 2_000.0, "mfu": 0.3}] * 2, [1_800.0] * 2)
    assert resnet.status == PASS and resnet.figures["ratio"] == pytest.approx(2_000 / 1_800)
    assert (resnet.figures["precision"], resnet.figures["verdict_mfu"]) == ("fp32", 0.3)



def test_the_snapshot_row_judges_the_benchmarks_own_result_and_each_way_it_fails():
    # The benchmark as gpu-check runs it, here with the host as the device: the same trainer,
    # holder and comparison, the copy without a side stream (which only a GPU has); a small
    # model with BatchNorm, whose buffers the step after the snapshot changes too.
    bench = subprocess.run([sys.executable, str(REPO / "tests" / "bench" / "snapshots.py"),
                            "--device", "cpu", "--arch", "mobilenet_v3_small", "--rounds", "1",
                            "--steps", "2", "--batch-size", "2", "--image-size", "32"],
                           capture_output=True, text=True, timeout=300, check=True)
    row = judge_snapshots("snapshots side stream", bench.stdout)
    assert row.status == PASS, row.reason
    assert row.figures["state_mib"] > 20 and row.figures["auto_every_1024"] >= 1
    assert "the snapshot is the state of its step: True" in bench.stdout

    def judged(**changes: object) -> Check:
        line = next(line for line in bench.stdout.splitlines() if line.startswith("SNAPSHOT_"))
        result = {**json.loads(line.split(" ", 1)[1]), **changes}
        return judge_snapshots("snapshots side stream", f"SNAPSHOT_BENCH {json.dumps(result)}")

    for failed, says in ((judged(whole=False), "overtook its copy"),
                         (judged(changed=False), "proves nothing"),
                         (judged(auto_share_1024=0.02), "2.00% of the step time (at most 1%)"),
                         (judge_snapshots("s", "Traceback"), "no result; last line: Traceback")):
        assert failed.status == FAIL and says in failed.reason

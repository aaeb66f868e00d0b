"""Scripts of a user's own, not xscale's trainers, through run.sh and the supervisor on the
virtual cluster: what they get without a line of xscale in them, what the lines
docs/YOUR-SCRIPT.md shows add (a stop at Slurm's warning with a checkpoint, the requeue and the
resume, the straggler line, the summary, the goodput ledger), and the mistakes carried over from
the job scripts they come with (a stale WORLD_SIZE) stopped before any rank waits."""

from __future__ import annotations

import ast
import difflib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, VENV_BIN
from tests.helpers import block_placed, tagged_records, wait_for
from tests.test_failures import allocated, job_fields, job_nodes, past_step, trainer_pids

OWN_DDP = "tests/programs/own_ddp.py"
WORKSHOP = "tests/programs/workshop_gpt_neo.py"
YOUR_SCRIPT = REPO / "docs" / "YOUR-SCRIPT.md"
JOB = "tests/programs/own-script-job.sh"
IMAGE = "xscale-test.sif"  # ignored by the shim: the host root plays the image


def in_container(*command: str) -> list[str]:
    return ["singularity", "exec", IMAGE, "/runscripts/run.sh", *command]


def test_a_plain_ddp_script_of_ones_own_runs_as_a_job(cluster, tmp_path: Path):
    """2 nodes x 2 ranks under --cpu-bind=none (the local templates' binding), the script's own
    `--dist-url`, DataLoader workers, the supervisor around the step: every rank trains with one
    thread (two ranks share a two-core node), the banner says the script's rendezvous wins over
    run.sh's, and the job ends with what the supervisor knows without progress notes."""
    output = tmp_path / "job.out"
    job = cluster.sbatch(JOB, OWN_DDP, "--workers", "1", output=output,
                         env={"OUTPUT_DIR": str(tmp_path / "out")})
    assert job.state == "COMPLETED", (job.state, job.output[-4000:])
    ranks = sorted(tagged_records(job.output, "RESULT"), key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3], job.output[-4000:]
    block_placed(ranks)  # ranks 0-1 on one node, 2-3 on another
    assert {r["world_size"] for r in ranks} == {4}
    assert all(r["loss_last"] < r["loss_first"] for r in ranks), ranks
    # Each rank's share of its node's two CPUs, not all of them.
    assert [(r["omp_threads"], r["torch_threads"]) for r in ranks] == [("1", 1)] * 4, ranks
    port = 40000 + int(job.job_id) % 20000
    banner = [line for line in job.output.splitlines() if "xscale: launcher=" in line]
    assert len(banner) == 1, banner
    assert re.search(r"master=nid001:\d+ \(not used: the command's own "
                     rf"--dist-url tcp://nid001:{port} wins\)$", banner[0]), banner
    ending = [line for line in job.output.splitlines() if line.startswith("xscale: goodput")]
    assert len(ending) == 2, job.output[-3000:]
    assert re.fullmatch(r"xscale: goodput: unknown, the training noted no progress: "
                        r"[\d.]+ min allocated, 1 launch, 0 failed, 0 restarted, 0 requeued",
                        ending[0]), ending
    assert "docs/FAILURES.md" in ending[1] and "XSCALE_PROGRESS" in ending[1], ending


def test_a_rank_of_a_plain_script_that_dies_ends_its_launch(cluster, tmp_path: Path):
    """Under the supervisor the launch's srun leaves a task's end to live recovery's coordinator
    (--kill-on-bad-exit=0), but a script without xscale never reaches it: rank 1 killed, the
    coordinator, told by srun's line, ends the step as --kill-on-bad-exit would have, rather
    than leave the others to their collective's timeout (NCCL's may not notice a lost peer)."""
    output = tmp_path / "job.out"
    job_id = cluster.submit(JOB, OWN_DDP, "--epochs", "100000", output=output,
                            env={"OUTPUT_DIR": str(tmp_path / "out")})
    try:
        pids = wait_for(lambda: len(ranks := trainer_pids(job_id)) == 4 and ranks, 240,
                        "four ranks training")
        os.kill(pids[1], signal.SIGKILL)
        state = cluster.wait_state(job_id, {"FAILED", "COMPLETED", "CANCELLED"}, 240)
    finally:
        subprocess.run(["scancel", job_id], timeout=30, check=False)
    text = output.read_text()
    assert state == "FAILED", text[-4000:]
    assert re.search(r"^xscale: live recovery: not possible: rank 1 ended \((Killed|Exited with "
                     r"exit code 137)\) and never reached the coordinator", text, re.M), text
    assert "xscale: first failure: rank 1 on " in text, text[-4000:]


def test_stale_rank_variables_stop_every_rank_before_it_waits(cluster):
    """LUMI's AI-guide job scripts export WORLD_SIZE=16 LOCAL_WORLD_SIZE=8 for 2 nodes x 8 GPUs;
    kept in a 2 x 2 step they would leave every rank waiting in the rendezvous. Each rank says
    so in one line and exits 2 before its command starts."""
    layout = ("-N2", "--ntasks-per-node=2", "--cpu-bind=none")
    stale = cluster.srun(*layout, *in_container("python", "-c", "print('STARTED')"),
                         env={"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, timeout=60)
    assert stale.returncode == 2, stale.stdout + stale.stderr
    assert "STARTED" not in stale.stdout
    errors = [line for line in stale.stderr.splitlines() if "run.sh: error:" in line]
    assert len(errors) == 4, stale.stderr
    assert all("WORLD_SIZE=16 was set before run.sh, but slurm says 4 (SLURM_NTASKS)" in line
               for line in errors), errors
    assert "Traceback" not in stale.stderr
    # A stale RANK is right on one rank at most; the others stop, and with the templates'
    # --kill-on-bad-exit the step ends instead of leaving that one waiting.
    rank = cluster.srun(*layout, "--kill-on-bad-exit=1",
                        *in_container("python", "-c", "print('STARTED')"),
                        env={"RANK": "0"}, timeout=60)
    assert rank.returncode != 0
    errors = [line for line in rank.stderr.splitlines() if "run.sh: error:" in line]
    assert len(errors) == 3, rank.stderr
    assert all(re.search(r"RANK=0 was set before run.sh, but slurm says [123] \(SLURM_PROCID\)",
                         line) for line in errors), errors


# ---- the same scripts with xscale's lines ------------------------------------------------------

def with_xscale(script: str) -> str:
    return script.replace(".py", "_xscale.py")


def code_lines(script: str) -> list[str]:
    """The script's lines after its module docstring (which says what the script is for)."""
    text = (REPO / script).read_text()
    body = ast.parse(text).body
    return text.splitlines()[body[0].end_lineno:]


def documented_diff(kind: str) -> list[str]:
    """The ```diff block under docs/YOUR-SCRIPT.md's heading that names KIND."""
    text = YOUR_SCRIPT.read_text()
    section = text[text.index(f"## {kind}"):]
    block = re.search(r"```diff\n(.*?)```", section, re.S)
    assert block, f"no diff block under '## {kind}' in {YOUR_SCRIPT}"
    return block.group(1).splitlines()


def changed_lines(before: list[str], after: list[str]) -> list[str]:
    """The lines taken out and put in, as a unified diff marks them, in order."""
    return [line for line in difflib.unified_diff(before, after, lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]


@pytest.mark.parametrize(("kind", "script"), [("A plain PyTorch loop", OWN_DDP),
                                              ("Hugging Face's Trainer", WORKSHOP)])
def test_the_documented_lines_are_the_whole_difference(kind: str, script: str):
    """docs/YOUR-SCRIPT.md shows what a script gains xscale by; the test scripts with and
    without xscale differ by exactly those lines, no more (the doc does not hide a line a
    script needs) and no fewer."""
    documented = [line for line in documented_diff(kind) if line[:1] in "+-"]
    assert changed_lines(code_lines(script), code_lines(with_xscale(script))) == documented


def slowed_and_requeued(cluster, job_id: str, output: Path, records: Path,
                        percent: int = 90) -> None:
    """The job run through this: nid002 slowed from the first step (RECORDS: the job's
    xscale-records), the straggler line, Slurm's time-limit warning, the requeue and the
    resumed run to its end (its OUTPUT); the job cancelled whatever happens."""
    try:
        cluster.slow_once_training("nid002", records, percent)
        state = requeue_after_the_warning(cluster, job_id, output)
    finally:
        subprocess.run(["scancel", job_id], timeout=30, check=False)
    assert state == "COMPLETED", output.read_text()[-3000:]


def requeue_after_the_warning(cluster, job_id: str, output: Path) -> str:
    """Once the straggler line names the slowed node: Slurm's time-limit warning as
    `--signal=B:USR1` sends it, to the batch shell, which hands it to the step; heal nid002
    (the warning is on its way: a stop at a tenth of the pace would test nothing more), wait
    for the job to requeue itself, release it (Slurm holds a requeued job back for a while:
    tests/test_failures.py), and wait for its end."""
    with_output(output, lambda: wait_for(
        lambda: output.exists() and "xscale: straggler:" in output.read_text(), 240,
        "the straggler line"))
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True, timeout=30)
    cluster.fault("heal", "nid002")
    # A job that ended instead of requeueing (a rank that failed at the stop) ends the wait.
    requeued = with_output(output, lambda: cluster.wait_state(
        job_id, {"PENDING", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 120))
    assert requeued == "PENDING", f"the job ended {requeued} at the warning: " \
        f"{output.read_text()[-4000:]}"
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now+2"], check=True,
                   timeout=30)
    return cluster.wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 300)


def with_output(output: Path, wait: Callable[[], str]) -> str:
    """WAIT's result; if it times out, the job's output goes with the error: the state alone
    cannot say where a job stood."""
    try:
        return wait()
    except AssertionError as error:
        text = output.read_text() if output.exists() else "(no output yet)"
        raise AssertionError(f"{error}\n{text[-4000:]}") from None


def check_stopped_and_resumed(output: Path, out: Path, steps: int, straggler: str) -> None:
    """What the lines bought: the first run stopped at the warning with a checkpoint, the
    requeued one resumed at that step and finished; the slowed rank was named; the summary
    file holds the last run; the goodput ledger counted the training, and `xscale report`
    shows it."""
    text = output.read_text()
    first, second = tagged_records(text, "XSCALE_SUMMARY")
    assert (first["stopped_early"], first["signal"]) == (True, "SIGUSR1"), first
    assert first["checkpoint"] and 0 < first["steps"] < steps, first
    assert (second["start_step"], second["steps"]) == (first["steps"], steps), second
    assert second["stopped_early"] is False
    # The slowed rank is named, in the line and in the first run's summary; the healthy ranks
    # never are, slowed or healed (healthy runs name nobody: tests/test_jobs.py).
    named = re.findall(r"xscale: straggler: rank (\d+ on \S+): [\d.]+x the median", text)
    assert named and set(named) == {straggler}, text[-3000:]
    assert "{rank} on {node}".format(**first["straggler"]) == straggler, first
    assert json.loads((out / "xscale-summary.json").read_text())["steps"] == steps
    ledger = tagged_records(text, "XSCALE_GOODPUT")[-1]
    assert 0 < ledger["goodput"] < 1 and ledger["training_s"] > 0, ledger
    report = subprocess.run([str(VENV_BIN / "xscale"), "report", str(output)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert f"  goodput     {ledger['text']}" in report.stdout.splitlines(), report
    assert "requeueing job" in text and "xscale: the launch failed" not in text


# Three ranks on two nodes (two on nid001, one on nid002): a slowed nid002 leaves a healthy
# majority, whose median names its rank (xscale.observe.stragglers). Two intervals together, not
# three: the test waits for the line before it sends the warning.
THREE_RANKS = ("--nodelist=nid[001-002]", "--ntasks=3")
STRAGGLER_ENV = {"XSCALE_STRAGGLER_INTERVALS": "2", "OMP_NUM_THREADS": "1"}


@pytest.fixture
def healed_nid002(cluster):
    """nid002 healed of the slowdown the test puts on it, whatever happens in the test."""
    yield
    cluster.fault("heal", "nid002")


def test_a_trainer_script_with_xscales_lines_stops_resumes_and_names_a_straggler(
        cluster, healed_nid002, tiny, tmp_path: Path):  # noqa: F811
    model, data = tiny
    out, output = tmp_path / "out", tmp_path / "job.out"
    steps = 120  # the stop comes near step 40: the slowed node holds every step back
    job_id = cluster.submit(
        JOB, with_xscale(WORKSHOP), "--model-name", "tiny", "--output-path", str(out),
        "--logging-path", str(tmp_path / "logs"), "--num-workers", "1",
        "--pretrained-model", str(model), "--dataset", str(data), "--max-steps", str(steps),
        output=output, sbatch_options=THREE_RANKS,
        env={"OUTPUT_DIR": str(out), "HF_HUB_OFFLINE": "1", **STRAGGLER_ENV})
    slowed_and_requeued(cluster, job_id, output, out / "xscale-records")
    check_stopped_and_resumed(output, out / "tiny", steps, "2 on nid002")
    # The summaries' losses and tokens are xscale's own count: the script asks Trainer for no
    # token count (include_num_input_tokens_seen), and its log cadence does not matter.
    text = output.read_text()
    first, second = tagged_records(text, "XSCALE_SUMMARY")
    for run in (first, second):
        assert run["tokens_per_s"] > 0 and run["loss_last"] < run["loss_first"], run
    # After the stop the script's evaluation is skipped (the time left is the checkpoint's);
    # the resumed run evaluates.
    skipped = [line for line in text.splitlines() if "xscale: evaluation skipped" in line]
    assert len(skipped) == 1 and f"stopped at step {first['steps']} " in skipped[0], skipped


def test_a_plain_ddp_script_with_xscales_lines_outlives_a_frozen_node(cluster, tmp_path: Path):
    """XSCALE_SPARES=1 on four nodes, one rank each: the script with docs/YOUR-SCRIPT.md's lines
    (the short form) gets live recovery without a line more. A node that freezes whole (every
    process stopped: nothing fails, no connection closes, so only its silence tells:
    XSCALE_HEARTBEAT_S, 6 s here, 30 by default) is replaced by the spare, and the job completes
    in its one allocation; the healthy ranks are the processes they were, nothing was taken for
    a failure before (the auto interval's checkpoints included), and nobody for a straggler. (A
    crashed node, its connections closed: tests/test_failures.py's mnist job, the Trainer's
    below.)"""
    fault = "freeze"
    out, output = tmp_path / "out", tmp_path / "job.out"
    job_id = cluster.submit(JOB, with_xscale(OWN_DDP), "--epochs", "30", output=output,
                            sbatch_options=("--nodes=4", "--ntasks-per-node=1", "--no-kill"),
                            env={"OUTPUT_DIR": str(out), "XSCALE_SPARES": "1",
                                 "XSCALE_HEARTBEAT_S": "6"})
    progress = out / "xscale-records" / "attempt0-launch1.progress"
    frozen = None
    try:
        nodes = job_nodes(job_id)  # nodes[3] is the spare
        wait_for(lambda: past_step(progress, 60), 240, "training under way")
        before = trainer_pids(job_id)
        frozen, frozen_at = nodes[1], time.monotonic()
        cluster.fault(fault, frozen)
        wait_for(lambda: f"in place of {frozen}" in output.read_text(), 60, "the live recovery")
        recovered_s = time.monotonic() - frozen_at
        after = trainer_pids(job_id)
        state = cluster.wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, 300)
    finally:
        subprocess.run(["scancel", job_id], timeout=30, check=False)
        if frozen is not None:
            cluster.fault("heal", frozen)
    text = output.read_text()
    assert state == "COMPLETED" and job_fields(job_id)["Restarts"] == "0", text[-4000:]
    leaves = [line for line in text.splitlines() if "every rank leaves" in line]
    assert len(leaves) == 1, leaves
    assert f"on {frozen} sent nothing for 6 s" in leaves[0], leaves  # only its silence tells
    assert f"xscale: live recovery: {nodes[3]} in place of {frozen}" in text
    assert all(after[rank] == before[rank] for rank in (0, 2)), (before, after)
    # A healthy run of short steps names nobody, the replacement that just joined included.
    assert "xscale: straggler:" not in text, text[-4000:]
    summary = tagged_records(text, "XSCALE_SUMMARY")[-1]
    assert summary["steps"] == 30 * (1024 // 3 // 32) and summary["world_size"] == 3, summary
    print(f"{frozen} {fault}: replaced live {recovered_s:.1f} s later (XSCALE_HEARTBEAT_S=6)")


def test_a_trainer_script_with_xscales_lines_outlives_five_faults_shrinks_and_grows_back(
        cluster, tmp_path: Path):
    """The workshop's Trainer script with docs/YOUR-SCRIPT.md's one line more, 2 x 2 ranks and
    two spares: a node crashed mid-run is replaced live, then the replacement's node freezes
    (noticed by its silence, XSCALE_HEARTBEAT_S) and the other spare replaces it; then that
    node crashes too, with no spare left, and the healthy node's two ranks go on alone, each
    drawing two of every step's four batches (xscale.hf._SharedBatches); then rank 1 is killed
    there, starts again on its node and takes its share in the smaller world; meanwhile the
    first node crashed is healed, the node job the supervisor asked the queue for runs on it
    (jobs/lib/grow_back.py), and its two ranks come back: 2 x 2 again. Each time
    Trainer's loop is left and begun again at the source rank's step with the state in memory
    (xscale.hf._LiveSteps); rank 0 keeps its process throughout and no disk checkpoint is read.
    The model the run ends with is the one an uninterrupted run of the same job ends with: no
    step redone or skipped, each step's samples and their mean the same, the learning-rate
    schedule where it was. (One job for the five faults: each Trainer rank's start is seconds
    of CPU, and the bed's four nodes share two cores.)"""
    from tests.fixtures.tiny_gpt_neo import build

    # The workshop script evaluates every 10 steps: on the other tests' 200 test reviews that
    # was a third of both runs' CPU; 40 leave it a tenth.
    model, data = build(tmp_path / "tiny", test_size=40)
    # The grow comes 25-35 s after the heal, at 10-15 steps a second (it came at step 375 on an
    # idle bed): the run ends 15 s after that. The smaller world crosses epochs' ends (125 steps
    # each), where its batches must go on as the launch's.
    steps = 560

    def submit(name: str) -> tuple[str, Path, Path]:
        out, output = tmp_path / name, tmp_path / f"{name}.out"
        job_id = cluster.submit(
            JOB, with_xscale(WORKSHOP), "--model-name", "tiny", "--output-path", str(out),
            "--logging-path", str(tmp_path / "logs"), "--num-workers", "1",
            "--pretrained-model", str(model), "--dataset", str(data), "--max-steps", str(steps),
            output=output, sbatch_options=("--nodes=4", "--ntasks-per-node=2", "--no-kill"),
            env={"OUTPUT_DIR": str(out), "HF_HUB_OFFLINE": "1", "XSCALE_SPARES": "2",
                 "XSCALE_HEARTBEAT_S": "6", "OMP_NUM_THREADS": "1"})
        return job_id, out, output

    job_id, out, output = submit("faults")
    progress = out / "xscale-records" / "attempt0-launch1.progress"
    lost, took = [], {}
    try:
        nodes = job_nodes(job_id)  # nodes[2] and nodes[3] are the spares
        wait_for(lambda: past_step(progress, 8), 300, "training under way")
        before = trainer_pids(job_id)
        replaced = "xscale: live recovery: {} in place of {}".format
        # The progress notes come every 10 steps: each fault comes at the next ten.
        for count, (fault, kind, node, after_step, recovered) in enumerate((
                ("crash", "crash", nodes[1], 10, replaced(nodes[2], nodes[1])),
                ("freeze", "freeze", nodes[2], 24, replaced(nodes[3], nodes[2])),
                ("crash past the spares", "crash", nodes[3], 34,
                 f"2 ranks on 1 node go on without {nodes[3]}"),
                # Healed as the world shrank, once Slurm had dropped it from the job: the
                # queue's, and the node job's. Its ranks' start (seconds of a Trainer's
                # imports) outlasts the kill's recovery, which the grow waits for.
                ("heal", "heal", nodes[1], None, None),
                # Past the smaller world's second step (docs/FAILURES.md, "When it falls back").
                ("kill of rank 1", "kill", None, 44, "rank 1 started again on its node")),
                start=1):
            if after_step is not None:
                wait_for(lambda step=after_step: past_step(progress, step), 300, "training")
            began = time.monotonic()
            if kind == "heal":
                wait_for(lambda n=node: n not in allocated(job_id), 60, f"Slurm to drop {node}")
                cluster.fault("heal", node, XSC_IN_SERVICE="1")  # a node job may take it at once
                healed_at = began
                continue  # its ranks come back after the kill's recovery, below
            if kind == "kill":
                shrunk = trainer_pids(job_id)
                os.kill(shrunk[1], signal.SIGKILL)
            else:
                lost.append(node)
                cluster.fault(kind, node)
            wait_for(lambda line=recovered: line in output.read_text(), 120,
                     f"the live recovery from the {fault}")
            recoveries = count - (kind == "kill")  # the heal is none (yet)
            wait_for(lambda n=recoveries: output.read_text().count(
                "training goes on at step") == n, 60, "training to go on")  # once a recovery
            took[fault] = time.monotonic() - began
        restarted = trainer_pids(job_id)
        wait_for(lambda: "the launch's world again" in output.read_text(), 120,
                 "the lost ranks back")
        wait_for(lambda: output.read_text().count("training goes on at step") == 5, 60,
                 "training to go on")
        took["heal"] = time.monotonic() - healed_at
        after = trainer_pids(job_id)
        state = cluster.wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, 300)
    finally:
        subprocess.run(["scancel", job_id], timeout=30, check=False)
        subprocess.run(["scancel", "--name", f"xscale-grow-{job_id}"], timeout=30, check=False)
        for node in lost:
            cluster.fault("heal", node)
    text = output.read_text()
    assert state == "COMPLETED" and job_fields(job_id)["Restarts"] == "0", text[-4000:]
    leaves = [line for line in text.splitlines() if "every rank leaves" in line]
    assert len(leaves) == 5, leaves
    assert f"on {nodes[2]} sent nothing for 6 s" in leaves[1], leaves  # only its silence tells
    assert "resuming from" not in text and "live recovery is off" not in text, text[-4000:]
    assert "cannot go on in a smaller world" not in text, text[-4000:]
    assert "training goes on as 2 ranks on 1 node, each step's 16 samples dealt over them " \
        "(2 micro-batches on rank 0)" in text, text[-4000:]
    assert shrunk[0] == after[0] == before[0] and shrunk[1] == before[1] != after[1], \
        (before, shrunk, after)
    assert restarted == after, (restarted, after)  # ranks 2 and 3 are the node job's
    assert f"xscale: live recovery: {nodes[1]} is the training's again: ranks 2,3 start " \
        "there" in text, text[-4000:]
    summary = tagged_records(text, "XSCALE_SUMMARY")[-1]
    assert (summary["steps"], summary["world_size"], summary["nodes"]) == (steps, 4, 2), summary
    assert (summary["global_batch_size"], summary["accumulation"]) == (16, 1), summary
    [shrink] = summary["shrinks"]
    assert (shrink["world_size"], shrink["nodes"]) == (2, 1) and 40 <= shrink["step"] < 50 \
        and 50 <= shrink["until"] < steps, summary
    print(f"training went on {took['crash']:.1f} s after the crash, {took['freeze']:.1f} s "
          f"after the freeze (XSCALE_HEARTBEAT_S=6), {took['crash past the spares']:.1f} s "
          f"after the crash with no spare left, as 2 ranks from step {shrink['step']}, "
          f"{took['kill of rank 1']:.1f} s after rank 1 was killed there, and as 2 x 2 again "
          f"from step {shrink['until']}, {took['heal']:.1f} s after {nodes[1]} was healed")
    reference_id, reference, reference_output = submit("uninterrupted")
    assert cluster.wait_state(reference_id, {"COMPLETED", "FAILED", "CANCELLED"}, 300) \
        == "COMPLETED", reference_output.read_text()[-4000:]
    ended, uninterrupted = (final_weights(run / "tiny" / f"checkpoint-{steps}")
                            for run in (out, reference))
    # Float noise only: 250-300 of the steps summed their micro-batches in another order (two
    # ranks of two each): measured up to 2.2e-6 on weights of 0.01 to 1. Wrong batches moved
    # them by 5e-4 within five steps (an epoch drawn in another's order, docs/FAILURES.md).
    for name, tensor in uninterrupted.items():
        assert torch.allclose(ended[name], tensor, rtol=1e-4, atol=1e-5), name


def final_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(checkpoint / "model.safetensors")

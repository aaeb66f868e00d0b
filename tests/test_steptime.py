"""xscale.observe.steptime: how a rank's step splits into data, compute, communication, checkpoints
and the rest, which rank the verdict is read from, and what it advises. Two real ranks with DDP
here; the bed's real faults (a throttled link) in the test at the end."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
from xscale.observe import bounds, steptime

from tests.conftest import ENDED, REPO, VENV_BIN, tool_env
from tests.fixtures.imagefolder import write_imagefolder
from tests.fixtures.mnist_idx import write_mnist
from tests.helpers import (
    TRAINING_IMPORTS,
    check_step_time,
    results_of,
    run_two_ranks,
    tagged_records,
)
from tests.test_jobs import WAIT_S

PROGRAM = (REPO / "tests" / "programs" / "two_ranks_steptime.py").read_text()


def breakdown(seconds: float, data: float = 0.0, compute: float = 0.0,
              communication: float | None = 0.0, checkpoint: float = 0.0) -> steptime.Breakdown:
    other = seconds - data - compute - (communication or 0.0) - checkpoint
    return steptime.Breakdown(seconds, data, compute, communication, checkpoint, other)


def test_the_verdict_is_read_from_the_rank_that_waited_least_and_names_the_largest_part():
    # Rank 1 computes longest; rank 0 waits for it in the all-reduce, which counts as its
    # communication: the run is bound by rank 1's compute, not by the network.
    ranks = [(0, breakdown(0.2, data=0.01, compute=0.05, communication=0.13)),
             (1, breakdown(0.2, data=0.01, compute=0.17, communication=0.01))]
    step_time = steptime.summarise(ranks)
    assert (step_time.rank, step_time.bound) == (1, "compute")
    assert step_time.field() == {"seconds": 0.2, "data": 0.05, "compute": 0.85,
                                 "communication": 0.05, "checkpoint": 0.0, "other": 0.05}
    assert step_time.ranks()["spread"]["communication"] == {
        "min": 0.05, "min_rank": 1, "max": 0.65, "max_rank": 0}
    assert step_time.verdict() == (
        "xscale: step time 200 ms: data 5%, compute 85%, communication 5% (not hidden), "
        "checkpoints 0%, other 5%: compute-bound; " + bounds.ADVICE["compute"]
        + " (rank 1; docs/STEPTIME.md)")


@pytest.mark.parametrize("bound", bounds.BOUNDS)
def test_each_bound_has_its_advice(bound):
    parts = {"data": 0.1, "compute": 0.1, "communication": 0.1, "checkpoint": 0.1, bound: 0.5}
    step_time = steptime.summarise([(0, breakdown(0.9, **parts))])
    assert step_time.bound == bound
    assert step_time.verdict().endswith(
        f": {bound}-bound; {bounds.ADVICE[bound]} (rank 0; docs/STEPTIME.md)")


def test_without_ddp_communication_is_not_measured_and_stays_inside_compute():
    step_time = steptime.summarise([(0, breakdown(0.1, compute=0.09, communication=None)),
                                    (1, None)])  # a rank with too few steps to time
    assert step_time.field()["communication"] is None and step_time.bound == "compute"
    assert "communication not measured (inside compute: no DDP)" in step_time.verdict()
    assert steptime.summarise([(0, None)]) is None


def test_a_clock_leaves_the_warm_up_out_and_books_data_and_checkpoint_waits():
    now = [0.0]
    clock = steptime.StepClock(warmup_steps=2, now=lambda: now[0])
    clock.waited_for_data(5.0)  # the warm-up's waits count for nothing
    for _ in range(2):
        now[0] += 6.0
        clock.step()
    assert clock.breakdown() is None  # no step after the warm-up yet
    for _ in range(2):
        clock.waited_for_data(0.5)
        clock.waited_for_checkpoint(0.25)
        now[0] += 1.0
        clock.step()
    clock.waited_for_checkpoint(9.0)  # the save after the last step is outside its time
    assert clock.breakdown() == steptime.Breakdown(seconds=1.0, data=0.5, compute=0.25,
                                                   communication=0.0, checkpoint=0.25, other=0.0)


def doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def compile_a_graph(size: int) -> None:
    """torch.compile captures a new graph: a shape not seen before, without dynamic shapes
    (dynamo's eager backend: no code is generated, the capture is what counts)."""
    torch.compile(doubled, backend="eager", dynamic=False)(torch.ones(size))


def test_the_steps_torch_compile_spent_compiling_are_warm_up_until_one_compiled_nothing():
    now = [0.0]
    clock = steptime.StepClock(warmup_steps=1, now=lambda: now[0])
    # The counted first step, the compiling second, a recompiling third; then one that compiled
    # nothing, and from there a compilation (step 6's) is the run's own cost.
    seconds = {1: 3.0, 2: 40.0, 3: 20.0, 6: 5.0}
    for step in range(1, 8):
        if step in (2, 3, 6):
            compile_a_graph(size=step)
        now[0] += seconds.get(step, 1.0)
        clock.step()
    assert clock.breakdown().seconds == pytest.approx((1.0 + 1.0 + 5.0 + 1.0) / 4)


@pytest.mark.parametrize("delay_s, bound", [("0", None), ("0.004", "data")])
def test_two_ddp_ranks_measure_every_part_and_slow_reads_are_data_bound(tmp_path, delay_s,
                                                                      bound):
    # A peak as a CPU might have: the MFU is then low, and the verdict says why.
    runs = run_two_ranks(tmp_path, PROGRAM, str(tmp_path / "out"), preload=TRAINING_IMPORTS,
                         DATA_DELAY_S=delay_s, XSCALE_PEAK_TFLOPS="2")
    for record in results_of(runs):
        parts = record["breakdown"]
        assert parts["compute"] > 0 and parts["communication"] is not None, parts
        total = sum(parts[name] for name in bounds.SHARES)
        assert total == pytest.approx(parts["seconds"]), parts
    summary = json.loads((tmp_path / "out" / "xscale-summary.json").read_text())
    check_step_time(summary)
    rank0_out = runs[0][1]
    assert tagged_records(rank0_out, "XSCALE_SUMMARY")[-1]["bound"] == summary["bound"]
    [line] = [line for line in rank0_out.splitlines() if line.startswith("xscale: step time ")]
    assert re.search(rf": {summary['bound']}-bound, MFU [0-9.e+-]+% \([0-9.e+-]+ GFLOP/s of 2 "
                     r"TFLOP/s fp32\); ", line), line
    assert summary["flops"]["peak_source"] == "XSCALE_PEAK_TFLOPS=2" and summary["mfu"] < 0.2
    if summary["bound"] == "compute":
        assert "under 20% of the peak, likely for matmuls in fp32" in line, line
    if bound:
        assert summary["bound"] == bound, summary["step_time"]


# --- the three verdicts on the test bed, from real faults -------------------------------------

MNIST_JOB = REPO / "jobs" / "local" / "mnist.sbatch"
# A mnist step's gradients (1.7 MB) then take 0.2 s; its compute took 0.02 s on one machine of
# this kind and 0.08 s on a slower one, where 20mbit left the verdict to chance.
LINK_RATE = "10mbit"
# A batch of 8 images of 4.5 kB then takes 2.2 s to read. Its compute, beside the two mnist jobs,
# took 0.2-0.4 s on one machine of this kind and 0.7 s on a slower one, where 32k (1.1 s a
# batch, the worker reading ahead during the compute) left the data wait below the compute.
READ_RATE = "16k"


def test_a_healthy_run_is_compute_bound_a_throttled_link_communication_bound_slow_reads_data_bound(
        cluster, tmp_path):
    """Three jobs at once, each on two nodes with one rank per node:
    - mnist on nid001 and nid002, healthy;
    - mnist on nid003 and nid004, with nid004's link throttled to LINK_RATE (fault.sh
      throttle-link): its all-reduce waits for the link;
    - the ImageNet-style trainer on nid001 and nid002 too (the other core of each), its data
      set read at READ_RATE on nid002 (fault.sh slow-reads): rank 1 waits for its batches and
      rank 0 for rank 1 in the all-reduce. The verdict comes from the rank that waited least in
      communication, rank 1: data-bound, while its peer would have said communication.
    The two faulty runs go through run-profile.sh with PROFILER=torch: one rank's trace says the
    same as the step clock, at the end of the run and again from `xscale report --profile`."""
    mnist, images = write_mnist(tmp_path / "mnist"), write_imagefolder(tmp_path / "images")
    outputs = {name: tmp_path / name for name in ("compute", "communication", "data")}
    for output in outputs.values():
        output.mkdir()
    cluster.fault("throttle-link", "nid004", LINK_RATE)
    cluster.fault("slow-reads", "nid002", str(images), READ_RATE)
    profiled = {"communication": profile_env(outputs["communication"], 0, 10, 20),
                "data": profile_env(outputs["data"], 1, 2, 8)}
    jobs, data_run = [], None
    try:
        for name, nodes in (("compute", "nid[001-002]"), ("communication", "nid[003-004]")):
            jobs.append(cluster.submit(MNIST_JOB, output=outputs[name] / "job.out", sbatch_options=(
                f"--chdir={REPO}", f"--nodelist={nodes}", "--nodes=2", "--ntasks-per-node=1"),
                env={"DATA": str(mnist), "OUTPUT_DIR": str(outputs[name]), "MAX_STEPS": "40",
                     "EPOCHS": "100000", **profiled.get(name, {})}))
        # As tests/test_trainers_cv.py runs it: srun, the container, run.sh, one worker.
        data_run = subprocess.Popen(
            ["srun", "--nodelist=nid[001-002]", "-N2", "-n2", "--cpu-bind=none", "--label",
             "singularity", "exec", "xscale-test.sif", "/runscripts/run-profile.sh", "python",
             "python/imagenet.py", "-a", "resnet18", "--image-size", "32", "-b", "8", "-j", "1",
             "--epochs", "1000", "--max-steps", "10", "--output-dir", str(outputs["data"]),
             str(images)], cwd=REPO, env=tool_env() | profiled["data"], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        data_text, _ = data_run.communicate(timeout=WAIT_S)
        states = [cluster.wait_state(job, ENDED, WAIT_S) for job in jobs]
    finally:
        subprocess.run(["scancel", *jobs], timeout=30, check=False)
        if data_run is not None and data_run.poll() is None:
            data_run.kill()
        cluster.fault("heal", "nid002", "nid004")
    assert data_run.returncode == 0, data_text[-3000:]
    texts = {"data": data_text}
    for name, state in zip(("compute", "communication"), states, strict=True):
        texts[name] = (outputs[name] / "job.out").read_text()
        assert state == "COMPLETED", texts[name][-3000:]
    records = {name: json.loads((outputs[name] / "xscale-summary.json").read_text())
               for name in texts}
    for name, record in records.items():
        check_step_time(record)
        assert record["bound"] == name, (name, record["step_time"])
        assert re.search(rf": {name}-bound, [0-9.e+-]+ [GT]FLOP/s, MFU unknown "
                         rf"\(XSCALE_PEAK_TFLOPS gives the peak\); "
                         rf"{re.escape(bounds.ADVICE[name])} \(rank ", texts[name]), \
            texts[name][-3000:]
    assert records["data"]["step_time_ranks"]["rank"] == 1  # nid002's view, not its peer's
    shares = {name: record["step_time"] for name, record in records.items()}
    for fault in ("communication", "data"):  # the fault's part grew from the healthy run's
        assert shares[fault][fault] > shares["compute"][fault], shares
        check_profile_summary(texts[fault], profiled[fault], fault)
    print("step-time shares:", json.dumps(shares))


def profile_env(output: Path, rank: int, start: int, steps: int) -> dict[str, str]:
    """run-profile.sh's settings for torch.profiler on RANK, steps START.. (STEPS of them)."""
    return {"RUNSCRIPT": "run-profile.sh", "PROFILER": "torch", "PROFILE_RANKS": str(rank),
            "PROFILE_DIR": str(output / "profile"), "PROFILE_STEP_START": str(start),
            "PROFILE_STEPS": str(steps)}


def check_profile_summary(text: str, env: dict[str, str], bound: str) -> None:
    """The profiled rank printed its trace's summary at the end of its run, with the run's bound
    from the trace, and `xscale report --profile` prints the same again."""
    rank, start = int(env["PROFILE_RANKS"]), int(env["PROFILE_STEP_START"])
    last = start + int(env["PROFILE_STEPS"]) - 1
    heading = f"xscale: profile of rank {rank}, steps {start}-{last} ({last - start + 1} steps)"
    assert heading in text, text[-3000:]
    verdicts = [line for line in text.splitlines() if f"(rank {rank}'s trace; " in line]
    assert len(verdicts) == 1 and f": {bound}-bound; {bounds.ADVICE[bound]} " in verdicts[0], \
        verdicts
    again = subprocess.run([str(VENV_BIN / "xscale"), "report", "--profile", env["PROFILE_DIR"]],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 0, again.stderr
    assert heading in again.stdout and verdicts[0].split("xscale: ", 1)[1] in again.stdout, \
        again.stdout

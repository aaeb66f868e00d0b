"""Naming the culprit on the virtual cluster (docs/FAILURES.md): how long a hang takes to be
reported, how soon a slowed node is named a straggler, and how many straggler lines healthy
runs print (the goal is none). jobs/local/mnist.sbatch each time, as a user submits it:

- hang: 2 nodes x 2 ranks, XSCALE_TIMEOUT_S=10; after the first checkpoint rank 3 is frozen
  (SIGSTOP). Seconds from the freeze to the report's first-failure line, and to the job's end.
- slow: 4 nodes x 1 rank, nid004 slowed (tests/cluster/fault.sh slow nid004 90). The log
  interval after which rank 0 names it, and the factor.
- healthy: RUNS runs of 4 nodes x 1 rank; the straggler lines they print, and each run's
  slowest rank's factor (the summary's `straggler`).

Needs the cluster up (`make bench` starts it) and root (the fault helper).

    python tests/bench/culprits.py [--healthy-runs N]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from xscale.runtime import STOP_VOTE_EVERY as LOG_EVERY
from xscale.shared import taglines

REPO = Path(__file__).resolve().parents[2]

WORK = REPO / "build" / "bench-culprits"
JOB = REPO / "jobs" / "local" / "mnist.sbatch"
FAULT = REPO / "tests" / "cluster" / "fault.sh"
STRAGGLER = re.compile(r"xscale: straggler: rank (\d+) on (\S+): ([\d.]+)x")


def submit(name: str, nodes: int, tasks_per_node: int, **env: str) -> tuple[str, Path]:
    """sbatch the template as a user would; (job id, its output file)."""
    folder = WORK / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    job_env = dict(os.environ, PATH=os.pathsep.join(
        [str(REPO / "tests" / "shim"), str(REPO / ".venv" / "bin"), os.environ["PATH"]]),
        DATA=str(WORK / "mnist"), OUTPUT_DIR=str(folder / "out"), OMP_NUM_THREADS="1", **env)
    output = folder / "job.out"
    job = subprocess.run(
        ["sbatch", "--parsable", "-o", str(output), f"--chdir={REPO}", f"--nodes={nodes}",
         f"--ntasks-per-node={tasks_per_node}", str(JOB)],
        env=job_env, capture_output=True, text=True, check=True).stdout.strip()
    return job, output


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"culprits bench: error: no {what} within {timeout:.0f} s")
        time.sleep(0.1)


def ended(job: str) -> bool:
    return not subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True,
                              text=True, check=False).stdout.strip()


def text_of(output: Path) -> str:
    return output.read_text(errors="replace") if output.exists() else ""


def rank_pid(job: str, rank: int) -> int:
    """The trainer of RANK (run.sh exec'd it with RANK set), found by its environment."""
    for entry in Path("/proc").iterdir():
        try:
            env = entry.joinpath("environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SLURM_JOB_ID={job}".encode() in env and f"RANK={rank}".encode() in env:
            return int(entry.name)
    raise SystemExit(f"culprits bench: error: no rank {rank} in job {job}")


def hang() -> None:
    job, output = submit("hang", 2, 2, XSCALE_TIMEOUT_S="10", MAX_STEPS="1000000",
                         EPOCHS="100000", CHECKPOINT_EVERY="4")
    try:
        wait_until(lambda: any((WORK / "hang" / "out").glob("ckpt-*")), 240, "checkpoint")
        os.kill(rank_pid(job, 3), signal.SIGSTOP)
        frozen = time.monotonic()
        wait_until(lambda: "xscale: first failure" in text_of(output), 300, "report")
        reported = time.monotonic() - frozen
        wait_until(lambda: ended(job), 300, "end of the job")
        over = time.monotonic() - frozen
    finally:
        subprocess.run(["scancel", job], check=False)
    first = next(line for line in text_of(output).splitlines()
                 if line.startswith("xscale: first failure"))
    print(f"hang: rank 3 frozen, XSCALE_TIMEOUT_S=10: the report {reported:.1f} s later, "
          f"the job over {over:.1f} s later\n  {first}")


def run_to_end(name: str, steps: int) -> str:
    job, output = submit(name, 4, 1, MAX_STEPS=str(steps), EPOCHS="100000")
    wait_until(lambda: ended(job), 600, f"end of job {job}")
    return text_of(output)


def slow(steps: int) -> None:
    subprocess.run(["bash", str(FAULT), "slow", "nid004", "90"], check=True,
                   stdout=subprocess.DEVNULL)
    try:
        text = run_to_end("slow", steps)
    finally:
        subprocess.run(["bash", str(FAULT), "heal", "nid004"], check=True,
                       stdout=subprocess.DEVNULL)
    named = STRAGGLER.search(text)
    if named is None:
        print(f"slow: nid004 slowed 90%: not named in {steps} steps")
        return
    # The progress bar's last step before the line; the line comes at the vote that follows.
    before = re.findall(rf"(\d+)/{steps} ", text[:named.start()])
    interval = math.ceil(int(before[-1]) / LOG_EVERY) if before else 0
    print(f"slow: nid004 slowed 90%: rank {named[1]} on {named[2]} named at {named[3]}x at log "
          f"interval {interval} (one every {LOG_EVERY} steps; the first is warm-up)")


def healthy(runs: int, steps: int) -> None:
    lines, factors = 0, []
    for run in range(runs):
        text = run_to_end(f"healthy{run}", steps)
        lines += len(STRAGGLER.findall(text))
        summary = taglines.tagged(text.splitlines(), "XSCALE_SUMMARY")[-1]
        factors.append(summary.get("straggler", {}).get("factor"))
    print(f"healthy: {runs} runs of 4 nodes x 1 rank, {steps} steps: {lines} straggler lines; "
          f"the slowest rank's factor per run: {factors}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--healthy-runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=120)
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    if not (WORK / "mnist").is_dir():
        subprocess.run([sys.executable, str(REPO / "tests" / "fixtures" / "mnist_idx.py"),
                        str(WORK / "mnist")], check=True, stdout=subprocess.DEVNULL)
    hang()
    slow(args.steps)
    healthy(args.healthy_runs, args.steps)


if __name__ == "__main__":
    main()

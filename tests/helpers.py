"""Parsing of the machine-readable lines xscale prints (XSCALE_SUMMARY, XSCALE_RANK, ...), the
checks that code meant for a host's system Python is Python 3.6 code, and two ranks of a program
on a real gloo group (the library's tests)."""

from __future__ import annotations

import ast
import errno
import importlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from xscale.shared import taglines


def tagged_records(output: str, tag: str) -> list[dict]:
    """Every `TAG {json}` line in the output, in order: after srun --label's `RANK: `, and
    joined again where srun --label cut it (xscale.shared.taglines.unsplit)."""
    return taglines.tagged(output.splitlines(), tag)


def summary(output: str) -> dict:
    """The last run's whole summary: from the file its XSCALE_SUMMARY line names, else the line
    (xscale.shared.taglines.whole_summary); fails loudly (with the output) when there is no line."""
    found = tagged_records(output, "XSCALE_SUMMARY")
    if not found:
        raise AssertionError(f"no XSCALE_SUMMARY line in output:\n{output[-4000:]}")
    return taglines.whole_summary(found[-1])


def whole_summary_lines(output: str) -> list[dict]:
    """Every XSCALE_SUMMARY line of a job's output (srun --label's included), each parsed by
    json.loads as it stands, with no rejoining: what a user's `grep XSCALE_SUMMARY | cut | jq`
    gets. The last one's summary file exists and holds every field of the line, with the same
    values, and the start-up detail the line leaves out."""
    texts = [line.split("XSCALE_SUMMARY ", 1)[1] for line in output.splitlines()
             if "XSCALE_SUMMARY " in line]
    assert texts, f"no XSCALE_SUMMARY line in output:\n{output[-4000:]}"
    found = [json.loads(text) for text in texts]
    last = found[-1]
    whole = json.loads(Path(last["summary_file"]).read_text())
    assert {name: whole.get(name) for name in last} == last, (last, whole)
    assert isinstance(whole["startup"], dict) and "startup" not in last, whole
    return found


# The type every common field has in every trainer's summary (None: it may be null).
SUMMARY_TYPES = {
    "trainer": str, "world_size": int, "nodes": int, "device": str, "backend": (str, None),
    "start_step": int, "steps": int, "batch_size": int, "global_batch_size": int,
    "accumulation": int, "samples_per_s": float, "samples_per_s_per_rank": float,
    "tokens_per_s": (float, None), "loss_first": float, "loss_last": float, "seconds": float,
    "train_seconds": float, "stopped_early": bool, "signal": (str, None),
    "checkpoint": (str, None), "checkpoint_stall_s": float, "checkpoints_saved": int,
    "startup": dict, "straggler": (dict, None), "step_time": (dict, None), "bound": (str, None),
    "tflops": (float, None), "mfu": (float, None), "step_time_ranks": (dict, None),
    "flops": (dict, None), "shrinks": (list, None), "summary_file": str,
}


def check_summary_schema(output: str, trainer: str) -> dict:
    """The one summary schema every trainer ends with (xscale.observe.runlog.SUMMARY_FIELDS, in that
    order, then the trainer's own fields): whole in the file, and less the per-phase start-up
    detail in its last XSCALE_SUMMARY line, what `xscale report`, the benchmarks and users
    read, whichever trainer wrote it. The whole record."""
    from xscale.observe.runlog import (
        FILE_ONLY,
        LEFT_OUT_FIRST,
        LEFT_OUT_NEXT,
        SUMMARY_FIELDS,
        line_record,
    )

    assert set(SUMMARY_TYPES) == set(SUMMARY_FIELDS)
    line = tagged_records(output, "XSCALE_SUMMARY")[-1]
    record = json.loads(Path(line["summary_file"]).read_text())
    assert tuple(record)[:len(SUMMARY_FIELDS)] == SUMMARY_FIELDS, list(record)
    # The line is the record within runlog.LINE_BUDGET: the test bed's paths are long enough
    # that the checkpoint's may be left out of it (CI's clone's were), never a field users grep.
    assert line == line_record(record), (line, record)
    kept = set(SUMMARY_FIELDS) - set(FILE_ONLY) - set(LEFT_OUT_FIRST) - set(LEFT_OUT_NEXT)
    assert kept <= set(line), sorted(kept - set(line))
    for field, kind in SUMMARY_TYPES.items():
        kinds = kind if isinstance(kind, tuple) else (kind,)
        value = record[field]
        assert (value is None and None in kinds) or isinstance(
            value, tuple(k for k in kinds if k is not None)), (field, value)
    assert record["trainer"] == trainer, record
    assert record["checkpoint"] is None or Path(record["checkpoint"]).exists(), record
    # What the saves held training up is part of the run's time.
    assert 0 <= record["checkpoint_stall_s"] <= record["seconds"], record
    assert (record["tokens_per_s"] is not None) == (trainer == "gpt_neo_imdb"), record
    assert record["global_batch_size"] == (
        record["batch_size"] * record["accumulation"] * record["world_size"]), record
    # Every trainer marks the end of its imports, the group and its first step.
    for phase in ("imports", "group", "first_step"):
        assert record["startup"][phase]["slowest"] >= 0, (phase, record["startup"])
    check_step_time(record)
    return record


def check_step_time(record: dict) -> None:
    """Every trainer splits its steps after the warm-up (at most 5 steps) into shares of the
    step that add up to the whole, and names the largest of the four that can bound it."""
    from xscale.observe.bounds import BOUNDS, SHARES

    step_time = record["step_time"]
    if step_time is None:
        assert record["steps"] - record["start_step"] <= 5, record
        return
    assert step_time["seconds"] > 0, record
    shares = {name: step_time[name] for name in SHARES}
    assert abs(sum(share or 0.0 for share in shares.values()) - 1) < 0.01, shares
    # The largest part; two parts can tie once rounded to the summary's three decimals.
    largest = max(shares[name] or 0.0 for name in BOUNDS)
    assert (shares[record["bound"]] or 0.0) == largest, record
    # Communication is measured wherever DDP trains; alone, a rank has none.
    assert (shares["communication"] is None) == (
        record["world_size"] > 1 and record["trainer"] == "imagenet_deepspeed"), record
    assert record["step_time_ranks"]["rank"] in range(record["world_size"])
    check_utilisation(record)


def check_utilisation(record: dict) -> None:
    """Every trainer counts its first step's model FLOPs (xscale.observe.flops): the achieved
    TFLOP/s are those FLOPs over the measured step, and the MFU their share of the peak, which
    the CPU has only where XSCALE_PEAK_TFLOPS gives it."""
    flops = record["flops"]
    assert flops["per_step"] > 0 and flops["kernels"] > 0, flops
    assert flops["precision"] in ("bf16", "fp16", "fp32"), flops
    assert record["tflops"] == pytest.approx(
        flops["per_step"] / record["step_time"]["seconds"] / 1e12, rel=2e-3), record
    if flops["peak_tflops"] is None:
        assert record["mfu"] is None and "XSCALE_PEAK_TFLOPS" in flops["peak_source"], flops
    else:
        assert record["mfu"] == pytest.approx(record["tflops"] / flops["peak_tflops"],
                                              rel=1e-3, abs=1e-4), record


def wait_for(condition: Callable[[], object], timeout: float, what: str,
             every: float = 0.2) -> object:
    """Poll a real condition, bounded: the tests never sleep a fixed time to synchronise. The
    condition's first true value."""
    deadline = time.monotonic() + timeout
    while not (met := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(every)
    return met


def rank_records(output: str, tag: str = "XSCALE_RANK") -> list[dict]:
    return tagged_records(output, tag)


def block_placed(ranks: list[dict], per_node: int = 2) -> list[str]:
    """The nodes of a run's ranks, in rank order, after checking srun's block placement: ranks
    0..PER_NODE-1 on one node, the next PER_NODE on another. Which nodes is Slurm's choice (a
    node still completing its last job, its epilog after a scancel, is passed over for the
    next idle one), so the tests do not name them."""
    nodes = [r["node"] for r in sorted(ranks, key=lambda r: r["rank"])]
    blocks = [nodes[i:i + per_node] for i in range(0, len(nodes), per_node)]
    assert all(len(set(block)) == 1 for block in blocks), nodes
    assert len({block[0] for block in blocks}) == len(blocks), nodes
    return nodes


def env_lines(output: str) -> dict[str, str]:
    """KEY=VALUE lines (run.sh --print-env) as a dict."""
    pairs = {}
    for line in output.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            pairs[key] = value
    return pairs


JOBS_LIB = Path(__file__).resolve().parent.parent / "jobs" / "lib"


def host_module(name: str) -> ModuleType:
    """jobs/lib/NAME.py, imported as the batch host's programs import each other (by its bare
    name, from jobs/lib)."""
    sys.path.insert(0, str(JOBS_LIB))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(JOBS_LIB))


def assert_python36_code(path: Path) -> None:
    """PATH parses as Python 3.6 and uses nothing 3.6 lacks that the parser lets through."""
    tree = ast.parse(path.read_text(), feature_version=(3, 6))
    for node in ast.walk(tree):
        assert not isinstance(node, ast.NamedExpr), "walrus is 3.8+"
        if isinstance(node, ast.ImportFrom):
            assert node.module not in ("__future__", "dataclasses"), node.module
        if isinstance(node, ast.Import):
            assert all(alias.name != "dataclasses" for alias in node.names)
        if isinstance(node, ast.keyword):  # zip(strict=) is 3.10, subprocess's two are 3.7
            assert node.arg not in ("strict", "capture_output", "text"), node.arg


def find_python36() -> str | None:
    """$XSCALE_PYTHON36, a python3.6 on PATH, or pyenv's, that really is 3.6 (a pyenv shim may not
    run)."""
    pyenv = sorted(Path.home().glob(".pyenv/versions/3.6*/bin/python3.6"))
    for python in (os.environ.get("XSCALE_PYTHON36"), shutil.which("python3.6"), *pyenv):
        if python:
            probe = subprocess.run([str(python), "-c",
                                    "import sys; assert sys.version_info[:2] == (3, 6)"],
                                   capture_output=True, timeout=60, check=False)
            if probe.returncode == 0:
                return str(python)
    return None


TRAINERS_DIR = Path(__file__).resolve().parent.parent / "python"


def trainer_module(name: str) -> ModuleType:
    """python/NAME.py imported by its path: the trainers are scripts beside the package, not part
    of it, and the tests import the package as users get it (installed; pyproject.toml)."""
    spec = importlib.util.spec_from_file_location(name, TRAINERS_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None, name
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def hosted_store(world: int):
    """The first rendezvous store of WORLD ranks on this machine, hosted by the test itself on a
    port the kernel chose as it bound it; client_env makes the ranks its clients, as torchrun's
    workers are of their agent's store. A port from free_port() is closed again until rank 0
    binds it, seconds later on a busy machine, and any socket of the machine's (gloo's
    listeners, the bed's ranks) may take it meanwhile. One store per run: a second group would
    read the first one's keys. Where rank 0's own store is under test (its end at the exit),
    rank 0 hosts it, as under run.sh."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)


def rank_env(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    """A rank's environment on this machine, the venv's tools first on PATH as in a job
    (conftest.tool_env): DeepSpeed's JIT build runs the venv's ninja, not the system's older
    one, whose other command hash made each rebuild the op the other had built (a minute)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               OMP_NUM_THREADS="1", XSCALE_TIMEOUT_S="60")
    env.update(extra)
    return env


def store_client(store) -> dict[str, str]:
    """The variables that make a rank a client of STORE (hosted_store), as torchrun's agents
    make their workers."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True"}


def client_env(rank: int, world: int, store, **extra: str) -> dict[str, str]:
    """rank_env for a client of STORE (hosted_store)."""
    return rank_env(rank, world, store.port, **{**store_client(store), **extra})


def run_two_ranks(tmp_path: Path, program: str, *args: str,
                  preload: tuple[str, ...] = ("torch",), **extra: str) -> list:
    """PROGRAM as the two ranks of a gloo job on this machine, forks of one interpreter that
    imported PRELOAD (ForkedRanks; TRAINING_IMPORTS for a program that builds an optimizer);
    [(exit status, stdout, stderr)] by rank."""
    script = tmp_path / "two_ranks.py"
    script.write_text(program)
    port = free_port()  # rank 0 hosts the store, as under run.sh: some callers test its exit
    ranks = ForkedRanks([([str(script), *args], rank_env(rank, 2, port, **extra))
                         for rank in range(2)], Path.cwd(), preload,
                        env=rank_env(0, 2, port, **extra))
    return [(result.returncode, result.stdout, result.stderr) for result in ranks.results(120)]


def results_of(runs: list) -> list[dict]:
    records = []
    for code, out, err in runs:
        assert code == 0, err
        line = next(x for x in out.splitlines() if x.startswith("RESULT "))
        records.append(json.loads(line.split(" ", 1)[1]))
    return records


FORKED_RUNS = Path(__file__).resolve().parent / "programs" / "forked_runs.py"


# What a training run imports before its first step: torch, and torch._dynamo, which the first
# optimizer imports (torch/_compile.py wraps Optimizer.add_param_group): 2.6 s of CPU here.
TRAINING_IMPORTS = ("torch", "torch._dynamo")


def run_forked(commands: list[tuple[list[str], dict[str, str]]], cwd: Path,
               preload: tuple[str, ...] = ("torch",), env: dict[str, str] | None = None,
               timeout: float = 600) -> list[subprocess.CompletedProcess[str]]:
    """Each (ARGV, ENV) as `python ARGV` with that environment, in a process of its own, but
    forked from one interpreter that imported PRELOAD once (tests/programs/forked_runs.py):
    for many short command lines whose own work is a fraction of `import torch`. ENV is that
    interpreter's: where a preloaded library reads a variable when imported (the Hugging Face
    libraries read HF_HOME), it must hold the value every command line has."""
    # A session of its own, so that a timeout kills the forked children with the tool: killed
    # alone, it left a child training on, two cores busy for the rest of the suite.
    tool = subprocess.Popen([sys.executable, str(FORKED_RUNS), *preload], cwd=cwd, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = tool.communicate(forked_runs_input(commands, cwd), timeout=timeout)
    finally:
        if tool.poll() is None:
            os.killpg(tool.pid, signal.SIGKILL)
            tool.communicate()
    assert tool.returncode == 0, err[-4000:]
    return forked_runs_results(commands, out)


def forked_runs_input(commands: list[tuple[list[str], dict[str, str]]], cwd: Path,
                      fifos: list[Path] = ()) -> str:
    """forked_runs.py's runs.json for (ARGV, ENV) COMMANDS run in CWD; the last len(FIFOS)
    wait each on its FIFO to be released."""
    runs = [{"argv": argv, "env": run_env, "cwd": str(cwd)} for argv, run_env in commands]
    for run, fifo in zip(runs[len(runs) - len(fifos):], fifos, strict=True):
        run["held"] = str(fifo)
    return json.dumps(runs)


def forked_runs_results(commands: list[tuple[list[str], dict[str, str]]],
                        output: str) -> list[subprocess.CompletedProcess[str]]:
    """forked_runs.py's results.json (OUTPUT), one CompletedProcess per command."""
    return [subprocess.CompletedProcess(argv, result["returncode"], result["stdout"],
                                        result["stderr"])
            for (argv, _), result in zip(commands, json.loads(output), strict=True)]


class ForkedRanks:
    """The ranks of one host-only job, started at once as forks of one interpreter that imported
    PRELOAD (tests/programs/forked_runs.py --together): each (ARGV, ENV) a process of its own,
    as `python ARGV` starts, without paying `import torch` again. ENV is that interpreter's, as
    for run_forked. The ranks' pids are in `pids`, for signals.

    HELD: (ARGV, ENV) of processes forked now that run only when `release` adds variables to
    their environment, in turn: the replacements a test's coordinator starts for lost ranks.
    Their results follow the ranks'; one never released ends with -9 once the ranks have ended.

    STORE: the rendezvous store the test hosts for them (hosted_store), held as long as they are.
    """

    def __init__(self, commands: list[tuple[list[str], dict[str, str]]], cwd: Path,
                 preload: tuple[str, ...], env: dict[str, str],
                 held: list[tuple[list[str], dict[str, str]]] = (), store=None):
        self.store = store
        self.commands = [*commands, *held]
        self.launched = len(commands)  # the ranks; the held processes follow them
        self._folder = Path(tempfile.mkdtemp(prefix="xscale-held-"))
        self._fifos = [self._folder / f"release-{index}" for index in range(len(held))]
        for fifo in self._fifos:
            os.mkfifo(fifo)
        self.released = 0  # how many of the held processes run
        self.timed_out = False
        self._tool = subprocess.Popen([sys.executable, str(FORKED_RUNS), "--together", *preload],
                                      cwd=cwd, env=env, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._tool.stdin.write(forked_runs_input(self.commands, cwd, self._fifos))
        self._tool.stdin.close()
        self._tool.stdin = None  # written whole: communicate() below only reads
        first = self._tool.stdout.readline()
        if not first:
            raise AssertionError(f"forked_runs.py started no rank: {self._tool.stderr.read()}")
        self.pids: list[int] = json.loads(first)

    def release(self, **added: str) -> None:
        """Run the next held process with ADDED in its environment. It opens its FIFO
        as it starts: one that never does (it died) fails the test instead of hanging it."""
        fifo = self._fifos[self.released]

        def opened() -> int | None:
            try:  # the FIFO's reader, or ENXIO at once (a blocking open would wait for one)
                return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as error:
                if error.errno != errno.ENXIO:
                    raise
                return None

        descriptor = wait_for(opened, 60, f"held process {fifo} to wait")
        with os.fdopen(descriptor, "w") as writer:
            writer.write(json.dumps(added) + "\n")
        self.released += 1

    def all_running(self) -> bool:
        """Every rank still runs (forked_runs.py reaps each as it ends)."""
        def running(pid: int) -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            return True

        return all(running(pid) for pid in self.pids)

    def kill(self) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def results(self, timeout: float) -> list[subprocess.CompletedProcess[str]]:
        """Each rank's exit status and output, once all have ended (killed after TIMEOUT, and
        `timed_out` set)."""
        try:
            out, err = self._tool.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.timed_out = True
            self.kill()
            out, err = self._tool.communicate(timeout=60)
        assert self._tool.returncode == 0, err[-4000:]
        shutil.rmtree(self._folder)
        return forked_runs_results(self.commands, out)

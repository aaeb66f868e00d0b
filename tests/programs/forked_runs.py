"""Run many one-process command lines `python SCRIPT ARGS...` from one interpreter that has
imported their heavy libraries once.

Each command line runs in a fork of this process: a process of its own, with its own environment,
output and exit status, started as `python SCRIPT` starts it (SCRIPT run as __main__, its folder
first on sys.path). Only the interpreter's start and the preloaded imports are shared. The tests
of user errors run a dozen command lines whose own work takes a fraction of a second after
seconds of `import torch`.

With --together, every command line starts at once and the tool prints their process ids as
the first line of its output, before it waits: the ranks of one job, which talk to each other
and which a test may signal. The ranks of the host-only training tests pay `import torch` once so.
A run with "held": FIFO is forked at once too, but runs only once the test writes a line there:
a JSON object of variables to add to its environment (a replacement that the test's coordinator
starts later, without paying `import torch` then). One never released is killed once every other
run has ended (its exit status -9, no output).

usage: forked_runs.py [--together] MODULE... < runs.json > results.json
  runs.json: [{"argv": [SCRIPT, ARG...], "env": {NAME: VALUE}, "cwd": DIR[, "held": FIFO]}, ...]
  results.json: [{"returncode": N, "stdout": TEXT, "stderr": TEXT}, ...] in the same order
                (with --together, after a line [PID, ...])
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import signal
import sys
import tempfile
import traceback


def start(run: dict, output: str) -> int:
    """Fork the child that runs RUN, its output in OUTPUT.stdout and OUTPUT.stderr; its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for stream in ("stdout", "stderr"):  # a run killed while held has empty ones
            open(f"{output}.{stream}", "w").close()
        env = run["env"]
        if "held" in run:
            with open(run["held"]) as fifo:  # blocks until the test opens it to write
                env = {**env, **json.loads(fifo.readline())}
            open(released(output), "w").close()
        os._exit(run_as_main(run["argv"], env, run["cwd"], f"{output}.stdout",
                             f"{output}.stderr"))
    return pid


def result(status: int, output: str) -> dict:
    """An ended child's exit status (os.wait's) and output."""
    with open(f"{output}.stdout") as stdout, open(f"{output}.stderr") as stderr:
        return {"returncode": os.waitstatus_to_exitcode(status), "stdout": stdout.read(),
                "stderr": stderr.read()}


def released(output: str) -> str:
    """The file a held run makes once the test released it."""
    return f"{output}.released"


def reap_all(pids: list[int], held: dict[int, str]) -> dict[int, int]:
    """Each child's wait status, reaped as it ends, whatever the order: a rank that dies is gone
    at once, as under srun, rather than a zombie that still answers kill(pid, 0). Once every
    child but the HELD ones (pid: output) has ended, those never released are killed: no
    replacement is coming for them (a released one runs with the others: they wait for it)."""
    statuses: dict[int, int] = {}
    while len(statuses) < len(pids):
        pid, status = os.wait()
        statuses[pid] = status
        if all(other in statuses for other in pids if other not in held):
            for other, output in held.items():
                if other not in statuses and not os.path.exists(released(output)):
                    os.kill(other, signal.SIGKILL)
    return statuses


def run_as_main(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> int:
    """In the child: what `python ARGV` does after the interpreter's start. Returns the exit
    status when the script returns or raises (a script that calls os._exit never returns)."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
    script = os.path.abspath(argv[0])
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(script)
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (stop.code is not None)
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def main() -> int:
    together = sys.argv[1:2] == ["--together"]
    for name in sys.argv[1 + together:]:
        importlib.import_module(name)
    runs = json.load(sys.stdin)
    with tempfile.TemporaryDirectory() as folder:
        runs_and_outputs = [(run, os.path.join(folder, str(index)))
                            for index, run in enumerate(runs)]
        if together:
            pids = [start(run, output) for run, output in runs_and_outputs]
            print(json.dumps(pids), flush=True)
            statuses = reap_all(pids, {pid: output for pid, (run, output)
                                       in zip(pids, runs_and_outputs, strict=True)
                                       if "held" in run})
            ended = [result(statuses[pid], output)
                     for pid, (_, output) in zip(pids, runs_and_outputs, strict=True)]
        else:  # one after another
            ended = [result(os.waitpid(start(run, output), 0)[1], output)
                     for run, output in runs_and_outputs]
    json.dump(ended, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())

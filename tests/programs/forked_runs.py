"""Run many one-process command lines `python SCRIPT ARGS...` from one interpreter that has
imported their heavy libraries once.

Each command line runs in a fork of this process: a process of its own, with its own environment,
output and exit status, started as `python SCRIPT` starts it (SCRIPT run as __main__, its folder
first on sys.path). Only the interpreter's start and the preloaded imports are shared. The tests
of user errors run a dozen command lines whose own work takes a fraction of a second after
seconds of `import torch`.

usage: forked_runs.py MODULE... < runs.json > results.json
  runs.json: [{"argv": [SCRIPT, ARG...], "env": {NAME: VALUE}, "cwd": DIR}, ...]
  results.json: [{"returncode": N, "stdout": TEXT, "stderr": TEXT}, ...] in the same order
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import tempfile
import traceback


def run_forked(argv: list[str], env: dict[str, str], cwd: str, folder: str) -> dict:
    out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os._exit(run_as_main(argv, env, cwd, out, err))
    _, status = os.waitpid(pid, 0)
    with open(out) as stdout, open(err) as stderr:
        return {"returncode": os.waitstatus_to_exitcode(status), "stdout": stdout.read(),
                "stderr": stderr.read()}


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
    for name in sys.argv[1:]:
        importlib.import_module(name)
    runs = json.load(sys.stdin)
    with tempfile.TemporaryDirectory() as folder:
        results = [run_forked(run["argv"], run["env"], run["cwd"], folder) for run in runs]
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())

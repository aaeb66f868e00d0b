#!/usr/bin/env python3
"""The Python stack of one rank of a running job step, read from outside with py-spy.

    rank_stack.py JOB.STEP RANK

The supervisor (jobs/lib/supervisor.py) starts this on the node that holds a rank which
never joined a collective, with `srun --overlap`, in the step's own image (py-spy is in it):
it finds the rank's process (the one whose environment names this job step and RANK, and whose
parent does not: not one of its DataLoader workers) and prints `py-spy dump` of it and of its
child processes (--subprocesses): a rank that waits for a DataLoader worker which hung shows
only the wait, its worker what it hung in. --nonblocking: py-spy's default pause fails on a
process that is stopped already (a frozen rank), and a hung one needs no pause to be read.
Standard library only, Python 3.6 and later; errors: one line, exit 1.
"""

import os
import shutil
import subprocess
import sys


def environment(pid):
    try:
        with open("/proc/%s/environ" % pid, "rb") as handle:
            items = handle.read().split(b"\0")
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)


def parent(pid):
    try:
        with open("/proc/%s/stat" % pid) as handle:
            return handle.read().rsplit(")", 1)[1].split()[1]
    except (OSError, IndexError):
        return ""


def find_rank(job_step, rank):
    """The pid of RANK's trainer in JOB.STEP on this node, or None."""
    job, _, step = job_step.partition(".")
    wanted = {"SLURM_JOB_ID": job, "SLURM_STEP_ID": step, "RANK": rank}
    matches = [pid for pid in os.listdir("/proc") if pid.isdigit()
               and all(environment(pid).get(name) == value for name, value in wanted.items())]
    roots = [pid for pid in matches if parent(pid) not in matches]
    return min(roots, key=int) if roots else None


def main(argv):
    if len(argv) != 2 or not argv[1].isdigit():
        print("rank_stack.py: error: usage: rank_stack.py JOB.STEP RANK", file=sys.stderr)
        return 1
    pid = find_rank(argv[0], argv[1])
    if pid is None:
        print("rank_stack.py: error: no process of rank %s of step %s here" % (argv[1], argv[0]),
              file=sys.stderr)
        return 1
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        print("rank_stack.py: error: py-spy is not installed here", file=sys.stderr)
        return 1
    return subprocess.run([py_spy, "dump", "--nonblocking", "--subprocesses",
                           "--pid", pid]).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

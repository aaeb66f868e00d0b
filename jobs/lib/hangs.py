"""Which rank hung: the evidence torch's flight recorder leaves, read on the batch host.

When a collective times out, every rank that waits in it writes its flight record into the
step's XSCALE_FR_DIR (python/xscale/observe/flight.py; torch's watchdog on NCCL and RCCL). A record
holds, per process group, the last collective the rank enqueued and the last it completed: a rank
that waits has enqueued one more than it completed. The rank that never joined that collective is
the one with no record (a frozen process writes none: SIGSTOP, a GPU stuck in a kernel) or whose
record stops short of it. That is read from the records themselves, not guessed from timing.

While the step runs, HangWatch waits for the first record; once the records stop coming and one
of them is a timeout, it reads the Python stack of every rank that left none, with py-spy on its
node (runscripts/lib/rank_stack.py, in the step's image, by `srun --overlap`), then lets the
waiting ranks go: they wait for that, a bounded while, because Slurm ends the whole step, the
hung rank with it, as soon as one of them exits.

Standard library only, Python 3.6 and later: the batch host's system Python.
"""

import json
import os
import pickle
import re
import subprocess
import threading
import time

from shared import contract

RECORD = re.compile(r"^%s(\d+)$" % contract.RECORD_PREFIX)
POLL_S = 0.5
# No new record for this long: every rank that could write one has. Ranks time out a little apart
# (each from when it entered the collective) and write their records under load; 2 s missed a
# waiting rank once in CI (a node's 2 CPUs shared by its ranks, py-spy and the test suite).
SETTLE_S = 5.0
MAX_STACKS = 4   # a hang of many ranks (a whole node) is told by the first few
STACK_TIMEOUT_S = 20
STACK_LINES = 12
MAX_CHILD_STACKS = 2  # a rank's DataLoader workers: the first two tell what they do
WORKER = "torch/utils/data/_utils/worker.py"  # a frame only a DataLoader worker's stack has
TIMED_OUT = re.compile(r"[Tt]imed out|[Tt]imeout")


def names_in(fr_dir):
    """What FR_DIR holds; nothing when it is not there (yet, or any more: an empty one is
    removed as its launch ends)."""
    try:
        return os.listdir(fr_dir)
    except OSError:
        return []


def records(fr_dir):
    """rank -> its flight record, for every record in FR_DIR (a partial one is not yet there)."""
    found = {}
    for name in sorted(names_in(fr_dir)):
        match = RECORD.match(name)
        if not match:
            continue
        try:
            with open(os.path.join(fr_dir, name), "rb") as handle:
                found[int(match.group(1))] = pickle.load(handle)
        except (OSError, EOFError, pickle.UnpicklingError, ValueError, AttributeError):
            continue
    return found


# ---- while the step runs --------------------------------------------------------------------

class HangWatch(threading.Thread):
    """Started with the step, stopped when it ends. RANKS: rank -> node, the step's placement;
    LINE: the launch line (jobs/lib/launch_line.py), which says how to run a program in its
    image."""

    def __init__(self, fr_dir, ranks, line, stacks_prefix):
        super().__init__(daemon=True)
        self.fr_dir, self.ranks, self.line = fr_dir, ranks, line
        self.stacks_prefix = stacks_prefix
        self.done = threading.Event()

    def stop(self):
        self.done.set()

    def run(self):
        examined = record_times(self.fr_dir)
        while True:
            seen = self.settled(examined)
            if seen is None:
                return
            if any(timed_out(record) for record in seen.values()) or hung_ranks(self.fr_dir):
                break
            # No rank timed out: a peer lost, no hang. The ranks that wait are let go, and the
            # watch goes on (live recovery may re-form the group, which may hang later).
            release(self.fr_dir, sorted(seen))
            examined = record_times(self.fr_dir)
        job_step = next((record.get("xscale", {}).get("job_step") for record in seen.values()
                         if record.get("xscale", {}).get("job_step")), None)
        silent = [rank for rank in sorted(self.ranks) if rank not in seen][:MAX_STACKS]
        # A peer lost (its node died, it exited) is no hang: its ranks need no stack, and a
        # stack read on a dead node would hold the ranks back until STACK_TIMEOUT_S.
        if job_step and (any(timed_out(record) for record in seen.values())
                         or hung_ranks(self.fr_dir)):
            for rank in silent:
                self.save_stack(rank, job_step)
        release(self.fr_dir, sorted(seen))

    def settled(self, examined):
        """The records once new ones (not as in EXAMINED, record_times') have come and no more
        come; None when the step ended first."""
        while record_times(self.fr_dir) == examined:
            if self.done.wait(POLL_S):
                return None
        seen = records(self.fr_dir)
        settled_at = time.monotonic()
        while len(seen) < len(self.ranks) and time.monotonic() - settled_at < SETTLE_S:
            if self.done.wait(POLL_S):
                return None
            now = records(self.fr_dir)
            if len(now) != len(seen):
                seen, settled_at = now, time.monotonic()
        return seen

    def save_stack(self, rank, job_step):
        text = read_stack(self.line, self.ranks[rank], job_step, rank)
        with open("%s%d.txt" % (self.stacks_prefix, rank), "w") as handle:
            handle.write(text)


def record_times(fr_dir):
    """name -> modification time of each record in FR_DIR, and of the coordinator's verdict of
    hung ranks: a record written again is news."""
    times = {}
    for name in names_in(fr_dir):
        if RECORD.match(name) or name == contract.HUNG:
            try:
                times[name] = os.stat(os.path.join(fr_dir, name)).st_mtime
            except OSError:
                continue
    return times


def hung_ranks(fr_dir):
    """The ranks live recovery's coordinator found hung (jobs/lib/coordinator.py), or []."""
    try:
        with open(os.path.join(fr_dir, contract.HUNG)) as handle:
            return [int(rank) for rank in json.load(handle)]
    except (OSError, ValueError, TypeError):
        return []


def release(fr_dir, recorded):
    """Let the waiting ranks go, noting whose records were there: once they exit, Slurm ends the
    step, and a frozen rank it continues (SIGCONT before SIGTERM) may time out too and write a
    record, late, that says nothing of what it did while frozen."""
    with open(os.path.join(fr_dir, contract.RELEASED), "w") as handle:
        json.dump({"recorded": recorded}, handle)


def recorded_before_release(fr_dir):
    """The ranks whose records came before the release; None without one (no watch ran)."""
    try:
        with open(os.path.join(fr_dir, contract.RELEASED)) as handle:
            return set(json.load(handle)["recorded"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_stack(line, node, job_step, rank):
    """RANK's Python stack, read on NODE while the step still runs, with py-spy in the step's
    image (runscripts/lib/rank_stack.py beside its entrypoint); or why not, in one line."""
    if line.runscripts is None:
        return "no stack: the step was given whole, not built around runscripts/run.sh\n"
    reader = line.probe(node, ["python3", os.path.join(line.runscripts, "lib", "rank_stack.py"),
                               job_step, str(rank)])
    try:
        proc = subprocess.run(reader, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              universal_newlines=True, timeout=STACK_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as error:
        return "no stack: %s\n" % error
    return proc.stdout if proc.returncode == 0 else "no stack: %s\n" % last_line(proc.stdout)


def last_line(text):
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "the reader failed"


# ---- after the step: the evidence -----------------------------------------------------------

class Hang:
    """A collective that some ranks waited in until they timed out, and the ranks that never
    joined it."""

    def __init__(self, collective, seq, culprits, waiters, stacks):
        self.collective, self.seq = collective, seq
        self.culprits, self.waiters, self.stacks = culprits, waiters, stacks

    def what(self):
        return "%s #%d" % (self.collective, self.seq)


def read_hang(fr_dir, ranks, stacks_prefix):
    """The Hang the step's flight records show, or None: no rank timed out in a collective."""
    found = records(fr_dir)
    in_time = recorded_before_release(fr_dir)
    if in_time is not None:
        found = {rank: record for rank, record in found.items() if rank in in_time}
    waiting = {}  # rank -> (process group, the collective it waits in)
    # Where live recovery's coordinator found a rank hung, its peers' records were written as
    # they left the group it hung, not at their timeout: each tells where it waited.
    hung = hung_ranks(fr_dir)
    for rank, record in found.items():
        if not (timed_out(record) or hung):
            continue
        for group, status in (record.get("pg_status") or {}).items():
            waiting.setdefault(rank, (group, waited_in(status)))
    if not waiting:
        return None
    group, seq = max(waiting.values(), key=lambda spot: list(waiting.values()).count(spot))
    waiters = sorted(rank for rank, spot in waiting.items() if spot == (group, seq))
    members = group_members(found[waiters[0]], group, ranks)
    # A rank that left no record explains every wait. A rank behind by a collective that timed
    # out in it may only be held up by that one: a ring all-reduce ends on some ranks while
    # others still wait for the silent rank's part (seen in CI with a frozen rank's node-mate).
    silent = [rank for rank in members if rank not in found]
    culprits = silent or [rank for rank in members if short_of(found[rank], group, seq)]
    if not culprits:
        return None
    return Hang(collective_name(found[waiters[0]], group, seq), seq, culprits, waiters,
                {rank: read_stack_file("%s%d.txt" % (stacks_prefix, rank)) for rank in culprits})


def waited_in(status):
    """The collective a timed-out rank waited in: NCCL's first one not completed; gloo counts
    even a timed-out one as completed, so there it is the last one enqueued (a DDP bucket queued
    after the stuck one makes that a later number, but the same step)."""
    enqueued = status.get("last_enqueued_collective", -1)
    completed = status.get("last_completed_collective", -1)
    return completed + 1 if enqueued > completed else enqueued


def timed_out(record):
    """torch's watchdog writes a record on a timeout only; xscale's says what the error was."""
    own = record.get("xscale")
    return own is None or bool(TIMED_OUT.search(own.get("error", "")))


def short_of(record, group, seq):
    return (record.get("pg_status") or {}).get(group, {}).get("last_enqueued_collective", -1) < seq


def group_members(record, group, ranks):
    """The ranks of the process group: every rank for the default one (id 0), else what the
    record's pg_config lists ("[0, 1]"), else every rank."""
    if str(group) != "0":
        for config in (record.get("pg_config") or {}).values():
            try:
                members = json.loads(config.get("ranks", ""))
            except (ValueError, AttributeError):
                continue
            if isinstance(members, list) and len(members) < len(ranks):
                return members
    return sorted(ranks)


def collective_name(record, group, seq):
    for entry in record.get("entries") or []:
        if entry.get("collective_seq_id") == seq and str(entry.get("pg_id")) == str(group):
            return entry.get("profiling_name") or "a collective"
    return "a collective"


def read_stack_file(path):
    """A saved stack's first thread, the main one, at most STACK_LINES lines (py-spy's header,
    which names the process, and the helper threads' stacks are left to the file); then the
    main thread of MAX_CHILD_STACKS of its child processes, DataLoader workers first, each
    under a line that names the child. Or the one line that says why there is none."""
    try:
        with open(path) as handle:
            # Not the blank lines, nor the line of dashes between two processes.
            lines = [line.rstrip() for line in handle if line.strip().strip("-")]
    except OSError:
        return []
    starts = [at for at, line in enumerate(lines) if line.startswith("Process ")]
    if not starts:
        return main_thread(lines)
    ends = starts[1:] + [len(lines)]
    sections = [lines[start:ends[at]] for at, start in enumerate(starts)]
    stack = main_thread(sections[0])
    # DataLoader workers first: on a GPU the rank's first children are its resource tracker and
    # the fork server (xscale.lifecycle.worker_context), which only wait.
    children = sorted(sections[1:], key=lambda child: not any(WORKER in line for line in child))
    for child in children[:MAX_CHILD_STACKS]:
        pid = child[0].split()[1].rstrip(":")
        stack += ["its child process %s:" % pid] + main_thread(child)
    return stack


def main_thread(lines):
    """The first thread's lines of one process's py-spy dump, at most STACK_LINES; without a
    thread (a reader's error), its first lines."""
    threads = [at for at, line in enumerate(lines) if line.startswith("Thread ")] + [len(lines)]
    if len(threads) == 1:
        return lines[:STACK_LINES]
    return lines[threads[0]:threads[1]][:STACK_LINES]

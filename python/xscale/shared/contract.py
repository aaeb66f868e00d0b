"""The contract between the batch host and the ranks: every file, progress event and variable the
supervisor (jobs/lib) and the training processes (this package) hand each other, named here
and nowhere else.

The supervisor keeps each launch of the training (one Slurm step) in the records directory as
attemptA-launchL.log (launch L of attempt A of the job: a requeue starts the next attempt). The
launch's other files are named after its log (launch_file):

    .fr/            XSCALE_FR_DIR: each rank's flight record of a failed collective, rankN
                    (xscale.observe.flight, torch's watchdog); the supervisor writes
                    .fr/released once it has read them and the ranks may exit
                    (jobs/lib/hangs.py)
    .progress       XSCALE_PROGRESS: rank 0's progress notes, one JSON line per event (below),
                    for the goodput ledger and for whether the training finished
    .stack-rankN.txt  the Python stack of rank N that left no flight record (py-spy)
    .node-states    Slurm's view of the nodes after a failure (sinfo)

The progress events, each {"event": ..., "step": ..., "time": time.time()} plus its fields:

    first_step      the launch's first optimizer step is done: the start-up ends
    interval        each log interval (the stop vote)
    checkpoint      training was held up stall_s seconds by a checkpoint
    end             training is over (evaluation may follow); stopped: it ended at a stop signal

Every launch also gets XSCALE_LAUNCH_T, when the supervisor launched it (docs/STARTUP.md).

Live recovery (docs/FAILURES.md): the supervisor's coordinator (jobs/lib/coordinator.py) and each
rank's link (xscale.recovery.link) speak over TCP, one JSON object a line, {"kind": KIND, ...}: one
type below per message, its fields named there. A rank says Hello, then Live once its training can
leave a broken step and re-enter (or NotLive, with why not), Beat every few seconds, Broken when a
collective of its generation failed, Left once it left that group (with the steps it had done),
Store (the address of the store it hosts when asked), Joined, and Bye at its end, or Failed (an
error of its own, its first line, as the rank ends). The coordinator says Abort (leave generation G
now), HostStore (host the next generation's store), Join (form generation G on that store; state
from rank SOURCE) and Fallback (no live recovery: exit, the usual restart or requeue follows).

Standard library only, and Python 3.6: the host's programs load this file by path
(jobs/lib/shared.py), where the package itself does not import.
"""

import json
import os
import socket
import time
from typing import NamedTuple

# Variables the supervisor hands to every rank of a launch.
FR_DIR_VAR = "XSCALE_FR_DIR"
PROGRESS_VAR = "XSCALE_PROGRESS"
LAUNCH_TIME_VAR = "XSCALE_LAUNCH_T"
RECOVERY_VAR = "XSCALE_RECOVERY"  # the coordinator's host:port, with spares
# A replacement's: the generation it joins (no rendezvous of its own), and the node it stands
# in for, NODE_RANK/NNODES, or the one rank, NODE_RANK/NNODES:LOCAL_RANK/PER_NODE (run.sh
# numbers its ranks from it).
JOIN_VAR = "XSCALE_RECOVERY_JOIN"
REPLACEMENT_VAR = "XSCALE_REPLACEMENT"

# A launch's files, after its log's name (without .log).
FLIGHT_RECORDS = ".fr"
PROGRESS = ".progress"
STACK = ".stack-rank"
NODE_STATES = ".node-states"
RECORD_PREFIX = "rank"  # FLIGHT_RECORDS/rankN
RELEASED = "released"  # FLIGHT_RECORDS/released
# FLIGHT_RECORDS/hung: the ranks live recovery's coordinator found hung (silent while their
# node's other ranks answered), a JSON list; their peers' records then tell the collective.
HUNG = "hung"

# Progress events.
FIRST_STEP, INTERVAL, CHECKPOINT, END = "first_step", "interval", "checkpoint", "end"
# A peer snapshot taken (stall_s), and a live recovery that rolled back to one (redone: the
# steps done again; redone_s: their seconds, where rank 0 timed them).
SNAPSHOT, ROLLED_BACK = "snapshot", "rolled_back"

# Live recovery's messages: a rank's, then the coordinator's.
class Hello(NamedTuple):
    rank: int
    node: str
    pid: int
    generation: int  # 0, or the generation a replacement joins (JOIN_VAR)


class Live(NamedTuple):
    shrinks: bool = False  # its loop can go on in a smaller world (the same global batch)


class NotLive(NamedTuple):
    why: str


class Beat(NamedTuple):
    pass


class Broken(NamedTuple):
    generation: int
    why: str


class Left(NamedTuple):
    generation: int
    step: int  # the optimizer steps this rank had done: where the failure happened


class Stepping(NamedTuple):
    generation: int  # its loop began a step there: from here it answers an Abort within a step


class Store(NamedTuple):
    address: list  # [host, port]


class Joined(NamedTuple):
    generation: int


class Bye(NamedTuple):
    pass


class Failed(NamedTuple):
    why: str


class Abort(NamedTuple):
    generation: int


class HostStore(NamedTuple):
    generation: int


class Join(NamedTuple):
    generation: int
    store: list  # [host, port]
    source: int  # the rank whose state every rank takes
    ranks: list = None  # a smaller world: its ranks' numbers before, in their new order
    nodes: int = None  # how many nodes the generation's ranks run on


class Fallback(NamedTuple):
    why: str


class Dismiss(NamedTuple):
    why: str  # this rank's node is lost (a line blames it): the rank exits, the others go on


MESSAGES = {"hello": Hello, "live": Live, "not_live": NotLive, "beat": Beat, "broken": Broken,
            "left": Left, "stepping": Stepping, "store": Store, "joined": Joined, "bye": Bye,
            "failed": Failed, "abort": Abort, "host_store": HostStore, "join": Join,
            "fallback": Fallback, "dismiss": Dismiss}
KIND_OF = {kind_type: kind for kind, kind_type in MESSAGES.items()}


def encode(message):
    """One message of live recovery, as the bytes of its line."""
    fields = dict(message._asdict(), kind=KIND_OF[type(message)])
    return (json.dumps(fields) + "\n").encode()


def decode(line):
    """The message on LINE; ValueError if it is none (not JSON, an unknown kind, its fields
    not the kind's)."""
    fields = json.loads(line.decode())
    if not isinstance(fields, dict):
        raise ValueError("not a message: %r" % (fields,))
    kind_type = MESSAGES.get(fields.pop("kind", None))
    if kind_type is None:
        raise ValueError("no such kind of message")
    try:
        return kind_type(**fields)
    except TypeError as error:
        raise ValueError(str(error)) from None


def read_messages(stream):
    """The messages on STREAM (a socket's file, in binary), until it closes; a line that is no
    message ends it too (its sender is broken)."""
    try:
        for line in stream:
            try:
                yield decode(line)
            except ValueError:
                return
    except OSError:  # reset: its process was killed
        return


def node_name():
    """The node this process runs on, as Slurm names it (the name in squeue and in the
    supervisor's records), else the host's name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def launch_file(log, suffix):
    """The launch's file SUFFIX, named after its log attemptA-launchL.log."""
    return log[:-len(".log")] + suffix


def progress_line(event, step, **fields):
    """One progress note, as rank 0 appends it to XSCALE_PROGRESS."""
    return json.dumps(dict({"event": event, "step": step, "time": time.time()}, **fields))


def read_progress(path):
    """The events noted in PATH, oldest first; a line cut short (its node died) is passed
    over, and a launch without notes has none."""
    events = []
    try:
        with open(path) as handle:
            for line in handle:
                try:
                    events.append(json.loads(line))
                except ValueError:
                    continue
    except OSError:
        pass
    return events


def first(events, name):
    """The first event called NAME, or None."""
    return next((event for event in events if event.get("event") == name), None)


def training_finished(events):
    """Whether the launch's training ran to its end rather than stopping at a signal."""
    end = first(events, END)
    return end is not None and end.get("stopped") is False


def flight_record(fr_dir, rank):
    """Where rank RANK writes its flight record."""
    return os.path.join(fr_dir, f"{RECORD_PREFIX}{rank}")

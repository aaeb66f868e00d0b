#!/usr/bin/env python3
"""What failed in a Slurm job step, and which node to blame for it.

    failure_report.py --log STEP_LOG --nodes NODELIST [--tasks-per-node SPEC]
                      [--node-states FILE] [--patterns FILE ...] [--blame-file FILE]
    failure_report.py --check-patterns FILE ...

jobs/lib/time-limit.sh runs this on the batch host after a failed step. STEP_LOG is what the
step's `srun --label` wrote: each rank's lines prefixed `RANK: `, and srun's own messages, among
them one per failed task in the order srun learned of them:

    srun: error: nid002: task 3: Exited with exit code 3
    srun: error: nid001: tasks 0-1: Killed
    srun: error: Node failure on nid004

The first of those is the first failure; the later ones are knock-on (srun --kill-on-bad-exit, or
peers that lost their collective). The report names the first failure, its node, status and last
lines, counts the knock-on, and blames nodes when a bad-node pattern (jobs/lib/blame/*.patterns)
matched a line, or Slurm saw a node of the job go down (NODE-STATES: `sinfo -N -o '%N %T'`). The
blamed nodes go to BLAME-FILE as one Slurm hostlist (empty: no node to blame, do not retry).

Runs on the batch host, where python3 may be 3.6: standard library only, nothing newer than 3.6.
"""

import argparse
import configparser
import os
import re
import socket
import sys
from collections import OrderedDict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "..", "runscripts", "lib"))
import hostlist  # noqa: E402  (runscripts/lib, shared with get-master and the doctor)

LAST_LINES = 5  # of the first failed rank's output
TASK_EXIT = re.compile(r"^srun: error: (?P<node>\S+): tasks? (?P<ranks>[0-9,-]+): (?P<how>.+)$")
NODE_FAILURE = re.compile(r"^srun: error: Node failure on (?P<node>\S+)")
LABELLED = re.compile(r"^ *(?P<rank>[0-9]+): ?(?P<text>.*)$")
# sinfo states of a node that failed or was taken away while the job ran (a trailing * means
# "not responding"); see sinfo(1), NODE STATE CODES.
BAD_NODE_STATE = re.compile(r"^(down|drain|drained|draining|fail|failing|unknown)|\*$")


class PatternError(Exception):
    pass


class Pattern:
    def __init__(self, name, regex, source, origin):
        self.name, self.regex, self.source, self.origin = name, regex, source, origin


class TaskExit:
    """One srun exit message: RANKS on NODE ended HOW ('Exited with exit code 3', 'Killed')."""

    def __init__(self, node, ranks, how):
        self.node, self.ranks, self.how = node, ranks, how

    def describe(self):
        return f"{rank_words(self.ranks)} on {self.node}: {self.how.lower()}"


class Blame:
    def __init__(self, node, reason):
        self.node, self.reason = node, reason


def rank_words(ranks):
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranges(ranks)}"


def ranges(numbers):
    """1,2,3,5 -> '1-3,5'."""
    return ",".join(str(low) if low == high else f"{low}-{high}"
                    for low, high in hostlist.spans(numbers))


def expand_ranks(text):
    ranks = []
    for item in text.split(","):
        low, _, high = item.partition("-")
        ranks.extend(range(int(low), int(high or low) + 1))
    return ranks


# ---- pattern files ----------------------------------------------------------------------------

def load_patterns(paths):
    """Every pattern of PATTERN FILES, in file order. A file that does not parse, a section without
    `match` or `source`, or a regex that does not compile raises PatternError with one line."""
    patterns = []
    for path in paths:
        parser = configparser.ConfigParser(interpolation=None)
        try:
            with open(path) as handle:
                parser.read_file(handle)
        except (OSError, configparser.Error) as error:
            raise PatternError(f"pattern file {path}: {one_line(error)}") from None
        for name in parser.sections():
            section = parser[name]
            for key in ("match", "source"):
                if not section.get(key, "").strip():
                    raise PatternError(f"pattern file {path}: [{name}] has no {key}")
            try:
                regex = re.compile(section["match"].strip())
            except re.error as error:
                raise PatternError(f"pattern file {path}: [{name}]: bad regular expression: "
                                   f"{error}") from None
            patterns.append(Pattern(name, regex, section["source"].strip(),
                                    os.path.basename(path)))
    return patterns


def one_line(error):
    return " ".join(str(error).split())


# ---- reading the step's log -------------------------------------------------------------------

class StepLog:
    def __init__(self, lines):
        self.exits = []             # TaskExit, in srun's order
        self.node_failures = []     # nodes srun reported as failed
        self.by_rank = {}           # rank -> its last lines
        self.lines = []             # (rank or None, text), every line
        for line in lines:
            self._read(line.rstrip("\n"))

    def _read(self, line):
        labelled = LABELLED.match(line)
        if labelled:
            rank, text = int(labelled.group("rank")), labelled.group("text")
            self.by_rank.setdefault(rank, []).append(text)
            del self.by_rank[rank][:-LAST_LINES]
            self.lines.append((rank, text))
            return
        self.lines.append((None, line))
        task_exit, node_failure = TASK_EXIT.match(line), NODE_FAILURE.match(line)
        if task_exit:
            self.exits.append(TaskExit(task_exit.group("node"),
                                       expand_ranks(task_exit.group("ranks")),
                                       task_exit.group("how").strip()))
        elif node_failure:
            self.node_failures.append(node_failure.group("node"))

    def first_exit(self):
        """The task exit srun reported first; every later one is knock-on (srun's
        --kill-on-bad-exit, or peers whose collective lost a member)."""
        return self.exits[0] if self.exits else None

    def node_of_rank(self, rank, placement):
        for task_exit in self.exits:
            if rank in task_exit.ranks:
                return task_exit.node
        return placement.get(rank)


# ---- blame ------------------------------------------------------------------------------------

class AddressBook:
    """Maps an address in a log line to a node of the job: the node name itself, or any address
    the node's names resolve to (NODE, and NODE-hsn0..3 as HPE Cray systems name their
    Slingshot interfaces). Resolved only when a pattern captured an address."""

    INTERFACE_SUFFIXES = ("", "-hsn0", "-hsn1", "-hsn2", "-hsn3")

    def __init__(self, nodes):
        self.nodes = nodes
        self._addresses = None

    def node_of(self, address):
        if address in self.nodes:
            return address
        if self._addresses is None:
            self._addresses = self._resolve_all()
        return self._addresses.get(address)

    def _resolve_all(self):
        addresses = {}
        for node in self.nodes:
            for suffix in self.INTERFACE_SUFFIXES:
                try:
                    for address in socket.gethostbyname_ex(node + suffix)[2]:
                        addresses.setdefault(address, node)
                except OSError:
                    continue
        return addresses


def pattern_blames(log, patterns, nodes, placement):
    blames = []
    book = AddressBook(nodes)
    for rank, text in log.lines:
        for pattern in patterns:
            found = pattern.regex.search(text)
            if not found:
                continue
            who = "" if rank is None else f" (rank {rank})"
            for node in blamed_nodes(found, rank, log, placement, book):
                blames.append(Blame(node, f"{pattern.origin} [{pattern.name}]{who}: "
                                          f"{text.strip()[:160]}"))
            break
    return blames


def blamed_nodes(found, rank, log, placement, book):
    """The job's nodes a matched line blames: named (a hostlist, or a fully qualified name as
    PALS prints them), through an address, or the node of the rank that printed it."""
    groups = found.groupdict()
    if groups.get("node"):
        return job_nodes_named(groups["node"], book.nodes)
    if groups.get("addr"):
        node = book.node_of(groups["addr"])
        return [node] if node else []
    node = None if rank is None else log.node_of_rank(rank, placement)
    return [node] if node in book.nodes else []


def job_nodes_named(text, nodes):
    try:
        named = list(hostlist.expand(text))
    except hostlist.HostlistError:
        named = [text]
    short_names = {node.split(".")[0]: node for node in nodes}
    return [short_names[name.split(".")[0]] for name in named if name.split(".")[0] in short_names]


def state_blames(states_text, nodes):
    blames = []
    for line in states_text.splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0] in nodes and BAD_NODE_STATE.search(fields[1].lower()):
            blames.append(Blame(fields[0], f"Slurm set the node {fields[1]} while the job ran"))
    return blames


def first_blame_per_node(blames):
    chosen = OrderedDict()
    for blame in blames:
        chosen.setdefault(blame.node, blame)
    return list(chosen.values())


# ---- the report -------------------------------------------------------------------------------

def report_lines(log, blames, placement, failed_nodes):
    """A node failure comes first when srun saw one, with the ranks it took along; the ranks that
    ended after it are knock-on."""
    first = log.first_exit()
    knock_on = list(log.exits)
    failed_ranks = {rank for task_exit in log.exits for rank in task_exit.ranks}
    quiet = sorted(set(log.by_rank) - failed_ranks)
    lost = [rank for rank in quiet if placement.get(rank) in failed_nodes]
    if log.node_failures:
        with_ranks = f", and with it {rank_words(lost)}" if lost else ""
        yield (f"first failure: node {', '.join(log.node_failures)} failed (srun: Node failure)"
               f"{with_ranks}")
        quiet = [rank for rank in quiet if rank not in lost]
    elif first is not None:
        knock_on.remove(first)
        yield f"first failure: {first.describe()}"
        for text in log.by_rank.get(first.ranks[0], []):
            yield f"  {first.ranks[0]}: {text}"
    else:
        yield "first failure: unknown: srun reported no failed task (see the step's lines above)"
    # Ranks srun has no message for ended with status 0: they stopped cleanly when srun's
    # SIGTERM ended the step (xscale's trainers save a checkpoint then).
    parts = [task_exit.describe() for task_exit in knock_on]
    if quiet:
        parts.append(f"{rank_words(quiet)}: stopped when srun ended the step")
    count = sum(len(task_exit.ranks) for task_exit in knock_on) + len(quiet)
    if count:
        plural = "" if count == 1 else "s"
        yield f"knock-on: {count} rank{plural} ended after it: " + "; ".join(parts)
    for blame in blames:
        yield f"blame: {blame.node}: {blame.reason}"
    if not blames:
        yield "blame: no node (no bad-node pattern matched and no node went down)"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="failure_report.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--check-patterns", nargs="+", metavar="FILE")
    parser.add_argument("--log")
    parser.add_argument("--nodes", help="the job's nodes, a Slurm hostlist")
    parser.add_argument("--tasks-per-node", default="", help="SLURM_TASKS_PER_NODE")
    parser.add_argument("--node-states", help="`sinfo -N -h -o '%%N %%T'` of the job's nodes")
    parser.add_argument("--patterns", nargs="*", default=[], metavar="FILE")
    parser.add_argument("--blame-file")
    args = parser.parse_args(argv)
    try:
        if args.check_patterns:
            load_patterns(args.check_patterns)
            return 0
        return report(args)
    except (PatternError, hostlist.HostlistError, OSError) as error:
        print(f"xscale: error: {one_line(error)}", file=sys.stderr)
        return 2


def report(args):
    if not (args.log and args.nodes):
        raise PatternError("--log and --nodes are required")
    patterns = load_patterns(args.patterns)
    nodes = list(hostlist.expand(args.nodes))
    placement = hostlist.block_placement(nodes, args.tasks_per_node)
    with open(args.log, errors="replace") as handle:
        log = StepLog(handle)
    states = ""
    if args.node_states:
        with open(args.node_states) as handle:
            states = handle.read()
    node_failures = [Blame(node, "srun: node failure during the step")
                     for text in log.node_failures for node in job_nodes_named(text, nodes)]
    blames = first_blame_per_node(node_failures + state_blames(states, nodes)
                                  + pattern_blames(log, patterns, nodes, placement))
    failed_nodes = {node for text in log.node_failures for node in job_nodes_named(text, nodes)}
    for line in report_lines(log, blames, placement, failed_nodes):
        print("xscale: " + line)
    if args.blame_file:
        with open(args.blame_file, "w") as handle:
            handle.write(hostlist.compress([blame.node for blame in blames]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

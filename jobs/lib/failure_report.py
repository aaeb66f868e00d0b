"""What failed in a Slurm job step, and which node to blame for it.

jobs/lib/supervisor.py calls report() on the batch host after a failed step. The step log is what
the step's `srun --label` wrote: each rank's lines prefixed `RANK: `, and srun's own messages,
among them one per failed task in the order srun learned of them:

    srun: error: nid002: task 3: Exited with exit code 3
    srun: error: nid001: tasks 0-1: Killed
    srun: error: Node failure on nid004

The first of those is the first failure; the later ones are knock-on (srun --kill-on-bad-exit, or
peers that lost their collective). The report names the first failure, its node, status and last
lines, counts the knock-on, and blames nodes when a bad-node pattern (jobs/lib/blame/*.patterns)
matched a line, or Slurm saw a node of the job go down (`sinfo -N -o '%N %T'` after the step).

Runs on the batch host, where python3 may be 3.6: standard library only, nothing newer than 3.6.
"""

import configparser
import os
import re
import socket
from collections import OrderedDict

from shared import hostlist, taglines

LAST_LINES = 5  # of the first failed rank's output
TASK_EXIT = re.compile(r"^srun: error: (?P<node>\S+): tasks? (?P<ranks>[0-9,-]+): (?P<how>.+)$")
NODE_FAILURE = re.compile(r"^srun: error: Node failure on (?P<node>\S+)")
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
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {hostlist.ranges(ranks)}"


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
        labelled = taglines.label(line)
        if labelled:
            rank, text = labelled
            self.by_rank.setdefault(rank, []).append(text)
            del self.by_rank[rank][:-LAST_LINES]
            self.lines.append((rank, text))
            return
        self.lines.append((None, line))
        task_exit, node_failure = TASK_EXIT.match(line), NODE_FAILURE.match(line)
        if task_exit:
            self.exits.append(TaskExit(task_exit.group("node"),
                                       hostlist.expand_numbers(task_exit.group("ranks")),
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
    by_short_name = {hostlist.short_name(node): node for node in nodes}
    return [by_short_name[hostlist.short_name(name)] for name in named
            if hostlist.short_name(name) in by_short_name]


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

def report_lines(log, blames, placement, failed_nodes, hang=None):
    """A node failure comes first when srun saw one, with the ranks it took along, then a hang
    (the ranks that never joined a collective others timed out in: jobs/lib/hangs.py), then
    srun's first failed task; the ranks that ended after it are knock-on."""
    first = log.first_exit()
    knock_on = list(log.exits)
    failed_ranks = {rank for task_exit in log.exits for rank in task_exit.ranks}
    quiet = sorted(set(log.by_rank) - failed_ranks)
    lost = [rank for rank in quiet if placement.get(rank) in failed_nodes]
    if failed_nodes:
        with_ranks = f", and with it {rank_words(lost)}" if lost else ""
        yield (f"first failure: node {', '.join(failed_nodes)} failed (srun: Node failure)"
               f"{with_ranks}")
        quiet = [rank for rank in quiet if rank not in lost]
    elif hang is not None:
        yield from hang_lines(hang, log, placement)
        # The hung ranks' own end (srun killed them) is part of the first failure.
        knock_on = [TaskExit(task_exit.node, others, task_exit.how) for task_exit in knock_on
                    for others in [[rank for rank in task_exit.ranks
                                    if rank not in hang.culprits]] if others]
        quiet = [rank for rank in quiet if rank not in hang.culprits]
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
    if blames:
        return
    if hang is not None:
        yield ("blame: no node (a hang names a rank; its node only when it is down, a bad-node "
               "pattern names it, or it hung in the attempt before: docs/FAILURES.md)")
    else:
        yield "blame: no node (no bad-node pattern matched and no node went down)"


def hang_lines(hang, log, placement):
    """The hung ranks, the collective they never joined, and what the first was doing: its
    Python stack, or else its last lines."""
    nodes = sorted({placement.get(rank, "?") for rank in hang.culprits})
    them = "it" if len(hang.culprits) == 1 else "them"
    yield (f"first failure: {rank_words(hang.culprits)} on {', '.join(nodes)}: hung: "
           f"{rank_words(hang.waiters)} timed out in {hang.what()} waiting for {them}")
    culprit = hang.culprits[0]
    for text in hang.stacks.get(culprit) or log.by_rank.get(culprit, []):
        yield f"  {culprit}: {text}"


def report(log_path, nodes_text, tasks_per_node, node_states, patterns, hang=None,
           hung_before=None, placement=None, lost_live=()):
    """(the report's lines, the nodes it blames) for the step whose srun --label output is in
    LOG_PATH, on the job's nodes NODES_TEXT (a hostlist) laid out as TASKS_PER_NODE
    (SLURM_TASKS_PER_NODE), NODE_STATES as `sinfo -N -h -o '%N %T'` printed them after it. HANG:
    what the flight records show (jobs/lib/hangs.py); HUNG_BEFORE: the nodes a hang named in the
    job's attempt before this one. PLACEMENT (rank -> node) when it is not Slurm's block
    placement over the nodes in order: a spare that took a node's place live holds its ranks.
    A node whose failure srun reported but that is no longer among NODES (replaced live) is
    left out, unless it is in LOST_LIVE: a live recovery took it out of the launch and fell
    back, so its loss ended the launch."""
    nodes = list(hostlist.expand(nodes_text))
    if placement is None:
        placement = hostlist.block_placement(nodes, tasks_per_node)
    with open(log_path, errors="replace") as handle:
        log = StepLog(handle)
    failed_nodes = [node for text in log.node_failures for node in job_nodes_named(text, nodes)]
    node_failures = [Blame(node, "srun: node failure during the step") for node in failed_nodes]
    patterned = pattern_blames(log, patterns, nodes, placement)
    # A line that blames a node says more than that live recovery lost it (it may have lost
    # it for that line: a rank is not started again on a node a line blames).
    by_line = {blame.node for blame in patterned}
    lost = [Blame(node, "lost during the launch; its live recovery fell back")
            for node in lost_live if node not in by_line]
    blames = first_blame_per_node(node_failures + lost + state_blames(node_states, nodes)
                                  + patterned
                                  + repeated_hang_blames(hang, placement, hung_before or []))
    lines = list(report_lines(log, blames, placement, failed_nodes, hang))
    return lines, [blame.node for blame in blames]


def repeated_hang_blames(hang, placement, hung_before):
    """One hang is a rank's; the same node hanging in two attempts in a row is the node's."""
    if hang is None:
        return []
    return [Blame(node, "a rank on it hung in this attempt and in the one before")
            for node in sorted({placement.get(rank) for rank in hang.culprits})
            if node in hung_before]

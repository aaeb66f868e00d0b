#!/usr/bin/env python3
"""Slurm's syntax, in one module: hostlists (expanded exactly as `scontrol show hostnames` prints
them, and compressed as Slurm reads them back), lists of numbers and ranges (cpusets, srun's task
ranges), a node's short name, and where Slurm's block distribution puts each rank.

    hostlist.py --all LIST   every host, one per line, in Slurm's order
    hostlist.py LIST         the first host

Its users run where only a system Python may be: `get-master --all` execs this inside containers
without Slurm tools and on login nodes, the doctor imports it on every rank, and the batch host's
supervisor, stager and failure report (jobs/lib/) import it too. So: the standard library only and
no syntax newer than Python 3.6. A malformed LIST prints one line, `get-master: error: ...`, on
stderr and exits 2. run.sh's first-host path is bash (hostlist.sh, which says why); the tests hold
both grammars to one table of cases (tests/test_get_master.py).

Slurm's rules, checked against `scontrol show hostnames` (Slurm 22.05):
- items are separated by ',' or whitespace; duplicates are kept, order is kept;
- every number is zero-padded to the width of the low end of its range (`[1-010]` gives 1..10,
  `[01-2]` gives 01 02, `[09-100]` gives 09..99 100);
- with several brackets in one name the last bracket varies fastest, then the first, the second,
  and so on up to the last but one, which varies slowest (`a[1-2]b[3-4]c[5-6]` gives a1b3c5
  a1b3c6 a2b3c5 a2b3c6 a1b4c5 ...): Slurm expands the brackets before the last one recursively,
  right to left;
- a range may not hold more than 65536 hosts, nor may the brackets before the last one of a name.
Text after the last bracket (`node[1-2]-ib`) expands as node1-ib, node2-ib. Slurm 22.05 rejects
it, but newer Slurm's hostlist_create accepts such a suffix on one-dimensional clusters.
"""

import argparse
import itertools
import os
import re
import signal
import sys
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

MAX_RANGE_HOSTS = 65536  # Slurm's MAX_RANGE and MAX_PREFIX_CNT (hostlist.c)
MAX_DIGITS = 18  # keeps numbers within the bash path's signed 64-bit arithmetic

# C-locale [[:space:]], which the bash path uses; Python's \s would also take Unicode spaces.
_SPACE = r"[ \t\n\v\f\r]"

# First match wins. The same checks, in the same order and words, are in hostlist.sh (POSIX ERE
# there: `$` here is `\Z`, because Python's `$` also matches before a final newline).
_UNMATCHED_CLOSE = "']' without a matching '['"
_UNMATCHED_OPEN = "'[' without a matching ']'"
_BAD_BRACKET = "brackets must hold numbers or ranges N-M, separated by ','"
SYNTAX_CHECKS = [
    (r"^" + _SPACE + r"*\Z", "it names no host"),
    (r"^" + _SPACE + r"*,", "it starts with ','"),
    (r"," + _SPACE + r"*\Z", "it ends with ','"),
    (r"," + _SPACE + r"*,", "it has an empty item (',,')"),
    (r"^[^\[\]]*\]", _UNMATCHED_CLOSE),
    (r"\][^\[]*\]", _UNMATCHED_CLOSE),
    (r"\[[^\]]*\[", _UNMATCHED_OPEN),
    (r"\[[^\]]*\Z", _UNMATCHED_OPEN),
    (r"\[\]", "empty brackets '[]'"),
    (r"\[[^\]]*[^\]0-9,\-]", "brackets may hold only digits, ',' and '-'"),
    (r"\[[^0-9]", _BAD_BRACKET),
    (r"\[[^\]]*[,\-][^0-9]", _BAD_BRACKET),
    (r"\[[^\]]*-[0-9]*-", _BAD_BRACKET),
]
_COMPILED_CHECKS = [(re.compile(pattern), reason) for pattern, reason in SYNTAX_CHECKS]

# On a list that passed the checks: an item is a run of text and brackets.
_ITEM = re.compile(r"(?:[^\[\], \t\n\v\f\r]|\[[^\]]*\])+")
_BRACKET = re.compile(r"\[([^\]]*)\]")

Range = Tuple[str, str]  # low and high end as written, e.g. ("005", "012")


class HostlistError(ValueError):
    """A malformed hostlist; str() is the message get-master prints after 'error: '."""

    def __init__(self, hostlist: str, reason: str) -> None:
        shown = hostlist.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
        super().__init__(f"invalid hostlist '{shown}': {reason}")


def syntax_error(hostlist: str) -> Optional[str]:
    """The reason the first failing syntax check gives, or None for a well-formed list."""
    for pattern, reason in _COMPILED_CHECKS:
        if pattern.search(hostlist):
            return reason
    return None


def parse_ranges(bracket: str) -> List[Range]:
    """'1-3,7' -> [('1', '3'), ('7', '7')]."""
    ranges = []
    for element in bracket.split(","):
        low, _, high = element.partition("-")
        ranges.append((low, high or low))
    return ranges


def range_error(low: str, high: str) -> Optional[str]:
    """Slurm's numeric rules for one range, or None when it is fine."""
    if len(low) > MAX_DIGITS or len(high) > MAX_DIGITS:
        shown = low if low == high else low + "-" + high
        return f"number {shown} has more than {MAX_DIGITS} digits"
    if int(high) < int(low):
        return f"descending range {low}-{high}"
    if int(high) - int(low) + 1 > MAX_RANGE_HOSTS:
        return f"range {low}-{high} holds more than {MAX_RANGE_HOSTS} hosts (Slurm's limit)"
    return None


def count_hosts(ranges: Sequence[Range]) -> int:
    return sum(int(high) - int(low) + 1 for low, high in ranges)


def numbers(ranges: Sequence[Range]) -> List[str]:
    """Every number of a bracket, each padded to the width of its range's low end."""
    out = []
    for low, high in ranges:
        width = len(low)
        out.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return out


class Item:
    """One name of the list: literal texts around its brackets, text[0] [b0] text[1] [b1] ..."""

    def __init__(self, source: str) -> None:
        parts = _BRACKET.split(source)
        self.texts: List[str] = parts[0::2]
        self.brackets: List[List[Range]] = [parse_ranges(b) for b in parts[1::2]]

    def error(self) -> Optional[str]:
        for ranges in self.brackets:
            for low, high in ranges:
                reason = range_error(low, high)
                if reason:
                    return reason
        for ranges in self.brackets[:-1]:
            if count_hosts(ranges) > MAX_RANGE_HOSTS:
                return (
                    f"a bracket before the last one of a name holds more than "
                    f"{MAX_RANGE_HOSTS} hosts (Slurm's limit)"
                )
        return None

    def hosts(self) -> Iterator[str]:
        columns = [numbers(ranges) for ranges in self.brackets]
        order = slurm_loop_order(len(columns))
        for combo in itertools.product(*(columns[i] for i in order)):
            picked = [""] * len(columns)
            for depth, position in enumerate(order):
                picked[position] = combo[depth]
            yield self.texts[0] + "".join(
                picked[i] + self.texts[i + 1] for i in range(len(picked))
            )


def slurm_loop_order(brackets: int) -> List[int]:
    """Bracket positions from the outermost loop to the innermost, as Slurm expands them.

    Slurm expands the last bracket of a name as a plain range and the ones before it
    recursively from right to left: the last but one bracket is the outermost loop, then
    down to the first, and the last bracket is the innermost.
    """
    if brackets == 0:
        return []
    return list(range(brackets - 2, -1, -1)) + [brackets - 1]


def parse(hostlist: str) -> List[Item]:
    """Check the whole list (syntax, then every range) and split it into items."""
    reason = syntax_error(hostlist)
    if reason:
        raise HostlistError(hostlist, reason)
    items = [Item(match.group(0)) for match in _ITEM.finditer(hostlist)]
    for item in items:
        reason = item.error()
        if reason:
            raise HostlistError(hostlist, reason)
    return items


def expand(hostlist: str) -> Iterator[str]:
    """Every host in Slurm's order; raises HostlistError before yielding anything."""
    items = parse(hostlist)
    return itertools.chain.from_iterable(item.hosts() for item in items)


def compress(hosts: Sequence[str]) -> str:
    """The shortest bracket form of HOSTS that Slurm reads back (`--exclude`, `--nodelist`):
    names sorted, numeric suffixes of one prefix and width merged into ranges, e.g.
    nid002 nid003 nid005 -> nid[002-003,005]. The inverse of expand for sorted unique names."""
    groups = {}  # type: dict
    plain = []
    for host in sorted(set(hosts)):
        match = re.match(r"^(.*?)([0-9]+)$", host)
        if match:
            groups.setdefault((match.group(1), len(match.group(2))), []).append(int(match.group(2)))
        else:
            plain.append(host)
    items = plain + [_bracket(prefix, width, numbers)
                     for (prefix, width), numbers in groups.items()]
    return ",".join(sorted(items))


def short_name(host: str) -> str:
    """A node's short name, as `hostname -s` and Slurm print it: PALS and PBS's node file name
    Aurora's nodes by their full domain name (x4102c5s2b0n0.hostmgmt2102.cm.aurora.alcf.anl.gov),
    Slurm and the ranks' own reports by the first label alone."""
    return host.split(".", 1)[0]


def expand_numbers(text: str) -> List[int]:
    """A list of numbers and ranges, as cpusets ("0-7,64-71\\n" in sysfs) and srun's task
    messages ("tasks 0-1,3") write them, in order: [0, ..., 7, 64, ..., 71]. Raises ValueError
    for anything else (an empty item, a range that runs backwards, a word)."""
    numbers = []  # type: List[int]
    for item in text.strip().split(","):
        match = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", item.strip())
        if not match:
            raise ValueError("'%s' is not a list of numbers and ranges (e.g. 0-3,8)" % text)
        low, high = int(match.group(1)), int(match.group(2) or match.group(1))
        if high < low:
            raise ValueError("range '%s' runs backwards" % item.strip())
        numbers.extend(range(low, high + 1))
    return numbers


def ranges(numbers: Sequence[int]) -> str:
    """The inverse of expand_numbers for a set: 1 2 3 5 -> '1-3,5'."""
    return ",".join(str(low) if low == high else "%d-%d" % (low, high)
                    for low, high in spans(set(numbers)))


def spans(numbers: Sequence[int]) -> List[List[int]]:
    """Runs of consecutive numbers, sorted: 1 2 3 5 -> [1, 3], [5, 5]."""
    runs = []  # type: List[List[int]]
    for number in sorted(numbers):
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    return runs


def _bracket(prefix: str, width: int, numbers: List[int]) -> str:
    if len(numbers) == 1:
        return "%s%0*d" % (prefix, width, numbers[0])
    parts = ["%0*d" % (width, low) if low == high else "%0*d-%0*d" % (width, low, width, high)
             for low, high in spans(numbers)]
    return "%s[%s]" % (prefix, ",".join(parts))


def block_placement(nodes: Sequence[str], tasks_per_node: str) -> Dict[int, str]:
    """rank -> node under Slurm's default block distribution, from the nodes and
    SLURM_TASKS_PER_NODE ("2(x3),1": 2 tasks on each of 3 nodes, then 1); empty when the spec
    does not parse."""
    counts = []  # type: List[int]
    for group in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", group.strip())
        if not match:
            return {}
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    placement, rank = {}, 0
    for node, count in zip(nodes, counts):  # noqa: B905  (strict= is Python 3.10)
        for _ in range(count):
            placement[rank] = node
            rank += 1
    return placement


def write_hosts(hosts: Iterator[str]) -> None:
    # Bytes out, as they came in: host names need not be valid in the current locale.
    out = sys.stdout.buffer
    for host in hosts:
        out.write(os.fsencode(host) + b"\n")
    out.flush()


def main(argv: Optional[Sequence[str]] = None) -> int:
    # `get-master --all | head -1` should end quietly, as a shell tool would.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    parser = argparse.ArgumentParser(
        prog="hostlist.py", description="Expand a Slurm hostlist like `scontrol show hostnames`."
    )
    parser.add_argument("--all", action="store_true", help="print every host, one per line")
    parser.add_argument("hostlist", help="e.g. nid[005252-005254,005260]")
    args = parser.parse_args(argv)
    try:
        hosts = expand(args.hostlist)
    except HostlistError as error:
        print(f"get-master: error: {error}", file=sys.stderr)
        return 2
    write_hosts(hosts if args.all else iter([next(hosts)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

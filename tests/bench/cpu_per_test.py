"""A pytest plugin: the CPU seconds the whole machine was busy during each test (setup, call
and teardown), from /proc/stat, as cpu_busy.sh measures a command. Run the tests one at a time
and alone on the machine (no -n), so that the busy time is theirs: the bed's daemons and ranks
count, which a process's own rusage would miss.

    .venv/bin/python -m pytest -q -p tests.bench.cpu_per_test -m cluster tests

prints the tests by busy CPU seconds at the end, with their wall time and the share of the
cores they kept busy (docs/TESTBED.md, "What a test costs here").
"""

from __future__ import annotations

import os
import time

import pytest

HZ = os.sysconf("SC_CLK_TCK")
CORES = os.cpu_count() or 1
_costs: dict[str, tuple[float, float]] = {}  # test id: (wall s, busy CPU-s)


def _busy_s() -> float:
    """Busy CPU seconds of all cores since boot: user, nice, system, irq, softirq, steal."""
    with open("/proc/stat") as stat:
        fields = stat.readline().split()[1:9]
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields)
    return (user + nice + system + irq + softirq + steal) / HZ


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    wall, busy = time.monotonic(), _busy_s()
    yield
    _costs[item.nodeid] = (time.monotonic() - wall, _busy_s() - busy)


def pytest_terminal_summary(terminalreporter):
    write = terminalreporter.write_line
    write(f"CPU per test ({CORES} cores; busy CPU-s, wall s, share of the cores busy):")
    total = 0.0
    for nodeid, (wall, busy) in sorted(_costs.items(), key=lambda item: -item[1][1]):
        total += busy
        write(f"{busy:8.1f} {wall:8.1f} {100 * busy / max(wall * CORES, 1e-9):4.0f}%  {nodeid}")
    write(f"{total:8.1f} CPU-s busy over {len(_costs)} tests")

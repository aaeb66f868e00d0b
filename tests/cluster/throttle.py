"""fault.sh slow: stop a virtual node's processes PERCENT of the time, in short periods, so that
everything on the node runs at (100 - PERCENT)% of its pace, as on a node that is slower than
the rest; slurmd is spared, so that Slurm keeps hearing from the node.

    python3 tests/cluster/throttle.py NODE PERCENT SLURMD_PID

The period is 2 ms. A process that wakes from a wait (a collective's answer, a queue, a sleep)
during a stop starts at the beginning of the next running window and has all of it: with 10 ms
periods, a 0.5 ms burst of work after a 1 ms sleep was slowed 1.7x at 90% instead of 10x, so a
rank's forward pass, which starts right after the all-reduce answers, escaped most of the fault.
Running windows of 0.2 ms are shorter than any part of a step, which is then slowed alike. The
signals go to process groups (a rank, its shell, its DataLoader workers), two or three kill()s a
period, and the throttler runs at a real-time priority where it may, so that a busy machine
delays neither its stops nor its continues. The node's processes are listed again every second,
for the workers and steps that start later. The sleeps are the fault itself, not
synchronisation. On SIGTERM (fault.sh heal) every process is left running.
"""

import os
import signal
import subprocess
import sys
import time

PERIOD_S = 0.002
RELIST_S = 1.0


def node_groups(node, spared):
    """The process groups of NODE's processes, but slurmd's and this one's."""
    listed = subprocess.run(["ip", "netns", "pids", node], stdout=subprocess.PIPE,
                            text=True).stdout.split()
    groups = set()
    for pid in listed:
        try:
            groups.add(os.getpgid(int(pid)))
        except ProcessLookupError:
            pass
    for pid in (spared, str(os.getpid())):
        if pid:
            groups.discard(os.getpgid(int(pid)))
    return groups


def send(groups, signum):
    for group in groups:
        try:
            os.killpg(group, signum)
        except ProcessLookupError:
            pass


def punctual():
    """A real-time priority, where the machine allows it: without one, a busy machine delays
    the throttler's wake-ups and weakens the fault by a varying amount."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except (OSError, AttributeError):
        pass


def main(node, percent, spared):
    stopped_s = PERIOD_S * percent / 100
    groups = set()

    def leave(signum, frame):
        send(groups, signal.SIGCONT)
        sys.exit(0)

    signal.signal(signal.SIGTERM, leave)
    punctual()
    listed_at = 0.0
    while True:
        if time.monotonic() - listed_at > RELIST_S:
            groups, listed_at = node_groups(node, spared), time.monotonic()
        send(groups, signal.SIGSTOP)
        time.sleep(stopped_s)
        send(groups, signal.SIGCONT)
        time.sleep(PERIOD_S - stopped_s)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])

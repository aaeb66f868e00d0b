"""fault.sh slow: stop a virtual node's processes PERCENT of the time, in short periods, so that
everything on the node runs at (100 - PERCENT)% of its pace, as on a node that is slower than
the rest; slurmd is spared, so that Slurm keeps hearing from the node.

    python3 tests/cluster/throttle.py NODE PERCENT SLURMD_PID

A period of 10 ms is short next to a training step's parts (a forward pass takes milliseconds to
seconds), so each of them is slowed alike rather than some stopped whole and others not at all;
the node's processes are listed again every second, for the workers and steps that start later.
The sleeps are the fault itself, not synchronisation. On SIGTERM (fault.sh heal) every process
is left running.
"""

import os
import signal
import subprocess
import sys
import time

PERIOD_S = 0.010
RELIST_S = 1.0


def node_pids(node, spared):
    listed = subprocess.run(["ip", "netns", "pids", node], stdout=subprocess.PIPE,
                            text=True).stdout.split()
    return [int(pid) for pid in listed if pid != spared and int(pid) != os.getpid()]


def send(pids, signum):
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def main(node, percent, spared):
    stopped_s = PERIOD_S * percent / 100
    pids = []

    def leave(signum, frame):
        send(pids, signal.SIGCONT)
        sys.exit(0)

    signal.signal(signal.SIGTERM, leave)
    listed_at = 0.0
    while True:
        if time.monotonic() - listed_at > RELIST_S:
            pids, listed_at = node_pids(node, spared), time.monotonic()
        send(pids, signal.SIGSTOP)
        time.sleep(stopped_s)
        send(pids, signal.SIGCONT)
        time.sleep(PERIOD_S - stopped_s)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])

#!/usr/bin/env python3
"""A stand-in for Slurm's srun, for the LUMI templates run without a cluster.

tests/test_jobs.py (stub_bin) copies it to a bin directory on PATH as `srun`. It records each
call in $FAKE_LOG/srun (argv as JSON, the MASTER_ADDR and OUTPUT_DIR it inherited, and the
SINGULARITYENV_ variables). A host-side step (mkdir, tar, rm) runs once, here;
jobs/lib/stage-node runs once per node (nid001, nid002); a container step does not run. The
training step (the one that starts /runscripts/run*.sh) waits for USR1 when FAKE_SRUN_WAIT is
set, as a running step waits for Slurm's time-limit warning: it touches $FAKE_LOG/step-started,
and appends what it got to $FAKE_LOG/step-signals.
"""

import json
import os
import signal
import subprocess
import sys
import time

log = os.environ["FAKE_LOG"]
with open(os.path.join(log, "srun"), "a") as out:
    record = {"argv": sys.argv[1:], "MASTER_ADDR": os.environ.get("MASTER_ADDR"),
              "OUTPUT_DIR": os.environ.get("OUTPUT_DIR"),
              **{k: v for k, v in os.environ.items() if k.startswith("SINGULARITYENV_")}}
    out.write(json.dumps(record) + "\n")
command = [a for a in sys.argv[1:] if not a.startswith("-")]
if command and command[0].endswith("/stage-node"):  # jobs/lib/stage: once per node
    for node in ("nid001", "nid002"):
        subprocess.run(command, env={**os.environ, "SLURMD_NODENAME": node})
    sys.exit(0)
if command and command[0] != "singularity":
    sys.exit(subprocess.run(sys.argv[1 + sys.argv[1:].index(command[0]):]).returncode)
if os.environ.get("FAKE_SRUN_WAIT") and any("/runscripts/run" in a for a in sys.argv):
    got = []
    signal.signal(signal.SIGUSR1, lambda *_: got.append("USR1"))
    open(os.path.join(log, "step-started"), "w").close()
    deadline = time.monotonic() + 60
    while not got and time.monotonic() < deadline:
        time.sleep(0.05)
    with open(os.path.join(log, "step-signals"), "a") as out:
        out.write("".join(got) + "\n")

"""One launch of the training (a Slurm step) on the batch host: its line, output, signals and
hang watch.

The launch's output goes to the job's output as it comes and, copied, to its log; the stop
signals the batch shell writes down (jobs/lib/supervise.sh) or this process receives are passed
on to it; a watch for a hang (jobs/lib/hangs.py) reads the flight records the ranks leave in the
launch's own directory, XSCALE_FR_DIR; rank 0 notes its progress in XSCALE_PROGRESS
(python/xscale/shared/contract.py names both). Standard library only, Python 3.6 and later.
"""

import os
import signal
import subprocess
import sys
import threading
import time

import failure_report
import hangs
from shared import contract, say, taglines

STOP_SIGNALS = {signal.SIGUSR1: "USR1", signal.SIGTERM: "TERM"}
COPY_DRAIN_S = 5  # how long the launch's output may trail its end (a process it left behind)


def record_stop(stop_file, name):
    if stop_file:
        with open(stop_file, "a") as handle:
            handle.write(name + "\n")


def stop_signals(stop_file):
    """The stop signals the batch shell received so far, oldest first."""
    try:
        with open(stop_file) as handle:
            return handle.read().split()
    except (OSError, TypeError):
        return []


class SupervisedLaunch:
    """LINE (a LaunchLine: jobs/lib/launch_line.py) run and logged to LOG, with ENV added to its
    environment and PLACEMENT (rank -> node) for its hang watch."""

    def __init__(self, line, log, stop_file, env, placement):
        self.line, self.log, self.stop_file = line, log, stop_file
        self.env, self.placement = env, placement
        self.proc = None
        self.on_start = None  # called with the launch's process once it runs
        self.on_srun_line = None  # called with each line srun itself prints ("srun: ...")
        self.forwarded = set()
        self.fr_dir = contract.launch_file(log, contract.FLIGHT_RECORDS)

    def execute(self):
        """Start the launch, pass the stop signals on, wait for its end; its exit status."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, self.on_stop)
        came = stop_signals(self.stop_file)
        if came:
            say("not starting the launch: SIG%s came before it" % came[-1])
            return 143 if came[-1] == "TERM" else 0
        env = self.environment()
        os.makedirs(self.fr_dir, exist_ok=True)
        with open(self.log, "ab") as log:
            try:
                argv = self.line.argv()
                self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                             stderr=subprocess.STDOUT)
            except OSError as error:
                say("cannot start the launch: %s: %s" % (argv[0], error.strerror))
                return 127
            if self.on_start is not None:
                self.on_start(self.proc)
            copier = threading.Thread(target=copy_output,
                                      args=(self.proc.stdout, log, self.on_srun_line),
                                      daemon=True)
            copier.start()
            # A signal the batch shell got while this program started found no launch to pass
            # it on to.
            for name in sorted(set(stop_signals(self.stop_file))):
                self.forward(getattr(signal, "SIG" + name))
            watch = hangs.HangWatch(self.fr_dir, self.placement, self.line,
                                    contract.launch_file(self.log, contract.STACK))
            watch.start()
            status = self.proc.wait()
            watch.stop()
            remove_if_empty(self.fr_dir)
            # The output ends with the launch, unless a process it left behind holds the pipe:
            # then the log may miss that process's lines, not the launch's.
            copier.join(COPY_DRAIN_S)
        return 128 - status if status < 0 else status

    def environment(self):
        """The launch's environment: the batch script's, ENV, and what the ranks are told of
        the launch. The launch time is for the trainers' start-up phases (docs/STARTUP.md), in
        bash's EPOCHREALTIME form; only this launch's environment holds it, so an srun typed
        later by hand reports its launch as unknown rather than this launch's."""
        env = dict(os.environ, **self.env)
        env.update({contract.LAUNCH_TIME_VAR: "%.6f" % time.time(),
                    contract.FR_DIR_VAR: self.fr_dir,
                    contract.PROGRESS_VAR: contract.launch_file(self.log, contract.PROGRESS)})
        return env

    def on_stop(self, signum, frame):
        """A stop signal from the batch shell, or from Slurm directly (scancel signals every
        process of the batch step): recorded as the batch shell records its own, and passed on."""
        record_stop(self.stop_file, STOP_SIGNALS[signum])
        if self.proc is not None:
            self.forward(signum)

    def forward(self, signum):
        """Each stop signal is passed on once: the trainers take it as a flag, and it may come
        twice (from the batch shell, and from scancel to every process of the batch step)."""
        if signum not in self.forwarded and self.proc.poll() is None:
            self.forwarded.add(signum)
            say("SIG%s received: the ranks save a checkpoint after their current step and exit"
                % STOP_SIGNALS[signum])
            self.proc.send_signal(signum)


def remove_if_empty(directory):
    try:
        os.rmdir(directory)
    except OSError:
        pass  # it holds the flight records of a failed launch


def copy_output(pipe, log, on_srun_line=None, first_rank=0):
    """PIPE's output to the job's and to LOG as it comes; srun's own lines, whole, to
    ON_SRUN_LINE (a str), when given. FIRST_RANK: the launch's rank of the step's task 0 (a
    replacement's step, whose tasks srun numbers from 0): its lines go on whole, in the
    launch's numbers (with_launch_ranks)."""
    out = sys.stdout.buffer
    pending = b""
    unshifted = b""  # with FIRST_RANK: the last line, not yet whole
    for chunk in iter(lambda: os.read(pipe.fileno(), 1 << 16), b""):
        if first_rank:
            whole, newline, unshifted = (unshifted + chunk).rpartition(b"\n")
            chunk = b"".join(with_launch_ranks(line, first_rank) + b"\n"
                             for line in whole.split(b"\n")) if newline else b""
        _write(out, log, chunk)
        if on_srun_line is not None:
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                if line.startswith(b"srun: "):
                    on_srun_line(line.decode(errors="replace"))
    if unshifted:
        _write(out, log, with_launch_ranks(unshifted, first_rank))


def _write(out, log, data):
    out.write(data)
    out.flush()
    log.write(data)
    log.flush()


def with_launch_ranks(line, first_rank):
    """LINE of a step whose task 0 is the launch's FIRST_RANK (a replacement: the ranks of a
    node on a spare, or one rank started again), with srun's task numbers, in its label or in
    its own line of a task's end, as the launch's ranks. The job's output and the failure
    report then know a rank, and the node a line blames, by one number, whichever step ran
    it. The bytes are kept as they are (surrogateescape: a line srun cut in a character)."""
    text = line.decode("utf-8", "surrogateescape")
    for pattern, numbers in ((taglines.SRUN_LABEL, 1), (failure_report.TASK_EXIT, "ranks")):
        found = pattern.match(text)
        if found:
            text = (text[:found.start(numbers)] + _shifted(found.group(numbers), first_rank)
                    + text[found.end(numbers):])
            break
    return text.encode("utf-8", "surrogateescape")


def _shifted(tasks, by):
    """srun's task list ("0-1", "0,2") with every number raised BY."""
    return ",".join("-".join(str(int(number) + by) for number in part.split("-"))
                    for part in tasks.split(","))

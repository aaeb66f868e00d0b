#!/usr/bin/env python3
"""The supervisor: what happens to a Slurm batch job's training launches, on the batch host.

Words (docs/ARCHITECTURE.md): a *launch* is one srun of the training, a Slurm job step; an
*attempt* is one run of the job between requeues (SLURM_RESTART_COUNT); a *step* is the
training's optimizer step only.

A job script sources jobs/lib/supervise.sh (the site preludes do) and launches its training in one
line (xs_local_train, xs_lumi_train: requeueable_launch); supervise.sh holds the signals the batch
shell receives and calls this program for everything else:

    supervisor.py --stop-file F check            settings and records directory, before a launch
    supervisor.py --stop-file F launch [PARTS] -- CMD...   the launch: its log, signals, status
    supervisor.py --stop-file F judge            after it: requeue at the time limit, or report
                                                 the failure, blame nodes and retry without them
    supervisor.py --stop-file F retry-without NODES|@FILE WHY   that retry, for another reason
    supervisor.py --stop-file F finish           as the batch script exits: the requeue decided

F is where supervise.sh writes each stop signal the batch shell got (USR1: Slurm's time-limit
warning, `#SBATCH --signal=B:USR1@300`; TERM: scancel or preemption) before passing it on: the
batch shell alone is signalled, and it is the one that knows, when `judge` runs, every signal that
came before the launch ended. docs/FAILURES.md tells the whole story; docs/ARCHITECTURE.md which
file owns what.

Runs on the batch host's system Python (3.6 on LUMI and Aurora): standard library only, nothing
newer than 3.6. User errors (a bad setting, a pattern file that does not parse, a records
directory that cannot be written) are one line, `xscale: error: ...`, and status 2.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

import coordinator
import failure_report
import goodput
import hangs
from allocation import Allocation, AllocationError
from attempt import Attempt
from launch_line import LaunchLine
from launches import SupervisedLaunch, stop_signals
from shared import contract, hostlist, output_of, say
from shared import settings as xscale_settings

UserError = xscale_settings.UserError  # a setting or input the user can fix: one line and status 2


# ---- settings -----------------------------------------------------------------------------------

class Settings:
    """What the job asked for, parsed and checked once from the environment by xscale's table of
    settings (docs/SETTINGS.md), before the first launch: a typo is one line and exit 2, not a
    surprise after an hour of training."""

    def __init__(self, env):
        self.env = env
        self.max_requeues = xscale_settings.value("XSCALE_MAX_REQUEUES", env)
        self.max_retries = xscale_settings.value("XSCALE_MAX_RETRIES", env)
        self.retry = xscale_settings.value("XSCALE_RETRY", env)  # requeue without blamed nodes
        self.blame_files = blame_files(xscale_settings.value("XSCALE_BLAME", env))
        try:
            self.patterns = failure_report.load_patterns(self.blame_files)
        except failure_report.PatternError as error:
            raise UserError(str(error)) from None
        self.spares = xscale_settings.value("XSCALE_SPARES", env)
        self.max_restarts = xscale_settings.value("XSCALE_MAX_RESTARTS", env)
        self.live_recovery = xscale_settings.value("XSCALE_LIVE_RECOVERY", env)
        self.max_rank_restarts = xscale_settings.value("XSCALE_MAX_RANK_RESTARTS", env)
        self.heartbeat_s = xscale_settings.value("XSCALE_HEARTBEAT_S", env)
        self.min_nodes = xscale_settings.value("XSCALE_MIN_NODES", env)
        self.grow_back = xscale_settings.value("XSCALE_GROW_BACK", env)
        self.job = requeue_id(env)
        self.attempt = int(env.get("SLURM_RESTART_COUNT") or 0)  # Slurm counts the requeues
        self.records_dir = xscale_settings.value("XSCALE_RECORDS_DIR", env) or os.path.join(
            env.get("SLURM_SUBMIT_DIR") or os.getcwd(), "xscale-records", self.job)


def blame_files(words):
    """The pattern files XSCALE_BLAME names: a word with a '/' is a path, any other is
    jobs/lib/blame/WORD.patterns."""
    here = os.path.dirname(os.path.abspath(__file__))
    return [word if "/" in word else os.path.join(here, "blame", word + ".patterns")
            for word in words.split()]


def requeue_id(env):
    """The job to requeue: an array task by its own id (ARRAY_TASK), not the whole array's."""
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return "%s_%s" % (env["SLURM_ARRAY_JOB_ID"], env["SLURM_ARRAY_TASK_ID"])
    return env.get("SLURM_JOB_ID", "")


# ---- the records: what this attempt of the job did, kept in XSCALE_RECORDS_DIR -----------------

class JobRecords:
    """XSCALE_RECORDS_DIR: the same directory in every attempt of the job (a requeue keeps the job
    id), so that an attempt knows how often the job was retried. Per attempt A: the log
    of each launch L, attemptA-launchL.log, and attemptA.json, its launches and the requeue
    decided (jobs/lib/attempt.py)."""

    def __init__(self, settings, create=True):
        self.dir = settings.records_dir
        self.attempt = settings.attempt
        if create:
            try:
                os.makedirs(self.dir, exist_ok=True)
            except OSError:
                pass
            if not (os.path.isdir(self.dir) and os.access(self.dir, os.W_OK)):
                raise UserError("XSCALE_RECORDS_DIR %s cannot be created or written" % self.dir)

    def path(self, name):
        return os.path.join(self.dir, name)

    def attempt_path(self, attempt=None):
        return self.path("attempt%d.json" % (self.attempt if attempt is None else attempt))

    def load(self, attempt=None):
        """Attempt ATTEMPT of the job (this one by default); a new one starts with the time the
        job started on its nodes."""
        try:
            with open(self.attempt_path(attempt)) as handle:
                return Attempt.loaded(json.load(handle))
        except (OSError, ValueError, KeyError, TypeError):
            return Attempt.fresh(job_start_time())

    def attempts(self):
        """The job's attempts so far, in order, as saved (what the goodput ledger reads)."""
        return [self.load(attempt).saved() for attempt in range(self.attempt + 1)
                if os.path.exists(self.attempt_path(attempt))]

    def save(self, attempt):
        partial = self.attempt_path() + ".new"
        with open(partial, "w") as handle:
            json.dump(attempt.saved(), handle, indent=1)
        os.replace(partial, self.attempt_path())

    def next_launch_log(self, attempt):
        return self.path("attempt%d-launch%d.log" % (self.attempt, len(attempt.launches) + 1))

    def retries(self):
        """Retries made so far, in every attempt: one line each in the history."""
        try:
            with open(self.path("retries")) as handle:
                return sum(1 for line in handle if line.strip())
        except OSError:
            return 0

    def last_hang_nodes(self):
        """The nodes of the ranks that hung in the job's attempt before this one (the history's
        last line, one JSON object a hang)."""
        try:
            with open(self.path("hangs")) as handle:
                lines = [line for line in handle if line.strip()]
            return json.loads(lines[-1])["nodes"] if lines else []
        except (OSError, ValueError, KeyError):
            return []

    def add_hang(self, hang, placement):
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "attempt": self.attempt,
                 "ranks": hang.culprits, "collective": hang.what(),
                 "nodes": sorted({placement.get(rank, "?") for rank in hang.culprits})}
        with open(self.path("hangs"), "a") as handle:
            handle.write(json.dumps(entry) + "\n")

    def add_retry(self, nodes, why):
        with open(self.path("retries"), "a") as handle:
            handle.write("%s attempt %d: excluded %s after %s\n"
                         % (time.strftime("%Y-%m-%dT%H:%M:%S"), self.attempt, nodes, why))


def job_start_time():
    """When this attempt of the job started on its nodes: when the batch shell that calls this
    program started (Slurm starts it with the allocation); now, where /proc does not say."""
    try:
        with open("/proc/%d/stat" % os.getppid()) as handle:
            ticks = int(handle.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as handle:
            booted = next(int(line.split()[1]) for line in handle if line.startswith("btime "))
        return booted + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


# ---- launch: the training, and its restarts inside the allocation ------------------------------

def command_launch(settings, stop_file, line):
    """Run the launch on the allocation's launch nodes. When it fails, report it; when the report
    blames nodes and enough healthy ones are left (spares, XSCALE_SPARES), relaunch it at once
    without them, at most XSCALE_MAX_RESTARTS times, the trainer resuming from its checkpoint;
    else requeue the job without them when the script exits, if asked (XSCALE_RETRY=1)."""
    job_records = JobRecords(settings)
    attempt = job_records.load()
    allocation = Allocation.from_env(settings.env, settings.spares, attempt.excluded)
    while True:
        placed = allocation.placed(line)
        launch = attempt.launch(job_records.next_launch_log(attempt),
                                allocation.layout(settings.env)[0])
        job_records.save(attempt)
        live = live_launch(settings, allocation, placed, launch.log)
        env = allocation.environment()
        if live is not None:
            placed = live.launch_line(placed)
            env.update(live.environment())
        supervised = SupervisedLaunch(placed, launch.log, stop_file, env,
                                      allocation.placement(settings.env))
        if live is not None:
            live.launch_env = supervised.environment()
            live.start()
            supervised.on_start = live.started
            supervised.on_srun_line = live.srun_said
        status = supervised.execute()
        if live is not None:
            status = live.end(status)
            launch.recoveries = live.coordinator.saved()
            attempt.excluded = sorted(allocation.excluded)
        launch.ended_with(status)
        job_records.save(attempt)
        if launch.status == 0 or stop_signals(stop_file) or supervised.proc is None:
            break  # done; stopped (TERM means stop, a warning leaves no time); never started
        if training_finished(launch.log):
            report_failure_after_training(settings, job_records, launch, allocation)
            break  # the training is done: nothing to restart, nothing to requeue
        lost_live = live.coordinator.unrecovered if live is not None else ()
        blamed = report_failure(settings, job_records, launch, allocation, lost_live)
        if not blamed:
            break  # a bug in the trainer must not loop
        if not restart(settings, attempt, allocation, blamed):
            retry_without(settings, job_records, attempt,
                          hostlist.compress(allocation.excluded), "the failure above")
            break
        job_records.save(attempt)
    job_records.save(attempt)
    return launch.status


def live_launch(settings, allocation, line, log):
    """Live recovery for this launch (jobs/lib/coordinator.py), when there is something to
    recover with (spares, or rank restarts) and a launch line the supervisor builds (a
    replacement runs its line on a spare, a rank started again on its node)."""
    if not ((settings.spares or settings.max_rank_restarts) and settings.live_recovery
            and line.built and allocation.per_node and len(allocation.launch_nodes) > 1):
        return None
    grow_job = settings.env.get("SLURM_JOB_ID") if settings.grow_back else None
    return coordinator.LiveLaunch(allocation, line, log, settings.heartbeat_s,
                                  settings.max_rank_restarts, settings.patterns,
                                  min_nodes(settings, allocation), grow_job)


def min_nodes(settings, allocation):
    """The fewest nodes a smaller world may train on (XSCALE_MIN_NODES; by default half the
    nodes the launch trains on, the spares left out); a floor above those nodes is a mistake."""
    nodes = allocation.needed
    if settings.min_nodes is None:
        return max(nodes // 2, 1)
    if settings.min_nodes > nodes and allocation.nodes:
        raise UserError("XSCALE_MIN_NODES=%d is more than the %d nodes the launch trains on "
                        "(XSCALE_SPARES=%d of the job's %d wait)" % (
                            settings.min_nodes, nodes, settings.spares, len(allocation.nodes)))
    return settings.min_nodes


def restart(settings, attempt, allocation, blamed):
    """Leave BLAMED out and say so; whether the launch can run again in this allocation."""
    done = attempt.restarts
    if done >= settings.max_restarts or not allocation.without(blamed):
        allocation.excluded |= set(blamed)
        return False
    attempt.restarting(allocation.excluded)
    say("restart %d of %d: relaunching on %s without %s"
        % (done + 1, settings.max_restarts, hostlist.compress(allocation.launch_nodes),
           hostlist.compress(blamed)))
    return True


# ---- judge: what the launch's end means ---------------------------------------------------------

def command_judge(settings, stop_file):
    """After a clean stop on USR1 the job is requeued when the script exits (so that any clean-up
    after the launch still runs), unless the launch had finished its training: the warning came as
    it ended. A stop on TERM is not requeued: scancel means stop, and Slurm requeues preempted
    jobs itself. A failure was reported as it happened (command_launch). Its status is the last
    step's."""
    job_records = JobRecords(settings)
    attempt = job_records.load()
    launch = attempt.last
    came = stop_signals(stop_file)
    if launch is None or launch.status is None:
        say("error: the launch's supervisor ended without its status (was it killed?)")
        return 1
    if launch.status != 0 and training_finished(launch.log):
        return 0  # the training's status: what failed after it was reported (command_launch)
    if came and came[-1] == "USR1" and launch.status == 0:
        if training_finished(launch.log):
            say("the launch had finished its training when SIGUSR1 came: no requeue")
        else:
            attempt.requeue_for("the time limit")
    elif launch.status != 0 and came and came[-1] != "TERM" and not launch.reported:
        # A failure as the warning came: reported, and requeued without what it blames, but
        # not restarted (no time is left for that).
        allocation = Allocation.from_env(settings.env, settings.spares, attempt.excluded)
        blamed = report_failure(settings, job_records, launch, allocation)
        if blamed:
            retry_without(settings, job_records, attempt, hostlist.compress(blamed),
                          "the failure above")
    job_records.save(attempt)
    return launch.status


def training_finished(log):
    """A launch that ran its training to the end says so in rank 0's progress notes (its `end`
    event, not stopped: xscale.shared.contract); one without notes is taken as stopped."""
    return contract.training_finished(progress_of(log))


def report_failure_after_training(settings, job_records, launch, allocation):
    """A launch that failed after its training finished (rank 0's `end` note): its first line
    says so, then the usual report of what srun saw. Its checkpoint of the last step is on disk,
    and no node is blamed, restarted or requeued for the training's sake: the job ends with the
    training's status, 0 (docs/FAILURES.md, "A finished training is not a failed job")."""
    end = contract.first(progress_of(launch.log), contract.END)
    say("the training finished at step %s; the launch failed after it (exit status %d), in "
        "what follows the training (an evaluation, the summary): the job ends with the "
        "training's status, 0; submitting it again resumes at that step and runs only what "
        "follows" % (end.get("step"), launch.status))
    report_failure(settings, job_records, launch, allocation)


def progress_of(log):
    """The progress notes of the launch logged to LOG."""
    return contract.read_progress(contract.launch_file(log, contract.PROGRESS))


def report_failure(settings, job_records, launch, allocation, lost_live=()):
    """Print the report of a failed launch; the nodes it blames (LOST_LIVE among them: those a
    live recovery that fell back had taken out of the launch)."""
    launch.failed([])
    say("the launch failed with exit status %d; what srun saw:" % launch.status)
    env = settings.env
    nodes, per_node = allocation.layout(env)
    states = node_states(env.get("SLURM_JOB_NODELIST", ""))
    with open(contract.launch_file(launch.log, contract.NODE_STATES), "w") as handle:
        handle.write(states)
    placement = allocation.placement(env)
    hang = hangs.read_hang(contract.launch_file(launch.log, contract.FLIGHT_RECORDS), placement,
                           contract.launch_file(launch.log, contract.STACK))
    try:
        lines, blamed = failure_report.report(launch.log, nodes, per_node, states,
                                              settings.patterns, hang,
                                              job_records.last_hang_nodes(), placement,
                                              lost_live)
    except (OSError, hostlist.HostlistError) as error:
        say("error: no report: %s" % " ".join(str(error).split()))
        return []
    for line in lines:
        say(line)
    if hang is not None:
        job_records.add_hang(hang, placement)
    launch.failed(blamed)
    return blamed


def node_states(nodes):
    """Nodes Slurm lost or set down while the launch ran (with --no-kill the job outlives them)."""
    if not nodes:
        return ""
    try:
        proc = subprocess.run(["sinfo", "--noheader", "--Node", "--nodes=" + nodes,
                               "--format=%N %T"], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, universal_newlines=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ""
    return proc.stdout if proc.returncode == 0 else ""


def retry_without(settings, job_records, attempt, nodes, why):
    """Requeue the job without NODES (a Slurm hostlist) when the script exits, if XSCALE_RETRY=1
    and fewer than XSCALE_MAX_RETRIES retries were made. A failure that blames no node never
    comes here: a bug in the trainer must not loop."""
    if not settings.retry:
        say("to run again without %s: sbatch --exclude=%s ... (XSCALE_RETRY=1 does it)"
            % (nodes, nodes))
        return
    done = job_records.retries()
    if done >= settings.max_retries:
        say("not retrying job %s without %s: %d retries already (XSCALE_MAX_RETRIES=%d)"
            % (settings.job, nodes, done, settings.max_retries))
        return
    job_records.add_retry(nodes, why)
    say("retry %d of %d: requeueing job %s without %s when this script ends"
        % (done + 1, settings.max_retries, settings.job, nodes))
    attempt.requeue_for(why, exclude=nodes)


def command_retry_without(settings, nodes, why):
    """NODES: a hostlist, or @FILE for the one in FILE (the doctor's `exclude`, the stager's
    --exclude-file), where "none", an empty or a missing file names no node."""
    if nodes.startswith("@"):
        nodes = listed_nodes(nodes[1:])
    if not nodes:
        return 0
    job_records = JobRecords(settings)
    attempt = job_records.load()
    retry_without(settings, job_records, attempt, nodes, why)
    job_records.save(attempt)
    return 0


def listed_nodes(path):
    try:
        with open(path) as handle:
            first = handle.readline().strip()
    except OSError:
        return ""
    return "" if first == "none" else first


# ---- finish: the requeue, as the batch script exits ------------------------------------------

def command_finish(settings):
    """Requeue as decided. Requeueing signals every process of the job, this one and scontrol
    included, and kills them after KillWait: TERM is ignored from here on (supervise.sh ignores it
    too, and scontrol inherits that)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if not os.path.isdir(settings.records_dir):
        return 0
    job_records = JobRecords(settings, create=False)
    attempt = job_records.load()
    if attempt.launches:
        attempt.done()
        job_records.save(attempt)
        report_goodput(job_records)
    decided = attempt.requeue
    if decided and decided.get("exclude"):
        requeue_without(settings.job, decided["exclude"])
    elif decided:
        requeue_at_time_limit(settings)
    return 0


def report_goodput(job_records):
    """The job's goodput so far, across its attempts: one line, the same as XSCALE_GOODPUT {json}
    for xscale.observe.report, and XSCALE_RECORDS_DIR/goodput.json (jobs/lib/goodput.py). Without
    the trainer's progress notes, what the supervisor saw, and where the rest comes from."""
    attempts = job_records.attempts()
    progress = {launch["log"]: progress_of(launch["log"])
                for attempt in attempts for launch in attempt.get("launches", [])}
    if any(progress.values()):
        book = goodput.ledger(attempts, lambda launch: progress.get(launch["log"], []))
        book["text"] = goodput.line(book)
    else:
        book = goodput.launches_only(attempts)
    book["records"] = goodput.write(job_records.dir, book)
    say("goodput: " + book["text"])
    print("XSCALE_GOODPUT " + json.dumps(book), flush=True)
    if book["goodput"] is None:
        say("goodput: its split into training, start-up, checkpoints and lost work needs rank 0's "
            "progress notes in $XSCALE_PROGRESS: docs/FAILURES.md, \"A script of your own\"")


def requeue_at_time_limit(settings):
    """A --time shorter than the --signal warning plus a minute gets the warning as the job
    starts: each run would stop at once and requeue itself again, so requeueing stops after
    XSCALE_MAX_REQUEUES attempts (Slurm counts them in SLURM_RESTART_COUNT)."""
    if settings.attempt >= settings.max_requeues:
        say("stopped before the time limit, not requeueing: job %s was requeued %d times already "
            "(XSCALE_MAX_REQUEUES=%d); is --time longer than the --signal warning?"
            % (settings.job, settings.attempt, settings.max_requeues))
        return
    say("stopped before the time limit; requeueing job %s to resume" % settings.job)
    scontrol("requeue", settings.job)


def requeue_without(job, nodes):
    """Slurm changes ExcNodeList only while a job is pending ("Job is no longer pending
    execution"), so the job is requeued first, then updated: Slurm holds a requeued job back
    (BeginTime) for longer than the update takes. Not `requeuehold` then `release`: an update
    that waits for the failed launch to end can outlast KillWait (seen on the test bed, KillWait=5),
    and a job whose `release` never ran would stay held for good, while one whose update was lost
    only runs again on the nodes Slurm still allows. Nodes excluded by earlier retries stay
    excluded."""
    shown = scontrol("show", "job", job)
    found = re.search(r"ExcNodeList=(\S+)", shown or "")
    excluded = found.group(1) if found and found.group(1) != "(null)" else ""
    if scontrol("requeue", job) is not None:
        scontrol("update", "JobId=" + job, "ExcNodeList=" + (excluded + "," if excluded else "")
                 + nodes)


def scontrol(*args):
    """scontrol's output, or None when it failed (it said why on stderr)."""
    return output_of(["scontrol"] + list(args))


def launch_line(args):
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.entrypoint is None:
        return LaunchLine.whole(command)
    return LaunchLine(command, args.srun_option, args.image, args.bind, args.entrypoint,
                      args.runtime)


# ---- command line ----------------------------------------------------------------------------

def main(argv=None):
    parser = argparse.ArgumentParser(prog="supervisor.py", description=__doc__.splitlines()[0])
    parser.add_argument("--stop-file", help="the stop signals the batch shell received")
    verbs = parser.add_subparsers(dest="verb")
    verbs.add_parser("check")
    launch = verbs.add_parser("launch", help="the launch line's parts (jobs/lib/launch_line.py), "
                              "or a command given whole")
    launch.add_argument("--srun-option", action="append", default=[], metavar="OPTION",
                     help="an option of srun's, as --srun-option=--label")
    launch.add_argument("--image", help="the container image the entrypoint runs in")
    launch.add_argument("--bind", help="its -B list")
    launch.add_argument("--runtime", default="singularity", help="singularity or apptainer")
    launch.add_argument("--entrypoint", help="runscripts/run.sh's path in the image")
    launch.add_argument("command", nargs=argparse.REMAINDER)
    verbs.add_parser("judge")
    retry = verbs.add_parser("retry-without")
    retry.add_argument("nodes")
    retry.add_argument("why")
    verbs.add_parser("finish")
    args = parser.parse_args(argv)
    try:
        settings = Settings(os.environ)
        if args.verb == "check":
            JobRecords(settings)
            min_nodes(settings, Allocation.from_env(settings.env, settings.spares))
            return 0
        if args.verb == "launch":
            return command_launch(settings, args.stop_file, launch_line(args))
        if args.verb == "judge":
            return command_judge(settings, args.stop_file)
        if args.verb == "retry-without":
            return command_retry_without(settings, args.nodes, args.why)
        if args.verb == "finish":
            return command_finish(settings)
        parser.error("no verb given")
    except (UserError, AllocationError) as error:
        say("error: " + str(error))
        return 2


if __name__ == "__main__":
    sys.exit(main())

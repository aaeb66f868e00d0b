"""Growing a smaller world back (docs/FAILURES.md, "Growing back"): nodes asked of the queue.

Slurm takes a node that went down out of a running job, and adds none to a job with GPUs (its
job expansion refuses allocated GRES). So when live recovery goes on without a node and no spare
is left (a smaller world, jobs/lib/coordinator.py), the supervisor asks the queue for a node in
its place: a job of one whole node (named NAME_PREFIX and the job's id) with the job's partition,
account, QOS, reservation, constraint and GPUs, for the time the job has left, which only holds
its node. Once it runs, the lost node's ranks start in it as a step of that job
(`srun --jobid`), and the coordinator takes them back into the training. The node jobs end with
the launch.

Standard library only, Python 3.6: the batch host's system Python.
"""

import re
import threading
import time

from shared import output_of, say

NAME_PREFIX = "xscale-grow-"
POLL_S = 3.0  # how often the queue is asked whether a node job runs
HOLD = "exec sleep 2147483647"  # what a node job runs: its ranks come as steps
COPIED = (("Partition", "--partition"), ("Account", "--account"), ("QOS", "--qos"),
          ("Reservation", "--reservation"), ("Features", "--constraint"))
UNSET = ("", "(null)", "None")


def job_fields(record):
    """The KEY=VALUE fields of `scontrol show job -o`'s line (each value up to a space)."""
    return dict(word.partition("=")[::2] for word in record.split() if "=" in word)


def node_job_options(fields, now):
    """sbatch's options for a node job that stands in for one of the job whose FIELDS these are
    (job_fields), at NOW: its partition, account, QOS, reservation, constraint, its GPUs per node
    (TresPerNode: gres:gpu:8 or gres/gpu:8) and the minutes it has left."""
    options = ["%s=%s" % (option, fields[key]) for key, option in COPIED
               if fields.get(key, "") not in UNSET]
    gres = fields.get("TresPerNode", "")
    if gres not in UNSET:
        options.append("--gres=" + ",".join(re.sub(r"^gres[:/]", "", item)
                                             for item in gres.split(",")))
    try:
        ends = time.mktime(time.strptime(fields.get("EndTime", ""), "%Y-%m-%dT%H:%M:%S"))
        options.append("--time=%d" % max((ends - now) // 60, 1))
    except ValueError:
        pass  # no end (no time limit): the partition's default
    return options


class NodeJobs:
    """The node jobs one launch asked the queue for, each for the launch's node at an index."""

    def __init__(self, job_id):
        self.job_id = job_id
        self.asked = {}  # job id -> the launch's node index it is for, until it is taken
        self.held = []  # every node job submitted: all are cancelled at the launch's end
        self.lock = threading.Lock()

    def ask(self, index, lost):
        """Submit a node job for the launch's node INDEX, which LOST was."""
        record = output_of(["scontrol", "show", "job", "-o", self.job_id]) or ""
        argv = (["sbatch", "--parsable", "--nodes=1", "--exclusive", "--no-requeue",
                 "--job-name=" + NAME_PREFIX + self.job_id, "--output=/dev/null"]
                + node_job_options(job_fields(record), time.time()) + ["--wrap=" + HOLD])
        submitted = output_of(argv)
        if not submitted:
            say("live recovery: the queue took no job for a node in place of %s: the world "
                "stays smaller" % lost)
            return
        job = submitted.strip().split(";")[0]
        with self.lock:
            self.asked[job] = index
            self.held.append(job)
        say("live recovery: job %s asks the queue for a node in place of %s" % (job, lost))

    def running(self):
        """[(job, index, node)] for each node job that runs and is not taken yet; those gone
        from the queue (ended, cancelled) are forgotten."""
        with self.lock:
            jobs = sorted(self.asked)
        if not jobs:
            return []
        listed = output_of(["squeue", "--noheader", "--jobs=" + ",".join(jobs),
                      "--format=%i %T %N"])
        if listed is None:
            return []  # slurmctld busy, or every job gone: asked again at the next poll
        states = {}
        for line in listed.splitlines():
            words = line.split()
            if len(words) >= 2:
                states[words[0]] = words[1:]
        with self.lock:
            for job in jobs:
                if job not in states:
                    self.asked.pop(job, None)
            return [(job, self.asked[job], states[job][1]) for job in jobs
                    if job in self.asked and states[job][0] == "RUNNING"
                    and len(states[job]) > 1]

    def taken(self, job):
        """JOB's node is the training's now: no longer asked for."""
        with self.lock:
            self.asked.pop(job, None)

    def cancel(self, jobs=None):
        """Cancel JOBS (default: every node job of the launch)."""
        with self.lock:
            jobs = list(self.held) if jobs is None else list(jobs)
            for job in jobs:
                self.asked.pop(job, None)
        if jobs:
            output_of(["scancel"] + jobs)

"""One attempt of a batch job, as the supervisor keeps it between its commands: the launches
of the training (Slurm steps) and what the supervisor decided. A requeue starts the job's next
attempt; Slurm counts them in SLURM_RESTART_COUNT, and each is XSCALE_RECORDS_DIR/attemptA.json.

The supervisor's commands (jobs/lib/supervisor.py) load the attempt, move it on by one of its
named transitions, and save it:

    Attempt.fresh(started)      the job's allocation started (a new attempt)
    attempt.launch(log, nodes)  a launch of the training starts: it is training
    launch.ended_with(status)   it ended; launch.failed(blamed): its failure was reported
    attempt.restarting(nodes)   relaunched in the same allocation without NODES
    attempt.requeue_for(why)    to be requeued (at the time limit, or without nodes) at the end
    attempt.done()              the batch script ends

The goodput ledger (jobs/lib/goodput.py) reads the saved form. Standard library only, Python 3.6.
"""

import time


class Launch:
    """One launch of the training on NODES, logged to LOG. status None: still running, or its
    supervisor was killed."""

    def __init__(self, log, nodes, launched, status=None, ended=None, reported=False,
                 blamed=None, recoveries=()):
        self.log, self.nodes, self.launched = log, nodes, launched
        self.status, self.ended = status, ended
        self.reported, self.blamed = reported, blamed
        self.recoveries = list(recoveries)  # live recoveries (jobs/lib/coordinator.py)

    def ended_with(self, status):
        self.status, self.ended = status, time.time()

    def failed(self, blamed):
        """Its failure was reported, blaming BLAMED (nodes; none: the training's own bug)."""
        self.reported, self.blamed = True, list(blamed)

    def saved(self):
        return dict(vars(self))

    @classmethod
    def loaded(cls, saved):
        return cls(**saved)


class Attempt:
    """The job's attempt: when it started and ended, its launches, the restarts within the
    allocation and the nodes they left out, and the requeue decided ({"why", "exclude"})."""

    def __init__(self, started, launches=(), requeue=None, restarts=0, excluded=(), ended=None):
        self.started, self.ended = started, ended
        self.launches = list(launches)
        self.requeue, self.restarts, self.excluded = requeue, restarts, sorted(excluded)

    @classmethod
    def fresh(cls, started):
        return cls(started)

    @property
    def last(self):
        """The latest launch, or None before the first."""
        return self.launches[-1] if self.launches else None

    def launch(self, log, nodes):
        launch = Launch(log, nodes, time.time())
        self.launches.append(launch)
        return launch

    def restarting(self, excluded):
        self.restarts += 1
        self.excluded = sorted(excluded)

    def requeue_for(self, why, exclude=None):
        self.requeue = {"why": why}
        if exclude:
            self.requeue["exclude"] = exclude

    def done(self):
        self.ended = time.time()

    def saved(self):
        return {"started": self.started, "ended": self.ended, "requeue": self.requeue,
                "restarts": self.restarts, "excluded": self.excluded,
                "launches": [launch.saved() for launch in self.launches]}

    @classmethod
    def loaded(cls, saved):
        return cls(saved["started"],
                   [Launch.loaded(launch) for launch in saved.get("launches", [])],
                   saved.get("requeue"), saved.get("restarts", 0), saved.get("excluded", []),
                   saved.get("ended"))

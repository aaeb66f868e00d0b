"""The training's launch line as data: what the supervisor runs, built from its parts.

A site prelude (jobs/lib/local.sh, lumi.sh) hands the supervisor the parts of its srun line, not
the line itself:

    supervisor.py launch --srun-option=--label --srun-option=--cpu-bind=none \
        --image IMAGE --bind BINDS --entrypoint /runscripts/run.sh -- python train.py ...

and every change the supervisor makes is made on those parts: the nodes and task count of a
launch moved to spare nodes (jobs/lib/allocation.py), and the line that reads a hung rank's
Python stack in the same image on its node (jobs/lib/hangs.py). A command given whole
(`requeueable_step CMD...`, a script's own line) runs as it is, and nothing is changed in it.

Standard library only, Python 3.6: the batch host's system Python.
"""

import os


class LaunchLine:
    """srun with OPTIONS, then ENTRYPOINT (run.sh) in IMAGE with BINDS (RUNTIME: singularity or
    apptainer), then COMMAND; or, with no entrypoint, COMMAND alone (given whole). PLACEMENT:
    srun's node options, set by on()."""

    def __init__(self, command, options=(), image=None, binds=None, entrypoint=None,
                 runtime="singularity", placement=()):
        self.command, self.options = list(command), list(options)
        self.image, self.binds, self.entrypoint = image, binds, entrypoint
        self.runtime, self.placement = runtime, list(placement)

    @classmethod
    def whole(cls, command):
        return cls(command)

    @property
    def built(self):
        """Whether the supervisor builds the line (and so may move it), rather than given it."""
        return self.entrypoint is not None

    def in_image(self, program):
        """PROGRAM (a list) run in the launch's image, as the entrypoint is."""
        if self.image is None:
            return list(program)
        binds = ["-B", self.binds] if self.binds else []
        return [self.runtime, "exec"] + binds + [self.image] + list(program)

    def argv(self):
        if not self.built:
            return list(self.command)
        return (["srun"] + self.placement + self.options
                + self.in_image([self.entrypoint] + self.command))

    def on(self, nodes, per_node, nodelist, overlap):
        """This line on NODES nodes (NODELIST, a Slurm hostlist) with PER_NODE tasks each;
        OVERLAP: sharing the nodes with a step Slurm has not completed (a restart)."""
        placement = ["--nodes=%d" % nodes, "--ntasks=%d" % (nodes * per_node),
                     "--nodelist=" + nodelist] + (["--overlap"] if overlap else [])
        return LaunchLine(self.command, self.options, self.image, self.binds, self.entrypoint,
                          self.runtime, placement)

    def in_job(self, job):
        """This line as a step of another job of the user's, JOB (a node it holds for the
        training, jobs/lib/grow_back.py), not of the job that runs it."""
        return LaunchLine(self.command, self.options, self.image, self.binds, self.entrypoint,
                          self.runtime, self.placement + ["--jobid=" + job])

    def one_rank(self, node, local_rank):
        """This line as one task on NODE, beside the launch (--overlap), in the place of its
        LOCAL_RANK: a --cpu-bind list of one entry per local rank keeps that rank's entry."""
        options = [one_rank_binding(option, local_rank) for option in self.options]
        placement = ["--nodes=1", "--ntasks=1", "--nodelist=" + node, "--overlap"]
        return LaunchLine(self.command, options, self.image, self.binds, self.entrypoint,
                          self.runtime, placement)

    def probe(self, node, program):
        """The line that runs PROGRAM once on NODE in the launch's image, beside its ranks
        (--overlap: their CPUs stay theirs); None for a line given whole."""
        if not self.built:
            return None
        return (["srun", "--overlap", "--nodelist=" + node, "--nodes=1", "--ntasks=1",
                 "--kill-on-bad-exit=0"] + self.in_image(program))

    @property
    def runscripts(self):
        """Where the entrypoint's directory is, in the image (rank_stack.py is in its lib/)."""
        return os.path.dirname(self.entrypoint) if self.built else None


LISTED_BINDINGS = ("mask_cpu:", "map_cpu:", "mask_ldom:", "map_ldom:")


def one_rank_binding(option, local_rank):
    """OPTION, where it is --cpu-bind=[FLAGS,]KIND:LIST with one entry per local rank, with
    LOCAL_RANK's entry alone (srun gives a lone task the list's first); else OPTION."""
    if not option.startswith("--cpu-bind="):
        return option
    value = option[len("--cpu-bind="):]
    for kind in LISTED_BINDINGS:
        flags, found, entries = value.partition(kind)
        if found and entries:
            entries = entries.split(",")
            return "--cpu-bind=%s%s%s" % (flags, kind, entries[local_rank % len(entries)])
    return option

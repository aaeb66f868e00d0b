"""Which nodes of the job's allocation the training step runs on.

With XSCALE_SPARES=S the job allocates its --nodes and the launch runs on all but the last S of
them; the spares wait. When a launch fails and its report blames nodes, the supervisor relaunches
the launch at once without them, on the nodes that are left, spares first in, as long as enough
are left for the same number of nodes (and so the same world size and global batch). The launch
line (jobs/lib/launch_line.py) gets the nodes and the task count, and the ranks their rendezvous
on the first of those nodes (MASTER_ADDR). A step whose nodes were never changed
runs exactly as the template wrote it.

Standard library only, Python 3.6 and later: the batch host's system Python.
"""

import re

from shared import hostlist


class AllocationError(Exception):
    """A setting that does not fit the allocation: one line and status 2."""


def tasks_per_node(env):
    """The job's tasks on each node: SLURM_NTASKS_PER_NODE, else SLURM_TASKS_PER_NODE when it is
    the same on every node ("2(x4)"); None when the nodes differ."""
    if (env.get("SLURM_NTASKS_PER_NODE") or "").isdigit():
        return int(env["SLURM_NTASKS_PER_NODE"])
    counts = set(re.findall(r"(\d+)(?:\(x\d+\))?", env.get("SLURM_TASKS_PER_NODE", "")))
    return int(counts.pop()) if len(counts) == 1 else None


class Allocation:
    """The job's nodes in Slurm's order, the tasks per node, and which nodes the launch uses."""

    def __init__(self, nodes, per_node, spares, excluded=()):
        self.nodes, self.per_node, self.spares = list(nodes), per_node, spares
        self.needed = len(self.nodes) - spares
        self.excluded = set(excluded)
        self.moved = bool(spares or self.excluded)
        healthy = [node for node in self.nodes if node not in self.excluded]
        self.launch_nodes = healthy[:self.needed]

    @classmethod
    def from_env(cls, env, spares, excluded=()):
        try:
            nodes = list(hostlist.expand(env.get("SLURM_JOB_NODELIST", "")))
        except hostlist.HostlistError:
            nodes = []
        per_node = tasks_per_node(env)
        if spares and (not nodes or spares >= len(nodes)):
            raise AllocationError("XSCALE_SPARES=%d must be smaller than the job's %d nodes"
                                  % (spares, len(nodes)))
        if spares and per_node is None:
            raise AllocationError("XSCALE_SPARES needs the same number of tasks on every node "
                                  "(#SBATCH --ntasks-per-node)")
        return cls(nodes, per_node, spares, excluded)

    def without(self, blamed):
        """Leave BLAMED out for the rest of the job; whether enough healthy nodes are left for
        the launch, which keeps its surviving nodes and takes spares in for the others."""
        self.excluded |= set(blamed)
        healthy = [node for node in self.nodes if node not in self.excluded]
        if len(healthy) < self.needed or self.per_node is None:
            return False
        kept = [node for node in self.launch_nodes if node not in self.excluded]
        spares = [node for node in healthy if node not in kept]
        chosen = set(kept + spares[:self.needed - len(kept)])
        self.launch_nodes = [node for node in self.nodes if node in chosen]
        self.moved = True
        return True

    def replace_live(self, node):
        """Live recovery: a spare takes NODE's place in the launch, at its position (its ranks
        keep their numbers); the spare, or None when none is left."""
        self.excluded.add(node)
        spares = self.spares_left()
        if not spares or node not in self.launch_nodes:
            return None
        self.launch_nodes[self.launch_nodes.index(node)] = spares[0]
        self.moved = True
        return spares[0]

    def spares_left(self):
        """The allocation's nodes that neither run the launch nor were excluded."""
        return [node for node in self.nodes
                if node not in self.excluded and node not in self.launch_nodes]

    def placed(self, line):
        """LINE (a LaunchLine) on the launch's nodes: unchanged until spares or a restart move
        the launch.

        A restart also shares the nodes with the failed step (--overlap): when its ranks on the
        healthy nodes ended before Slurm declared the dead node down, Slurm never completes that
        step, and a new step waits for its CPUs for good ("step creation temporarily disabled
        ... Requested nodes are busy"; seen on the test bed, and nebius/soperator#854)."""
        if not self.moved:
            return line
        if not line.built:
            raise AllocationError("XSCALE_SPARES and restarts move the training to other nodes: "
                                  "they need the launch line the site prelude builds "
                                  "(xs_local_train, xs_lumi_train), not a command given whole")
        return line.on(len(self.launch_nodes), self.per_node,
                       hostlist.compress(self.launch_nodes), overlap=bool(self.excluded))

    def environment(self):
        """The rendezvous on the launch's first node, when the launch moved."""
        return {"MASTER_ADDR": self.launch_nodes[0]} if self.moved and self.launch_nodes else {}

    def placement(self, env):
        """rank -> node for the launch (Slurm's block distribution)."""
        if not self.moved:
            try:
                nodes = list(hostlist.expand(env.get("SLURM_JOB_NODELIST", "")))
            except hostlist.HostlistError:
                return {}
            return hostlist.block_placement(nodes, env.get("SLURM_TASKS_PER_NODE", ""))
        return self.launch_placement()

    def launch_placement(self):
        """rank -> node over the launch nodes, PER_NODE ranks each (a spare that took a node's
        place live holds its ranks)."""
        return {rank: node for index, node in enumerate(self.launch_nodes)
                for rank in range(index * self.per_node, (index + 1) * self.per_node)}

    def layout(self, env):
        """(the launch's nodes as a hostlist, its tasks per node as SLURM_TASKS_PER_NODE writes
        it), for the failure report."""
        if not self.moved:
            return env.get("SLURM_JOB_NODELIST", ""), env.get("SLURM_TASKS_PER_NODE", "")
        return (hostlist.compress(self.launch_nodes),
                "%d(x%d)" % (self.per_node, len(self.launch_nodes)))

"""How much of a long training campaign goes to training: requeue after each failure, or restart
on spare nodes inside the allocation. `xscale goodput-model --nodes 256` for your job;
`--table` prints docs/GOODPUT.md's table. The defaults, and where each comes from, are there.

A campaign needs WORK seconds of training on NODES nodes. Each allocation starts with the job's
start-up (to the first step), then trains, stalled CHECKPOINT seconds every Young's interval
sqrt(2 x checkpoint x mean time between failures). Nodes fail at random (a Poisson process,
FAILURES per node-hour); Slurm notices after DETECT seconds. A failure blamed on a node restarts
the step at once on a spare while one is left (RELAUNCH, then the start-up again); any other
failure, a failure with no spare left, and the time limit (WALL_HOURS, after a checkpoint) put
the job back in the queue: Slurm's hold, the wait in the queue, a new allocation with all its
spares again. The work since the last checkpoint is lost at each failure. Idle spares fail too.
With --live (live recovery, docs/FAILURES.md) a failure blamed on a node, with a spare left,
costs only its noticing, the group's re-forming, the state's transfer and the replacement's
start: the step goes on, nothing is lost. With --rank-restarts too, a failure not blamed on a
node costs the same (its rank starts again on its own node; no spare is used); with --shrink,
a node failure with no spare left costs the noticing and the re-forming, and the nodes left
train on at their share of the speed (the same global batch) while at least half the nodes
are left, until the allocation ends; with --grow-back, until a node asked of the queue in the
lost one's place comes (NODE_QUEUE seconds, then the replacement's start) and joins (the
re-forming and the state's transfer).

Out: the effective training time ratio (training / wall-clock time, queue waits included) and
the goodput per node-hour (training node-hours / allocated node-hours, spares included: a spare
is billed while it waits). Averaged over RUNS campaigns with the same random failures for every
number of spares compared, so that the differences are the policy's.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import dataclass, replace

HOUR, DAY = 3600.0, 86400.0


@dataclass(frozen=True)
class Assumptions:
    nodes: int = 1024
    failures_per_node_hour: float = 419 / (54 * 24 * 2048)  # Llama 3: 419 in 54 days, 2,048 nodes
    node_share: float = 321 / 419  # of those, blamed on a node (a GPU, the host, its maintenance)
    checkpoint_s: float = 30.0
    startup_s: float = 349.0  # docs/STARTUP.md's model at 1,024 nodes, from Lustre
    detect_s: float = 300.0  # Slurm's default SlurmdTimeout
    relaunch_s: float = 3.0
    setup_s: float = 0.0  # the job script's work before its first step: staging, for one
    hold_s: float = 120.0  # Slurm's BeginTime hold of a requeued job
    queue_s: float = HOUR
    wall_s: float = 2 * DAY  # LUMI standard-g's longest job
    work_s: float = 30 * DAY
    # Live recovery (docs/FAILURES.md): a node failure with a spare left costs LIVE_S and no
    # lost work, no start-up of the whole job, no requeue.
    live: bool = False
    notice_s: float = 30.0  # the heartbeat window: a frozen node (a crashed one is seen at once)
    reform_s: float = 0.5  # nvidia-resiliency-ext's group rebuild at 16k ranks
    transfer_s: float = 0.7  # 16 GB of state (1B parameters with Adam) at 25 GB/s
    replacement_s: float = 60.0  # one node's ranks started: its container, `import torch`
    rank_restarts: bool = False  # with live: a failure not blamed on a node, live too
    shrink: bool = False  # with live: no spare left, the nodes left train on, slower
    grow_back: bool = False  # with shrink: a node from the queue takes a lost one's place
    node_queue_s: float = 600.0  # a one-node job's wait in the queue
    min_share: float = 0.5  # of the nodes, the fewest a smaller world trains on (XSCALE_MIN_NODES)

    def live_s(self) -> float:
        return self.notice_s + self.reform_s + self.transfer_s + self.replacement_s

    def mean_time_between_failures(self) -> float:
        return HOUR / (self.failures_per_node_hour * self.nodes)

    def checkpoint_interval(self) -> float:
        return math.sqrt(2 * self.checkpoint_s * self.mean_time_between_failures())


@dataclass
class Campaign:
    """One campaign's clocks, in seconds."""

    wall: float = 0.0
    node_seconds: float = 0.0
    trained: float = 0.0


def step(rng: random.Random, model: Assumptions, budget: float, left: float,
         startup_s: float | None = None, speed: float = 1.0):
    """One training step, from its launch: (seconds it ran, training it saved, training done up
    to its end, how it ended: 'failure', 'limit' or 'done'). It ends at the first failure
    (during its start-up too), when BUDGET (the allocation's time left) runs out, or with LEFT
    seconds of training done. STARTUP_S: the start-up (0 where live recovery goes on). SPEED:
    the training done per second, a share of the whole job's (a smaller world)."""
    startup_s = model.startup_s if startup_s is None else startup_s
    interval = model.checkpoint_interval()
    period = interval + model.checkpoint_s
    failure = rng.expovariate(1 / model.mean_time_between_failures())
    need = left / speed
    finish = startup_s + (need // interval) * period + need % interval
    ran = min(failure, budget, finish)
    trained_for = max(ran - startup_s, 0.0)
    done = min(trained_for - (trained_for // period) * model.checkpoint_s, need) * speed
    if ran == finish:
        return ran, left, left, "done"
    if ran == budget:  # the time limit's warning: a checkpoint of everything done, then requeue
        return ran, done, done, "limit"
    return ran, (trained_for // period) * interval * speed, done, "failure"


def allocation(rng: random.Random, model: Assumptions, spares: int, campaign: Campaign) -> None:
    """One allocation, from its start to the requeue or the campaign's end. Each spare has its
    own time of failure while it waits; a restart takes one that has not failed yet."""
    hours = model.failures_per_node_hour / HOUR
    spares_fail_at = [rng.expovariate(hours) for _ in range(spares)]
    used = model.setup_s  # staging reaches the spares too: a restart needs none
    startup_s = model.startup_s
    training = model  # the nodes that train now: fewer in a smaller world
    returns: list[float] = []  # when each lost node's stand-in joins (--grow-back)
    while True:
        limit = max(model.wall_s - used, 0.0)
        until_return = min(returns, default=math.inf) - used
        ran, saved, done, ending = step(rng, training, min(limit, until_return),
                                        model.work_s - campaign.trained, startup_s,
                                        training.nodes / model.nodes)
        used += ran
        if ending == "limit" and until_return < limit:  # a node back: the world grows
            campaign.trained += done
            returns.remove(min(returns))
            training = replace(training, nodes=training.nodes + 1)
            used += model.reform_s + model.transfer_s
            startup_s = 0.0
            continue
        if ending != "failure":
            campaign.trained += saved
            break
        healthy = [index for index, fails in enumerate(spares_fail_at) if fails > used]
        blamed = bool(healthy) and rng.random() < model.node_share  # drawn as it always was
        if not healthy and model.live and (model.rank_restarts or model.shrink):
            blamed = rng.random() < model.node_share
        went_on = _live(model, training, bool(healthy), blamed)
        if went_on is not None:  # nothing lost; the step goes on
            campaign.trained += done
            if healthy and blamed:
                del spares_fail_at[healthy[0]]
            if went_on[0].nodes < training.nodes and model.grow_back:
                returns.append(used + model.node_queue_s + model.replacement_s)
            training, seconds = went_on
            used += seconds
            startup_s = 0.0
            continue
        campaign.trained += saved
        used += model.detect_s
        if not healthy or not blamed:
            break
        del spares_fail_at[healthy[0]]
        used += model.relaunch_s
        startup_s = model.startup_s
    campaign.wall += used
    campaign.node_seconds += used * (model.nodes + spares)
    if ending != "done":
        campaign.wall += model.hold_s + model.queue_s


def _live(model: Assumptions, training: Assumptions, spare: bool,
          blamed: bool) -> tuple[Assumptions, float] | None:
    """How live recovery goes on after a failure (BLAMED on a node or not; a SPARE left or
    not): the nodes that train then and the seconds it costs; None where it does not."""
    if not model.live:
        return None
    if blamed and spare or not blamed and model.rank_restarts:
        return training, model.live_s()  # a replacement, on a spare or on the rank's node
    if blamed and model.shrink and training.nodes - 1 >= model.min_share * model.nodes:
        return replace(training, nodes=training.nodes - 1), model.notice_s + model.reform_s
    return None


def simulate(model: Assumptions, spares: int, runs: int, seed: int = 1) -> tuple[float, float]:
    """(effective training time ratio, goodput per node-hour), averaged over RUNS campaigns."""
    ratio = per_node_hour = 0.0
    for run in range(runs):
        rng, campaign = random.Random(seed * 100003 + run), Campaign()
        while campaign.trained < model.work_s:
            allocation(rng, model, spares, campaign)
        ratio += model.work_s / campaign.wall
        per_node_hour += model.work_s * model.nodes / campaign.node_seconds
    return ratio / runs, per_node_hour / runs


SPARE_CHOICES = (0, 1, 2, 4, 8, 16, 32, 64)
ETTR_WITHIN = 0.01  # "the most ETTR": the fewest spares within a point of it


def compare_spares(model: Assumptions, runs: int) -> dict[int, tuple[float, float]]:
    return {spares: simulate(model, spares, runs) for spares in SPARE_CHOICES
            if spares < model.nodes}


def best(results: dict[int, tuple[float, float]], measure: int, within: float) -> int:
    """The fewest spares within WITHIN of the best MEASURE (0: ETTR, 1: per node-hour): the
    last spares add little, and the model's noise is a few tenths of a point."""
    top = max(result[measure] for result in results.values())
    return min(spares for spares, result in results.items() if result[measure] >= top - within)


# docs/GOODPUT.md's rows: the start-up at each size is docs/STARTUP.md's model, from Lustre.
TABLE_SIZES = ((64, 236.0), (1024, 349.0), (8192, 1174.0))


def cell(spares: int, result: tuple[float, float]) -> str:
    return f"{spares}: {result[0]:.1%} / {result[1]:.1%}"


def size_table(runs: int) -> list[str]:
    rows = ["| nodes | a failure every | checkpoint every | requeue only | spares for the most "
            "ETTR | spares for the most per node-hour |", "|---|---|---|---|---|---|"]
    for nodes, startup in TABLE_SIZES:
        model = replace(Assumptions(), nodes=nodes, startup_s=startup)
        results = compare_spares(model, runs)
        for_time, for_hours = best(results, 0, ETTR_WITHIN), best(results, 1, 0.001)
        rows.append(f"| {nodes:,} | {model.mean_time_between_failures() / HOUR:.1f} h "
                    f"| {model.checkpoint_interval() / 60:.0f} min | {cell(0, results[0])} "
                    f"| {cell(for_time, results[for_time])} "
                    f"| {cell(for_hours, results[for_hours])} |")
    return rows


# What moves the 1,024-node figures: one assumption changed at a time.
VARIANTS = (("as above", {}),
            ("no wait in the queue", {"queue_s": 0.0}),
            ("6 h in the queue", {"queue_s": 6 * HOUR}),
            ("failure noticed in 30 s", {"detect_s": 30.0}),
            ("start-up with Copper (194 s)", {"startup_s": 194.0}),
            ("checkpoint stall 3 s", {"checkpoint_s": 3.0}),
            ("inputs staged, 188 s a new allocation", {"setup_s": 188.0}))


def variant_table(runs: int) -> list[str]:
    rows = ["| 1,024 nodes | requeue only | spares for the most ETTR | spares for the most per "
            "node-hour |", "|---|---|---|---|"]
    for name, changes in VARIANTS:
        results = compare_spares(replace(Assumptions(), **changes), runs)
        for_time, for_hours = best(results, 0, ETTR_WITHIN), best(results, 1, 0.001)
        rows.append(f"| {name} | {cell(0, results[0])} | {cell(for_time, results[for_time])} "
                    f"| {cell(for_hours, results[for_hours])} |")
    return rows


def table(runs: int) -> str:
    return "\n".join(size_table(runs) + [""] + variant_table(runs))


def main(argv: list[str] | None = None, prog: str = "python -m xscale.goodput_model") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    defaults = Assumptions()
    for field, help_text in (("nodes", "nodes that train"),
                             ("checkpoint_s", "seconds training stalls for a checkpoint"),
                             ("startup_s", "seconds from a step's launch to its first step"),
                             ("detect_s", "seconds until Slurm ends a step whose node died"),
                             ("setup_s", "seconds of the job script's staging, each allocation"),
                             ("queue_s", "seconds a requeued job waits in the queue")):
        kind = int if field == "nodes" else float
        parser.add_argument("--" + field.replace("_", "-"), type=kind,
                            default=getattr(defaults, field), help=help_text)
    parser.add_argument("--live", action="store_true",
                        help="live recovery: a node failure with a spare left costs "
                             "--notice-s and the replacement's start, nothing else")
    parser.add_argument("--rank-restarts", action="store_true",
                        help="with --live: a failure not blamed on a node starts its rank "
                             "again on its node, live, instead of the requeue")
    parser.add_argument("--shrink", action="store_true",
                        help="with --live: a node failure with no spare left goes on without "
                             "the node, slower, while half the nodes are left")
    parser.add_argument("--grow-back", action="store_true",
                        help="with --shrink: a node asked of the queue takes each lost one's "
                             "place after --node-queue-s and the replacement's start")
    parser.add_argument("--node-queue-s", type=float, default=defaults.node_queue_s,
                        help="with --grow-back: seconds a one-node job waits in the queue")
    parser.add_argument("--notice-s", type=float, default=defaults.notice_s,
                        help="with --live: seconds until a failure is noticed (a frozen node: "
                             "the heartbeat window)")
    parser.add_argument("--replacement-s", type=float, default=defaults.replacement_s,
                        help="with --live: seconds for a replacement node's ranks to start")
    parser.add_argument("--runs", type=int, default=40, help="campaigns to average")
    parser.add_argument("--table", action="store_true", help="docs/GOODPUT.md's table")
    args = parser.parse_args(argv)
    if args.table:
        print(table(args.runs))
        return 0
    if args.nodes < 1 or args.runs < 1 or min(args.checkpoint_s, args.startup_s, args.detect_s,
                                               args.setup_s, args.queue_s, args.notice_s,
                                               args.replacement_s, args.node_queue_s) < 0:
        parser.error("--nodes and --runs must be at least 1, the seconds not negative")
    model = replace(defaults, nodes=args.nodes, checkpoint_s=args.checkpoint_s,
                    startup_s=args.startup_s, detect_s=args.detect_s, setup_s=args.setup_s,
                    queue_s=args.queue_s, live=args.live, notice_s=args.notice_s,
                    replacement_s=args.replacement_s, rank_restarts=args.rank_restarts,
                    shrink=args.shrink, grow_back=args.grow_back, node_queue_s=args.node_queue_s)
    for spares, (ratio, per_node_hour) in compare_spares(model, args.runs).items():
        print(f"{spares:3d} spares: {ratio:6.1%} of the wall-clock time trains, "
              f"{per_node_hour:6.1%} of the node-hours")
    return 0


if __name__ == "__main__":
    sys.exit(main())

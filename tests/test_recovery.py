"""Live recovery (jobs/lib/coordinator.py, python/xscale/recovery/) with three real processes on
a real gloo group and the real coordinator, here, without Slurm: each rank claims a node of its
own (SLURMD_NODENAME), and the coordinator's replace() starts the replacement as the supervisor
would on a spare. The test bed's runs with a crashed and a frozen node are in
tests/test_failures.py and tests/test_own_scripts.py; this one checks what they cannot see:
that the replicas are equal, to the last bit, after the recovery, that every rank trained each
micro-batch on the batch an uninterrupted run gives it, and that the first step after the
recovery applied that run's gradients, wherever the survivors met the loss (CASES): a step
apart, in the middle of a step of two micro-batches, in a checkpoint, in an evaluation."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import types
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset
from xscale.data import ResumableSampler
from xscale.recovery import ddp as ddp_kind
from xscale.recovery import link as rank_link
from xscale.recovery import live
from xscale.shared import contract

from tests.conftest import REPO
from tests.helpers import (
    TRAINING_IMPORTS,
    ForkedRanks,
    client_env,
    free_port,
    host_module,
    hosted_store,
    results_of,
    tagged_records,
)

PROGRAM = REPO / "tests" / "programs" / "live_ranks.py"
PRELOAD = (*TRAINING_IMPORTS, "xscale")  # what the forked ranks' interpreter imports once
INTERPRETER_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # its own: each rank's is set in its fork
# 80 micro-batches, less than an epoch; DIE_AT: between two votes (live_ranks.py logs every 5).
MICRO_BATCHES, DIE_AT, BATCH = 80, 31, 16


def expected_batches(rank: int, accumulation: int) -> dict[str, float]:
    """The digest of the batch RANK trains each micro-batch on ("STEP.MICRO") in an
    uninterrupted run of live_ranks.py (its data, its sampler; the run is shorter than an
    epoch)."""
    inputs = torch.randn(4096, 32, generator=torch.Generator().manual_seed(0))
    sampler = ResumableSampler(TensorDataset(inputs), 3, rank)
    sampler.set_position(0)
    order = list(sampler)
    expected = {}
    for step in range(1, MICRO_BATCHES // accumulation + 1):
        for micro in range(accumulation):
            first = ((step - 1) * accumulation + micro) * BATCH
            expected[f"{step}.{micro}"] = float(inputs[order[first:first + BATCH]].double().sum())
    return expected


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory):
    """The digest of the gradients each step of live_ranks.py applies in a run with no failure
    and no coordinator (DDP's own all-reduce), on rank 0, by (form, steps, accumulation)."""
    runs: dict[tuple[str, int, int], dict[str, float]] = {}

    def gradients(form: str, steps: int, accumulation: int) -> dict[str, float]:
        if (form, steps, accumulation) not in runs:
            runs[form, steps, accumulation] = run_uninterrupted(
                tmp_path_factory.mktemp("uninterrupted"), FORM=form, MAX_STEPS=str(steps),
                ACCUMULATION=str(accumulation))
        return runs[form, steps, accumulation]
    return gradients


def run_uninterrupted(output_dir: Path, **extra: str) -> dict[str, float]:
    store = hosted_store(3)
    ranks = ForkedRanks([([str(PROGRAM), str(output_dir)], client_env(rank, 3, store, **extra))
                         for rank in range(3)], REPO, PRELOAD, INTERPRETER_ENV)
    runs = ranks.results(timeout=120)
    return results_of([(run.returncode, run.stdout, run.stderr) for run in runs])[0]["gradients"]


# Where the others meet rank 2's loss (live_ranks.py's settings):
# - behind: one survivor is held a step behind, the source of the state (the lowest survivor)
#   or another;
# - mid-step: rank 2 dies after the first of a step's two micro-batches; the survivors finish
#   the step alone and drop it, and recover at its end. Through xscale.Loop, and through
#   xscale.prepare's short form, where the script counts its micro-batches itself;
# - in a checkpoint: rank 2 dies after its update, the others are in the checkpoint that ends
#   the step (it gathers every rank's generators);
# - in an evaluation: the others evaluate after the step (vision.evaluate_classifier).
CASES = {
    "source-behind": {"HOLD_RANK": "0"},
    "survivor-behind": {"HOLD_RANK": "1"},
    "mid-step-of-two": {"ACCUMULATION": "2", "DIE_MICRO": "1"},
    "prepared-mid-step-of-two": {"FORM": "prepared", "ACCUMULATION": "2", "DIE_MICRO": "1"},
    "in-a-checkpoint": {"DIE_MICRO": "-1", "CHECKPOINT_EVERY": str(DIE_AT)},
    "in-an-evaluation": {"EVALUATE_AT": str(DIE_AT)},
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_lost_rank_is_replaced_and_every_replica_ends_equal(tmp_path: Path, uninterrupted,
                                                              case: str):
    settings = CASES[case]
    form, accumulation = settings.get("FORM", "loop"), int(settings.get("ACCUMULATION", "1"))
    host_side = host_module("coordinator")
    store, steps = hosted_store(3), MICRO_BATCHES // accumulation

    # A collective timeout longer than the test waits: a recovery that waited one out (a
    # broken group's destructor joining a thread still waiting on a survivor, 55 s before
    # link.abort_group) fails the test instead of slowing it.
    def env(rank: int, node: str, **extra: str) -> dict[str, str]:
        return client_env(rank, 3, store, SLURMD_NODENAME=node, MAX_STEPS=str(steps),
                          DIE_AT=str(DIE_AT), DIE_RANK="2", DIE_HOW="kill",
                          XSCALE_RECOVERY=coordinator.address, XSCALE_TIMEOUT_S="600",
                          **settings, **extra)

    def replace(nodes: list[str], generation: int) -> list[str]:
        ranks.release(XSCALE_RECOVERY_JOIN=str(generation))
        return ["n3"]

    coordinator = host_side.Coordinator(3, replace, lambda why: None, heartbeat_s=30.0)
    coordinator.start()
    ranks = ForkedRanks([([str(PROGRAM), str(tmp_path)], env(rank, f"n{rank}"))
                         for rank in range(3)], REPO, PRELOAD, INTERPRETER_ENV,
                        held=[([str(PROGRAM), str(tmp_path)], env(2, "n3"))])
    runs = lost_and_replaced(ranks, coordinator)
    records = results_of(runs)
    # The survivors trained from the start, the replacement from where the rank was lost;
    # all to the end, with the same parameters and optimizer state.
    assert [(r["rank"], r["started_at"], r["steps"]) for r in records] == [
        (0, 0, steps), (1, 0, steps), (2, DIE_AT, steps)], records
    assert len({r["digest"] for r in records}) == 1, records
    # The first step after the recovery applied the gradients of an uninterrupted run's step
    # there: no micro-batch lost or counted twice (float32's rounding apart: the live run's
    # all-reduce divides after summing, DDP's before, and Adam carries the difference on).
    first = str(DIE_AT + 1)
    reference = uninterrupted(form, steps, accumulation)[first]
    assert records[0]["gradients"][first] == pytest.approx(reference, rel=1e-3), reference
    # The same position on every rank after the recovery: each step's batch is the one an
    # uninterrupted run draws there (a survivor a step behind drew one batch too many before).
    for record in records:
        expected = expected_batches(record["rank"], accumulation)
        assert record["trained"] == {
            f"{step}.{micro}": expected[f"{step}.{micro}"]
            for step in range(record["started_at"] + 1, steps + 1)
            for micro in range(accumulation)}, record["rank"]
    (entry,) = coordinator.saved()
    assert (entry["lost"], entry["spares"], entry["ranks"]) == (["n2"], ["n3"], [2]), entry
    assert f"training goes on at step {DIE_AT}" in runs[0][1] + runs[0][2], runs[0]
    if "EVALUATE_AT" in settings:  # the survivors' evaluation is lost, and said so
        assert [r["evaluated"] for r in records] == [{str(DIE_AT): None}] * 2 + [{}], records
        assert "an evaluation was cut short by a lost rank" in runs[0][1], runs[0][1]
    assert coordinator.finished(wait_s=5.0)


def test_with_no_spare_left_the_survivors_go_on_as_a_smaller_world_and_grow_back(
        tmp_path: Path, uninterrupted):
    """Ranks 0 and 2 on node n0, rank 1 on n1; n1 is lost and no spare is left. Ranks 0 and 2
    go on as a world of two (rank 2 is rank 1 there), and each step's three micro-batches are
    dealt over them, two to rank 0 and one to rank 1 (xscale.data.Share): every step trains
    the samples an uninterrupted run of three trains, none twice or skipped, and applies its
    gradients; the summary says when the world shrank and keeps the global batch. Then rank 2
    is killed on its own (its node-mate lives): the coordinator starts it again on n0 by its
    launch number, it joins as rank 1 of the two, takes its share and the record of the shrink.
    Then a node, n5, is the training's again (a node job ran, jobs/lib/grow_back.py): rank 1
    starts there and the coordinator takes it back in (grow) at step G, from the restart's
    step to step WAIT_AT (rank 0 waits there for it); from there each rank trains its own batch
    of the launch's again.
    The three replicas end equal, every step with the uninterrupted run's gradients."""
    host_side = host_module("coordinator")
    store, again_at, wait_at, nodes = hosted_store(3), 50, 65, ["n0", "n1", "n0"]

    def env(rank: int, node: str, **extra: str) -> dict[str, str]:
        return client_env(rank, 3, store, SLURMD_NODENAME=node, MAX_STEPS=str(MICRO_BATCHES),
                          DIE_AT=str(DIE_AT), DIE_RANK="1", DIE_HOW="kill",
                          THEN_DIE=f"2@{again_at}", XSCALE_TIMEOUT_S="600", WAIT_AT=str(wait_at),
                          XSCALE_RECOVERY=coordinator.address, **extra)

    def restart(lost: list[int], generation: int) -> None:
        assert lost == [2], lost  # the launch's number: where it runs
        ranks.release(XSCALE_RECOVERY_JOIN=str(generation))

    def grow_back() -> None:
        with coordinator.changed:
            coordinator.changed.wait_for(lambda: len(coordinator.recoveries) == 2, timeout=120)
        grown.append(coordinator.grow(
            [1], lambda generation: ranks.release(XSCALE_RECOVERY_JOIN=str(generation)), "n5"))

    coordinator = host_side.Coordinator(3, lambda nodes, generation: None, lambda why: None,
                                        heartbeat_s=30.0, restart=restart, max_rank_restarts=1,
                                        min_nodes=1)
    coordinator.start()
    held = [([str(PROGRAM), str(tmp_path)], env(2, "n0")),
            ([str(PROGRAM), str(tmp_path)], env(1, "n5"))]
    ranks = ForkedRanks([([str(PROGRAM), str(tmp_path)], env(rank, nodes[rank]))
                         for rank in range(3)], REPO, PRELOAD, INTERPRETER_ENV, held=held)
    grown: list[str] = []
    growing = threading.Thread(target=grow_back, daemon=True)
    growing.start()
    try:
        ended, restarts = ended_in_time(ranks)
    finally:
        coordinator.stop()
        ranks.kill()
    growing.join(timeout=10)
    assert [run.returncode for run in ended[1:]] == [-9, -9], ended[0].stderr[-3000:]
    assert len(restarts) == 2 and grown == [host_side.GROWN], (grown, ended[0].stdout[-3000:])
    runs = [(run.returncode, run.stdout, run.stderr) for run in (ended[0], *restarts)]
    records = results_of(runs)
    (summary,) = tagged_records(runs[0][1], "XSCALE_SUMMARY")
    (shrink,) = summary["shrinks"]
    grow_at = shrink["until"]
    # The grow may come before the restarted world's first step ends (its abort drops that
    # step): on a loaded machine it did, at again_at itself.
    assert again_at <= grow_at <= wait_at, summary
    assert [(r["rank"], r["started_at"], r["steps"]) for r in records] == [
        (0, 0, MICRO_BATCHES), (2, again_at, MICRO_BATCHES), (1, grow_at, MICRO_BATCHES)], \
        records
    assert records[0]["pid"] == ranks.pids[0], records
    assert len({r["digest"] for r in records}) == 1, records
    # Each step after the loss: rank 0 trained the launch's ranks 0 and 2's batches, rank 2
    # (rank 1 now, the process started again after again_at) rank 1's; from grow_at on each
    # trained its own batch; and every step applied the uninterrupted run's gradients.
    expected = [expected_batches(rank, 1) for rank in range(3)]
    reference = uninterrupted("loop", MICRO_BATCHES, 1)
    for step in range(DIE_AT + 1, MICRO_BATCHES + 1):
        trained = records[0]["trained"]
        if step <= grow_at:
            assert sorted([trained[f"{step}.0"], trained[f"{step}.1"]]) == sorted(
                [expected[0][f"{step}.0"], expected[2][f"{step}.0"]]), step
        else:  # (the step the grow dropped may have trained a second micro-batch: not again)
            assert trained[f"{step}.0"] == expected[0][f"{step}.0"], step
            assert step == grow_at + 1 or f"{step}.1" not in trained, step
            assert records[2]["trained"][f"{step}.0"] == expected[1][f"{step}.0"], step
        if step > again_at:
            launch_rank = 1 if step <= grow_at else 2
            assert records[1]["trained"][f"{step}.0"] == expected[launch_rank][f"{step}.0"], step
            assert f"{step}.1" not in records[1]["trained"], step
        assert records[0]["gradients"][str(step)] == pytest.approx(reference[str(step)],
                                                                   rel=1e-3), step
    shrunk, restarted, grew = coordinator.saved()
    assert (shrunk["lost"], shrunk["spares"], shrunk["world_size"]) == (["n1"], [], 2), shrunk
    assert (restarted["lost"], restarted["restarted"]) == ([], [2]), restarted
    assert (grew["grown"], grew["ranks"], grew["world_size"], grew["smaller"]) == (
        ["n5"], [1], 3, False), grew
    said = runs[0][1] + runs[0][2]
    assert "training goes on as 2 ranks on 1 node, each step's 48 samples dealt over them " \
        "(2 micro-batches on rank 0)" in said, said[-3000:]
    assert f"training goes on as the launch's 3 ranks on 2 nodes from step {grow_at}" in said, \
        said[-3000:]
    assert (summary["world_size"], summary["global_batch_size"]) == (3, 48), summary
    assert (shrink["step"], shrink["world_size"], shrink["nodes"]) == (DIE_AT, 2, 1), summary
    # The processes started later know of the shrink from the source's position (a rank 0
    # started again so writes it in its summary), and how long the world was smaller: the one
    # that joined as the world grew back too, though the source handed the world before.
    for record in records[1:]:
        (known,) = record["shrinks"]
        assert {key: known[key] for key in ("step", "until", "world_size", "nodes")} == \
            {key: shrink[key] for key in ("step", "until", "world_size", "nodes")}, record
        assert known["seconds"] == pytest.approx(shrink["seconds"], abs=2.0), (known, shrink)
    assert coordinator.finished(wait_s=5.0)


@pytest.mark.parametrize("how", ["killed-once", "raises-every-time"])
def test_a_rank_that_fails_on_its_own_starts_again_on_its_node_until_it_fails_too_often(
        tmp_path: Path, how: str):
    """Ranks 0 and 1 on node n0, rank 2 on n1. Rank 1 fails on its own, its node-mate lives:
    the coordinator starts it again on n0 (restart()), not on a spare. Killed once, it joins and
    every replica ends equal; raising at the same step in every process (a bug), it is started
    again XSCALE_MAX_RANK_RESTARTS times, and the next failure stops the launch with one line
    naming the rank, the step and the error's first line."""
    host_side = host_module("coordinator")
    store, gave_up = hosted_store(3), []
    steps = MICRO_BATCHES

    def env(rank: int, node: str, **extra: str) -> dict[str, str]:
        return client_env(rank, 3, store, SLURMD_NODENAME=node, MAX_STEPS=str(steps),
                          DIE_AT=str(DIE_AT), DIE_RANK="1",
                          DIE_HOW="kill" if how == "killed-once" else "raise",
                          XSCALE_RECOVERY=coordinator.address, **extra)

    def restart(lost: list[int], generation: int) -> None:
        assert lost == [1], lost
        ranks.release(XSCALE_RECOVERY_JOIN=str(generation))

    coordinator = host_side.Coordinator(3, lambda nodes, generation: None, gave_up.append,
                                        heartbeat_s=30.0, restart=restart, max_rank_restarts=2)
    coordinator.start()
    ranks = ForkedRanks([([str(PROGRAM), str(tmp_path)], env(rank, node))
                         for rank, node in enumerate(["n0", "n0", "n1"])], REPO, PRELOAD,
                        INTERPRETER_ENV, held=[([str(PROGRAM), str(tmp_path)], env(1, "n0"))] * 2)
    try:
        first, restarts = ended_in_time(ranks)
    finally:
        coordinator.stop()
        ranks.kill()
    if how == "killed-once":
        assert (first[1].returncode, len(restarts), gave_up) == (-9, 1, []), first[0].stderr
        records = results_of([(run.returncode, run.stdout, run.stderr)
                              for run in (first[0], first[2], restarts[0])])
        assert [(r["rank"], r["started_at"], r["steps"]) for r in records] == [
            (0, 0, steps), (2, 0, steps), (1, DIE_AT, steps)], records
        assert len({r["digest"] for r in records}) == 1, records
        (entry,) = coordinator.saved()
        assert (entry["lost"], entry["spares"], entry["restarted"]) == ([], [], [1]), entry
        return
    # Three failures at one step, two restarts: the third ends the launch.
    assert len(restarts) == 2, (gave_up, first[0].stderr[-3000:])
    assert gave_up == [f"rank 1 on n0 failed 3 times at step {DIE_AT} (XSCALE_MAX_RANK_RESTARTS="
                       f"2): a bug, not bad luck; the first time: RuntimeError: rank 1 cannot "
                       f"train step {DIE_AT + 1}"], gave_up
    assert [first[0].returncode, first[2].returncode] == [rank_link.FALLBACK_EXIT] * 2
    assert all(code not in (0, rank_link.FALLBACK_EXIT) for code in
               [first[1].returncode, *(run.returncode for run in restarts)]), first[1].stderr
    assert len(coordinator.saved()) == 2, coordinator.saved()


def test_a_rank_that_fails_on_a_blamed_node_takes_its_node_mates_with_it_to_a_spare():
    """Ranks 0 and 1 on n0, rank 2 on n1; rank 1's process ends, its node-mate lives, but a
    line of the launch's output blames n0 (a bad GPU): rank 1 is not started again there.
    Rank 0 is dismissed (it exits; DISMISS), n0 counts as lost, and the spare takes both
    ranks; rank 2 goes on. (On the bed, with a real bad-node line: tests/test_failures.py.)"""
    host_side = host_module("coordinator")
    why = "n0 is blamed by a line of its ranks' output (lumi.patterns [lumi-hsa-hw-exception])"
    replaced, gave_up = [], []

    def replace(nodes: list[str], generation: int) -> list[str]:
        replaced.append((nodes, generation))
        return ["n9"]

    coordinator = host_side.Coordinator(
        3, replace, gave_up.append, heartbeat_s=30.0, restart=lambda ranks, generation: None,
        max_rank_restarts=2, blamed=lambda nodes: {node: why for node in nodes if node == "n0"})
    coordinator.start()
    port = int(coordinator.address.rsplit(":", 1)[1])

    def connect(rank: int, node: str, generation: int = 0) -> tuple[socket.socket, Iterator]:
        connection = socket.create_connection(("127.0.0.1", port), timeout=10)
        connection.sendall(contract.encode(contract.Hello(rank=rank, node=node, pid=rank,
                                                          generation=generation))
                           + contract.encode(contract.Live(shrinks=True)))
        return connection, contract.read_messages(connection.makefile("rb"))

    ranks = [connect(rank, node) for rank, node in enumerate(["n0", "n0", "n1"])]
    spares = []
    try:
        with coordinator.changed:
            assert coordinator.changed.wait_for(lambda: len(coordinator.peers) == 3 and all(
                peer.live for peer in coordinator.peers.values()), timeout=10)
        ranks[1][0].shutdown(socket.SHUT_RDWR)  # rank 1's process ended (its file keeps it)
        for rank in (0, 2):
            assert next(ranks[rank][1]) == contract.Abort(generation=0)
            ranks[rank][0].sendall(contract.encode(contract.Left(generation=0, step=7)))
        assert next(ranks[0][1]) == contract.Dismiss(why=why)
        assert next(ranks[2][1]) == contract.HostStore(generation=1)  # the lowest survivor
        ranks[2][0].sendall(contract.encode(contract.Store(address=["127.0.0.1", 1])))
        spares = [connect(rank, "n9", generation=1) for rank in (0, 1)]
        for connection, messages in (ranks[2], *spares):
            assert next(messages) == contract.Join(generation=1, store=["127.0.0.1", 1],
                                                   source=2, nodes=2)
            connection.sendall(contract.encode(contract.Joined(generation=1)))
        with coordinator.changed:
            assert coordinator.changed.wait_for(lambda: coordinator.recoveries, timeout=10)
    finally:
        coordinator.stop()
        for connection, _ in ranks + spares:
            connection.close()
    assert (replaced, gave_up) == ([(["n0"], 1)], []), gave_up
    (entry,) = coordinator.saved()
    assert {key: entry[key] for key in ("lost", "spares", "restarted", "ranks", "blamed")} == {
        "lost": ["n0"], "spares": ["n9"], "restarted": [], "ranks": [0, 1], "blamed": ["n0"]}


def test_a_grow_takes_its_ranks_in_once_they_came_and_gives_up_cleanly_when_they_cannot():
    """Ranks 0 and 1 on n0, rank 2 on n1, no spare: n1 is lost and ranks 0 and 1 go on as a
    world of two. A grow before that finds nothing to grow. A grow whose ranks' srun ends
    before they came (abandon_grow) fails and leaves the world as it was; the next, whose rank
    2 says Hello from n5, waits for ranks 0 and 1 to step in generation 1 (a rank still
    re-entering its loop would not leave in time), then has them leave it and forms generation
    2 with all three, in the launch's numbers, on two nodes. (Real ranks: the grow-back test
    above; on the bed, tests/test_failures.py.)"""
    host_side = host_module("coordinator")
    coordinator = host_side.Coordinator(3, lambda nodes, generation: None, lambda why: None,
                                        heartbeat_s=30.0, min_nodes=1)
    coordinator.start()
    port = int(coordinator.address.rsplit(":", 1)[1])
    connections = []

    def connect(rank: int, node: str, generation: int = 0) -> tuple[socket.socket, Iterator]:
        connection = socket.create_connection(("127.0.0.1", port), timeout=10)
        connection.sendall(contract.encode(contract.Hello(rank=rank, node=node, pid=rank,
                                                          generation=generation))
                           + contract.encode(contract.Live(shrinks=True)))
        connections.append(connection)
        return connection, contract.read_messages(connection.makefile("rb"))

    def form(generation: int, ranks: list, nodes: int, members) -> None:
        """The survivors leave GENERATION - 1, rank 0 hosts the store, MEMBERS join."""
        for connection, messages in members[:2]:
            assert next(messages) == contract.Abort(generation=generation - 1)
            connection.sendall(contract.encode(contract.Left(generation=generation - 1,
                                                             step=7)))
        assert next(members[0][1]) == contract.HostStore(generation=generation)
        members[0][0].sendall(contract.encode(contract.Store(address=["127.0.0.1", 1])))
        for connection, messages in members:
            assert next(messages) == contract.Join(generation=generation,
                                                   store=["127.0.0.1", 1], source=0,
                                                   ranks=ranks, nodes=nodes)
            connection.sendall(contract.encode(contract.Joined(generation=generation)))

    def records(count: int) -> list[dict]:
        with coordinator.changed:
            assert coordinator.changed.wait_for(lambda: len(coordinator.recoveries) == count,
                                                timeout=10)
        return coordinator.saved()

    try:
        ranks = [connect(rank, node) for rank, node in enumerate(["n0", "n0", "n1"])]
        assert coordinator.grow([2], lambda generation: None, "n5") == host_side.BUSY
        ranks[2][0].shutdown(socket.SHUT_RDWR)  # n1's rank is gone, and no spare is left
        form(1, [0, 1], 1, ranks[:2])
        assert records(1)[0]["world_size"] == 2
        started = []

        def start_and_end(generation: int) -> None:
            started.append(generation)
            coordinator.abandon_grow("the ranks of n1, started again, ended with status 1")

        assert coordinator.grow([2], start_and_end, "n5") == host_side.FAILED
        assert started == [2] and coordinator.layout == [0, 1] and not coordinator.recovering
        grown = []
        growing = threading.Thread(target=lambda: grown.append(coordinator.grow(
            [2], lambda generation: started.append(generation), "n5")), daemon=True)
        growing.start()
        with coordinator.changed:  # started: its rank says Hello from its node
            assert coordinator.changed.wait_for(lambda: len(started) == 2, timeout=10)
        joining = connect(2, "n5", generation=started[1])
        with coordinator.changed:  # it came, but the survivors have not stepped in generation 1
            assert coordinator.changed.wait_for(lambda: all(coordinator.arriving.values()),
                                                timeout=10)
            assert not coordinator.changed.wait_for(lambda: coordinator.recovering, timeout=1)
        for connection, _ in ranks[:2]:
            connection.sendall(contract.encode(contract.Stepping(generation=1)))
        form(2, [0, 1, 2], 2, [*ranks[:2], joining])
        growing.join(timeout=10)
        assert grown == [host_side.GROWN], grown
    finally:
        coordinator.stop()
        for connection in connections:
            connection.close()
    entry = records(2)[1]
    assert {key: entry[key] for key in ("grown", "ranks", "world_size", "smaller")} == {
        "grown": ["n5"], "ranks": [2], "world_size": 3, "smaller": False}, entry


def lost_and_replaced(ranks: ForkedRanks, coordinator) -> list[tuple[int, str, str]]:
    """RANKS (three, and a held replacement) to their ends, rank 2 killed and the replacement
    released by the coordinator: [(exit status, stdout, stderr)] of rank 0, rank 1 and the
    replacement. The coordinator is stopped and every process killed, whatever happens."""
    try:
        ended, replacements = ended_in_time(ranks)
    finally:
        coordinator.stop()
        ranks.kill()
    assert replacements, ended[0].stdout[-3000:]  # the coordinator fell back
    assert ended[2].returncode == -9, ended[2].stderr[-3000:]
    return [(run.returncode, run.stdout, run.stderr) for run in (*ended[:2], replacements[0])]


def ended_in_time(ranks: ForkedRanks) -> tuple[list[subprocess.CompletedProcess],
                                               list[subprocess.CompletedProcess]]:
    """RANKS' results once all have ended: the ranks launched, and the replacements released.
    One that hangs fails the test with every process's last lines."""
    ended = ranks.results(timeout=240)
    if ranks.timed_out:
        pytest.fail("a rank hung; each rank's end:\n" + "\n".join(
            f"--- {index}, exit {run.returncode}:\n{run.stdout[-1500:]}{run.stderr[-3000:]}"
            for index, run in enumerate(ended)))
    return ended[:ranks.launched], ended[ranks.launched:ranks.launched + ranks.released]


def hello(rank: int) -> bytes:
    """A fake rank's first message, as xscale.recovery.link's Link sends it (pid: the rank)."""
    return contract.encode(contract.Hello(rank=rank, node=f"n{rank}", pid=rank, generation=0))


def test_a_loop_live_recovery_cannot_serve_falls_back_with_its_reason_not_no_survivor():
    """Ranks that said at their start why live recovery cannot serve them (here: a model of the
    script's own DDP class, as LUMI's container test has): when one dies, the coordinator falls
    back at once with those words, not with "no rank survived" after the leave window."""
    host_side = host_module("coordinator")
    gave_up = threading.Event()
    reasons: list[str] = []

    def give_up(why: str) -> None:
        reasons.append(why)
        gave_up.set()

    coordinator = host_side.Coordinator(2, lambda nodes, generation: ["n9"], give_up,
                                        heartbeat_s=30.0)
    coordinator.start()
    port = int(coordinator.address.rsplit(":", 1)[1])
    ranks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
    try:
        why = "the loop's model is a DistributedDataParallel of the script's own"
        for rank, connection in enumerate(ranks):
            connection.sendall(hello(rank) + contract.encode(contract.NotLive(why=why)))
        with coordinator.changed:  # each connection is read by a thread of its own
            assert coordinator.changed.wait_for(lambda: len(coordinator.peers) == 2 and all(
                peer.not_live for peer in coordinator.peers.values()), timeout=10)
        connection = ranks.pop()
        connection.close()  # rank 1's process died
        assert gave_up.wait(timeout=10)
    finally:
        coordinator.stop()
        for connection in ranks:
            connection.close()
    assert reasons == [f"rank 1 on n1 (pid 1) is gone; rank 0 on n0 cannot be recovered live: "
                       f"{why}"], reasons


@pytest.mark.parametrize("min_nodes, shrinks, why", [
    (2, True, "1 node would be left, fewer than XSCALE_MIN_NODES=2"),
    (1, False, "rank 0 on n0 cannot go on in a smaller world (only a DDP model under "
               "xscale.Loop or XscaleTrainer deals a step's batch over fewer ranks)")])
def test_with_no_spare_a_world_that_cannot_shrink_falls_back_saying_why(
        min_nodes: int, shrinks: bool, why: str):
    """Two ranks on two nodes, no spare, rank 1's node lost: below XSCALE_MIN_NODES, or with a
    rank whose loop cannot deal a step's batch over fewer ranks (a sharded model), the
    coordinator falls back (the usual restart or requeue) and says which."""
    host_side = host_module("coordinator")
    reasons: list[str] = []
    gave_up = threading.Event()

    def give_up(reason: str) -> None:
        reasons.append(reason)
        gave_up.set()

    coordinator = host_side.Coordinator(2, lambda nodes, generation: None, give_up,
                                        heartbeat_s=30.0, min_nodes=min_nodes)
    coordinator.start()
    port = int(coordinator.address.rsplit(":", 1)[1])
    ranks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
    try:
        for rank, connection in enumerate(ranks):
            connection.sendall(hello(rank) + contract.encode(contract.Live(shrinks=shrinks)))
        with coordinator.changed:
            assert coordinator.changed.wait_for(lambda: len(coordinator.peers) == 2 and all(
                peer.live for peer in coordinator.peers.values()), timeout=10)
        ranks.pop().close()  # rank 1's node is gone
        ranks[0].sendall(contract.encode(contract.Left(generation=0, step=7)))
        assert gave_up.wait(timeout=10)
    finally:
        coordinator.stop()
        for connection in ranks:
            connection.close()
    assert reasons == [f"no spare node is left for n1, and {why}"], reasons


def test_a_loop_without_torch_ddp_says_why_it_cannot_be_recovered_live(monkeypatch):
    """What a rank tells the coordinator, and rank 0 prints as the run starts, when its loop
    cannot be recovered live: the model's class, the missing optimizer, a sharded model."""
    said: list[str] = []

    class Link:
        def not_live(self, why: str) -> None:
            said.append(why)

    monkeypatch.setattr(rank_link, "_link", Link())
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx = None  # a kind of recovery is made only when the loop qualifies
    assert live.for_loop(ctx, model, optimizer) == (None, said[0])
    assert said[0].startswith("the loop's model is a torch.nn.modules.linear.Linear, not "
                              "torch's DistributedDataParallel"), said
    monkeypatch.setattr(ddp_kind, "DDP", nn.Linear)  # a DDP, for the checks that follow
    assert live.for_loop(ctx, model, None)[1].startswith("the loop was given no optimizer")
    # A model that fully_shard made (FSDPModule, as the check sees it): its shards are held
    # nowhere else but in peer snapshots, which need a peer on another node, and a step to
    # drop.
    monkeypatch.setitem(sys.modules, "torch.distributed.fsdp",
                        types.SimpleNamespace(FSDPModule=nn.Linear))
    one_node = types.SimpleNamespace(nnodes=1)
    assert live.for_loop(one_node, model, optimizer)[1] == (
        "its ranks are on one node: a snapshot needs a peer on another")
    assert live.for_loop(one_node, model, None)[1].startswith("the loop was given no optimizer")
    monkeypatch.setenv("XSCALE_SNAPSHOT_EVERY", "0")
    assert live.for_loop(types.SimpleNamespace(nnodes=2), model, optimizer)[1] == (
        "XSCALE_SNAPSHOT_EVERY=0: no peer snapshots, and a lost shard is held nowhere else")
    monkeypatch.setattr(rank_link, "_link", None)
    assert live.for_loop(ctx, model, optimizer) == (None, None)


def test_a_collective_that_fails_after_the_training_ended_is_no_recovery():
    """Bye said, a rank's evaluation lost its peer: the training is over, and what follows is
    the launch's end to judge (docs/FAILURES.md, "A finished training is not a failed job")."""
    host_side = host_module("coordinator")
    coordinator = host_side.Coordinator(2, lambda nodes, generation: ["n9"], lambda why: None,
                                        heartbeat_s=30.0)
    coordinator.start()
    port = int(coordinator.address.rsplit(":", 1)[1])
    ranks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
    try:
        for rank, connection in enumerate(ranks):
            connection.sendall(hello(rank) + contract.encode(contract.Live())
                               + contract.encode(contract.Bye()))
        # The coordinator reads a connection's messages in order: Joined marks the Broken read.
        ranks[1].sendall(contract.encode(contract.Broken(generation=0,
                                                         why="Connection closed by peer"))
                         + contract.encode(contract.Joined(generation=7)))
        with coordinator.changed:
            assert coordinator.changed.wait_for(
                lambda: 1 in coordinator.peers and coordinator.peers[1].joined == 7, timeout=10)
            assert not coordinator.recovering and not coordinator.fallen_back
    finally:
        coordinator.stop()
        for connection in ranks:
            connection.close()


PEER_THAT_LEFT = """
import datetime, sys, time
import torch.distributed as dist
dist.init_process_group("gloo", init_method=sys.argv[1], rank=1, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
time.sleep(30)  # in its recovery: its connections stay open, it calls no collective
"""


def test_a_frameworks_blocking_collective_ends_as_soon_as_the_group_is_broken(monkeypatch):
    """Trainer's own gathers (its logging's, its evaluation's) block in gloo, and gloo's abort
    does not end them. A peer that left the group for its recovery keeps its connections open,
    so the gather would wait out the collective timeout and the coordinator would take this rank
    for a hung one. Within abortable_collectives it ends in GroupBroken once the link says the
    group is broken, and torch's own functions are back after it."""
    import torch.distributed as dist

    address = f"tcp://127.0.0.1:{free_port()}"
    peer = subprocess.Popen([sys.executable, "-c", PEER_THAT_LEFT, address])
    broken = threading.Event()
    monkeypatch.setattr(rank_link, "_link", types.SimpleNamespace(
        broken=broken, generation=0, declare_broken=lambda why, generation: broken.set()))
    original = dist.all_gather
    dist.init_process_group("gloo", init_method=address, rank=0, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        threading.Timer(0.5, broken.set).start()  # the coordinator's ABORT, as the link hears it
        with pytest.raises(rank_link.GroupBroken), rank_link.abortable_collectives():
            dist.all_gather([torch.zeros(1), torch.zeros(1)], torch.ones(1))
    finally:
        peer.kill()  # first: the abort waits for the gather, which ends when the peer is gone
        peer.wait()
        dist.distributed_c10d._abort_process_group()
    assert dist.all_gather is original and dist.distributed_c10d.all_gather is original


# The sharded kinds, as live_ranks.py builds them (the preload: what their forks import once).
# ZeRO stage 2 has stage 1's optimizer (DeepSpeedZeroOptimizer), whose partitions the snapshot
# and the hand-over take alike (xscale.recovery.zero.PARTITIONS): stage 1 stands for both.
SHARDED = {
    "fsdp": ({"MODEL": "fsdp"}, ()),
    "zero-1": ({"MODEL": "deepspeed", "ZERO_STAGE": "1"}, ("deepspeed",)),
    "zero-3": ({"MODEL": "deepspeed", "ZERO_STAGE": "3"}, ("deepspeed",)),
}


# How rank 2 is lost (live_ranks.py's settings), and the step every rank goes on from:
# - killed as step 31 ends: the snapshots of step 30 are whole everywhere;
# - frozen after its update of step 30, before it took that step's snapshot: its buddy (rank 0)
#   waits in the exchange for a copy that never comes, until the coordinator hears the silence
#   (XSCALE_HEARTBEAT_S) and aborts it; the copy rank 0 holds for it is step 20's.
FAULTS = {
    "killed": ({"DIE_AT": "31", "DIE_HOW": "kill"}, 30),
    "frozen-in-an-exchange": ({"DIE_AT": "30", "DIE_MICRO": "-1", "DIE_HOW": "stop"}, 20),
}
# A frozen rank is noticed by its silence; a killed one by its closed link, so its test waits
# longer for silence: on a loaded machine a rank starting DeepSpeed once sent nothing for 6 s,
# and the coordinator took it for lost before any rank was in its loop.
HEARTBEAT_S = {"killed": 30.0, "frozen-in-an-exchange": 6.0}


@pytest.mark.parametrize("kind, fault", [("fsdp", "frozen-in-an-exchange"),
                                         ("zero-1", "killed"), ("zero-3", "killed")])
def test_a_sharded_models_lost_rank_comes_back_from_its_buddys_snapshot(tmp_path: Path,
                                                                        kind: str, fault: str):
    """FSDP2, or a DeepSpeed engine with ZeRO stage 1 or 3, as the loop's model
    (live_ranks.py), three ranks on three nodes, a peer snapshot every 10 steps: rank 2 is lost
    (FAULTS). Its shard (FSDP2's of the weights and the optimizer's state, ZeRO's fp32 partition
    and its optimizer state) is held by no other rank but in its buddy's snapshot (rank 0's, the
    same local rank on the next node): the replacement takes it from there, the survivors keep
    their processes and roll back in place to the newest step whose snapshot every rank holds
    (ZeRO's counters and LR warm-up with them), and the run ends with the model and optimizer
    state an uninterrupted run ends with, whole on every rank. No checkpoint is read (there is
    none). The replacement's engine starts without the survivors (ZeRO 3's broadcast of each
    weight, its barriers and gathers included); ZeRO 3 gathers the weights in the forward,
    where the break can come, but its biases, which it keeps whole on every rank."""
    from tests.conftest import torch_extensions  # DeepSpeed's CPU op, built once

    model, preload = SHARDED[kind]
    loss, back_to = FAULTS[fault]
    host_side = host_module("coordinator")
    # A store for each run: the live run would read the uninterrupted one's keys.
    uninterrupted_store, live_store, steps = hosted_store(3), hosted_store(3), 40

    def env(rank: int, store, **extra: str) -> dict[str, str]:
        values = client_env(rank, 3, store, SLURMD_NODENAME=f"n{rank}", MAX_STEPS=str(steps),
                            XSCALE_SNAPSHOT_EVERY="10", DS_ACCELERATOR="cpu",
                            TORCH_EXTENSIONS_DIR=str(torch_extensions()),
                            XSCALE_HEARTBEAT_S=str(HEARTBEAT_S[fault]),
                            **model, **extra)
        values.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", NODE_RANK=str(rank), NNODES="3")
        return values

    def replace(nodes: list[str], generation: int) -> list[str]:
        if loss["DIE_HOW"] == "stop":
            os.kill(ranks.pids[2], signal.SIGKILL)  # a frozen node's processes stay lost
        ranks.release(XSCALE_RECOVERY_JOIN=str(generation))
        return ["n3"]

    uninterrupted = ForkedRanks([([str(PROGRAM), str(tmp_path / "uninterrupted")],
                                  env(rank, uninterrupted_store)) for rank in range(3)],
                                REPO, (*PRELOAD, *preload), env(0, uninterrupted_store))
    reference = results_of([(run.returncode, run.stdout, run.stderr)
                            for run in uninterrupted.results(timeout=120)])
    coordinator = host_side.Coordinator(3, replace, lambda why: None,
                                        heartbeat_s=HEARTBEAT_S[fault])
    coordinator.start()
    ranks = ForkedRanks([([str(PROGRAM), str(tmp_path / "live")],
                          env(rank, live_store, XSCALE_RECOVERY=coordinator.address,
                              DIE_RANK="2", **loss)) for rank in range(3)],
                        REPO, (*PRELOAD, *preload), env(0, live_store),
                        held=[([str(PROGRAM), str(tmp_path / "live")],
                               env(2, live_store, XSCALE_RECOVERY=coordinator.address))])
    runs = lost_and_replaced(ranks, coordinator)
    records = results_of(runs)
    assert [(r["rank"], r["started_at"], r["steps"]) for r in records] == [
        (0, 0, steps), (1, 0, steps), (2, back_to, steps)], records
    assert [r["pid"] for r in records[:2]] == ranks.pids[:2], records
    assert f"training goes on at step {back_to}" in runs[0][1] + runs[0][2], runs[0]
    assert len({r["digest"] for r in records}) == 1, records
    assert records[0]["digest"] == pytest.approx(reference[0]["digest"], rel=1e-9), reference
    assert coordinator.finished(wait_s=5.0)


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_peer_snapshot_comes_back_whole_or_not_at_all(corrupt: bool):
    """Rank 1's snapshot is held by rank 0 (its buddy, on the other node). With the interval
    auto, the first is taken 10 steps after the first step, and rank 0's decision is every
    rank's. Restored, the survivor (rank 0) has its own state of the snapshot's step back and the
    replacement (rank 1) the copy its buddy held, shard sizes and dtypes as they were, and both
    go on from the source's place, each with its own random generators as they were then. One
    byte flipped in the held copy: its CRC-32 does not match,
    and neither rank loads anything: both refuse with the same line."""
    store = hosted_store(2)
    address = f"tcp://127.0.0.1:{store.port}"
    program = REPO / "tests" / "programs" / "snapshot_pair.py"
    ranks = [subprocess.Popen([sys.executable, str(program), address],
                              env=client_env(rank, 2, store, CORRUPT="1" if corrupt else "0"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    outcomes = [(proc.wait(timeout=60), *proc.communicate(timeout=10)) for proc in ranks]
    records = results_of(outcomes)
    if corrupt:
        assert records == [{"refused": "the snapshot of rank 1 at step 11 fails its checksum: "
                                       "it is not loaded, and the launch falls back to its "
                                       "newest checkpoint"}] * 2, records
        return
    assert [r["state"] for r in records] == [
        [[0.0, 1.0, 2.0, 3.0, 4.0], 7, [0.5, 0.5, 0.5]],
        [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], 8, [0.5, 0.5, 0.5]]], records
    assert [r["place"] for r in records] == [[11, 0], [11, 0]], records
    assert [r["taken"] for r in records] == [[11], [11]], records
    assert [r["drawn_again"] for r in records] == [r["drawn"] for r in records], records
    assert records[0]["drawn"] != records[1]["drawn"], records  # each rank its own
    decided = re.search(r"XSCALE_SNAPSHOT_EVERY auto: every (\d+) steps", outcomes[0][1])
    assert decided and [r["every"] for r in records] == [int(decided[1])] * 2, outcomes[0][1]


def test_the_step_rolled_back_to_is_one_whose_snapshot_every_rank_has_whole():
    """Four ranks on four nodes; what each says it holds after a failure: its own copies' steps
    and those of its partner's copies it received whole. The step loaded is the newest that
    every survivor holds its own copy of and every replacement's buddy holds its copy of: an
    exchange cut short (rank 2's copy of step 30 never reached rank 3) leaves step 20. A rank
    lost with its buddy, or no step in common, serves no recovery: the line says which."""
    from xscale.recovery import snapshots

    peer = snapshots.PeerSnapshots(list, rank=0, world_size=4, per_node=1, every=10)
    whole, replacement = {"own": [20, 30], "held": [20, 30]}, {"own": [], "held": []}
    inventories = [(False, whole), (False, whole), (True, replacement),
                   (False, {"own": [20, 30], "held": [20]})]
    assert peer._agreed_step(inventories) == 20
    inventories[3] = (True, replacement)
    with pytest.raises(snapshots.SnapshotUnusable, match="rank 2 and rank 3, which held its "
                       "snapshot, were lost together: its part of the state is gone"):
        peer._agreed_step(inventories)
    inventories = [(False, {"own": [30], "held": [30]}), (False, {"own": [40], "held": [40]}),
                   (False, whole), (False, whole)]
    with pytest.raises(snapshots.SnapshotUnusable, match="no snapshot step that every rank "
                       "holds"):
        peer._agreed_step(inventories)


def test_snapshots_that_would_take_over_half_a_nodes_free_memory_are_turned_off(tmp_path: Path):
    """Two nodes of two ranks, each rank's snapshot 1 GiB: a node's ranks need 8 GiB (two slots,
    each an own copy and a partner's). 16 GiB free on both nodes: they fit. One node with 15 GiB
    free (its lowest rank's figure counts): off, with that node named. Linux's MemAvailable is
    read in bytes; a meminfo without it is unknown, and unknown memory turns nothing off."""
    from xscale.recovery import snapshots

    gib = 2**30
    assert snapshots.memory_shortfall([gib] * 4, [16 * gib] * 4, per_node=2) is None
    why = snapshots.memory_shortfall([gib] * 4, [16 * gib, 16 * gib, 15 * gib, 16 * gib], 2)
    assert why == ("they need 8.00 GiB of host memory on the node of rank 2, which has 15.00 "
                   "GiB free (they may take 50% of it)")
    assert snapshots.memory_shortfall([gib] * 4, [None] * 4, per_node=2) is None
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:   20000000 kB\n")
    assert snapshots.host_memory_free(str(meminfo)) == 20000000 * 1024
    meminfo.write_text("MemTotal:       32000000 kB\n")
    assert snapshots.host_memory_free(str(meminfo)) is None

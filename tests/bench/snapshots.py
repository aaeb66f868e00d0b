"""What a peer snapshot costs (python/xscale/recovery/snapshots.py): two gloo ranks on this
machine, each standing for a node (its buddy is the other), train torchvision's resnet50 sharded
by FSDP2 with Adam, one thread each, batch 8 of 112 x 112 images per rank. Rounds of N steps
without snapshots and N with one at every step's end, interleaved, through the loop's own call
(PeerSnapshots.after_step, K fixed at 1); medians. "stall": what a snapshot holds its step up,
the copy to host memory (and a wait for the exchange before, if it had not ended: its checksum
and transfer run in the background); then K as XSCALE_SNAPSHOT_EVERY=auto decides it (Young's
interval, the default node MTBF) and the share of the step time the snapshots then take, at
this job's 2 nodes and at 1,024.

With --device (cuda or xpu: gpu-check's `snapshots` row) rank 0 trains resnet50 (--arch: another
of torchvision's) alone on its device (batch 32 of 224 x 224 images, Adam) and rank 1, on the
host, holds its copies. Rounds of
N steps, timed on the device's clock: none, one snapshot after the first step on its side stream
(SideCopy), and one with the synchronize that stream replaced, interleaved; each is taken once
the exchange before has ended, as K steps later it would be. "stall": a snapshot round's time
less a plain round's, medians. Then the check that the side copy is the state of its step: the
state copied by hand before the snapshot, one more step (which changes all of it), and the
snapshot's copy read back must equal it. The last line is the same as JSON, for gpu-check.

    python tests/bench/snapshots.py [--rounds N] [--steps N] [--device DEVICE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]
from pair import rank0_output  # noqa: E402

from tests.gpu.verdict import SNAPSHOT_RESULT  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--device", default=None,
                        help="train on this device instead (cuda, xpu): its side-stream copy")
    parser.add_argument("--arch", default="resnet50", help="with --device: torchvision's model")
    parser.add_argument("--batch-size", type=int, default=32, help="with --device")
    parser.add_argument("--image-size", type=int, default=224, help="with --device")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def rank_main(args: argparse.Namespace) -> None:
    import threading

    import torch.distributed as dist
    from xscale.recovery import link as links

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=2, timeout=datetime.timedelta(seconds=300))
    # No coordinator here: the waits go through the link's abortable path, as in a live run.
    links._link = types.SimpleNamespace(broken=threading.Event(), generation=0,
                                        declare_broken=lambda why, generation: None)
    if args.device is None:
        fsdp_pair(args)
    elif args.rank == 0:
        device_trainer(args)
    else:
        holder(args)
    dist.destroy_process_group()


def fsdp_pair(args: argparse.Namespace) -> None:
    import torch
    import torchvision
    from torch.distributed.fsdp import fully_shard
    from xscale.checkpoints import cadence
    from xscale.recovery import fsdp, snapshots

    torch.manual_seed(0)
    model = torchvision.models.resnet50()
    for block in [*model.layer1, *model.layer2, *model.layer3, *model.layer4]:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    images, labels = torch.randn(8, 3, 112, 112), torch.randint(0, 1000, (8,))
    peer = snapshots.PeerSnapshots(lambda: fsdp.shard_state(model, optimizer), args.rank, 2, 1,
                                   every=1)
    step = 0

    def train(steps: int, snapshot: bool) -> tuple[float, list[float]]:
        nonlocal step
        stalls, started = [], time.perf_counter()
        for _ in range(steps):
            torch.nn.functional.cross_entropy(model(images), labels).backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if snapshot:
                stalls.append(peer.after_step(types.SimpleNamespace(step=step)))
        return (time.perf_counter() - started) / steps, stalls

    train(2, snapshot=True)  # warm-up; the snapshots' buffers are made
    plain, with_snapshots, stalls = [], [], []
    for _ in range(args.rounds):
        plain.append(train(args.steps, snapshot=False)[0])
        step_s, taken = train(args.steps, snapshot=True)
        with_snapshots.append(step_s)
        stalls += taken
    if args.rank != 0:
        return
    state = sum(t.numel() * t.element_size() for t in fsdp.shard_state(model, optimizer))
    memory = sum(slot.own.numel() + slot.held.numel() for slot in peer.slots)
    step_s, stall_s = statistics.median(plain), statistics.median(stalls)
    print(f"resnet50, FSDP2 over 2 ranks, Adam: {state / 2**20:.0f} MiB of state per rank; "
          f"host memory {memory / 2**20:.0f} MiB per rank (two snapshots, each its own copy "
          "and its partner's)")
    print(f"step {step_s:.3f} s without snapshots, {statistics.median(with_snapshots):.3f} s "
          f"with one at every step; a snapshot stalls the step {stall_s:.3f} s (median of "
          f"{len(stalls)})")
    for nodes in (2, 1024):
        every, _, _ = cadence.auto_interval(stall_s, 0.0, step_s, nodes, cadence.NODE_MTBF_H)
        print(f"auto at {nodes} nodes: every {every} steps, "
              f"{100 * stall_s / (every * step_s):.3f}% of the step time")


def device_snapshots(args: argparse.Namespace) -> int:
    """How many snapshots the device trainer takes: both ranks take each one together."""
    return 1 + 2 * args.rounds + 1  # the warm-up, the two kinds of rounds, the check


def device_trainer(args: argparse.Namespace) -> None:
    import torch
    import torchvision
    from xscale.checkpoints import cadence
    from xscale.recovery import fsdp, snapshots

    device = torch.device(args.device, 0)
    torch.manual_seed(0)
    model = torchvision.models.get_model(args.arch).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    labels = torch.randint(0, 1000, (args.batch_size,), device=device)
    peer = snapshots.PeerSnapshots(lambda: fsdp.shard_state(model, optimizer), 0, 2, 1, every=1)
    steps = 0

    def step() -> None:
        nonlocal steps
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad()
        steps += 1

    def synchronize() -> None:
        if device.type != "cpu":
            torch.accelerator.synchronize()

    def synchronous_copy_in(buffer: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        snapshots._copy_each(buffer, tensors)  # the copy before SideCopy: one wait for all
        synchronize()

    def round_s(kind: str) -> float:
        """ARGS.steps steps, a snapshot of KIND after the first ('none': no snapshot)."""
        peer.finish()  # the exchange before has ended, as it would have K steps later
        side_copy_in = snapshots._copy_in
        if kind == "synchronize":
            snapshots._copy_in = synchronous_copy_in
        try:
            synchronize()
            started = time.perf_counter()
            for index in range(args.steps):
                step()
                if index == 0 and kind != "none":
                    peer.after_step(types.SimpleNamespace(step=steps))
            synchronize()
            return time.perf_counter() - started
        finally:
            snapshots._copy_in = side_copy_in

    round_s("side stream")  # warm-up: the buffers are made, the device copy's time measured
    rounds: dict[str, list[float]] = {"none": [], "side stream": [], "synchronize": []}
    for _ in range(args.rounds):
        for kind, times in rounds.items():
            times.append(round_s(kind))
    plain = statistics.median(rounds["none"])
    stall = {kind: statistics.median(t - p for t, p in zip(rounds[kind], rounds["none"],
                                                              strict=True))
             for kind in ("side stream", "synchronize")}
    step_s = plain / args.steps
    state = fsdp.shard_state(model, optimizer)
    result = {
        "device": str(device), "state_mib": snapshots.payload_bytes(state) / 2**20,
        "host_mib": sum(s.own.numel() + s.held.numel() for s in peer.slots) / 2**20,
        "step_s": step_s, "stall_s": stall["side stream"],
        "stall_synchronize_s": stall["synchronize"], "copy_s": peer.copy_s,
        **whole_at_its_step(peer, state, step)}
    for nodes in (2, 1024):
        every, _, _ = cadence.auto_interval(max(result["stall_s"], 0.0), 0.0, step_s, nodes,
                                            cadence.NODE_MTBF_H)
        result[f"auto_every_{nodes}"] = every
        result[f"auto_share_{nodes}"] = max(result["stall_s"], 0.0) / (every * step_s)
    print(f"{args.arch} on {device}, Adam, batch {args.batch_size}: {result['state_mib']:.0f} MiB "
          f"of state; host memory {result['host_mib']:.0f} MiB (two snapshots, each its own "
          f"copy and its partner's)")
    side_ms, synchronize_ms = (1000 * stall[kind] for kind in ("side stream", "synchronize"))
    print(f"step {1000 * step_s:.1f} ms; a snapshot stalls training {side_ms:.1f} ms on its "
          f"side stream, {synchronize_ms:.1f} ms with a synchronize (medians of {args.rounds} "
          f"rounds of {args.steps} steps); the copy takes {1000 * (peer.copy_s or 0.0):.1f} ms "
          "on the device")
    for nodes in (2, 1024):
        print(f"auto at {nodes} nodes: every {result[f'auto_every_{nodes}']} steps, "
              f"{100 * result[f'auto_share_{nodes}']:.3f}% of the step time")
    print(f"the snapshot is the state of its step: {result['whole']} (the step after it "
          f"changed the state: {result['changed']})")
    print(SNAPSHOT_RESULT + json.dumps(result), flush=True)


def whole_at_its_step(peer: Any, state: list[Any], step: Callable[[], None]) -> dict[str, bool]:
    """Whether the snapshot holds the state of its step, though the step after it was issued
    while the copy could still run: `whole`, and `changed`, that step changed the state (else
    the comparison proves nothing)."""
    import torch
    from xscale.checkpoints import generators
    from xscale.recovery import snapshots

    peer.finish()
    before = [tensor.detach().to("cpu", copy=True) for tensor in state]
    peer.after_step(types.SimpleNamespace(step=-1))
    slot = peer.exchange.slot
    step()
    peer.finish()
    read = [torch.empty_like(tensor) for tensor in before]
    snapshots._read(slot.own, read + generators.generator_tensors())
    after = [tensor.detach().to("cpu") for tensor in state]
    return {"whole": snapshots._checksum_matches(slot.own)
            and all(torch.equal(a, b) for a, b in zip(before, read, strict=True)),
            "changed": any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))}


def holder(args: argparse.Namespace) -> None:
    """Rank 1 with --device: the other node, which holds the trainer's copies (and sends its
    own, of one number); each snapshot is a collective of both ranks."""
    import torch
    from xscale.recovery import snapshots

    peer = snapshots.PeerSnapshots(lambda: [torch.zeros(1)], 1, 2, 1, every=1)
    for taken in range(device_snapshots(args)):
        peer.after_step(types.SimpleNamespace(step=taken))
    peer.finish()


def main() -> None:
    args = parse_args()
    if args.rank is not None:
        rank_main(args)
        return
    options = ["--rounds", str(args.rounds), "--steps", str(args.steps)]
    if args.device is not None:
        options += ["--device", args.device, "--arch", args.arch, "--batch-size",
                    str(args.batch_size), "--image-size", str(args.image_size)]
    # With a device, a failure's traceback goes to stderr (gpu-check's log): one run per session
    print(rank0_output(__file__, *options, quiet=args.device is None), end="")


if __name__ == "__main__":
    main()

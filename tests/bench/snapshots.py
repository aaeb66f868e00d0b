"""What a peer snapshot costs (python/xscale/recovery/snapshots.py): two gloo ranks on this
machine, each standing for a node (its buddy is the other), train torchvision's resnet50 sharded
by FSDP2 with Adam, one thread each, batch 8 of 112 x 112 images per rank. Rounds of N steps
without snapshots and N with one at every step's end, interleaved, through the loop's own call
(PeerSnapshots.after_step, K fixed at 1); medians. "stall": what a snapshot holds its step up,
the copy to host memory (and a wait for the exchange before, if it had not ended: its checksum
and transfer run in the background); then K as XSCALE_SNAPSHOT_EVERY=auto decides it (Young's
interval, the default node MTBF) and the share of the step time the snapshots then take, at
this job's 2 nodes and at 1,024.

    python tests/bench/snapshots.py [--rounds N] [--steps N]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pair import rank0_output  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def rank_main(args: argparse.Namespace) -> None:
    import threading

    import torch
    import torch.distributed as dist
    import torchvision
    from torch.distributed.fsdp import fully_shard
    from xscale.checkpoints import cadence
    from xscale.recovery import fsdp, snapshots
    from xscale.recovery import link as links

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=2, timeout=datetime.timedelta(seconds=300))
    # No coordinator here: the waits go through the link's abortable path, as in a live run.
    links._link = types.SimpleNamespace(broken=threading.Event(), generation=0,
                                        declare_broken=lambda why, generation: None)
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
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    if args.rank is not None:
        rank_main(args)
        return
    print(rank0_output(__file__, "--rounds", str(args.rounds), "--steps", str(args.steps)),
          end="")


if __name__ == "__main__":
    main()

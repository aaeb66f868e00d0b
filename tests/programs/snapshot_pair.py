"""Two ranks on two nodes of their own, peer snapshots between them (xscale.recovery.snapshots),
at their default interval, auto: steps 1 to 11 end, the first snapshot is taken at step 11 and
the interval decided from it; each changes its state and draws on from its random generators
(seeded by rank), and then rank 1 plays a replacement (it lost its state: zeros, and its
generators: seeded anew), rank 0 a survivor, and both restore. With CORRUPT=1 rank 0 flips one
byte of the copy it holds for rank 1 first. Each rank prints `RESULT {json}`: its state after
the restore, the place it goes on from, the interval, and the numbers its generators gave after
the snapshot and again after the restore; or the line that refused the restore."""

import datetime
import json
import os
import random
import sys
import threading
import types

import torch
import torch.distributed as dist
from xscale import lifecycle
from xscale.recovery import link as links
from xscale.recovery import snapshots


def main() -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=sys.argv[1], rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    links._link = types.SimpleNamespace(broken=threading.Event(), generation=0,
                                        declare_broken=lambda why, generation: None)
    random.seed(100 + rank)
    torch.manual_seed(100 + rank)
    # Shards of different sizes, and dtypes of different widths (FSDP2's, Adam's step).
    state = [torch.arange(5.0 + rank), torch.tensor(7 + rank, dtype=torch.int64),
             torch.full((3,), 0.5, dtype=torch.float16)]
    peer = snapshots.PeerSnapshots(lambda: state, rank, 2, 1, every="auto")
    taken = [step for step in range(1, 12)
             if peer.after_step(types.SimpleNamespace(step=step, rank=rank)) is not None]
    after_snapshot = draws()
    for tensor in state:
        tensor.zero_() if rank == 1 else tensor.add_(1)  # the replacement's state is gone
    if rank == 1:
        random.seed(0)
        torch.manual_seed(0)
    peer.finish()  # the exchange, in the background
    if rank == 0 and os.environ.get("CORRUPT") == "1":
        peer.slots[0].held[snapshots.HEADER.size + 2] ^= 0xFF
    try:
        place = peer.restore(joining=rank == 1, source=0)
    except snapshots.SnapshotUnusable as error:
        print("RESULT " + json.dumps({"refused": str(error)}), flush=True)
        return
    print("RESULT " + json.dumps({"state": [t.tolist() for t in state], "taken": taken,
                                  "place": [place.step, place.rank],
                                  "every": peer.schedule.every, "drawn": after_snapshot,
                                  "drawn_again": draws()}), flush=True)


def draws() -> list[float]:
    """Python's and torch's next numbers (a Gaussian: Python caches its second one)."""
    return [random.random(), random.gauss(0.0, 1.0), *torch.rand(2).tolist()]


if __name__ == "__main__":
    main()
    lifecycle.exit_cleanly(0)  # as xscale's trainers leave: gloo can abort an interpreter's exit

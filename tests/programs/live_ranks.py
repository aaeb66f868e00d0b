"""A rank of a small DDP training through xscale.Loop (a BatchNorm layer, Adam, one DataLoader
worker), for live recovery's tests: MAX_STEPS steps; the rank in DIE_RANK kills itself (SIGKILL,
as a crashed node's processes die) or stops (SIGSTOP, as a frozen node's) when its step DIE_AT
is recorded, in the way DIE_HOW says. The rank in HOLD_RANK, at that step, waits after its
optimizer step until the group is known broken, so that it recovers a step behind the others
(as a survivor does whose ring all-reduce ended later than another's). Each rank prints
`RESULT {json}` at its end: its pid, the step it started at, the steps, a digest of its
parameters and optimizer state (equal on every rank of a healthy DDP run), and of the batch it
trained each step on.
"""

import json
import os
import signal
import sys

import torch
import xscale
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset
from xscale.recovery import link as links

MAX_STEPS = int(os.environ.get("MAX_STEPS", "120"))
DIE_AT = int(os.environ.get("DIE_AT", "-1"))
DIE_RANK = int(os.environ.get("DIE_RANK", "-1"))
REPLACEMENT = "XSCALE_RECOVERY_JOIN" in os.environ  # it does not die again
DIE_HOW = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}[os.environ.get("DIE_HOW", "kill")]
HOLD_RANK = int(os.environ.get("HOLD_RANK", "-1"))


def digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """The parameters' and the optimizer's state (not the buffers: each rank's last forward
    updates BatchNorm's statistics from its own batch)."""
    tensors = list(model.parameters())
    for state in optimizer.state.values():
        tensors += [value for value in state.values() if torch.is_tensor(value)]
    return float(sum(tensor.double().sum() for tensor in tensors))


def main() -> None:
    ctx = xscale.start(backend="gloo")
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(4096, 32, generator=generator)
    data = TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64),
                                                  nn.ReLU(), nn.Linear(64, 1)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = xscale.loader(data, ctx, batch_size=16, workers=1)
    loop = xscale.Loop(ctx, loader, model=model, optimizer=optimizer, max_steps=MAX_STEPS,
                       output_dir=sys.argv[1], log_every=5, name="live")
    started_at, trained = loop.step, {}
    for _, (features, target) in loop.batches():
        trained[loop.step + 1] = float(features.double().sum())  # a dropped step's is replaced
        loss = nn.functional.mse_loss(model(features), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if ctx.rank == HOLD_RANK and loop.step + 1 == DIE_AT and not REPLACEMENT:
            links.link().broken.wait(timeout=60)
        loop.record(loss, len(features))
        if ctx.rank == DIE_RANK and loop.step == DIE_AT and not REPLACEMENT:
            os.kill(os.getpid(), DIE_HOW)
    loop.finish()
    print("RESULT " + json.dumps({"rank": ctx.rank, "pid": os.getpid(), "started_at": started_at,
                                  "steps": loop.step, "digest": digest(model, optimizer),
                                  "trained": trained}),
          flush=True)
    loop.report()


if __name__ == "__main__":
    xscale.run_and_exit(main)

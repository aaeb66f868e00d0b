"""One of two ranks on a real gloo group training a small DDP model through xscale.Loop, with
its batches from a data set that takes DATA_DELAY_S seconds per sample (default 0: none), as a
slow file system would; one DataLoader worker, as production has. The run's end prints the
step-time verdict (xscale.observe.steptime) and rank 0 writes the summary under argv[1].

tests/test_steptime.py runs two of it (tests.helpers.run_two_ranks); each rank prints one
`RESULT {json}` line.
"""

import json
import os
import sys
import time

import torch
import xscale
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

DELAY_S = float(os.environ.get("DATA_DELAY_S", "0"))


class SlowReads(Dataset):
    """Random regression samples, each read in DELAY_S."""

    def __init__(self, samples: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(samples, 64, generator=generator)
        self.targets = self.inputs.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(DELAY_S)  # the fault this program stands for, not synchronisation
        return self.inputs[index], self.targets[index]


def main() -> None:
    ctx = xscale.start(backend="gloo")
    loader = xscale.loader(SlowReads(1024), ctx, batch_size=16, workers=1)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(),
                                                  nn.Linear(256, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loop = xscale.Loop(ctx, loader, model=model, optimizer=optimizer, max_steps=25,
                       output_dir=sys.argv[1], name="steptime")
    for _, (features, target) in loop.batches():
        loss = nn.functional.mse_loss(model(features), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loop.record(loss, len(features))
    loop.finish()
    loop.report()
    breakdown = loop.tally.clock.breakdown()
    print("RESULT " + json.dumps({"rank": ctx.rank, "breakdown": breakdown.__dict__}), flush=True)


if __name__ == "__main__":
    xscale.run_and_exit(main)

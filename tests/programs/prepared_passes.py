"""A one-process script in the short form (xscale.prepare) whose samples are their own indices,
so that the steps it trains can be compared between runs. tests/test_prepared.py runs it.

    prepared_passes.py [--epochs N] [--peek] [--stop-at STEP] [--scaler] [--own-group]
                       [--mistake KIND]

--peek: each epoch first takes `next(iter(loader))` to print the batch size, as
pytorch/examples' ddp-tutorial-series does; --stop-at: a stop signal arrives at that step;
--scaler: a GradScaler skips the first steps (no optimizer.step(), no step hook); --own-group:
the script joins its group itself (prepare() takes it as it is);
--mistake: hand prepare() what it cannot serve. Prints `TRAINED {json}`: the first index of
each batch it trained and the learning rate it trained with (a StepLR halves it each epoch), its
passes' lengths, and the steps its GradScaler skipped.
"""

import argparse
import json
import signal

import torch
import torch.distributed as dist
import xscale
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(64))


class Engine(nn.Linear):
    """What a DeepSpeed engine looks like to prepare(): a module with its own backward."""

    def backward(self, loss):
        loss.backward()

    def save_checkpoint(self, path):
        pass

    def load_checkpoint(self, path):
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--peek", action="store_true")
    parser.add_argument("--stop-at", type=int, default=None)
    parser.add_argument("--scaler", action="store_true",
                        help="a GradScaler whose first steps overflow, and are skipped")
    parser.add_argument("--own-group", action="store_true",
                        help="join the process group with torch's own call, not xscale.start()")
    parser.add_argument("--mistake", choices=["no-end", "stream", "engine", "batch-sampler"])
    args = parser.parse_args()
    if args.own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    else:
        xscale.start()
    torch.manual_seed(0)
    data = TensorDataset(torch.arange(64, dtype=torch.float32).unsqueeze(1))
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data), num_workers=1)
    model = nn.Linear(1, 1)
    ends = {"epochs": args.epochs}
    if args.mistake == "no-end":
        ends = {}
    elif args.mistake == "stream":
        loader = DataLoader(Stream(), batch_size=4)
    elif args.mistake == "engine":
        model = Engine(1, 1)
    elif args.mistake == "batch-sampler":
        loader = DataLoader(data, batch_sampler=[[0, 1], [2, 3]])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    # 1e38: the first gradients overflow; the scale halves at each skipped step until they fit.
    scaler = torch.amp.GradScaler("cpu", init_scale=1e38, enabled=args.scaler)
    # Stepped after each epoch, as pytorch/examples' ImageNet script steps its StepLR.
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, loader = xscale.prepare(model, optimizer, loader, checkpoint_every=5,
                                              scheduler=scheduler, scaler=scaler, **ends)
    trained, rates, passes, step, skipped = [], [], [], 0, 0
    for epoch in range(args.epochs):
        if args.peek:
            print(f"epoch {epoch}: batch size {len(next(iter(loader))[0])}", flush=True)
        drawn = 0
        for (batch,) in loader:
            loss = model(batch).pow(2).mean()
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scale = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            skipped += scaler.get_scale() < scale
            trained.append(int(batch[0, 0]))
            rates.append(optimizer.param_groups[0]["lr"])
            drawn += 1
            step += 1
            if step == args.stop_at:
                signal.raise_signal(signal.SIGUSR1)  # Slurm's warning, to this rank alone
        passes.append(drawn)
        scheduler.step()
    print("TRAINED " + json.dumps({"first_indices": trained, "rates": rates, "passes": passes,
                                   "batches_per_epoch": len(loader), "skipped": skipped}),
          flush=True)


if __name__ == "__main__":
    main()

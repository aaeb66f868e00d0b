"""A training loop's DataLoader workers hit by Slurm's warning signal (SIGUSR1 to the whole
process group, as Slurm signals a step): with xscale.data.make_loader the workers live on and the
loop finishes with the stop noted; a plain DataLoader's spawned workers die of it.

tests/test_data.py (test_loader_workers_survive_slurms_warning_signal) runs it in a session of
its own as `loader_workers_under_sigusr1.py HOW DEVICE`: HOW is "xscale" (make_loader) or "plain"
(a DataLoader with the same start method); DEVICE is only a name ("cuda" stands for a GPU rank,
which means spawn; "cpu" means fork): no GPU is touched. It prints the samples seen and whether
the stop flag holds SIGUSR1. Its top level says on stderr whether torch was imported before it
ran: a spawned worker imports it again, a fork of xscale's fork server has it already.
"""

import os
import sys

print(f"top level run: torch {'already' if 'torch' in sys.modules else 'not'} imported",
      file=sys.stderr, flush=True)

import signal  # noqa: E402  (after the line above, which must see what came before)

import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from xscale import data, lifecycle  # noqa: E402

if __name__ == "__main__":  # a spawned worker or a fork server imports this file again
    lifecycle.install_stop_handlers()
    dataset = TensorDataset(torch.arange(64))
    sampler = torch.utils.data.SequentialSampler(dataset)
    if sys.argv[1] == "xscale":  # make_loader: spawn on GPUs, fork on CPUs
        loader = data.make_loader(dataset, sampler, batch_size=4, workers=2,
                                  device=torch.device(sys.argv[2]))
    else:  # a plain DataLoader with the same start method
        method = "spawn" if sys.argv[2] != "cpu" else "fork"
        loader = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=2,
                            persistent_workers=True, multiprocessing_context=method)
    seen = 0
    for epoch in range(2):
        for index, batch in enumerate(loader):
            seen += len(batch[0])
            if epoch == 0 and index == 1:  # workers are up: Slurm signals the whole task
                os.killpg(os.getpgid(0), signal.SIGUSR1)
    print(seen, lifecycle.stop_received() == signal.SIGUSR1, flush=True)
    lifecycle.exit_cleanly(0)

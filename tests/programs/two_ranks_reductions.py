"""One of two ranks on a real gloo group (run.sh's variables: RANK, WORLD_SIZE, MASTER_ADDR,
...), exercising what a run reduces or agrees on over its ranks: the mean loss and the accuracy
over uneven shards (sums, not averages of means), the stop vote, the throughput's sum, and the
newest checkpoint (refused when the ranks' directories differ, shared when they are the same).
Checkpoints go under the directory argv[1]; the exit status is $EXIT_WITH (default 0).

tests/test_runtime.py (test_two_ranks_reduce_sums_not_averages_and_agree) runs two of it
(tests.helpers.run_two_ranks); each rank prints one `RESULT {json}` line.
"""

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn
from xscale import lifecycle, reductions, runtime, vision
from xscale.checkpoints import contents, files
from xscale.dist import init_distributed
from xscale.lifecycle import UserError
from xscale.observe.throughput import Throughput

ctx = init_distributed()
out = {"rank": ctx.rank, "world": ctx.world_size, "backend": ctx.backend}
# Uneven shards: rank 0 has 3 samples of loss 1.0, rank 1 one sample of loss 5.0. The job's
# mean is 8/4 = 2.0; the mean of the two ranks' means would be 3.0.
if ctx.rank == 0:
    sums = reductions.all_reduce_sums({"loss_sum": 3.0, "samples": 3})
else:
    sums = reductions.all_reduce_sums({"loss_sum": 5.0, "samples": 1})
out["mean_loss"] = reductions.mean(sums, "loss_sum", "samples")


# Accuracy over uneven shards: a model that predicts class 0; rank 0's targets are all 0
# (3 right), rank 1's are [1, 1, 1, 0, 1] (1 right of 5): 4 / 8, not (1.0 + 0.2) / 2.
class Zero(nn.Module):
    def forward(self, x):
        return torch.stack([torch.ones(len(x)), torch.zeros(len(x))], dim=1)


targets = torch.tensor([0, 0, 0]) if ctx.rank == 0 else torch.tensor([1, 1, 1, 0, 1])
result = vision.evaluate_classifier(Zero(), [(torch.zeros(len(targets), 1), targets)],
                                   ctx.device)
out["accuracy"], out["eval_samples"] = result["accuracy"], result["samples"]
# A stop signal seen by rank 1 only stops both, at the same call.
if ctx.rank == 1:
    lifecycle.request_stop()
out["stop"] = runtime.vote().stop
meter = Throughput(ctx.device, warmup_steps=0)
meter.start()
meter.step(10 * (ctx.rank + 1))
meter.stop()
rates = meter.reduced()
out["rates_sum_ok"] = abs(rates["samples_per_s"] - 2 * rates["samples_per_s_per_rank"]) < 1e-6
# Checkpoints in different directories per rank (node-local storage): refused.
mine = Path(sys.argv[1]) / f"rank{ctx.rank}"
if ctx.rank == 0:
    files.save(mine, 4, {"step": 4})
try:
    files.load_latest(mine)
    out["disagreement"] = None
except UserError as error:
    out["disagreement"] = str(error)
# The same directory: every rank resumes from the same step.
shared = Path(sys.argv[1]) / "shared"
if ctx.rank == 0:
    files.save(shared, 9, {"step": 9})
torch.distributed.barrier()
out["shared_step"] = files.load_latest(shared)["step"]
rng = contents.gather_rng_states()
out["rng_states"] = len(rng)
print("RESULT " + json.dumps(out), flush=True)
lifecycle.exit_cleanly(int(os.environ.get("EXIT_WITH", "0")))

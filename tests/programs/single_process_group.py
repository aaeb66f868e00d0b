"""A one-process job without any rank variables or MASTER_ADDR: init_distributed makes a group
of one, an all_reduce on it works, and it prints `RANK WORLD_SIZE SUM`.

tests/test_dist.py (test_single_process_needs_no_master_addr) runs it.
"""

import torch
from xscale import lifecycle
from xscale.dist import init_distributed

ctx = init_distributed()
t = torch.ones(1)
torch.distributed.all_reduce(t)
print(ctx.rank, ctx.world_size, t.item())
lifecycle.exit_cleanly(0)

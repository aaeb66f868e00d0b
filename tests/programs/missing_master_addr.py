"""init_distributed as a trainer calls it (prog "p.py"), for a job that sets RANK and WORLD_SIZE
but no MASTER_ADDR: it must end with one `p.py: error: ...` line and status 2.

tests/test_dist.py (test_missing_master_addr_is_a_user_error) runs it.
"""

from xscale import lifecycle
from xscale.dist import init_distributed

lifecycle.run_and_exit(init_distributed, prog="p.py")

"""One local rank of a trainer's `--stage-tar`: xscale.staging.stage_tar(TAR, DEST,
local_rank=LOCAL_RANK, timeout_s=TIMEOUT_S), run as `stage_tar_rank.py TAR DEST LOCAL_RANK
TIMEOUT_S`; it prints the staged directory. Local rank 0 unpacks, the others wait for its marker.

tests/test_staging.py (stage_ranks) starts several of it at once, as the ranks of one node.
"""

import sys

from xscale import lifecycle, staging


def main():
    path = staging.stage_tar(sys.argv[1], sys.argv[2], local_rank=int(sys.argv[3]),
                             timeout_s=float(sys.argv[4]), poll_s=0.02)
    print(path)


sys.exit(lifecycle.run(main, prog="stage"))

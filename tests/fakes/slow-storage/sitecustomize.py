"""Test bed only: storage that is slow to make a checkpoint durable, as a loaded Lustre is.

tests/test_failures.py puts this directory on a job's PYTHONPATH, so every rank's Python imports
it at start-up. fsync of a checkpoint's temporary file (xscale.checkpoints.files'
`.ckpt-*.tmp`) then takes XSCALE_TEST_SLOW_FSYNC_S seconds longer: a background write is
reliably under way when the test signals or kills the ranks. Every other fsync, and everything
else, is the real one.
"""

import os
import time

_real_fsync = os.fsync
_delay_s = float(os.environ.get("XSCALE_TEST_SLOW_FSYNC_S", "0"))


def _slow_fsync(fd):
    try:
        name = os.path.basename(os.readlink(f"/proc/self/fd/{int(fd)}"))
    except (OSError, TypeError, ValueError):
        name = ""
    if name.startswith(".ckpt-"):
        time.sleep(_delay_s)
    _real_fsync(fd)


if _delay_s > 0:
    os.fsync = _slow_fsync

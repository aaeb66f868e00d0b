"""A checkpoint write killed halfway: saves step 10 into the directory argv[1], then starts saving
step 20 with a writer that stops halfway (as a save to a slow Lustre OST does when the time
limit's KILL arrives), prints "halfway", and blocks on stdin until it is killed.

tests/test_failures.py (test_kill_9_during_a_checkpoint_write_leaves_the_previous_one_loadable)
runs it, kills it with SIGKILL, and checks that step 10 still loads.
"""

import io
import sys

import torch
from xscale.checkpoints import files

out = sys.argv[1]
files.save(out, 10, {"step": 10, "weights": torch.full((4096,), 10.0)})


def halts_halfway(state, handle):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    handle.write(data[: len(data) // 2])
    handle.flush()
    print("halfway", flush=True)
    sys.stdin.read()  # blocks until the test kills this process
    handle.write(data[len(data) // 2:])


state = {"step": 20, "weights": torch.full((4096,), 20.0)}
files.atomic_save(state, files.checkpoint_path(out, 20), writer=halts_halfway)

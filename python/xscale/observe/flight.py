"""The flight recorder's record of a failed rank, for the supervisor to name a hung one.

torch's flight recorder keeps the last TORCH_FR_BUFFER_SIZE collectives of every process group
(run.sh turns it on), each with its sequence number; a process group's status says which it
enqueued last and which it completed last. When a collective times out, the ranks that wait in
it know its number; the rank that never joined it is the one whose record is missing (a frozen
process cannot write its own) or stops short of it. The supervisor (jobs/lib/supervisor.py)
exports XSCALE_FR_DIR for the step and reads the records there after it fails.

On NCCL and RCCL, torch's watchdog writes the record itself when a collective times out
(TORCH_NCCL_DUMP_ON_TIMEOUT, TORCH_FR_DUMP_TEMP_FILE=XSCALE_FR_DIR/rank, set by run.sh) and ends
the process. On gloo (and xccl) the timeout reaches Python as an exception, and
record_failure(), called by xscale.lifecycle on any exception that ends a trainer, writes the
same file: XSCALE_FR_DIR/rank<RANK>, a pickle torch's analyzer reads too
(`python -m torch.distributed.flight_recorder.fr_trace XSCALE_FR_DIR --prefix rank`), with
xscale's own entry added: the error, this rank's node, process and step.

Then the rank waits, a bounded while (HOLD_S), until the supervisor writes XSCALE_FR_DIR/released:
Slurm ends every task of the step once one has failed, and the hung rank has to be alive for the
supervisor to read its Python stack (py-spy).
"""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

import torch
import torch.distributed as dist

from xscale.shared import contract, settings

HOLD_S = 30.0  # the supervisor needs a few seconds: the records to settle, py-spy to attach
POLL_S = 0.2


def record_failure(error: BaseException, hold: bool = True, replace: bool = True) -> None:
    """Write this rank's flight record into XSCALE_FR_DIR and, with HOLD, wait for the
    supervisor's release; REPLACE: an earlier record of xscale's own. Nothing without
    XSCALE_FR_DIR (no supervisor watches) or a process group."""
    directory = settings.value(contract.FR_DIR_VAR)
    if not directory or not dist.is_initialized():
        return
    try:
        write_record(Path(directory), dist.get_rank(), error, replace)
    except (OSError, RuntimeError, pickle.PicklingError) as failure:
        print(f"xscale: warning: no flight record written: {failure}", flush=True)
        return
    if hold:
        wait_for_release(Path(directory), HOLD_S)


def write_record(directory: Path, rank: int, error: BaseException,
                 replace: bool = True) -> Path:
    """XSCALE_FR_DIR/rank<RANK>, written whole or not at all. Torch's own, if its watchdog
    already wrote one, is kept; xscale's own is replaced with REPLACE (a failure after one that
    live recovery recovered from, or the rank's own error after its group broke)."""
    path = Path(contract.flight_record(str(directory), rank))
    if path.exists() and not (replace and ours(path)):
        return path
    record = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    record["xscale"] = {
        "error": " ".join(str(error).split())[:400] or type(error).__name__,
        "node": contract.node_name(),
        "pid": os.getpid(),
        "job_step": f"{os.environ.get('SLURM_JOB_ID', '')}.{os.environ.get('SLURM_STEP_ID', '')}",
    }
    directory.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    # Protocol 2: the supervisor reads it with the batch host's Python, which may be 3.6.
    partial.write_bytes(pickle.dumps(record, protocol=2))
    partial.replace(path)
    return path


def ours(path: Path) -> bool:
    """Whether the record at PATH is xscale's (torch's watchdog writes none of its fields)."""
    try:
        return "xscale" in pickle.loads(path.read_bytes())
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError):
        return False


def wait_for_release(directory: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not (directory / contract.RELEASED).exists() and time.monotonic() < deadline:
        time.sleep(POLL_S)

#!/usr/bin/env python3
"""The doctor's torch child (started by doctor.py, once per rank): how long `import torch` takes,
how many GPUs torch sees, and, with the other ranks, a few timed all-reduces. Prints one JSON
line. A separate process, so that a hung or aborted collective (NCCL's watchdog ends the process)
costs the doctor this child, not its report.

The device and the backend are the trainers' own choice, from xscale.dist (python/xscale/dist.py):
one table, so the doctor's all-reduce runs on the backend training will use, with the import
that registers it (oneccl_bindings_for_pytorch for `ccl` on Aurora's older frameworks modules).
"""

import argparse
import json
import os
import sys
import time
from datetime import timedelta

# Where xscale's python/ is: beside runscripts/ in a checkout (Aurora, any job that runs
# runscripts/ from the checkout), in the checkout a job binds at its own path: XSCALE_ROOT
# (exported by jobs/lib/lumi.sh), else SLURM_SUBMIT_DIR (the templates' default XSCALE_ROOT,
# srun's directory on the test bed); or in xscale's images (/opt/xscale/python). The checkout's
# comes first, so that the doctor checks with the same xscale the job's trainers run; without
# any, the installed package (`pip install .`).
HERE = os.path.dirname(os.path.abspath(__file__))


def gpus_seen(torch):
    """How many GPUs torch sees, for the `gpus` check, as torch.cuda (which covers ROCm: HIP
    answers it) or torch.xpu count them; 0 with a CPU-only torch."""
    xpu = getattr(torch, "xpu", None)
    if not torch.cuda.is_available() and xpu is not None and xpu.is_available():
        return xpu.device_count()
    return torch.cuda.device_count()


def python_dirs():
    roots = [os.environ.get(name) for name in ("XSCALE_ROOT", "SLURM_SUBMIT_DIR")]
    return [os.path.join(HERE, os.pardir, os.pardir, "python"),
            *(os.path.join(root, "python") for root in roots if root), "/opt/xscale/python"]


def xscale_dist():
    """xscale.dist, the trainers' device and backend choice."""
    for folder in python_dirs():
        if os.path.isfile(os.path.join(folder, "xscale", "dist.py")):
            sys.path.insert(0, os.path.normpath(folder))
            break
    try:
        from xscale import dist
    except ImportError as error:
        raise ImportError("xscale's python/ is not in %s nor installed (%s): set XSCALE_ROOT "
                          "to the checkout" % (", ".join(python_dirs()), error)) from None
    return dist


def device_and_backend(xdist, accel):
    """This rank's device and backend as a trainer's runtime.start() takes them (XSCALE_BACKEND
    wins), the backend registered: `ccl` exists only once oneccl_bindings_for_pytorch is
    imported."""
    device = xdist.choose_device(int(os.environ.get("LOCAL_RANK", "0")), accel=accel)
    backend = xdist.choose_backend(None, device, accel)
    xdist.register_backend(backend)
    return device, backend


def synchronize(torch, device_type):
    if device_type == "cuda":
        torch.cuda.synchronize()
    elif device_type == "xpu":
        torch.xpu.synchronize()


def sweep(torch, device, device_type, sizes, iterations):
    """Bus bandwidth of an all-reduce per size, as nccl-tests defines it: the bytes each rank
    moves, 2(n-1)/n times the buffer, over the time."""
    dist = torch.distributed
    world = dist.get_world_size()
    results = []
    for size in sizes:
        buffer = torch.ones(size // 4, dtype=torch.float32, device=device)
        dist.all_reduce(buffer)  # warm-up: connections and buffers are set up here
        synchronize(torch, device_type)
        started = time.perf_counter()
        for _ in range(iterations):
            dist.all_reduce(buffer)
        synchronize(torch, device_type)
        seconds = (time.perf_counter() - started) / iterations
        busbw = size * 2 * (world - 1) / world / seconds / 1e9 if world > 1 else 0.0
        results.append({"bytes": size, "seconds": round(seconds, 6), "busbw_gbps": round(busbw, 3)})
    return results


def collective(torch, xdist, accel, sizes, timeout):
    dist = torch.distributed
    device, backend = device_and_backend(xdist, accel)
    xdist.use_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    try:
        iterations = 1 if len(sizes) == 1 else 3
        bandwidth = sweep(torch, device, device.type, sizes, iterations)
        return {"backend": backend, "bandwidth": bandwidth}
    finally:
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=60)
    parser.add_argument("--sizes", default="1048576")
    parser.add_argument("--no-collective", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    import torch
    record = {"import_s": round(time.perf_counter() - started, 3), "torch": torch.__version__,
              "nnodes": int(os.environ.get("NNODES", "1"))}
    record["torch_gpus"] = gpus_seen(torch)
    try:
        if not args.no_collective:
            xdist = xscale_dist()
            sizes = [int(size) for size in args.sizes.split(",")]
            record.update(collective(torch, xdist, xdist.probe_accelerator(), sizes,
                                     args.timeout))
    except Exception as error:  # noqa: BLE001  (reported, not raised: the verdict is rank 0's)
        first_line = (str(error).strip().splitlines() or [""])[0][:300]
        record["collective_error"] = "%s: %s" % (type(error).__name__, first_line)
    print(json.dumps(record), flush=True)
    # gloo can abort at interpreter exit after a finished group (docs/ARCHITECTURE.md): leave now.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

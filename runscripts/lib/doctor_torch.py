#!/usr/bin/env python3
"""The doctor's torch child (started by doctor.py, once per rank): how long `import torch` takes,
how many GPUs torch sees, and, with the other ranks, a few timed all-reduces. Prints one JSON
line. A separate process, so that a hung or aborted collective (NCCL's watchdog ends the process)
costs the doctor this child, not its report.
"""

import argparse
import json
import os
import sys
import time
from datetime import timedelta


def accelerator(torch):
    """(device type, GPUs torch sees). CUDA covers ROCm builds (HIP answers torch.cuda)."""
    if torch.cuda.is_available():
        return "cuda", torch.cuda.device_count()
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return "xpu", xpu.device_count()
    return "cpu", torch.cuda.device_count()  # 0 with a CPU-only torch


def backend_for(torch, device_type):
    """The backend a trainer would use; XSCALE_BACKEND wins, as in the trainers. On Intel GPUs,
    torch >= 2.8 ships 'xccl'; older frameworks modules register 'ccl' through
    oneccl_bindings_for_pytorch (ALCF, "PyTorch on Aurora")."""
    chosen = os.environ.get("XSCALE_BACKEND")
    if chosen:
        return chosen
    if device_type == "cuda":
        return "nccl"
    if device_type == "xpu":
        return "xccl" if torch.distributed.is_backend_available("xccl") else "ccl"
    return "gloo"


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


def collective(torch, device_type, count, sizes, timeout):
    dist = torch.distributed
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu")
    if device_type != "cpu" and count:
        device = torch.device(device_type, local_rank if count > 1 else 0)
        getattr(torch, device_type).set_device(device)
    backend = backend_for(torch, device_type)
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    try:
        iterations = 1 if len(sizes) == 1 else 3
        bandwidth = sweep(torch, device, device_type, sizes, iterations)
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
    device_type, count = accelerator(torch)
    record["torch_gpus"] = count
    if not args.no_collective:
        sizes = [int(size) for size in args.sizes.split(",")]
        try:
            record.update(collective(torch, device_type, count, sizes, args.timeout))
        except Exception as error:  # noqa: BLE001  (reported, not raised: the verdict is rank 0's)
            first_line = (str(error).strip().splitlines() or [""])[0][:300]
            record["collective_error"] = "%s: %s" % (type(error).__name__, first_line)
    print(json.dumps(record), flush=True)
    # gloo can abort at interpreter exit after a finished group (docs/ARCHITECTURE.md): leave now.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

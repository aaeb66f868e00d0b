"""What torch's flight recorder costs per collective: 2 gloo ranks on this machine, each round a
fresh pair of processes with TORCH_FR_BUFFER_SIZE=0 (off) or run.sh's default, interleaved, so
that the machine's drift falls on both alike. Per round: the median time of an all_reduce of
1 KiB (the kind a log interval's reduction is) and of a small DDP step (MNIST's model, batch 32).

    python tests/bench/flight_recorder.py [--rounds N] [--size ENTRIES]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from pair import rank0_output, timed_ddp_steps

COLLECTIVES = 2000
STEPS = 200
WARMUP = 20


def rank_main(rank: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    tensor = torch.ones(256)
    for _ in range(WARMUP):
        dist.all_reduce(tensor)
    times = []
    for _ in range(COLLECTIVES):
        start = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - start)
    steps = timed_ddp_steps(STEPS, WARMUP)
    if rank == 0:
        print(f"{statistics.median(times) * 1e6:.1f} {statistics.median(steps) * 1e3:.2f}",
              flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo can abort at interpreter exit (pytorch/pytorch issue 190489)


def one_round(size: int) -> tuple[float, float]:
    out = rank0_output(__file__, TORCH_FR_BUFFER_SIZE=str(size))
    collective_us, step_ms = (float(word) for word in out.split())
    return collective_us, step_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds per setting (default 6)")
    parser.add_argument("--size", type=int, default=2000, help="entries when on (run.sh's)")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.port)
    results: dict[int, list[tuple[float, float]]] = {0: [], args.size: []}
    for _ in range(args.rounds):
        for size in results:
            results[size].append(one_round(size))
    print(f"flight recorder, 2 gloo ranks, {args.rounds} interleaved rounds each "
          f"(median of the rounds' medians; min-max)")
    for size, rounds in results.items():
        collectives = [r[0] for r in rounds]
        steps = [r[1] for r in rounds]
        label = "off (0)" if size == 0 else f"on ({size} entries)"
        print(f"  {label:<20} all_reduce 1 KiB {statistics.median(collectives):7.1f} us "
              f"({min(collectives):.1f}-{max(collectives):.1f})   DDP step "
              f"{statistics.median(steps):6.2f} ms ({min(steps):.2f}-{max(steps):.2f})")


if __name__ == "__main__":
    main()

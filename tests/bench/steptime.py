"""What the step-time breakdown (xscale.observe.steptime) costs per step: 2 gloo ranks on this
machine, each round a fresh pair of processes training MNIST's model (batch 32) with DDP, without
the clock or with it (DDP timing one iteration in ten, the buffer-broadcast hooks, a clock read and
the booking of the batch wait per step), interleaved so that the machine's drift falls on both
alike. Per round: the median step; the issue's budget is 1% of the step.

    python tests/bench/steptime.py [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from pair import rank0_output, timed_ddp_steps

STEPS = 300
WARMUP = 20


def rank_main(rank: int, port: int, clocked: bool) -> None:
    import torch.distributed as dist
    from xscale.observe import steptime

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    clock = steptime.StepClock(WARMUP, world_size=2)

    def clock_step() -> None:
        clock.waited_for_data(0.0)
        clock.step()

    steps = timed_ddp_steps(STEPS, WARMUP, batch_norm=True,
                            watch=clock.watch if clocked else None,
                            after_step=clock_step if clocked else None)
    if clocked:
        clock.breakdown()
    if rank == 0:
        print(f"{statistics.median(steps) * 1e3:.3f}", flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo can abort at interpreter exit (pytorch/pytorch issue 190489)


def one_round(clocked: bool) -> float:
    return float(rank0_output(__file__, *(["--clocked"] if clocked else [])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds per setting (default 6)")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--clocked", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.port, args.clocked)
    results: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for clocked in results:
            results[clocked].append(one_round(clocked))
    print(f"step-time breakdown, 2 gloo ranks, MNIST's model with DDP, {args.rounds} interleaved "
          f"rounds each (median of the rounds' median steps; min-max)")
    medians = {clocked: statistics.median(rounds) for clocked, rounds in results.items()}
    for clocked, rounds in results.items():
        label = "with the clock" if clocked else "without"
        print(f"  {label:<16} {medians[clocked]:7.3f} ms ({min(rounds):.3f}-{max(rounds):.3f})")
    print(f"  difference       {(medians[True] / medians[False] - 1) * 100:+.2f}% of the step")
    per_step = clock_read_cost()
    print(f"  StepClock.step() alone: {per_step * 1e6:.2f} us per call")


def clock_read_cost(calls: int = 200_000) -> float:
    """One clock step's own cost, without DDP (a rank whose steps are all after the warm-up)."""
    from xscale.observe import steptime

    clock = steptime.StepClock(1)
    start = time.perf_counter()
    for _ in range(calls):
        clock.waited_for_data(0.0)
        clock.step()
    return (time.perf_counter() - start) / calls


if __name__ == "__main__":
    main()

"""How long a checkpoint holds training up: XSCALE_CHECKPOINT_MODE=sync against async, through
the trainers' own saver (xscale.checkpoints.savers.TrainingSaver), one process on this machine's
CPU, writing to build/bench-checkpoint in the checkout. Models with their optimizer state after one
step: imagenet.py's resnet50 with SGD and momentum, the GPT-neo test fixture (tests/fixtures/
tiny_gpt_neo.py) and a GPT-neo-125M-shaped model (random weights) with AdamW. Per round, one save in
each mode, interleaved; medians over the rounds. "blocks": the save call, which is all training
waits for; "writes": the background write that follows (async only).

Then whether spreading the write over the ranks pays: 2 and 4 gloo ranks holding the same
resnet50 state (DDP's case), each saving through the trainers' own saver with
XSCALE_CHECKPOINT_WRITERS=all (every rank its part of ckpt-STEP.dcp, torch.distributed.checkpoint)
and rank0 (ckpt-STEP.pt), in both modes, interleaved; medians. "blocks": the slowest rank's save
call (the next collective waits for it); "writes": rank 0's background write, to the whole
checkpoint's publication.

    python tests/bench/checkpoint.py [--rounds N] [--ranks-only]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO)]  # the fixtures (tests/); xscale is installed (`make setup`)

from xscale.checkpoints import savers  # noqa: E402


def resnet50() -> tuple[nn.Module, torch.optim.Optimizer]:
    import torchvision

    model = torchvision.models.resnet50()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def gpt_neo(hidden: int, layers: int, heads: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    config = GPTNeoConfig(vocab_size=50257, max_position_embeddings=2048, hidden_size=hidden,
                          num_layers=layers, num_heads=heads,
                          attention_types=[[["global", "local"], layers // 2]])
    model = GPTNeoForCausalLM(config)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def fixture_gpt_neo() -> tuple[nn.Module, torch.optim.Optimizer]:
    from tests.fixtures import tiny_gpt_neo

    model = tiny_gpt_neo.build_model(tiny_gpt_neo.build_tokenizer(["a tiny corpus"] * 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


MODELS = {"resnet50 + SGD": resnet50,
          "GPT-neo fixture + AdamW": fixture_gpt_neo,
          "GPT-neo-125M shape + AdamW": lambda: gpt_neo(768, 12, 12)}


def one_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Fill the optimizer's state, as a checkpoint in training holds it."""
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()


def state_mb(model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """The state's size, each storage once (tied weights)."""
    tensors = list(model.state_dict().values()) + [
        value for state in optimizer.state_dict()["state"].values() for value in state.values()
        if isinstance(value, torch.Tensor)]
    storages = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes()
                for tensor in tensors}
    return sum(storages.values()) / 1e6


def timed_save(saver: savers.TrainingSaver, step: int) -> tuple[float, float]:
    started = time.perf_counter()
    saver(step, 0)
    blocked = time.perf_counter() - started
    saver.wait()
    return blocked, saver.last_write_s


SPREAD = [(writers, mode) for writers in ("rank0", "all") for mode in ("sync", "async")]


def spread_rank(rank: int, world: int, port: int, work: Path, rounds: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    model, optimizer = resnet50()
    one_step(model, optimizer)
    savers = {(writers, mode): (savers.EveryRankSaver if writers == "all"
                                else savers.TrainingSaver)(
        work / f"{writers}-{mode}", model, optimizer, None, is_main=rank == 0, keep=1, mode=mode,
        extra={}) for writers, mode in SPREAD}
    times: dict[tuple[str, str], list[tuple[float, float]]] = {how: [] for how in SPREAD}
    for round_index in range(rounds):
        for how, saver in savers.items():
            dist.barrier()
            blocked, written = timed_save(saver, round_index + 1)
            slowest = torch.tensor([blocked])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times[how].append((slowest.item(), written))
    if rank == 0:
        for (writers, mode), seconds in times.items():
            blocks = statistics.median(blocked for blocked, _ in seconds)
            writes = statistics.median(written for _, written in seconds)
            after = f"{writes:8.3f} s" if mode == "async" else f"{'-':>10s}"
            print(f"{world:5d} {writers:>7s} {mode:>6s} {blocks:8.3f} s {after}")
    dist.barrier()
    dist.destroy_process_group()


def spread(world: int, work: Path, rounds: int) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    mp.spawn(spread_rank, args=(world, port, work, rounds), nprocs=world)
    shutil.rmtree(work, ignore_errors=True)


def models(work: Path, rounds: int) -> None:
    print(f"{'model':28s} {'state':>9s} {'sync blocks':>12s} {'async blocks':>13s} "
          f"{'async writes':>13s}")
    for name, build in MODELS.items():
        model, optimizer = build()
        one_step(model, optimizer)
        times: dict[str, list[tuple[float, float]]] = {"sync": [], "async": []}
        for round_index in range(rounds):
            for mode in times:
                shutil.rmtree(work, ignore_errors=True)
                saver = savers.TrainingSaver(work, model, optimizer, None, is_main=True,
                                                 keep=1, mode=mode, extra={})
                times[mode].append(timed_save(saver, round_index + 1))
        sync, asynchronous = (statistics.median(blocked for blocked, _ in times[mode])
                              for mode in ("sync", "async"))
        writes = statistics.median(written for _, written in times["async"])
        print(f"{name:28s} {state_mb(model, optimizer):7.0f} MB {sync:10.3f} s {asynchronous:11.3f}"
              f" s {writes:11.3f} s")
    shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ranks-only", action="store_true",
                        help="only the 2 and 4 rank comparison of the writers")
    args = parser.parse_args()
    work = REPO / "build" / "bench-checkpoint"
    if not args.ranks_only:
        models(work, args.rounds)
    print("\nresnet50 + SGD on several ranks, one save of the same state (medians):")
    print(f"{'ranks':>5s} {'writers':>7s} {'mode':>6s} {'blocks':>10s} {'writes':>10s}")
    for world in (2, 4):
        spread(world, work, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What counting one step's FLOPs (xscale.observe.flops) costs a run: a torchvision resnet18 (32
px, batch 32) and a GPT-neo-shaped transformer (the tiny fixture's shape, 64 tokens, batch 8)
trained on this machine's CPU, each step timed, the first after the warm-up inside the
FlopWindow. The cost is that step's time less the median step, as a share of a run of RUN_STEPS
steps (the issue's budget: 1% of a step, here spread over the run as the count happens once).

    python tests/bench/flop_count.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import torchvision
from xscale.observe.flops import FlopWindow

WARMUP, STEPS, RUN_STEPS = 3, 15, 1000


def timed_steps(step: Callable[[], None], counted_at: int) -> tuple[list[float], float, int]:
    """(each plain step's seconds, the counted step's seconds, its FLOPs)."""
    window, plain, counted = FlopWindow(), [], 0.0
    for index in range(WARMUP + STEPS):
        started = time.perf_counter()
        if index == counted_at:
            window.begin()
        step()
        if index == counted_at:
            window.end()
            counted = time.perf_counter() - started
        elif index >= WARMUP:
            plain.append(time.perf_counter() - started)
    return plain, counted, window.count.flops


def resnet_step() -> Callable[[], None]:
    model = torchvision.models.resnet18(num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images, labels = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))

    def step() -> None:
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def gpt_step() -> Callable[[], None]:
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    config = GPTNeoConfig(vocab_size=1000, hidden_size=64, num_layers=2, num_heads=4,
                          attention_types=[[["global", "local"], 1]], max_position_embeddings=128)
    model = GPTNeoForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 1000, (8, 64))

    def step() -> None:
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def main() -> None:
    torch.manual_seed(0)
    for name, make in (("resnet18", resnet_step), ("gpt-neo tiny", gpt_step)):
        plain, counted, flops = timed_steps(make(), counted_at=WARMUP)
        median = statistics.median(plain)
        extra = max(counted - median, 0.0)
        print(f"{name}: step {median * 1000:.1f} ms, the counted step {counted * 1000:.1f} ms "
              f"({flops / 1e9:.2f} GFLOP): +{extra * 1000:.1f} ms once, "
              f"{100 * extra / (RUN_STEPS * median):.3f}% of a {RUN_STEPS}-step run")


if __name__ == "__main__":
    main()

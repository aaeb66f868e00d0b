"""This process's random generators (Python's, torch's on the CPU, the accelerator's in use):
what a checkpoint saves for each rank and sets again at a resume, as a record (rng_state), and
what a peer snapshot copies, as tensors (generator_tensors)."""

from __future__ import annotations

import math
import random
from typing import Any

import torch


def rng_state() -> dict[str, Any]:
    """This process's random generators (Python, torch CPU, and the current accelerator's)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    accelerator = _accelerator_module()
    if accelerator is not None and accelerator.is_initialized():
        state["accelerator"] = accelerator.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_python_state(state["python"]))
    torch.set_rng_state(state["torch"])
    accelerator = _accelerator_module()
    saved = state.get("accelerator")
    if saved is not None and accelerator is not None:
        accelerator.set_rng_state(saved)


def generator_tensors() -> list[torch.Tensor]:
    """rng_state as tensors whose sizes stay the same from one call to the next (a peer
    snapshot copies them into a buffer laid out once): Python's 624 words and position, its
    cached Gaussian (NaN: none), torch's CPU state, and the accelerator's where in use."""
    state = rng_state()
    _, words, gauss = state["python"]
    return [torch.tensor(words, dtype=torch.int64),
            torch.tensor([math.nan if gauss is None else gauss], dtype=torch.float64),
            state["torch"], *([state["accelerator"]] if "accelerator" in state else [])]


def set_generators(tensors: list[torch.Tensor]) -> None:
    """The generators generator_tensors gave, set again (set_rng_state)."""
    words, gauss, cpu, *device = tensors
    cached = gauss.item()
    python = (PYTHON_STATE_VERSION, tuple(words.tolist()), None if math.isnan(cached) else cached)
    set_rng_state({"python": python, "torch": cpu,
                   **({"accelerator": device[0]} if device else {})})


PYTHON_STATE_VERSION = random.getstate()[0]  # the layout of the words (3 since Python 2.4)


def _accelerator_module() -> Any:
    """torch.cuda (CUDA and ROCm) or torch.xpu, whichever this process uses; None on CPUs."""
    device = torch.accelerator.current_accelerator(check_available=True)
    return None if device is None else torch.get_device_module(device)


def _as_python_state(value: Any) -> tuple:
    """random.setstate wants tuples; a round trip through the checkpoint may give lists."""
    version, internal, gauss = value
    return (version, tuple(internal), gauss)

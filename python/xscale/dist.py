"""Joining the process group from the variables run.sh (or torchrun) exports.

RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, NNODES, MASTER_ADDR, MASTER_PORT are
the only inputs: they mean the same under Slurm, PBS, MPI and torchrun, because run.sh translates
each launcher's names into torchrun's. With neither RANK nor WORLD_SIZE set the trainer is one
process (rank 0 of 1) and needs no MASTER_ADDR.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from xscale.cli import UserError

DEFAULT_TIMEOUT_S = 600


@dataclass(frozen=True)
class Placement:
    """Where this process sits in the job, as the launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    nnodes: int


@dataclass(frozen=True)
class DistContext:
    """This rank's place, its device and the backend of the (initialised) process group."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    nnodes: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _whole_number(name: str, value: str) -> int:
    try:
        return int(value.strip())
    except ValueError:
        raise UserError(f"{name}='{value}' is not a whole number") from None


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name)
    return None if value is None or value == "" else _whole_number(name, value)


def _agree(option: str, given: int | None, name: str, from_env: int | None) -> int | None:
    """A command-line value and the launcher's variable must describe the same rank."""
    if given is not None and from_env is not None and given != from_env:
        raise UserError(f"{option} {given} disagrees with {name}={from_env} from the launcher")
    return given if given is not None else from_env


def read_placement(
    environ: Mapping[str, str] | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
) -> Placement:
    """The rank variables, checked: numbers, in range, and consistent with each other.

    `rank`/`world_size` come from a pytorch/examples-style command line (--rank, --world-size);
    when the launcher's RANK/WORLD_SIZE are set too, both must say the same.
    """
    env = os.environ if environ is None else environ
    rank = _agree("--rank", rank, "RANK", _env_int(env, "RANK"))
    world_size = _agree("--world-size", world_size, "WORLD_SIZE", _env_int(env, "WORLD_SIZE"))
    if rank is None and world_size is None:
        return Placement(0, 1, 0, 1, 0, 1)
    if rank is None or world_size is None:
        missing = "RANK (--rank)" if rank is None else "WORLD_SIZE (--world-size)"
        raise UserError(f"{missing} is not set while the other one is: start the trainer "
                        "through runscripts/run.sh or torchrun")
    if world_size < 1:
        raise UserError(f"WORLD_SIZE={world_size} must be at least 1")
    if not 0 <= rank < world_size:
        raise UserError(f"RANK={rank} is outside 0..{world_size - 1} (WORLD_SIZE={world_size})")

    local_rank = _env_int(env, "LOCAL_RANK")
    local_world_size = _env_int(env, "LOCAL_WORLD_SIZE")
    nnodes = _env_int(env, "NNODES")
    if local_world_size is None:
        # Without the launcher's answer: one node, or the nodes share the ranks evenly.
        local_world_size = world_size // nnodes if nnodes else world_size
    if local_rank is None:
        local_rank = rank % local_world_size if local_world_size > 0 else 0
    if not 1 <= local_world_size <= world_size:
        raise UserError(f"LOCAL_WORLD_SIZE={local_world_size} is outside 1..{world_size} "
                        f"(WORLD_SIZE={world_size})")
    if not 0 <= local_rank < local_world_size:
        raise UserError(f"LOCAL_RANK={local_rank} is outside 0..{local_world_size - 1} "
                        f"(LOCAL_WORLD_SIZE={local_world_size})")
    if nnodes is None:
        nnodes = -(-world_size // local_world_size)
    node_rank = _env_int(env, "NODE_RANK")
    if node_rank is None:
        node_rank = rank // local_world_size
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise UserError(f"NODE_RANK={node_rank} is outside 0..{nnodes - 1} (NNODES={nnodes})")
    return Placement(rank, world_size, local_rank, local_world_size, node_rank, nnodes)


def timeout_from_env(environ: Mapping[str, str] | None = None) -> timedelta:
    """XSCALE_TIMEOUT_S: how long a collective may wait before the job fails instead of hangs."""
    env = os.environ if environ is None else environ
    seconds = _env_int(env, "XSCALE_TIMEOUT_S")
    if seconds is None:
        seconds = DEFAULT_TIMEOUT_S
    if seconds <= 0:
        raise UserError(f"XSCALE_TIMEOUT_S={seconds} must be a positive number of seconds")
    return timedelta(seconds=seconds)


def choose_backend(requested: str | None, on_gpu: bool,
                   environ: Mapping[str, str] | None = None) -> str:
    """The command line's backend, else XSCALE_BACKEND, else nccl on GPUs and gloo on CPUs.

    ROCm's torch reports its GPUs through torch.cuda and its "nccl" backend is RCCL.
    """
    env = os.environ if environ is None else environ
    backend = (requested or env.get("XSCALE_BACKEND") or ("nccl" if on_gpu else "gloo")).lower()
    if backend == "nccl" and not on_gpu:
        raise UserError("backend nccl needs a GPU and torch sees none: use gloo on CPUs "
                        "(--dist-backend gloo or XSCALE_BACKEND=gloo)")
    return backend


def choose_device(local_rank: int, gpu: int | None = None, require_gpu: bool = False,
                  environ: Mapping[str, str] | None = None) -> torch.device:
    """GPU number LOCAL_RANK (or `gpu`) of those visible, GPU 0 when the launcher gave each rank
    exactly one; the CPU when torch sees no GPU."""
    env = os.environ if environ is None else environ
    if not torch.cuda.is_available():
        if require_gpu or gpu is not None:
            raise UserError("a GPU was asked for (--gpu) but torch sees none")
        return torch.device("cpu")
    count = torch.cuda.device_count()
    index = local_rank if gpu is None else gpu
    if count == 1:
        index = 0
    elif not 0 <= index < count:
        visible = env.get("ROCR_VISIBLE_DEVICES") or env.get("CUDA_VISIBLE_DEVICES") or "all"
        raise UserError(f"GPU {index} asked for but only {count} are visible (visible: {visible})")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def init_distributed(
    *,
    backend: str | None = None,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    gpu: int | None = None,
    require_gpu: bool = False,
) -> DistContext:
    """Join the process group (every rank calls this once) and pick this rank's device.

    init_method: None or "env://" reads MASTER_ADDR/MASTER_PORT; "tcp://HOST:PORT" as in
    pytorch/examples' --dist-url. A single process gets a private in-memory store, so
    collectives, DDP and DeepSpeed work unchanged without any rendezvous.
    """
    where = read_placement(rank=rank, world_size=world_size)
    timeout = timeout_from_env()
    device = choose_device(where.local_rank, gpu, require_gpu)
    backend = choose_backend(backend, device.type == "cuda")
    if not dist.is_initialized():
        options: dict = {"backend": backend, "rank": where.rank,
                         "world_size": where.world_size, "timeout": timeout}
        if backend == "nccl":
            options["device_id"] = device  # eager NCCL/RCCL communicator on the right GPU
        url = None if init_method in (None, "", "env://") else init_method
        if url is None and where.world_size == 1:
            options["store"] = dist.HashStore()
        elif url is None:
            for name in ("MASTER_ADDR", "MASTER_PORT"):
                if not os.environ.get(name):
                    raise UserError(f"{name} is not set: start the trainer through "
                                    "runscripts/run.sh or torchrun, or pass --dist-url")
            options["init_method"] = "env://"
        else:
            options["init_method"] = url
        dist.init_process_group(**options)
    return DistContext(
        rank=where.rank,
        world_size=where.world_size,
        local_rank=where.local_rank,
        local_world_size=where.local_world_size,
        node_rank=where.node_rank,
        nnodes=where.nnodes,
        device=device,
        backend=backend,
    )


def collective_device() -> torch.device:
    """Where a tensor must live for the current group's collectives: NCCL/RCCL reduce only GPU
    memory, gloo only host memory."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0

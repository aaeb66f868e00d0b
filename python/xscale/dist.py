"""Where a rank runs: its place in the job, its device, and the process group it joins.

RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, NNODES, MASTER_ADDR, MASTER_PORT are
the only inputs: they mean the same under Slurm, PBS, MPI and torchrun, because run.sh translates
each launcher's names into torchrun's. With neither RANK nor WORLD_SIZE set the trainer is one
process (rank 0 of 1) and needs no MASTER_ADDR.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from xscale.lifecycle import UserError
from xscale.recovery import link as links
from xscale.shared import contract, settings

DEFAULT_TIMEOUT_S = settings.setting("XSCALE_TIMEOUT_S").default


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
class DistContext(Placement):
    """This rank's place (the Placement's fields), its device and the backend of the
    (initialised) process group."""

    device: torch.device
    backend: str | None  # None: one process started by hand under Hugging Face's Trainer

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def at(cls, placement: Placement, device: torch.device, backend: str | None) -> DistContext:
        return cls(**vars(placement), device=device, backend=backend)


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
    return timedelta(seconds=settings.value("XSCALE_TIMEOUT_S", environ))


@dataclass(frozen=True)
class Accelerator:
    """What this torch can use: the accelerator's device type (None: CPU only), how many devices
    this process sees, and which collective libraries are there for Intel GPUs."""

    type: str | None
    count: int
    xccl: bool = False  # built into torch from 2.8 on (ALCF's frameworks module from 2025.3.1)
    ccl: bool = False  # oneccl_bindings_for_pytorch, in older frameworks modules
    xpu_compiled: bool = False  # torch built with XPU support at all


def probe_accelerator() -> Accelerator:
    """The facts, from torch.accelerator: CUDA (which covers ROCm: HIP answers as "cuda"),
    XPU (Intel GPUs; Aurora's tiles), or none."""
    device = torch.accelerator.current_accelerator(check_available=True)
    return Accelerator(
        type=None if device is None else device.type,
        count=torch.accelerator.device_count() if device is not None else 0,
        xccl=dist.is_xccl_available(),
        ccl=_oneccl_bindings_importable(),
        xpu_compiled=torch.xpu._is_compiled(),
    )


def _oneccl_bindings_importable() -> bool:
    from importlib.util import find_spec

    return find_spec("oneccl_bindings_for_pytorch") is not None


def choose_device(local_rank: int, gpu: int | None = None, require_gpu: bool = False,
                  accel: Accelerator | None = None,
                  environ: Mapping[str, str] | None = None) -> torch.device:
    """Accelerator number LOCAL_RANK (or `gpu`) of those visible, number 0 when the launcher
    gave each rank exactly one; the CPU when torch sees no accelerator.

    A GPU asked for and missing is an error, never a silent run on the CPU: at 10% of the speed
    it would spend the allocation and look like a hang.
    """
    env = os.environ if environ is None else environ
    accel = probe_accelerator() if accel is None else accel
    if accel.type is None:
        if require_gpu or gpu is not None:
            raise UserError(f"a GPU was asked for (--gpu) but torch {torch.__version__} sees "
                            f"none: {no_gpu_reason(accel)}")
        return torch.device("cpu")
    index = local_rank if gpu is None else gpu
    if accel.count == 1:
        index = 0
    elif not 0 <= index < accel.count:
        visible = next((f"{name}={env[name]}" for name in VISIBILITY_VARIABLES if env.get(name)),
                       "all")
        raise UserError(f"{accel.type} device {index} asked for (LOCAL_RANK or --gpu) but only "
                        f"{accel.count} are visible ({visible})")
    return torch.device(accel.type, index)


VISIBILITY_VARIABLES = ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES",
                        "ZE_AFFINITY_MASK")


def no_gpu_reason(accel: Accelerator) -> str:
    cuda = "no CUDA or ROCm device is visible" if torch.cuda._is_compiled() \
        else "it is built without CUDA or ROCm"
    xpu = "no XPU is visible" if accel.xpu_compiled \
        else "it has no XPU support (Intel GPUs: on Aurora, `module load frameworks`)"
    return f"{cuda}, and {xpu}"


# The backend each device type takes when the user names none. nccl is RCCL in ROCm's torch.
# Intel GPUs: xccl, built into torch from 2.8 and the form ALCF's "PyTorch on Aurora" page
# documents since the frameworks module 2025.3.1 ("the backend must be changed to xccl from
# ccl"; docs.alcf.anl.gov/aurora/data-science/frameworks/pytorch/). Older modules only have
# ccl, registered by `import oneccl_bindings_for_pytorch`: used when xccl is missing.
KNOWN_BACKENDS = ("nccl", "xccl", "ccl", "gloo", "mpi")
BACKEND_DEVICE = {"nccl": "cuda", "xccl": "xpu", "ccl": "xpu"}
# init_process_group(device_id=...) forms the communicator at once, so a broken network fails
# at start-up rather than at the first all-reduce; "Currently ... only under NCCL" (PyTorch,
# torch.distributed.init_process_group).
EAGER_INIT_BACKENDS = ("nccl",)


def choose_backend(requested: str | None, device: torch.device, accel: Accelerator | None = None,
                   environ: Mapping[str, str] | None = None) -> str:
    """The command line's backend, else XSCALE_BACKEND, else the device's: nccl on CUDA/ROCm,
    xccl (or ccl) on XPU, gloo on the CPU. A backend the device cannot use is a UserError."""
    accel = probe_accelerator() if accel is None else accel
    named = (requested or settings.value("XSCALE_BACKEND", environ)).strip().lower()
    backend = named or _default_backend(device.type, accel)
    if backend not in KNOWN_BACKENDS:
        raise UserError(f"backend '{backend}' is not one of {', '.join(KNOWN_BACKENDS)}")
    needs = BACKEND_DEVICE.get(backend)
    if needs is not None and device.type != needs:
        what = "an Intel GPU (XPU)" if needs == "xpu" else "a CUDA or ROCm GPU"
        raise UserError(f"backend {backend} needs {what} and this rank runs on {device.type}: "
                        "use gloo on CPUs (--dist-backend gloo or XSCALE_BACKEND=gloo)")
    if backend == "xccl" and not accel.xccl:
        raise UserError(f"backend xccl is not built into torch {torch.__version__}: use ccl with "
                        "oneccl_bindings_for_pytorch, or a newer frameworks module")
    if backend == "ccl" and not accel.ccl:
        raise UserError("backend ccl needs oneccl_bindings_for_pytorch, which is not installed")
    return backend


def _default_backend(device_type: str, accel: Accelerator) -> str:
    if device_type == "cuda":
        return "nccl"
    if device_type == "xpu":
        if accel.xccl:
            return "xccl"
        if accel.ccl:
            return "ccl"
        raise UserError(f"torch {torch.__version__} sees Intel GPUs but has no collective "
                        "backend for them (neither xccl nor oneccl_bindings_for_pytorch)")
    return "gloo"


def use_device(device: torch.device) -> None:
    """Make `device` this process's current one (allocations, streams, the barrier at exit)."""
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)


def register_backend(backend: str) -> None:
    """ccl exists only after oneccl_bindings_for_pytorch is imported (it registers itself)."""
    if backend == "ccl":
        import oneccl_bindings_for_pytorch  # noqa: F401


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

    Every check (placement, device, backend, rendezvous variables) comes before the group is
    joined, so a mistake is one line on every rank and nothing is half set up.
    init_method: None or "env://" reads MASTER_ADDR/MASTER_PORT; "tcp://HOST:PORT" as in
    pytorch/examples' --dist-url. A single process gets a private in-memory store, so
    collectives, DDP and DeepSpeed work unchanged without any rendezvous.
    """
    where = read_placement(rank=rank, world_size=world_size)
    timeout = timeout_from_env()
    accel = probe_accelerator()
    device = choose_device(where.local_rank, gpu, require_gpu, accel)
    backend = choose_backend(backend, device, accel)
    rendezvous = _rendezvous(init_method, where.world_size)
    use_device(device)
    if not dist.is_initialized():
        register_backend(backend)
        links.connect(where.rank, where.world_size)  # with spares (xscale.recovery)
        if links.joining():  # a replacement: the group is the survivors' next one
            join_next_group(DistContext.at(where, device, backend), timeout)
        else:
            dist.init_process_group(backend=backend, rank=where.rank,
                                    world_size=where.world_size, timeout=timeout,
                                    **_eager_init(backend, device), **rendezvous)
    return DistContext.at(where, device, backend)


def join_next_group(ctx: DistContext, timeout: timedelta | None = None) -> None:
    """Form the group that live recovery's coordinator names next, on its store: a replacement
    at its start, a survivor after leaving the broken one (xscale.recovery), with the rank and
    world size the coordinator gave (a smaller world renumbers the ranks)."""
    link = links.link()
    store, generation = link.next_store()
    dist.init_process_group(backend=ctx.backend, rank=link.rank, world_size=link.world_size,
                            timeout=timeout or timeout_from_env(), store=store,
                            **_eager_init(ctx.backend, ctx.device))
    link.formed(generation)


def reach_coordinator() -> None:
    """For a script whose framework joins the process group itself (Hugging Face's Trainer,
    whose arguments' accelerate state joins it): under the supervisor's live recovery
    (XSCALE_RECOVERY), connect this rank to the coordinator, before the group is joined where
    the adapter is imported first. A replacement's join must not go to the launch's first
    rendezvous (its host may be the lost node, its ranks are in their recovery): the
    framework's init_process_group is made to join the survivors' next group on the
    coordinator's store instead, with the framework's backend and timeout."""
    if not os.environ.get(contract.RECOVERY_VAR) or links.link() is not None:
        return
    try:
        where = read_placement()
    except UserError:
        return  # the script's own join says it, in its one line
    links.connect(where.rank, where.world_size)
    if not links.joining() or dist.is_initialized():
        return
    original = dist.init_process_group

    @functools.wraps(original)
    def join(backend: str | None = None, *_: object, **kwargs: object) -> None:
        dist.init_process_group = original  # once: join_next_group's own call is torch's
        accel = probe_accelerator()
        device = choose_device(where.local_rank, accel=accel)
        backend = backend or choose_backend(None, device, accel)
        timeout = kwargs.get("timeout")
        join_next_group(DistContext.at(where, device, backend),
                        timeout if isinstance(timeout, timedelta) else None)

    dist.init_process_group = join


def _eager_init(backend: str, device: torch.device) -> dict:
    return {"device_id": device} if backend in EAGER_INIT_BACKENDS else {}


def _rendezvous(init_method: str | None, world_size: int) -> dict:
    url = None if init_method in (None, "", "env://") else init_method
    if url is not None:
        return {"init_method": url}
    if world_size == 1:
        return {"store": dist.HashStore()}
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise UserError(f"{name} is not set: start the trainer through runscripts/run.sh "
                            "or torchrun, or pass --dist-url")
    return {"init_method": "env://"}


def collective_device() -> torch.device:
    """Where a tensor must live for the current group's collectives: NCCL/RCCL and oneCCL on
    XPU reduce device memory, gloo host memory."""
    if dist.is_initialized() and dist.get_backend() in BACKEND_DEVICE:
        return torch.device(BACKEND_DEVICE[dist.get_backend()],
                            torch.accelerator.current_device_index())
    return torch.device("cpu")


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP or a DeepSpeed engine (both keep it in `.module`)."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def sharded_units(model: nn.Module) -> list[nn.Module]:
    """The modules inside MODEL that FSDP2 shards as units of their own (fully_shard applied to
    each), MODEL itself left out: each gathers its weights from every rank as its forward
    starts. Empty for a model that is not sharded."""
    unit = _fsdp_module_class()
    if unit is None:
        return []
    return [module for module in model.modules()
            if module is not model and isinstance(module, unit)]


def is_sharded(model: nn.Module) -> bool:
    """Whether MODEL's parameters are sharded over the ranks by FSDP2 (torch's fully_shard):
    no rank holds the whole model, so only every rank together can save it."""
    unit = _fsdp_module_class()
    return unit is not None and isinstance(model, unit)


def _fsdp_module_class() -> type | None:
    """FSDP2's FSDPModule if the script imported FSDP, else None: read from sys.modules, a
    script that sharded its model has imported it, and one that did not is spared the import."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return None if fsdp is None else fsdp.FSDPModule

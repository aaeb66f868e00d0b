"""A rank of a small DDP training through xscale.Loop, or with FORM=prepared xscale.prepare's
short form (a BatchNorm layer, Adam, an LR raised at every step, one DataLoader worker), for
live recovery's tests:
MAX_STEPS steps of ACCUMULATION micro-batches each. With MODEL=fsdp the model is sharded by
FSDP2 (fully_shard) instead, through xscale.Loop; with MODEL=deepspeed it is a DeepSpeed engine
with ZeRO stage ZERO_STAGE (default 1; torch's Adam, fp32, an LR warm-up; DS_CONFIG: JSON merged
into its config), the loop's model (FORM and EVALUATE_AT do not apply to it). Those two sharded
models have a dropout layer, whose masks each rank draws from its own generator (seeded by
rank): a rollback to a snapshot that did not set the generators back would draw others.

- With DIE_HOW=raise, the rank in DIE_RANK raises (a bug) as it begins the step after DIE_AT,
  in every process of that rank, those started again included.
- Else the rank in DIE_RANK kills itself (SIGKILL, as a crashed node's processes die) or stops
  (SIGSTOP, as a frozen node's), as DIE_HOW says: when its step DIE_AT is recorded; or
  DIE_MICRO micro-batches into the step after it; or, with DIE_MICRO=-1, after its optimizer
  step of DIE_AT but before recording it, so that the others meet its loss in the step's
  checkpoint (every CHECKPOINT_EVERY steps; none by default).
- With THEN_DIE=RANK@STEP, that rank dies too (as DIE_HOW says) when its step STEP is
  recorded: a second failure, later in the run.
- The rank in HOLD_RANK waits after its optimizer step of DIE_AT until the group is known
  broken, so that it recovers a step behind the others (as a survivor does whose ring
  all-reduce ended later than another's).
- Rank 0, in a smaller world, waits after its step WAIT_AT until the group is known broken
  (the coordinator takes the lost ranks back in; the others wait for it in the next step's
  all-reduce meanwhile): the run does not end before they are back.
- After step EVALUATE_AT every rank evaluates the model (xscale.vision.evaluate_classifier, as
  a one-class classifier: its accuracy is 1, or NaN when the evaluation was cut short).

Each rank prints `RESULT {json}` at its end: its pid, the step it started at, the steps, a
digest of its parameters and optimizer state (equal on every rank of a healthy DDP run; FSDP2's
are gathered whole first, and ZeRO's partitions of the optimizer state summed over the ranks),
of the batch it trained each micro-batch on ("STEP.MICRO"), of the gradients each optimizer step
applied, and its evaluation's accuracy.
"""

import json
import math
import os
import signal
import sys
from typing import Any

import torch
import xscale
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset
from xscale import vision
from xscale.recovery import link as links

MAX_STEPS = int(os.environ.get("MAX_STEPS", "120"))
DIE_AT = int(os.environ.get("DIE_AT", "-1"))
DIE_RANK = int(os.environ.get("DIE_RANK", "-1"))
REPLACEMENT = "XSCALE_RECOVERY_JOIN" in os.environ  # it does not die again
DIE_HOW = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP,
           "raise": None}[os.environ.get("DIE_HOW", "kill")]
DIE_MICRO = int(os.environ.get("DIE_MICRO", "0"))
THEN_DIE = os.environ.get("THEN_DIE", "")  # RANK@STEP
HOLD_RANK = int(os.environ.get("HOLD_RANK", "-1"))
ACCUMULATION = int(os.environ.get("ACCUMULATION", "1"))
PREPARED = os.environ.get("FORM", "loop") == "prepared"
CHECKPOINT_EVERY = int(os.environ.get("CHECKPOINT_EVERY", "0"))
EVALUATE_AT = int(os.environ.get("EVALUATE_AT", "-1"))
WAIT_AT = int(os.environ.get("WAIT_AT", "-1"))
SHARDED = os.environ.get("MODEL", "ddp") == "fsdp"
DEEPSPEED = os.environ.get("MODEL", "ddp") == "deepspeed"
ZERO_STAGE = int(os.environ.get("ZERO_STAGE", "1"))


def digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """The parameters' and the optimizer's state (not the buffers: each rank's last forward
    updates BatchNorm's statistics from its own batch)."""
    tensors = list(model.parameters())
    for state in optimizer.state.values():
        tensors += [value for value in state.values() if torch.is_tensor(value)]
    return float(sum(whole(tensor).double().sum() for tensor in tensors))


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded DTensor gathered whole (a collective), a plain tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (no collective), a plain tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class Watch:
    """What the rank trained: the step it started at, each micro-batch's batch ("STEP.MICRO";
    a dropped step's are drawn again, and replaced), each applied step's gradients."""

    def __init__(self, loop: xscale.Loop, model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        self.loop, self.model, self.started_at = loop, model, loop.step
        self.trained: dict[str, float] = {}
        self.gradients: dict[int, float] = {}
        self.evaluated: dict[int, float | None] = {}
        optimizer.register_step_pre_hook(self.applied)  # after xscale's: they run in order

    def batch(self, micro: int, features: torch.Tensor) -> None:
        self.trained[f"{self.loop.step + 1}.{micro}"] = float(features.double().sum())

    def applied(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The summed gradients the step applies; none in a dropped step."""
        present = [p.grad for p in self.model.parameters() if p.grad is not None]
        if present:
            self.gradients[self.loop.step + 1] = float(sum(local(g).double().abs().sum()
                                                           for g in present))

    def evaluate(self, ctx: xscale.Context) -> None:
        """The model as a one-class classifier over 64 samples (None: NaN, cut short)."""
        inputs = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
        data = TensorDataset(inputs, torch.zeros(64, dtype=torch.long))
        batches = xscale.eval_loader(data, ctx, batch_size=16)
        accuracy = vision.evaluate_classifier(self.model, batches, ctx.device)["accuracy"]
        self.evaluated[self.loop.step] = None if math.isnan(accuracy) else accuracy

    def raise_now(self, rank: int) -> None:
        """A bug: the step after DIE_AT fails on DIE_RANK, whatever process trains it."""
        if DIE_HOW is None and rank == DIE_RANK and self.loop.step == DIE_AT:
            raise RuntimeError(f"rank {rank} cannot train step {DIE_AT + 1}")

    def dies_now(self, rank: int, micro: int) -> bool:
        """Whether this rank dies now: after recording MICRO micro-batches of the step after
        DIE_AT (0: as DIE_AT ends), or with MICRO -1 after DIE_AT's optimizer step."""
        if micro == 0 and not REPLACEMENT and THEN_DIE == f"{rank}@{self.loop.step}":
            return True
        return (DIE_HOW is not None and rank == DIE_RANK and micro == DIE_MICRO
                and not REPLACEMENT
                and self.loop.step == (DIE_AT - 1 if micro == -1 else DIE_AT))


def warm_up(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """The LR raised at every step over the run: a replacement or a rollback that did not take
    the scheduler's state along would train on at another LR."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (step + 1) / MAX_STEPS)


def with_loop(ctx: xscale.Context, model: nn.Module, optimizer: torch.optim.Optimizer,
              loader: Any) -> Watch:
    """The explicit form: the loop hands out the micro-batches and counts them (loop._micro:
    the test reads the loop's own count)."""
    scheduler = warm_up(optimizer)
    loop = xscale.Loop(ctx, loader, model=model, optimizer=optimizer, max_steps=MAX_STEPS,
                       output_dir=sys.argv[1], log_every=5, name="live",
                       accumulation=ACCUMULATION, checkpoint_every=CHECKPOINT_EVERY,
                       scheduler=scheduler)
    watch = Watch(loop, model, optimizer)
    for _, (features, target) in loop.batches():
        watch.raise_now(ctx.rank)
        watch.batch(loop._micro, features)
        with loop.sync_gradients(model):
            loss = nn.functional.mse_loss(model(features), target)
            loss.backward()
        if loop.boundary:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if ctx.rank == HOLD_RANK and loop.step + 1 == DIE_AT and not REPLACEMENT:
                links.link().broken.wait(timeout=60)
            if watch.dies_now(ctx.rank, -1):
                os.kill(os.getpid(), DIE_HOW)
        loop.record(loss, len(features))
        if watch.dies_now(ctx.rank, loop._micro):
            os.kill(os.getpid(), DIE_HOW)
        if loop.step == EVALUATE_AT and loop._micro == 0 and not REPLACEMENT:
            watch.evaluate(ctx)
        if loop.step == WAIT_AT and loop._micro == 0 and ctx.rank == 0 \
                and loop.ctx.world_size < ctx.world_size:  # not yet grown back
            links.link().broken.wait(timeout=60)
    loop.finish()
    return watch


def prepared(ctx: xscale.Context, model: nn.Module, optimizer: torch.optim.Optimizer,
             loader: Any) -> Watch:
    """The short form: the script counts its micro-batches itself and steps the optimizer
    every ACCUMULATION of them (DDP all-reduces each: no no_sync here)."""
    scheduler = warm_up(optimizer)
    model, optimizer, loader = xscale.prepare(model, optimizer, loader, max_steps=MAX_STEPS,
                                              output_dir=sys.argv[1], log_every=5,
                                              accumulation=ACCUMULATION, scheduler=scheduler)
    watch = Watch(loader._run.loop, model, optimizer)  # the test reads the loop's step
    for index, (features, target) in enumerate(loader):
        micro = index % ACCUMULATION
        watch.batch(micro, features)
        loss = nn.functional.mse_loss(model(features), target)
        loss.backward()
        if micro == ACCUMULATION - 1:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if watch.dies_now(ctx.rank, (micro + 1) % ACCUMULATION):
            os.kill(os.getpid(), DIE_HOW)
    return watch


def sharded(layers: nn.Sequential, ctx: xscale.Context) -> nn.Module:
    """FSDP2: each Linear a unit of its own, and the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    for layer in layers:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(layers, mesh=mesh)


def engine_digest(engine: Any) -> float:
    """The whole model (every rank holds it in ZeRO 1 and 2; ZeRO 3's is gathered) and the
    optimizer's state, whose partitions are summed over the ranks (collectives): the same on
    every rank."""
    import deepspeed
    import torch.distributed as dist

    partitions = [value for state in engine.optimizer.optimizer.state.values()
                  for value in state.values() if torch.is_tensor(value)]
    summed = torch.tensor([float(sum(t.double().sum() for t in partitions))], dtype=torch.float64)
    dist.all_reduce(summed)
    parameters = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(parameters, enabled=ZERO_STAGE == 3):
        return float(sum(p.double().sum() for p in parameters) + summed[0])


def deepspeed_engine(layers: nn.Module) -> Any:
    """A DeepSpeed engine of LAYERS: ZeRO stage ZERO_STAGE, torch's Adam, fp32, as
    python/configs/ds_cpu_z1.json, and a warm-up of the LR over the run (a recovery that did not
    bring the scheduler back would train on at another LR)."""
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": ACCUMULATION,
              "steps_per_print": 10**9, "gradient_clipping": 0, "wall_clock_breakdown": False,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "scheduler": {"type": "WarmupLR", "params": {
                  "warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3, "warmup_num_steps": MAX_STEPS,
                  "warmup_type": "linear"}},
              # ZeRO 3 keeps weights under 100 elements whole on every rank (the biases), and
              # gathers the others in the forward.
              "zero_optimization": {"stage": ZERO_STAGE,
                                    **({"stage3_param_persistence_threshold": 100}
                                       if ZERO_STAGE == 3 else {})},
              **json.loads(os.environ.get("DS_CONFIG", "{}"))}  # by hand: bf16, overlap_comm...
    engine, _, _, _ = deepspeed.initialize(model=layers, model_parameters=layers.parameters(),
                                           config=config)
    return engine


def with_engine(ctx: xscale.Context, engine: Any, loader: Any) -> Watch:
    """A DeepSpeed engine as the loop's model: its backward and step at every micro-batch (it
    counts the accumulation itself)."""
    loop = xscale.Loop(ctx, loader, model=engine, max_steps=MAX_STEPS, output_dir=sys.argv[1],
                       log_every=5, name="live", accumulation=ACCUMULATION,
                       checkpoint_every=CHECKPOINT_EVERY)
    watch = Watch(loop, engine.module, engine.optimizer.optimizer)
    dtype = next(engine.module.parameters()).dtype  # bf16 and fp16 cast the weights
    for _, (features, target) in loop.batches():
        watch.raise_now(ctx.rank)
        watch.batch(loop._micro, features)
        loss = nn.functional.mse_loss(engine(features.to(dtype)).float(), target)
        engine.backward(loss)
        engine.step()
        if loop.boundary and ctx.rank == HOLD_RANK and loop.step + 1 == DIE_AT \
                and not REPLACEMENT:
            links.link().broken.wait(timeout=60)
        if loop.boundary and watch.dies_now(ctx.rank, -1):
            os.kill(os.getpid(), DIE_HOW)
        loop.record(loss, len(features))
        if watch.dies_now(ctx.rank, loop._micro):
            os.kill(os.getpid(), DIE_HOW)
    loop.finish()
    return watch


def main() -> None:
    ctx = xscale.start(backend="gloo")
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(4096, 32, generator=generator)
    data = TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))
    torch.manual_seed(0)
    dropout = [nn.Dropout(0.2)] if SHARDED or DEEPSPEED else []
    layers = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), *dropout,
                           nn.Linear(64, 1))
    torch.manual_seed(1000 + ctx.rank)  # the same weights everywhere, each rank's own masks
    if DEEPSPEED:
        engine = deepspeed_engine(layers)
        loader = xscale.loader(data, ctx, batch_size=16, workers=1)
        watch = with_engine(ctx, engine, loader)
        result = engine_digest(engine)
    else:
        model = sharded(layers, ctx) if SHARDED else DistributedDataParallel(layers)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        loader = xscale.loader(data, ctx, batch_size=16, workers=1)
        watch = (prepared if PREPARED else with_loop)(ctx, model, optimizer, loader)
        result = digest(model, optimizer)
    print("RESULT " + json.dumps({"rank": ctx.rank, "pid": os.getpid(),
                                  "started_at": watch.started_at, "steps": watch.loop.step,
                                  "digest": result, "trained": watch.trained,
                                  "gradients": watch.gradients,
                                  "evaluated": watch.evaluated,
                                  "shrinks": watch.loop.shrinks.done()}),
          flush=True)
    if not PREPARED:
        watch.loop.report()  # prepare's loop wrote its summary at its last step


if __name__ == "__main__":
    xscale.run_and_exit(main)

"""xscale: the runtime of a training script on a supercomputer, in a few lines of it.

    import xscale

    ctx = xscale.start()                                  # the process group, on this rank's GPU
    ...                                                   # the script's model, optimizer, loader
    model, optimizer, loader = xscale.prepare(model, optimizer, loader, epochs=10)
    ...                                                   # the script's own loop, unchanged

or, with the loop xscale's (the explicit form):

    ctx = xscale.start()
    loader = xscale.loader(dataset, ctx, batch_size=32, workers=4)
    loop = xscale.Loop(ctx, loader, model=model, optimizer=optimizer, epochs=10,
                       output_dir=out, checkpoint_every="auto")
    for epoch, (inputs, targets) in loop.batches():      # resumed where the last job stopped
        ...
        loop.record(loss, len(inputs))                    # log, checkpoint, stop at Slurm's warning
    loop.finish()
    loop.report()                                         # XSCALE_SUMMARY

docs/YOUR-SCRIPT.md shows the lines for a plain PyTorch loop (either form), Hugging Face's Trainer
(xscale.hf.XscaleTrainer) and DeepSpeed (an engine is a Loop's model). The public API is what
`__all__` names, plus the modules xscale.hf, xscale.ds and xscale.vision (the example classifiers'
command line, data and evaluation); the other modules are the package's own and may change.
Settings are XSCALE_* environment variables (docs/SETTINGS.md, `xscale settings`).

Importing xscale does no work and imports nothing heavy: a public name is loaded when first
used, and the start-up's `imports` moment is marked by the first call that starts a run
(xscale.start(), XscaleTrainer), once the script's imports are really done
(docs/STARTUP.md). The batch host's programs (jobs/lib/) load xscale/shared/'s modules by
path, on Python 3.6 without the package (ARCHITECTURE.md).
"""

from __future__ import annotations

import importlib
from typing import Any

# Each public name and the module that defines it (loaded on first use: PEP 562).
_PUBLIC = {
    "start": "runtime",
    "catch_stop_signals": "runtime",
    "stop_agreed": "runtime",
    "Loop": "runtime",
    "prepare": "prepared",
    "Context": "dist",
    "loader": "data",
    "eval_loader": "data",
    "atomic_save": "checkpoints.files",
    "checkpoint_interval": "checkpoints.cadence",
    "run_and_exit": "lifecycle",
    "UserError": "lifecycle",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'xscale' has no attribute '{name}'")
    module = importlib.import_module(f"xscale.{_PUBLIC[name]}")
    value = getattr(module, "DistContext" if name == "Context" else name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))

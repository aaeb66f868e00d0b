"""Test bed only (PYTHONPATH=tests/fakes/torch-gpus): torch reports as many GPUs as Slurm gave
the process in ROCR_VISIBLE_DEVICES, as a ROCm build of torch on a LUMI-G node would.

The virtual nodes have no GPUs, so this fakes the one outside fact the preflight doctor reads
from torch, `torch.cuda.device_count()`, and nothing else: torch.cuda.is_available() stays False,
so collectives still run on gloo. The patch is applied when torch is first imported, so the import
itself (which the doctor times) is untouched.
"""

import importlib.abc
import importlib.machinery
import os
import sys


class _PatchTorchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def load_and_patch(module):
            load(module)
            visible = [d for d in os.environ.get("ROCR_VISIBLE_DEVICES", "").split(",") if d]
            module.cuda.device_count = lambda: len(visible)

        spec.loader.exec_module = load_and_patch
        return spec


sys.meta_path.insert(0, _PatchTorchOnImport())

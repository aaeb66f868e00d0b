"""Test bed only (PYTHONPATH=tests/fakes/torch-gpus): torch reports as many GPUs as Slurm gave
the process in ROCR_VISIBLE_DEVICES, as a ROCm build of torch on a LUMI-G node would.

The virtual nodes have no GPUs, so this fakes the one outside fact the preflight doctor reads
from torch, `torch.cuda.device_count()` as the running script calls it, and nothing else:
torch.cuda.is_available() and torch's own calls see no GPU, so collectives still run on gloo.
The patch is applied when torch is first imported, so the import itself (which the doctor
times) is untouched.
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
            real_count = module.cuda.device_count

            def device_count():
                # Only the script's own calls get the fake count; torch's internals keep the
                # real one (0), or they would try to start a CUDA driver that is not there
                # (seen once in CI: "Found no NVIDIA driver" in the doctor's all-reduce step).
                if sys._getframe(1).f_globals.get("__name__") == "__main__":
                    return len(visible)
                return real_count()

            module.cuda.device_count = device_count

        spec.loader.exec_module = load_and_patch
        return spec


sys.meta_path.insert(0, _PatchTorchOnImport())

"""Intel's oneccl_bindings_for_pytorch, as far as the doctor sees it: importing it registers the
"ccl" backend for XPUs, as the real bindings do, and a group on it fails (there is no XPU here).

tests/test_dist.py (test_the_doctor_on_an_old_aurora_module_imports_oneccl_and_takes_ccl) copies
it into a directory on sys.path as oneccl_bindings_for_pytorch.py, the name the doctor imports.
"""

import torch.distributed


def _no_xpu_here(store, rank, world_size, timeout):
    raise RuntimeError("the test's oneCCL bindings have no XPU to talk to")


torch.distributed.Backend.register_backend("ccl", _no_xpu_here, devices=["xpu"])

"""What deepspeed.comm does on a CPU accelerator as it starts (deepspeed/comm/torch.py): JIT-build
the shared-memory all-reduce op into TORCH_EXTENSIONS_DIR, then call its functions.

tests/test_ds.py (test_deepspeeds_cpu_op_builds_against_this_torch) runs it.
"""

from deepspeed.comm.torch import build_shm_op

op = build_shm_op()
assert op is not None, "DeepSpeed chose no shared-memory op on this CPU"
missing = [name for name in ("initialize", "vector_kernel_level") if not hasattr(op, name)]
assert not missing, missing

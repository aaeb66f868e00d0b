"""What jobs/lumi/smoke.sbatch's steps 2 and 3 print, run by runscripts/run.sh in the image.

    smoke_checks.py gpus      one line per node: the GPUs torch sees, next to the ones Slurm gave
                              the node. 0 torch GPUs with 8 visible means the image's torch is not
                              a ROCm build; fewer than 8 visible means a wrong --gpus-per-node.
    smoke_checks.py binding   one line per rank: the cores it may run on, to compare with the GCD
                              it uses (jobs/lib/cpu-masks lumi).
"""

import os
import sys


def gpus() -> str:
    import torch

    visible = (os.environ.get("ROCR_VISIBLE_DEVICES") or os.environ.get("CUDA_VISIBLE_DEVICES")
               or "none")
    return "smoke: node=%s torch_gpus=%d visible=%s" % (
        os.environ.get("SLURMD_NODENAME", "?"), torch.cuda.device_count(), visible)


def binding() -> str:
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    return "binding: rank=%s local_rank=%s node=%s cpus=%s" % (
        os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ.get("SLURMD_NODENAME", "?"),
        cpus)


if __name__ == "__main__":
    checks = {"gpus": gpus, "binding": binding}
    if len(sys.argv) != 2 or sys.argv[1] not in checks:
        print("smoke_checks.py: error: give one of: " + ", ".join(checks), file=sys.stderr)
        sys.exit(2)
    print(checks[sys.argv[1]](), flush=True)

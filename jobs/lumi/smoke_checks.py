"""What jobs/lumi/smoke.sbatch's steps 2 and 3 check, run by runscripts/run.sh in the image. Each
prints one line ending in `ok` or `FAIL: why`, and exits 1 on a failure, so that the step fails.

    smoke_checks.py gpus      one line per node: the GPUs torch sees against the ones Slurm gave
                              the node (SLURM_GPUS_ON_NODE). 0 torch GPUs with 8 given means the
                              image's torch is not a ROCm build; fewer visible than given, a
                              wrong bind or device cgroup.
    smoke_checks.py binding   one line per rank: the cores it may run on against the mask srun
                              was given for its local rank (--cpu-bind=mask_cpu:..., from
                              jobs/lib/cpu-masks): a different set means the binding did not apply.
"""

import os
import sys


def node() -> str:
    return os.environ.get("SLURMD_NODENAME", "?")


def visible_devices() -> list:
    """The devices Slurm's gres plugin left this task (ROCm reads ROCR_VISIBLE_DEVICES first)."""
    listed = os.environ.get("ROCR_VISIBLE_DEVICES") or os.environ.get("CUDA_VISIBLE_DEVICES") or ""
    return [device for device in listed.split(",") if device]


def gpus_problem(torch_gpus: int, visible: list, given: str) -> str:
    """'' when torch sees every GPU Slurm gave the node, else why not."""
    if not given.isdigit():
        return "SLURM_GPUS_ON_NODE is not set: submit with --gpus-per-node"
    if len(visible) != int(given):
        return "%d devices visible of the %s Slurm gave the node" % (len(visible), given)
    if torch_gpus != len(visible):
        return "torch sees %d of the %d visible GPUs (a CPU-only or wrong-vendor torch?)" % (
            torch_gpus, len(visible))
    return ""


def gpus() -> tuple:
    import torch

    visible = visible_devices()
    torch_gpus = torch.cuda.device_count()
    problem = gpus_problem(torch_gpus, visible, os.environ.get("SLURM_GPUS_ON_NODE", ""))
    line = "smoke: node=%s torch_gpus=%d visible=%s" % (node(), torch_gpus,
                                                        ",".join(visible) or "none")
    return line, problem


def mask_cpus(mask_hex: str) -> list:
    """The CPUs of a hexadecimal mask as srun lists it in SLURM_CPU_BIND_LIST ('0x3' or '3')."""
    bits = int(mask_hex, 16)
    return [cpu for cpu in range(bits.bit_length()) if bits >> cpu & 1]


def binding_problem(cpus: list, mask_list: str, local_rank: int) -> str:
    """'' when the rank runs on exactly the cores of its mask, else why not. srun reuses the
    list from the start when a node has more tasks than masks."""
    masks = [mask for mask in mask_list.split(",") if mask]
    if not masks:
        return "no mask given (SLURM_CPU_BIND_LIST is empty: srun ran without --cpu-bind=mask_cpu)"
    wanted = mask_cpus(masks[local_rank % len(masks)])
    if cpus != wanted:
        return "runs on cores %s, its mask gives %s" % (
            ",".join(map(str, cpus)), ",".join(map(str, wanted)))
    return ""


def binding() -> tuple:
    cpus = sorted(os.sched_getaffinity(0))
    local_rank = int(os.environ["LOCAL_RANK"])
    problem = binding_problem(cpus, os.environ.get("SLURM_CPU_BIND_LIST", ""), local_rank)
    line = "binding: rank=%s local_rank=%d node=%s cpus=%s" % (
        os.environ["RANK"], local_rank, node(), ",".join(map(str, cpus)))
    return line, problem


if __name__ == "__main__":
    checks = {"gpus": gpus, "binding": binding}
    if len(sys.argv) != 2 or sys.argv[1] not in checks:
        print("smoke_checks.py: error: give one of: " + ", ".join(checks), file=sys.stderr)
        sys.exit(2)
    line, problem = checks[sys.argv[1]]()
    print("%s %s" % (line, "FAIL: " + problem if problem else "ok"), flush=True)
    sys.exit(1 if problem else 0)

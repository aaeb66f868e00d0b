#!/usr/bin/env python3
"""xscale's preflight doctor: every rank checks its node, rank 0 prints one table for the job.

Started by runscripts/doctor (which exported the rank layout and the site profile, as run.sh
does); see `doctor --help` and docs/DOCTOR.md. Standard library only: it must run in any image,
before anything else is known to work. torch is imported in a child process
(doctor_torch.py), so that a hang or an abort in the collective cannot take the report with it.

How the ranks meet: each rank writes its results as one JSON file into a report directory on
storage every node shares, and rank 0 waits (bounded) for all of them. Not the network: a node
whose network is broken must still be able to say so.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hostlist  # noqa: E402  (beside this file)

PROG = "doctor"
OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
SEVERITY = {SKIP: 0, OK: 1, WARN: 2, FAIL: 3}
# Node checks (a failure blames the node) in table order, then the job-wide one.
NODE_CHECKS = ("layout", "gpus", "cpu-affinity", "network", "net-plugin", "storage", "paths",
               "import-torch")
JOB_CHECKS = ("bandwidth",)
CHECKS = NODE_CHECKS + JOB_CHECKS
TORCH_CHECKS = {"gpus", "net-plugin", "import-torch", "bandwidth"}  # need the torch child
SIZES_FULL = (1 << 20, 16 << 20, 64 << 20)  # all-reduce bytes: latency- to bandwidth-bound
SIZES_QUICK = (1 << 20,)
# An import this much slower than the job's median, and by this many seconds, is flagged: the
# node reads the Python environment from a slow file system (a small absolute floor keeps a
# 0.3 s vs 1.2 s difference from counting).
SLOW_IMPORT_FLOOR_S = 5.0


class UsageError(Exception):
    """A bad option or setting: one line, exit 2."""


@dataclass
class Result:
    check: str
    status: str
    message: str
    remedy: str = ""


@dataclass
class Rank:
    """This rank's place, as run.sh's environment set it."""
    rank: int
    world_size: int
    local_rank: int
    node: str
    master: str
    job_step: str

    @staticmethod
    def from_env(env: Dict[str, str]) -> "Rank":
        job = env.get("SLURM_JOB_ID") or env.get("PBS_JOBID", "nojob").split(".")[0]
        # A requeued job has the same id and step ids again: its reports are not the last run's.
        restart = env.get("SLURM_RESTART_COUNT", "0")
        step = env.get("SLURM_STEP_ID", "0") + ("" if restart == "0" else ".restart" + restart)
        return Rank(rank=int(env.get("RANK", "0")), world_size=int(env.get("WORLD_SIZE", "1")),
                    local_rank=int(env.get("LOCAL_RANK", "0")), node=node_name(env),
                    master="%s:%s" % (env.get("MASTER_ADDR", "?"), env.get("MASTER_PORT", "?")),
                    job_step="%s.%s" % (job, step))


def node_name(env: Dict[str, str]) -> str:
    return env.get("SLURMD_NODENAME") or hostlist.short_name(socket.gethostname())


# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------

class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print the usage too
        raise UsageError(message)


def number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError("'%s' is not a number" % text) from None
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError("'%s' must be 0 or more" % text)
    return value


def check_list(text: str) -> List[str]:
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError("'%s' is malformed (expected e.g. network,storage)" % text)
    unknown = [name for name in names if name not in CHECKS]
    if unknown:
        raise argparse.ArgumentTypeError("unknown check '%s' (have: %s)"
                                         % (unknown[0], ", ".join(CHECKS)))
    return names


def parse_options(argv: List[str], env: Dict[str, str]) -> argparse.Namespace:
    parser = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="rank 0 writes the job's report here")
    parser.add_argument("--quick", action="store_true",
                        help="one small all-reduce instead of the bandwidth sweep")
    parser.add_argument("--checks", type=check_list, default=list(CHECKS),
                        help="comma-separated subset of: " + ", ".join(CHECKS))
    parser.add_argument("--paths", default=",".join(p for p in (env.get("DATA"), env.get("HF_HOME"))
                                                    if p),
                        help="comma-separated paths every node must read (default: $DATA,$HF_HOME)")
    parser.add_argument("--report-dir", type=Path,
                        help="shared directory for the per-rank reports "
                             "(default: beside --json, else ./xscale-doctor-JOB.STEP)")
    parser.add_argument("--min-free-gb", type=number,
                        default=env.get("XSCALE_DOCTOR_MIN_FREE_GB", "1"))
    parser.add_argument("--min-free-inodes", type=number,
                        default=env.get("XSCALE_DOCTOR_MIN_FREE_INODES", "10000"))
    parser.add_argument("--slow-import-factor", type=number,
                        default=env.get("XSCALE_DOCTOR_SLOW_IMPORT_FACTOR", "3"))
    parser.add_argument("--timeout", type=number, default=env.get("XSCALE_DOCTOR_TIMEOUT_S", "60"),
                        help="seconds the collective, and rank 0's wait for reports, may take")
    # argparse converts a string default with the option's type, so a bad XSCALE_DOCTOR_* value
    # is refused like a bad option.
    options = parser.parse_args(argv)
    return options


# ---------------------------------------------------------------------------------------------
# Checks on this rank's node. Each returns one Result; a check that raises is reported as its
# own failure (run_check), never as a traceback that hides the others.
# ---------------------------------------------------------------------------------------------

def run_check(name: str, check: Callable[[], Result]) -> Result:
    try:
        return check()
    except Exception as error:  # noqa: BLE001  (any crash is this check's verdict)
        crash = "%s: %s" % (type(error).__name__, error)
        return Result(name, FAIL, "the check itself crashed: " + crash,
                      "a bug in the doctor; please report it with this line")


def split_list(text: str) -> List[str]:
    return [item for item in text.replace(" ", ",").split(",") if item]


# Which variable lists the GPUs a process may use, per vendor; Slurm sets all of them, and the
# runtime of each vendor reads its own.
VISIBLE_VARS = {"amd": "ROCR_VISIBLE_DEVICES", "nvidia": "CUDA_VISIBLE_DEVICES",
                "intel": "ZE_AFFINITY_MASK"}


def visible_gpus(env: Dict[str, str], vendor: str) -> Optional[List[str]]:
    """The GPU ids this rank may use, as the launcher gave them; None when nothing limits it."""
    names = [VISIBLE_VARS[vendor]] if vendor in VISIBLE_VARS else list(VISIBLE_VARS.values())
    for name in names:
        if env.get(name):
            return split_list(env[name])
    return None


def rank_gpu(visible: List[str], local_rank: int) -> Optional[str]:
    """The GPU this rank trains on: its only one, or the LOCAL_RANK-th of the node's."""
    if len(visible) == 1:
        return visible[0]
    return visible[local_rank] if local_rank < len(visible) else None


def check_gpus(me: Rank, env: Dict[str, str], vendor: str, torch_gpus: Optional[int]) -> Result:
    asked = int(env["SLURM_GPUS_ON_NODE"]) if env.get("SLURM_GPUS_ON_NODE", "").isdigit() else None
    visible = visible_gpus(env, vendor)
    if visible is None and not asked:
        return Result("gpus", SKIP, "no GPUs asked for")
    if visible is None and torch_gpus is None:
        return Result("gpus", SKIP, "no visible-devices variable, and torch was not asked")
    if visible is None:
        visible = [str(i) for i in range(torch_gpus)]
    device = rank_gpu(visible, me.local_rank)
    if device is None:
        return Result("gpus", FAIL, "local rank %d has no GPU: %d visible (%s)"
                      % (me.local_rank, len(visible), ",".join(visible)),
                      "ask for one GPU per rank (--gpus-per-node = --ntasks-per-node)")
    if asked is not None and len(visible) > 1 and len(visible) != asked:
        return Result("gpus", FAIL, "%d GPUs visible, the job asked for %d" % (len(visible), asked),
                      "check --gpus-per-node and what the job script exports as "
                      + VISIBLE_VARS.get(vendor, "*_VISIBLE_DEVICES"))
    if torch_gpus is not None and torch_gpus < len(visible):
        return Result("gpus", FAIL,
                      "torch sees %d of the %d visible GPUs" % (torch_gpus, len(visible)),
                      "the image's torch has no GPU support for this node (a CPU or wrong-vendor "
                      "build), or /dev/kfd and /dev/dri are not in the container")
    return Result("gpus", OK, "GPU %s of %s" % (device, ",".join(visible)))


def gpu_numa_node(vendor: str, gpu: str, sysfs: Path) -> Optional[int]:
    """The NUMA node of the GPU with this runtime index, where sysfs says; None where it does
    not. AMD: ROCm numbers GPUs in the order of the KFD topology's GPU nodes, whose properties
    give the PCI location. NVIDIA: the driver's per-GPU information file gives the minor number
    Slurm's ids refer to."""
    if not gpu.isdigit():
        return None
    readers = {"amd": amd_bus_ids, "nvidia": nvidia_bus_ids}
    bus_ids = readers[vendor](sysfs) if vendor in readers else []
    if int(gpu) >= len(bus_ids):
        return None
    numa = (sysfs / "bus/pci/devices" / bus_ids[int(gpu)] / "numa_node").read_text().strip()
    return int(numa) if int(numa) >= 0 else None


def amd_bus_ids(sysfs: Path) -> List[str]:
    nodes = sysfs / "class/kfd/kfd/topology/nodes"
    found = []
    for node in sorted(nodes.glob("*"), key=lambda p: int(p.name) if p.name.isdigit() else -1):
        lines = (node / "properties").read_text().splitlines()
        properties = dict(line.split()[:2] for line in lines if len(line.split()) >= 2)
        if properties.get("gpu_id", "0") == "0" or int(properties.get("simd_count", "0")) == 0:
            continue  # a CPU node
        location, domain = int(properties["location_id"]), int(properties.get("domain", "0"))
        found.append("%04x:%02x:%02x.%x" % (domain, location >> 8, (location >> 3) & 0x1F,
                                             location & 0x7))
    return found


def nvidia_bus_ids(sysfs: Path) -> List[str]:
    by_minor = {}
    for info in Path("/proc/driver/nvidia/gpus").glob("*/information"):
        match = re.search(r"Device Minor:\s*(\d+)", info.read_text())
        if match:
            by_minor[int(match.group(1))] = info.parent.name.lower()
    return [by_minor[minor] for minor in sorted(by_minor)]


def check_cpu_affinity(me: Rank, env: Dict[str, str], vendor: str, sysfs: Path) -> Result:
    visible = visible_gpus(env, vendor)
    device = rank_gpu(visible, me.local_rank) if visible else None
    if device is None:
        return Result("cpu-affinity", SKIP, "no GPU to place the CPUs next to")
    numa = gpu_numa_node(vendor, device, sysfs)
    if numa is None:
        return Result("cpu-affinity", SKIP, "sysfs does not say where GPU %s is" % device)
    mine = os.sched_getaffinity(0)
    near = set(hostlist.expand_numbers(
        (sysfs / ("devices/system/node/node%d/cpulist" % numa)).read_text()))
    shown = "CPUs %s, GPU %s on NUMA node %d" % (hostlist.ranges(mine), device, numa)
    remedy = "bind each rank next to its GPU: srun --cpu-bind=mask_cpu:$(jobs/lib/cpu-masks lumi)"
    if not mine & near:
        return Result("cpu-affinity", FAIL, shown + " (no CPU on it)", remedy)
    if not mine <= near:
        elsewhere = " (%d CPUs elsewhere)" % len(mine - near)
        return Result("cpu-affinity", WARN, shown + elsewhere, remedy)
    return Result("cpu-affinity", OK, shown)


def interface_state(name: str, sysfs: Path) -> str:
    """operstate as the kernel reports it; 'unknown' (loopback, some virtual NICs) counts as up."""
    try:
        return (sysfs / "class/net" / name / "operstate").read_text().strip()
    except OSError:
        return "absent"


def check_network(env: Dict[str, str], sysfs: Path) -> Result:
    """Every interface NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME name exists and is up. NCCL reads
    each item as a prefix ('=' for an exact name); a LUMI node has all of hsn0..3, and one
    missing or down is a broken NIC even though NCCL would carry on with the others."""
    wanted = [(var, item) for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
              for item in split_list(env.get(var, "")) if not env[var].startswith("^")]
    if not wanted:
        return Result("network", SKIP, "no socket interface named (NCCL_SOCKET_IFNAME unset)")
    have = sorted(p.name for p in (sysfs / "class/net").iterdir())
    checked, problems = [], []
    for var, item in wanted:
        exact = item.startswith("=") or var == "GLOO_SOCKET_IFNAME"
        names = [n for n in have if n == item.lstrip("=") or (not exact and n.startswith(item))]
        if not names:
            problems.append("no interface '%s' (%s; have: %s)" % (item, var, " ".join(have)))
        for name in names:
            state = interface_state(name, sysfs)
            checked.append(name)
            if state not in ("up", "unknown"):
                problems.append("%s is %s" % (name, state))
    if problems:
        return Result("network", FAIL, "; ".join(dict.fromkeys(problems)),
                      "a high-speed link of this node is missing or down: exclude the node and "
                      "report it to the site's support")
    return Result("network", OK, "up: " + " ".join(dict.fromkeys(checked)))


def library_dirs(env: Dict[str, str]) -> List[str]:
    return split_list(env.get("LD_LIBRARY_PATH", "").replace(":", ",")) + [
        "/usr/lib64", "/usr/lib", "/usr/local/lib", "/usr/lib/x86_64-linux-gnu"]


def find_library(names: List[str], env: Dict[str, str]) -> Optional[str]:
    for directory in library_dirs(env):
        for name in names:
            path = os.path.join(directory, name)
            if os.path.exists(path):
                return path
    return None


# What RCCL/NCCL print at NCCL_DEBUG=INFO about the network it chose (the plugin's name was
# "AWS Libfabric" and is "OFI" in newer aws-ofi-nccl releases; CSCS's NCCL page and the
# aws-ofi-nccl issues show both lines).
PLUGIN_NETWORK = re.compile(r"Using network (AWS Libfabric|OFI)\b")
SOCKET_NETWORK = re.compile(r"Using network Socket\b")
PROVIDER = re.compile(r"Selected Provider is (\w+)")


def judge_rccl_log(text: str) -> Result:
    if SOCKET_NETWORK.search(text) and not PLUGIN_NETWORK.search(text):
        return Result("net-plugin", FAIL, "RCCL fell back to TCP sockets ('Using network Socket')",
                      "RCCL did not load the aws-ofi-rccl plugin: bind it into the image "
                      "(LD_LIBRARY_PATH) with libfabric and the host's CXI libraries")
    if not PLUGIN_NETWORK.search(text):
        return Result("net-plugin", WARN, "RCCL's log names no network",
                      "run with NCCL_DEBUG=INFO and look for 'Using network'")
    provider = PROVIDER.search(text)
    if provider and provider.group(1) != "cxi":
        return Result("net-plugin", FAIL, "the plugin chose libfabric provider '%s', not cxi"
                      % provider.group(1),
                      "the host's libfabric with its cxi provider is not in the container: bind "
                      "/opt/cray and libcxi (jobs/lumi BINDS)")
    return Result("net-plugin", OK, "plugin in use (%s%s)" % (
        PLUGIN_NETWORK.search(text).group(1), ", provider cxi" if provider else ""))


def check_net_plugin(env: Dict[str, str], log_text: Optional[str]) -> Result:
    wanted = split_list(env.get("XSCALE_DOCTOR_NET_PLUGIN", ""))
    if not wanted:
        return Result("net-plugin", SKIP, "the site expects no network plugin")
    found = find_library(wanted, env)
    if not found:
        return Result("net-plugin", FAIL, "no %s in LD_LIBRARY_PATH or the system library "
                      "directories" % " or ".join(wanted),
                      "use an image that ships the plugin, or bind it and add its directory to "
                      "LD_LIBRARY_PATH; without it RCCL runs over TCP sockets, ten times slower")
    if log_text is None:
        return Result("net-plugin", OK, "%s found (no RCCL collective ran here)" % found)
    return judge_rccl_log(log_text)


def check_storage(env: Dict[str, str], min_free_gb: float, min_inodes: float) -> Result:
    roots = dict.fromkeys(["/tmp", env.get("XSCALE_CACHE_ROOT", "/tmp")])
    problems, shown = [], []
    for root in roots:
        stat = os.statvfs(root)
        free_gb = stat.f_bavail * stat.f_frsize / 1e9
        shown.append("%s %.1f GB free" % (root, free_gb))
        if free_gb < min_free_gb:
            problems.append("%s has %.2f GB free (< %g)" % (root, free_gb, min_free_gb))
        if stat.f_files and stat.f_favail < min_inodes:
            problems.append("%s has %d inodes free (< %d)" % (root, stat.f_favail, min_inodes))
    cache = env.get("XSCALE_CACHE_DIR")
    if cache:
        probe = os.path.join(cache, ".doctor-probe-%d" % os.getpid())
        try:
            with open(probe, "wb") as out:
                out.write(b"\0" * 65536)  # a small write can succeed on a full tmpfs page
            os.unlink(probe)
        except OSError as error:
            problems.append("cannot write to the cache %s: %s" % (cache, error.strerror))
            if os.path.exists(probe):
                os.unlink(probe)
    if problems:
        return Result("storage", FAIL, "; ".join(problems),
                      "free the node's /tmp (a previous job's files?) or exclude the node")
    return Result("storage", OK, ", ".join(shown))


def check_paths(paths: List[str]) -> Result:
    if not paths:
        return Result("paths", SKIP, "no paths given (--paths, $DATA, $HF_HOME)")
    problems = []
    for path in paths:
        if not os.path.exists(path):
            problems.append("%s is not visible" % path)
        elif not os.access(path, os.R_OK | (os.X_OK if os.path.isdir(path) else 0)):
            problems.append("%s is not readable" % path)
    if problems:
        return Result("paths", FAIL, "; ".join(problems),
                      "bind it into the container on every node (singularity exec -B PATH; "
                      "jobs/lumi: BINDS) and check it exists on a shared file system")
    return Result("paths", OK, "readable: " + " ".join(paths))


# ---------------------------------------------------------------------------------------------
# The torch child: import time, torch's GPU count, and the collective
# ---------------------------------------------------------------------------------------------

def rccl_log_path(env: Dict[str, str]) -> str:
    """Where RCCL writes its INFO lines for the child: the user's NCCL_DEBUG_FILE (%h and %p are
    the host and pid, NCCL's own placeholders), else a file in this rank's node-local cache."""
    return env.get("NCCL_DEBUG_FILE") or os.path.join(
        env.get("XSCALE_CACHE_DIR", "/tmp"), "doctor-rccl-rank%s.%%p.log" % env.get("RANK", "0"))


def run_torch_child(env: Dict[str, str], sizes: List[int], collective: bool, timeout: float,
                    ) -> Dict[str, object]:
    child_env = dict(env)
    child_env.setdefault("NCCL_DEBUG", "INFO")
    child_env.setdefault("NCCL_DEBUG_SUBSYS", "INIT,NET")
    child_env["NCCL_DEBUG_FILE"] = rccl_log_path(env)
    command = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                            "doctor_torch.py"),
               "--timeout", str(timeout), "--sizes", ",".join(map(str, sizes))]
    if not collective:
        command.append("--no-collective")
    # The child's own timeout bounds the collective; this one adds the import of torch.
    try:
        child = subprocess.Popen(command, env=child_env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        out, err = child.communicate(timeout=timeout + 120)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        return {"error": "torch child did not finish within %gs" % (timeout + 120)}
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if child.returncode != 0 or not lines:
        last = (err.strip().splitlines() or ["exit status %d" % child.returncode])[-1]
        return {"error": "torch child failed: " + last}
    record = json.loads(lines[-1])
    record["log"] = read_rccl_log(child_env["NCCL_DEBUG_FILE"], child.pid)
    return record


def read_rccl_log(pattern: str, pid: int) -> Optional[str]:
    path = pattern.replace("%h", socket.gethostname()).replace("%p", str(pid))
    try:
        with open(path, errors="replace") as log:
            return log.read()
    except OSError:
        return None


def check_import(record: Dict[str, object]) -> Result:
    if "import_s" not in record:
        return Result("import-torch", FAIL, str(record.get("error", "torch did not import")),
                      "check that the image's python has torch (python -c 'import torch')")
    return Result("import-torch", OK, "%.1f s" % record["import_s"])


# ---------------------------------------------------------------------------------------------
# Reports: one file per rank in a shared directory
# ---------------------------------------------------------------------------------------------

def default_report_dir(options: argparse.Namespace, me: Rank) -> Path:
    if options.report_dir:
        return options.report_dir
    if options.json:
        return options.json.parent / (options.json.stem + ".ranks")
    return Path("xscale-doctor-%s" % me.job_step)


def write_report(directory: Path, me: Rank, results: List[Result], facts: Dict[str, object],
                 final: bool) -> None:
    """Atomic: rank 0 never reads half a file (write beside, then rename)."""
    record = {"final": final, "facts": facts, "results": [asdict(r) for r in results], **asdict(me)}
    path = directory / ("rank-%d.json" % me.rank)
    partial = directory / (".rank-%d.json.%d" % (me.rank, os.getpid()))
    partial.write_text(json.dumps(record))
    partial.replace(path)


def gather(directory: Path, me: Rank, timeout: float) -> Dict[int, dict]:
    """Every rank's report of this job step; polls until all are final or the deadline passes
    (then what is there). Rank 0 finished its own collective when it gets here, so the others
    are about done. A report of another step (a reused --report-dir) is ignored."""
    deadline = time.monotonic() + timeout
    reports: Dict[int, dict] = {}
    while True:
        for path in directory.glob("rank-*.json"):
            rank = int(path.stem.split("-")[1])
            if rank not in reports or not reports[rank]["final"]:
                try:
                    report = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue
                if report.get("job_step") == me.job_step:
                    reports[rank] = report
        done = len(reports) >= me.world_size and all(r["final"] for r in reports.values())
        if done or time.monotonic() > deadline:
            return reports
        time.sleep(0.2)


# ---------------------------------------------------------------------------------------------
# Rank 0: judge the job
# ---------------------------------------------------------------------------------------------

@dataclass
class Verdict:
    # node -> check -> the results of the node's ranks
    nodes: Dict[str, Dict[str, List[Result]]] = field(default_factory=dict)
    job: List[Result] = field(default_factory=list)

    def add(self, node: str, result: Result) -> None:
        self.nodes.setdefault(node, {}).setdefault(result.check, []).append(result)

    def worst(self, node: str, check: str) -> Optional[Result]:
        results = self.nodes.get(node, {}).get(check, [])
        return max(results, key=lambda r: SEVERITY[r.status]) if results else None

    def failed_nodes(self) -> List[str]:
        return [node for node in self.nodes
                if any(r.status == FAIL for results in self.nodes[node].values() for r in results)]

    def failed(self) -> bool:
        return bool(self.failed_nodes()) or any(r.status == FAIL for r in self.job)


def expected_nodes(env: Dict[str, str]) -> Dict[int, str]:
    """rank -> node under Slurm's default block distribution, to name the node of a rank that
    never reported; empty when the step's layout is not known."""
    nodes_text = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    tasks_text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not nodes_text or not tasks_text:
        return {}
    return hostlist.block_placement(list(hostlist.expand(nodes_text)), tasks_text)


def judge(reports: Dict[int, dict], me: Rank, env: Dict[str, str], options) -> Verdict:
    verdict = Verdict()
    for report in reports.values():
        for result in report["results"]:
            verdict.add(report["node"], Result(**result))
    judge_layout(verdict, reports, me, env, "layout" in options.checks)
    if "gpus" in options.checks:
        judge_gpu_sharing(verdict, reports)
    if "import-torch" in options.checks:
        judge_import_times(verdict, reports, options.slow_import_factor)
    if "bandwidth" in options.checks:
        verdict.job.append(judge_bandwidth(reports, verdict, env))
    return verdict


def judge_layout(verdict: Verdict, reports: Dict[int, dict], me: Rank, env: Dict[str, str],
                 wanted: bool) -> None:
    placement = expected_nodes(env)
    for rank in range(me.world_size):
        if rank not in reports:
            verdict.add(placement.get(rank, "(unknown node)"), Result(
                "layout", FAIL, "rank %d wrote no report" % rank,
                "the rank did not start or died at once; is the report directory on a file "
                "system every node shares?"))
    if not wanted:
        return
    for report in reports.values():
        disagree = [key for key in ("world_size", "master") if report[key] != getattr(me, key)]
        if disagree:
            verdict.add(report["node"], Result(
                "layout", FAIL, "rank %d has %s" % (report["rank"], ", ".join(
                    "%s=%s (rank 0: %s)" % (k, report[k], getattr(me, k)) for k in disagree)),
                "every rank must get the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE: export "
                "them in the job script, not per node"))
        elif not report["final"]:
            verdict.add(report["node"], Result(
                "layout", FAIL, "rank %d did not finish its checks (hung or died in torch)"
                % report["rank"], "look at this rank's output in the job log"))
        else:
            verdict.add(report["node"], Result("layout", OK, "rank %d of %d"
                                               % (report["rank"], me.world_size)))
    extra = sorted(r for r in reports if r >= me.world_size)
    if extra:
        verdict.job.append(Result("layout", FAIL, "ranks beyond WORLD_SIZE reported: %s" % extra))


def judge_gpu_sharing(verdict: Verdict, reports: Dict[int, dict]) -> None:
    """Two ranks of one node on the same GPU: both would train on it, at half speed or out of
    memory, while another GPU idles."""
    users: Dict[tuple, List[int]] = {}
    for report in reports.values():
        device = report["facts"].get("gpu")
        if device is not None:
            users.setdefault((report["node"], device), []).append(report["rank"])
    for (node, device), ranks in sorted(users.items()):
        if len(ranks) > 1:
            verdict.add(node, Result("gpus", FAIL, "ranks %s share GPU %s"
                                     % (",".join(map(str, sorted(ranks))), device),
                                     "give each rank its own GPU: --gpus-per-task=1, or "
                                     "XSCALE_GPU_BIND=local, or torch device LOCAL_RANK"))


def judge_import_times(verdict: Verdict, reports: Dict[int, dict], factor: float) -> None:
    times = {r["rank"]: (r["node"], r["facts"]["import_s"]) for r in reports.values()
             if isinstance(r["facts"].get("import_s"), (int, float))}
    if len(times) < 2:
        return
    median = statistics.median(t for _, t in times.values())
    for rank, (node, seconds) in sorted(times.items()):
        if seconds > factor * median and seconds - median > SLOW_IMPORT_FLOOR_S:
            verdict.add(node, Result(
                "import-torch", WARN, "rank %d took %.1f s to import torch (job median %.1f s)"
                % (rank, seconds, median),
                "this node reads the Python environment slowly: stage it to node-local storage "
                "or exclude the node"))


def judge_bandwidth(reports: Dict[int, dict], verdict: Verdict, env: Dict[str, str]) -> Result:
    first = reports.get(0, {}).get("facts", {})
    if first.get("collective_error"):
        blamed = verdict.failed_nodes()
        suspects = "; failing nodes: " + hostlist.compress(blamed) if blamed else ""
        return Result("bandwidth", FAIL, "the all-reduce failed: %s%s"
                      % (first["collective_error"], suspects),
            "fix or exclude the failing nodes; otherwise run with XSCALE_DEBUG=1")
    sweep = first.get("bandwidth") or []
    if not sweep or len(reports) < 2:
        return Result("bandwidth", SKIP, "no all-reduce between ranks ran")
    shown = ", ".join("%s %.2f GB/s" % (human_bytes(s["bytes"]), s["busbw_gbps"]) for s in sweep)
    floor = env.get("XSCALE_DOCTOR_MIN_BUSBW_GBPS", "")
    largest = sweep[-1]["busbw_gbps"]
    if floor and first.get("nnodes", 1) > 1 and largest < float(floor):
        return Result("bandwidth", WARN,
                      "bus bandwidth %s: below the site's %s GB/s" % (shown, floor),
                      "a slow link or a fallback to TCP: see the net-plugin column")
    return Result("bandwidth", OK, "bus bandwidth " + shown + " (%s)" % first.get("backend", "?"))


def human_bytes(count: int) -> str:
    return "%d MiB" % (count >> 20) if count >= 1 << 20 else "%d KiB" % (count >> 10)


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------

CELL = {OK: "ok", WARN: "WARN", FAIL: "FAIL", SKIP: "-"}


def print_verdict(verdict: Verdict, checks: List[str], wall_s: float, world_size: int) -> None:
    columns = [c for c in NODE_CHECKS if c in checks or c == "layout"]
    nodes = sorted(verdict.nodes)
    width = max([len("node")] + [len(n) for n in nodes])
    print("doctor: %d ranks on %d nodes, %.1f s" % (world_size, len(nodes), wall_s))
    print("  ".join(["node".ljust(width)] + [c.ljust(max(len(c), 4)) for c in columns]))
    for node in nodes:
        cells = [CELL[verdict.worst(node, c).status] if verdict.worst(node, c) else "-"
                 for c in columns]
        print("  ".join([node.ljust(width)] + [cell.ljust(max(len(c), 4))
                                               for cell, c in zip(cells, columns)]))  # noqa: B905
    for node in nodes:
        for check in columns:
            worst = verdict.worst(node, check)
            if worst and worst.status in (WARN, FAIL):
                print("%s %s %s: %s" % (node, check, worst.status.upper(), worst.message))
                if worst.remedy:
                    print("    fix: " + worst.remedy)
    for result in verdict.job:
        print("job %s %s: %s" % (result.check, result.status.upper(), result.message))
        if result.status in (WARN, FAIL) and result.remedy:
            print("    fix: " + result.remedy)
    failed = verdict.failed_nodes()
    print("doctor: exclude: %s" % (hostlist.compress(failed) if failed else "none"))


def verdict_json(verdict: Verdict, me: Rank, wall_s: float) -> dict:
    failed = verdict.failed_nodes()
    return {
        "job_step": me.job_step, "world_size": me.world_size, "wall_s": round(wall_s, 3),
        "ok": not verdict.failed(),
        "nodes": {node: {check: asdict(verdict.worst(node, check)) for check in checks}
                  for node, checks in sorted(verdict.nodes.items())},
        "job": [asdict(r) for r in verdict.job],
        "failed_nodes": sorted(failed),
        "exclude": hostlist.compress(failed) if failed else "",
    }


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

def local_checks(me: Rank, env: Dict[str, str], options, sysfs: Path) -> List[Result]:
    vendor = env.get("XSCALE_GPU_VENDOR", "none")
    paths = split_list(options.paths)
    checks = {
        "cpu-affinity": lambda: check_cpu_affinity(me, env, vendor, sysfs),
        "network": lambda: check_network(env, sysfs),
        "storage": lambda: check_storage(env, options.min_free_gb, options.min_free_inodes),
        "paths": lambda: check_paths(paths),
    }
    return [run_check(name, check) for name, check in checks.items() if name in options.checks]


def torch_checks(me: Rank, env: Dict[str, str], options, facts: Dict[str, object]) -> List[Result]:
    vendor = env.get("XSCALE_GPU_VENDOR", "none")
    collective = bool({"bandwidth", "net-plugin"} & set(options.checks))
    sizes = list(SIZES_QUICK if options.quick else SIZES_FULL)
    record = run_torch_child(env, sizes, collective, options.timeout)
    for key in ("import_s", "torch_gpus", "bandwidth", "backend", "nnodes"):
        if key in record:
            facts[key] = record[key]
    facts["collective_error"] = record.get("collective_error") or (
        record.get("error") if collective else None)
    torch_gpus = record.get("torch_gpus")
    checks = {
        "import-torch": lambda: check_import(record),
        "gpus": lambda: check_gpus(me, env, vendor,
                                   torch_gpus if isinstance(torch_gpus, int) else None),
        "net-plugin": lambda: check_net_plugin(env, record.get("log")),
    }
    return [run_check(name, check) for name, check in checks.items() if name in options.checks]


def main(argv: List[str]) -> int:
    started = time.monotonic()
    env = dict(os.environ)
    options = parse_options(argv, env)
    me = Rank.from_env(env)
    directory = default_report_dir(options, me)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError("cannot create the report directory '%s': %s"
                         % (directory, error.strerror)) from None
    sysfs = Path("/sys")
    visible = visible_gpus(env, env.get("XSCALE_GPU_VENDOR", "none"))
    facts: Dict[str, object] = {"gpu": rank_gpu(visible, me.local_rank) if visible else None}
    results = local_checks(me, env, options, sysfs)
    write_report(directory, me, results, facts, final=False)  # in case torch never returns
    if TORCH_CHECKS & set(options.checks):
        results += torch_checks(me, env, options, facts)
    write_report(directory, me, results, facts, final=True)
    if me.rank != 0:
        # Only rank 0 decides the step's exit status: a rank that exits non-zero first would
        # have srun --kill-on-bad-exit end rank 0 before it prints the table.
        return 0
    reports = gather(directory, me, options.timeout)
    verdict = judge(reports, me, env, options)
    wall_s = time.monotonic() - started
    print_verdict(verdict, options.checks, wall_s, me.world_size)
    record = verdict_json(verdict, me, wall_s)
    (directory / "exclude").write_text(record["exclude"] + "\n")
    if options.json:
        options.json.write_text(json.dumps(record, indent=1) + "\n")
    sys.stdout.flush()
    return 1 if verdict.failed() else 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except UsageError as error:
        print("%s: error: %s" % (PROG, error), file=sys.stderr)
        sys.exit(2)

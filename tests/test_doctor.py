"""The preflight doctor (runscripts/doctor, docs/DOCTOR.md).

On the four-node test bed: a healthy job passes every check with one table row per node (through
jobs/lumi/smoke.sbatch, in test_jobs.py), and each fault injected on one node is found on that
node only, with its remedy, and named in the exclude list that the next sbatch accepts. What the
test bed lacks is faked at its outermost fact only: an RCCL plugin library file, an RCCL log, the
GPU count torch reports (tests/fakes/torch-gpus). The verdicts are the doctor's own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, RUNSCRIPTS, tool_env
from tests.helpers import wait_for

sys.path.insert(0, str(RUNSCRIPTS / "lib"))
import doctor  # noqa: E402
import hostlist  # noqa: E402

IMAGE = "xscale-test.sif"  # ignored by the shim
WRAPPER = "tests/programs/doctor-rank.sh"
FAKE_TORCH_GPUS = str(REPO / "tests" / "fakes" / "torch-gpus")
# RCCL's own INFO lines (as CSCS's NCCL page and aws-ofi-nccl issues show them), one log per node.
PLUGIN_LOG = ("nid001:1:2 [0] NCCL INFO NET/OFI Selected Provider is cxi (found 4 nics)\n"
              "nid001:1:2 [0] NCCL INFO Using network AWS Libfabric\n")
SOCKET_LOG = "nid003:1:2 [0] NCCL INFO NET/Socket : Using [0]hsn0:10.77.0.13<0>\n" \
             "nid003:1:2 [0] NCCL INFO Using network Socket\n"


def doctor_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """LUMI's profile on the test bed: its one NIC instead of four, a fake aws-ofi-rccl library
    file, torch reporting Slurm's GPUs. The doctor's own defaults otherwise (the /tmp floor too)."""
    plugin_dir = tmp_path / "plugin"
    plugin_dir.mkdir(exist_ok=True)
    (plugin_dir / "librccl-net.so").touch()
    env = {"XSCALE_SITE": "lumi", "NCCL_SOCKET_IFNAME": "hsn0", "LD_LIBRARY_PATH": str(plugin_dir),
           "PYTHONPATH": FAKE_TORCH_GPUS, "XSCALE_DOCTOR_TIMEOUT_S": "10"}
    env.update(extra)
    return env


def start_doctor(tmp_path: Path, nodes: int, wrapper_args: list[str], doctor_args: list[str],
                 env: dict[str, str], gpus: int = 0) -> subprocess.Popen:
    command = ["srun", f"-N{nodes}", f"-n{2 * nodes}", "--cpu-bind=none",
               *([f"--gres=gpu:{gpus}"] if gpus else []),
               "singularity", "exec", "-B", str(tmp_path), IMAGE, WRAPPER, *wrapper_args, "--",
               "/runscripts/doctor", "--report-dir", str(tmp_path / "ranks"),
               "--json", str(tmp_path / "verdict.json"), *doctor_args]
    return subprocess.Popen(command, cwd=REPO, env=tool_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def cells(verdict: dict) -> dict[str, dict[str, str]]:
    """node -> check -> status, from the verdict JSON."""
    return {node: {check: r["status"] for check, r in checks.items()}
            for node, checks in verdict["nodes"].items()}


def failures(verdict: dict) -> dict[tuple[str, str], dict]:
    return {(node, check): r for node, checks in verdict["nodes"].items()
            for check, r in checks.items() if r["status"] == "fail"}


# ---------------------------------------------------------------------------------------------
# On the virtual cluster
# ---------------------------------------------------------------------------------------------


def test_a_dead_link_and_a_full_tmp_are_found_on_their_nodes_and_excluded(cluster, tmp_path):
    """hsn0 down on nid002 and /tmp full on nid003. The link goes down after every rank has
    started (Slurm cannot launch on a node without it) and comes back once nid002's ranks have
    written their node checks: Slurm's own traffic shares hsn0 on the test bed (not on LUMI, where
    it uses the management network), and a longer cut would have it fail the node and the step."""
    hold, ranks = tmp_path / "hold", tmp_path / "ranks"
    hold.mkdir()
    proc = start_doctor(tmp_path, 4, ["--hold", str(hold)], ["--quick"], doctor_env(tmp_path))
    try:
        wait_for(lambda: len(list(hold.glob("ready-*"))) == 8, 120, "all 8 ranks to start")
        cluster.fault("link-down", "nid002")
        cluster.fault("fill-tmp", "nid003")
        (hold / "go").touch()
        wait_for(lambda: all((ranks / f"rank-{r}.json").exists() for r in (2, 3)), 60,
                 "nid002's node checks")
        cluster.fault("link-up", "nid002")
        output, errors = proc.communicate(timeout=300)
    finally:
        proc.kill()
        cluster.fault("heal", "nid002", "nid003")
    assert proc.returncode == 1, output + errors
    verdict = json.loads((tmp_path / "verdict.json").read_text())
    found = failures(verdict)
    assert found[("nid002", "network")]["message"] == "hsn0 is down", output
    assert "exclude the node" in found[("nid002", "network")]["remedy"]
    assert found[("nid003", "storage")]["message"].startswith("/tmp has 0.00 GB free"), output
    assert "No space left on device" in found[("nid003", "storage")]["message"]
    # Each fault on its node only: the healthy nodes pass every node check.
    assert {node for node, _ in found} == {"nid002", "nid003"}, output
    assert verdict["exclude"] == "nid[002-003]"
    assert output.rstrip().endswith("doctor: exclude: nid[002-003]"), output
    assert (ranks / "exclude").read_text() == "nid[002-003]\n"
    # The next job leaves them out, and Slurm accepts the list as the doctor wrote it.
    nodes = subprocess.run(
        ["srun", "-N2", f"--exclude={verdict['exclude']}", "hostname"], cwd=REPO,
        env=tool_env(), capture_output=True, text=True, timeout=120, check=False)
    assert nodes.returncode == 0, nodes.stderr
    assert sorted(nodes.stdout.split()) == ["nid001", "nid004"]


def test_a_shared_gpu_a_socket_fallback_and_a_missing_path_are_found_on_their_nodes(
        cluster, tmp_path):
    """nid002: local rank 1 is given rank 0's GPU; nid003: RCCL's log says it fell back to TCP
    sockets; nid004: the data path is missing (node-local /tmp stands in for a bind that one node
    lacks). nid001 stays healthy, and the bandwidth sweep runs."""
    data = "/tmp/xscale-doctor-data"
    for node in ("nid001", "nid002", "nid003", "nid004"):
        (cluster.node_tmp(node) / "xscale-rccl.log").write_text(
            SOCKET_LOG if node == "nid003" else PLUGIN_LOG.replace("nid001", node))
        if node != "nid004":
            (cluster.node_tmp(node) / "xscale-doctor-data").mkdir(exist_ok=True)
    try:
        proc = start_doctor(
            tmp_path, 4, ["--env", "nid002:1:ROCR_VISIBLE_DEVICES=0"], ["--paths", data],
            doctor_env(tmp_path, NCCL_DEBUG_FILE="/tmp/xscale-rccl.log"), gpus=2)
        output, errors = proc.communicate(timeout=300)
    finally:
        for node in ("nid001", "nid002", "nid003", "nid004"):
            (cluster.node_tmp(node) / "xscale-rccl.log").unlink(missing_ok=True)
            if (cluster.node_tmp(node) / "xscale-doctor-data").exists():
                (cluster.node_tmp(node) / "xscale-doctor-data").rmdir()
    assert proc.returncode == 1, output + errors
    verdict = json.loads((tmp_path / "verdict.json").read_text())
    found = failures(verdict)
    assert set(found) == {("nid002", "gpus"), ("nid003", "net-plugin"), ("nid004", "paths")}, output
    assert found[("nid002", "gpus")]["message"] == "ranks 2,3 share GPU 0"
    assert "--gpus-per-task=1" in found[("nid002", "gpus")]["remedy"]
    assert "'Using network Socket'" in found[("nid003", "net-plugin")]["message"]
    assert "aws-ofi-rccl" in found[("nid003", "net-plugin")]["remedy"]
    assert found[("nid004", "paths")]["message"] == f"{data} is not visible"
    assert "-B" in found[("nid004", "paths")]["remedy"]
    # The healthy node: every check that applies here passed, the plugin through its log.
    assert cells(verdict)["nid001"] == {
        "layout": "ok", "gpus": "ok", "cpu-affinity": "skip", "network": "ok",
        "net-plugin": "ok", "storage": "ok", "paths": "ok", "import-torch": "ok"}
    assert verdict["nodes"]["nid001"]["net-plugin"]["message"] == \
        "plugin in use (AWS Libfabric, provider cxi)"
    # The sweep crossed the nodes (gloo here), three sizes, below LUMI's floor: a warning.
    bandwidth = verdict["job"][0]
    assert bandwidth["status"] == "warn" and bandwidth["message"].count("GB/s") == 4, bandwidth
    assert verdict["exclude"] == "nid[002-004]"
    # One table row per node, the exclude list last.
    rows = [line.split()[0] for line in output.splitlines()
            if line.startswith("nid") and set(line.split()[1:]) <= {"ok", "WARN", "FAIL", "-"}]
    assert rows == ["nid001", "nid002", "nid003", "nid004"], output
    assert output.rstrip().endswith("doctor: exclude: nid[002-004]")


# ---------------------------------------------------------------------------------------------
# Without the cluster: bad input, crash isolation, and verdicts on faked sysfs facts
# ---------------------------------------------------------------------------------------------


def run_doctor(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(RUNSCRIPTS / "doctor"), *args], cwd=REPO,
                          env=tool_env(env), capture_output=True, text=True, timeout=120,
                          check=False)


@pytest.mark.parametrize("args, env, message", [
    (["--checks", "network,,storage"], {}, "argument --checks: 'network,,storage' is malformed"),
    (["--checks", "network,gpu"], {}, "argument --checks: unknown check 'gpu' (have: layout,"),
    (["--min-free-gb", "lots"], {}, "argument --min-free-gb: 'lots' is not a number"),
    ([], {"XSCALE_DOCTOR_TIMEOUT_S": "1m"}, "argument --timeout: '1m' is not a number"),
    (["--timeout", "nan"], {}, "argument --timeout: 'nan' must be 0 or more"),
    (["--report-dir", "/proc/xscale"], {}, "cannot create the report directory '/proc/xscale'"),
])
def test_bad_input_is_one_line_and_exit_2(args, env, message):
    proc = run_doctor(*args, **env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"doctor: error: {message}")


def test_a_crashing_check_is_that_checks_failure_and_the_others_still_run(tmp_path):
    def broken():
        raise KeyError("location_id")

    result = doctor.run_check("cpu-affinity", broken)
    assert result.status == "fail"
    assert result.message == "the check itself crashed: KeyError: 'location_id'"
    # A sysfs tree the parser does not expect (a GPU node without location_id) crashes one
    # check, inside local_checks, and the storage check beside it still answers.
    sysfs = fake_sysfs(tmp_path, gpus=[(0, 0)])
    props = sysfs / "class/kfd/kfd/topology/nodes/1/properties"
    props.write_text(props.read_text().replace("location_id", "location"))
    me = doctor.Rank(0, 1, 0, "n1", "a:1", "1.0")
    options = doctor.parse_options(["--checks", "cpu-affinity,storage"], {})
    results = doctor.local_checks(me, {"XSCALE_GPU_VENDOR": "amd", "ROCR_VISIBLE_DEVICES": "0",
                                       "XSCALE_DOCTOR_MIN_FREE_GB": "0"}, options, sysfs)
    assert [(r.check, r.status) for r in results] == [("cpu-affinity", "fail"), ("storage", "ok")]
    assert "crashed: KeyError" in results[0].message


def fake_sysfs(root: Path, gpus: list[tuple[int, int]]) -> Path:
    """A sysfs with LUMI-G's shape where it matters: two NUMA nodes of 8 CPUs, a KFD topology
    (node 0 a CPU, then one node per GPU) and each GPU's PCI function with its NUMA node.
    gpus: (PCI bus, NUMA node) per GPU, in ROCm's order."""
    sysfs = root / "sys"
    for numa, cpus in ((0, "0-7"), (1, "8-15")):
        node = sysfs / f"devices/system/node/node{numa}"
        node.mkdir(parents=True)
        (node / "cpulist").write_text(cpus + "\n")
    topology = sysfs / "class/kfd/kfd/topology/nodes"
    (topology / "0").mkdir(parents=True)
    (topology / "0/properties").write_text("cpu_cores_count 16\nsimd_count 0\ngpu_id 0\n")
    for index, (bus, numa) in enumerate(gpus, start=1):
        (topology / str(index)).mkdir()
        (topology / f"{index}/properties").write_text(
            f"simd_count 440\nlocation_id {bus << 8}\ndomain 0\ngpu_id {1000 + index}\n")
        device = sysfs / f"bus/pci/devices/0000:{bus:02x}:00.0"
        device.mkdir(parents=True)
        (device / "numa_node").write_text(f"{numa}\n")
    return sysfs


@pytest.mark.parametrize("gpu, affinity, status, message", [
    ("0", {1, 2}, "ok", "CPUs 1-2, GPU 0 on NUMA node 0"),
    ("1", {1, 2}, "fail", "CPUs 1-2, GPU 1 on NUMA node 1 (no CPU on it)"),
    ("1", {7, 8, 9}, "warn", "CPUs 7-9, GPU 1 on NUMA node 1 (1 CPUs elsewhere)"),
    ("2", {1}, "skip", "sysfs does not say where GPU 2 is"),
])
def test_cpu_mask_against_the_numa_node_of_the_ranks_gpu(tmp_path, monkeypatch, gpu, affinity,
                                                         status, message):
    sysfs = fake_sysfs(tmp_path, gpus=[(0xC1, 0), (0xD1, 1)])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: affinity)
    me = doctor.Rank(0, 1, 0, "n1", "a:1", "1.0")
    result = doctor.check_cpu_affinity(me, {"ROCR_VISIBLE_DEVICES": gpu}, "amd", sysfs)
    assert (result.status, result.message) == (status, message)


@pytest.mark.parametrize("log, status, message", [
    (PLUGIN_LOG, "ok", "plugin in use (AWS Libfabric, provider cxi)"),
    ("NCCL INFO Using network OFI\n", "ok", "plugin in use (OFI)"),
    (SOCKET_LOG, "fail", "RCCL fell back to TCP sockets ('Using network Socket')"),
    (PLUGIN_LOG.replace("cxi", "tcp"), "fail",
     "the plugin chose libfabric provider 'tcp', not cxi"),
    ("NCCL INFO comm 0x1 rank 0 nranks 2\n", "warn", "RCCL's log names no network"),
])
def test_rccl_log_verdicts(log, status, message):
    result = doctor.judge_rccl_log(log)
    assert (result.status, result.message) == (status, message)


def test_a_slow_import_is_flagged_against_the_jobs_median():
    reports = {rank: {"rank": rank, "node": f"nid00{rank // 2 + 1}", "facts": {"import_s": s}}
               for rank, s in enumerate([4.0, 4.5, 5.0, 21.0])}
    verdict = doctor.Verdict()
    doctor.judge_import_times(verdict, reports, factor=3)
    flagged = verdict.worst("nid002", "import-torch")
    assert flagged.status == "warn" and flagged.message.startswith("rank 3 took 21.0 s")
    assert verdict.worst("nid001", "import-torch") is None


def test_missing_ranks_are_blamed_on_the_node_slurm_placed_them_on():
    env = {"SLURM_STEP_NODELIST": "nid[001-002,004]", "SLURM_STEP_TASKS_PER_NODE": "2(x2),1"}
    assert doctor.expected_nodes(env) == {0: "nid001", 1: "nid001", 2: "nid002", 3: "nid002",
                                          4: "nid004"}


@pytest.mark.parametrize("hosts, compressed", [
    (["nid003", "nid002", "nid005"], "nid[002-003,005]"),
    (["nid001"], "nid001"),
    (["x1", "login", "x2", "x2"], "login,x[1-2]"),
])
def test_exclude_lists_are_in_slurms_hostlist_form(hosts, compressed):
    assert hostlist.compress(hosts) == compressed
    assert list(hostlist.expand(compressed)) == sorted(set(hosts))

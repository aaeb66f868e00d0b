"""The test bed itself (docs/TESTBED.md): four virtual nodes that behave like separate machines,
the fault helpers, and a cluster-down that leaves nothing behind.

What a rank sees here is what it sees on a real partition: its node's host name, its own hsn0
address, a /tmp no other node shares, and a master address that lives on another node.
"""

from __future__ import annotations

import re
import socket
import subprocess
import time
from pathlib import Path

from tests.conftest import CLUSTER_DIR, CLUSTER_STATE, NODES, REPO
from tests.helpers import rank_records, wait_for

IMAGE = "xscale-test.sif"  # ignored by the shim: the host root plays the image
ALLREDUCE = "tests/programs/allreduce.py"
BRIDGE = "xsbr0"
HOSTS_TAG = "# xscale-cluster"


def in_container(*command: str) -> list[str]:
    return ["singularity", "exec", IMAGE, "/runscripts/run.sh", *command]


def checks(output: str) -> list[dict]:
    return sorted(rank_records(output, "XSCALE_CHECK"), key=lambda r: r["rank"])


def sinfo_state(node: str) -> str:
    return subprocess.run(["sinfo", "-h", "-n", node, "-o", "%t"], capture_output=True,
                          text=True, timeout=30, check=True).stdout.strip()


def test_ranks_on_two_nodes_see_two_separate_machines(cluster):
    proc = cluster.srun("-N2", "-n4", "--cpu-bind=none",
                        *in_container("python", ALLREDUCE, "--mark-tmp"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = checks(proc.stdout)
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    first, second = ranks[0]["node"], ranks[2]["node"]
    assert first != second and {first, second} <= set(NODES)
    master_addr = socket.gethostbyname(first)
    for r in ranks:
        own_node = r["node"]
        # The host name is the node's, and the node's name resolves to its own hsn0.
        assert r["hostname"] == own_node
        assert r["addresses"] == {"lo": "127.0.0.1", "hsn0": socket.gethostbyname(own_node)}
        # MASTER_ADDR is the first node's name; every rank reaches it through its hsn0.
        assert r["master"].startswith(f"{first}:")
        assert r["route_to_master"] == {"to": master_addr, "from": r["addresses"]["hsn0"],
                                        "interface": "hsn0"}
        # /tmp is the node's own: a rank finds its node's markers, never the other node's.
        assert r["tmp_marks"] == [q["rank"] for q in ranks if q["node"] == own_node]
        # run.sh's per-job cache exists on the rank's node and nowhere else.
        cache = Path(r["cache_dir"])
        assert cache.parent == Path("/tmp")
        assert [node for node in NODES if (cluster.node_tmp(node) / cache.name).is_dir()] \
            == [own_node]
    assert ranks[0]["sum"] == ranks[0]["expected"] == 10  # the collective crossed the nodes
    for node in (first, second):
        for mark in cluster.node_tmp(node).glob("xscale-mark-*"):
            mark.unlink()


def test_lumi_profile_binds_gloo_to_hsn0_and_a_missing_interface_fails_fast(cluster):
    good = cluster.srun("-N2", "-n2", *in_container("python", ALLREDUCE),
                        env={"XSCALE_SITE": "lumi", "GLOO_SOCKET_IFNAME": "hsn0"})
    assert good.returncode == 0, good.stdout + good.stderr
    ranks = checks(good.stdout)
    assert [r["sum"] for r in ranks] == [3, 3]
    # The LUMI profile's RCCL list names the four Slingshot NICs; these nodes have hsn0 only,
    # which is enough for NCCL (it takes every interface that matches).
    assert {r["socket_ifname"]["nccl"] for r in ranks} == {"hsn0,hsn1,hsn2,hsn3"}
    assert {r["socket_ifname"]["gloo"] for r in ranks} == {"hsn0"}

    started = time.monotonic()
    bad = cluster.srun("-N2", "-n2", *in_container("python", ALLREDUCE),
                       env={"XSCALE_SITE": "lumi", "GLOO_SOCKET_IFNAME": "hsn7"})
    took = time.monotonic() - started
    assert bad.returncode == 2
    errors = sorted(line for line in bad.stderr.splitlines() if "run.sh: error:" in line)
    assert len(errors) == 2, bad.stderr
    for error in errors:
        assert "GLOO_SOCKET_IFNAME='hsn7': no interface 'hsn7'" in error
        assert error.endswith("(have: hsn0 lo)")
    # Each rank names its own node: the one to look at on a real partition.
    named = {re.search(r" on (nid\d+) ", error).group(1) for error in errors}
    assert len(named) == 2 and named <= set(NODES)
    assert "XSCALE_CHECK" not in bad.stdout and "Traceback" not in bad.stderr
    print(f"a missing GLOO_SOCKET_IFNAME interface failed the step in {took:.1f} s")


LINK_PROBE = str(REPO / "tests" / "programs" / "link_probe.py")


def seconds_to_send_a_mebibyte() -> float:
    """One MiB from nid004 to nid003, each end in its node's network namespace."""
    receiver = subprocess.Popen(["ip", "netns", "exec", "nid003", "python3", LINK_PROBE, "receive"],
                                stdout=subprocess.PIPE, text=True)
    try:
        port = receiver.stdout.readline().strip()
        sent = subprocess.run(["ip", "netns", "exec", "nid004", "python3", LINK_PROBE, "send",
                               "10.77.0.13", port],
                              capture_output=True, text=True, timeout=60, check=True)
        return float(sent.stdout)
    finally:
        receiver.kill()
        receiver.wait(timeout=30)


READ_PROBE = ("import sys, time; started = time.perf_counter(); "
              "open(sys.argv[1], 'rb').read(); print(time.perf_counter() - started)")


def seconds_to_read(cluster, node: str, path: Path) -> float:
    """The seconds a process on NODE takes to read PATH whole."""
    proc = cluster.srun("-w", node, "-N1", "-n1", "python3", "-c", READ_PROBE, str(path))
    assert proc.returncode == 0, proc.stderr
    return float(proc.stdout)


def test_fault_helpers_break_one_node_and_heal_restores_it(cluster, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "blob").write_bytes(bytes(64 * 1024))
    try:
        # Slow reads of a data directory on nid004 only: 64 KiB at 64 KiB/s take a second there,
        # every time (no page cache), and no time on nid003.
        cluster.fault("slow-reads", "nid004", str(data), "64k")
        slow_reads_s = [seconds_to_read(cluster, "nid004", data / "blob") for _ in range(2)]
        assert min(slow_reads_s) >= 0.95, slow_reads_s
        assert seconds_to_read(cluster, "nid003", data / "blob") < min(slow_reads_s) / 10
        assert re.search(rf"^nid004 .* slow-reads={data}$", cluster.fault("status"), re.M)
        # A throttled link: a MiB at 8 Mbit/s takes at least a second (less the 4 KiB burst),
        # however fast the machine; unthrottled it is memory speed.
        cluster.fault("throttle-link", "nid004", "8mbit")
        throttled_s = seconds_to_send_a_mebibyte()
        assert throttled_s >= (1 << 20) * 8 / 8e6 * 0.95, throttled_s
        assert re.search(r"^nid004 hsn0=UP .* rate=8Mbit ", cluster.fault("status"), re.M)
        # A full /tmp on nid003 only.
        cluster.fault("fill-tmp", "nid003")
        write = ["dd", "if=/dev/zero", "of=/tmp/xscale-fault-probe", "bs=64k", "count=1"]
        full = cluster.srun("-w", "nid003", "-N1", "-n1", *write)
        assert full.returncode != 0 and "No space left on device" in full.stderr
        fine = cluster.srun("-w", "nid004", "-N1", "-n1", *write)
        assert fine.returncode == 0, fine.stderr
        # A drained node, with the reason an administrator would give.
        cluster.fault("drain", "nid004", "xscale test: bad GPU")
        assert sinfo_state("nid004") == "drain"
        reasons = subprocess.run(["sinfo", "-R", "-h", "-o", "%n|%E"], capture_output=True,
                                 text=True, timeout=30, check=True).stdout
        assert "nid004|xscale test: bad GPU" in reasons.splitlines()
        # A dead slurmd: Slurm sets the node DOWN after SlurmdTimeout (5 s) and its next ping.
        cluster.fault("kill-slurmd", "nid003")
        wait_for(lambda: sinfo_state("nid003").startswith("down"), 90, "nid003 to be DOWN")
        status = cluster.fault("status")
        assert re.search(r"^nid003 hsn0=UP tmp=100% slurmd=dead state=down", status, re.M)
        assert re.search(r"^nid004 hsn0=UP tmp=\d+% slurmd=running state=drain", status, re.M)
    finally:
        cluster.fault("heal", "nid003", "nid004")
    assert {node: sinfo_state(node) for node in ("nid003", "nid004")} \
        == {"nid003": "idle", "nid004": "idle"}
    assert not list(cluster.node_tmp("nid003").glob(".xscale-fault-fill*"))
    (cluster.node_tmp("nid004") / "xscale-fault-probe").unlink()
    assert re.search(r"^nid004 .* rate=unlimited slow-reads=none$", cluster.fault("status"), re.M)
    healed_read_s = seconds_to_read(cluster, "nid004", data / "blob")
    assert healed_read_s < min(slow_reads_s) / 10
    print(f"a MiB over nid004's hsn0: {throttled_s:.2f} s at 8mbit, "
          f"{seconds_to_send_a_mebibyte():.3f} s healed; 64 KiB read on nid004: "
          f"{slow_reads_s} s at 64k, {healed_read_s:.3f} s healed")


def made_by_cluster_up() -> dict[str, list[str]]:
    """Everything cluster-up makes that could outlive it, as found on the machine now."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                           timeout=30, check=True).stdout
    mounts = Path("/proc/mounts").read_text()
    pid_files = list(CLUSTER_STATE.glob("*.pid")) if CLUSTER_STATE.is_dir() else []
    return {
        "namespaces": sorted(n for n in NODES if Path("/run/netns", n).exists()),
        "links": sorted(re.findall(rf"^\d+: ({BRIDGE}|xs-nid\d+)[@:]", links, re.M)),
        "hosts lines": [line for line in Path("/etc/hosts").read_text().splitlines()
                        if line.endswith(HOSTS_TAG)],
        "mounts": [line for line in mounts.splitlines() if str(CLUSTER_STATE) in line],
        "pid files": sorted(p.name for p in pid_files),
    }


def daemon_pids() -> list[int]:
    return [int(p.read_text().split()[0]) for p in CLUSTER_STATE.glob("*.pid")]


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def test_cluster_down_leaves_nothing_and_cluster_up_starts_it_again(cluster):
    before = made_by_cluster_up()
    assert len(before["namespaces"]) == len(before["hosts lines"]) == 4, before
    assert len(before["links"]) == 5 and len(before["mounts"]) == 4, before
    pids = daemon_pids()
    assert len(pids) >= 5, pids  # slurmctld, four slurmd (munged may be the distribution's)
    # Faults left in place must not survive either.
    cluster.fault("fill-tmp", "nid002")
    cluster.fault("drain", "nid003", "left by a test")

    down = subprocess.run(["bash", str(CLUSTER_DIR / "cluster-down.sh")], capture_output=True,
                          text=True, timeout=120, check=False)
    assert down.returncode == 0, down.stderr
    wait_for(lambda: not any(alive(pid) for pid in pids), 30, "the daemons to exit")
    assert made_by_cluster_up() == {"namespaces": [], "links": [], "hosts lines": [],
                                    "mounts": [], "pid files": []}
    assert not CLUSTER_STATE.exists()

    started = time.monotonic()
    up = subprocess.run(["bash", str(CLUSTER_DIR / "cluster-up.sh")], capture_output=True,
                        text=True, timeout=180, check=False)
    took = time.monotonic() - started
    assert up.returncode == 0, up.stderr
    print(f"cluster-up from nothing: {took:.1f} s")
    assert {node: sinfo_state(node) for node in NODES} == dict.fromkeys(NODES, "idle")
    # The fill is gone; only the mount point of a checkout cloned under /tmp may be there.
    checkout_under_tmp = {REPO.parts[2]} if REPO.parts[1:2] == ("tmp",) else set()
    assert {p.name for p in cluster.node_tmp("nid002").iterdir()} <= checkout_under_tmp
    # Idempotent: a second cluster-up keeps the running daemons.
    pids = sorted(daemon_pids())
    again = subprocess.run(["bash", str(CLUSTER_DIR / "cluster-up.sh")], capture_output=True,
                           text=True, timeout=180, check=False)
    assert again.returncode == 0, again.stderr
    assert sorted(daemon_pids()) == pids
    assert made_by_cluster_up()["hosts lines"] == before["hosts lines"]

"""jobs/lib/blame/*.patterns: every pattern parses, compiles, matches its example, blames a
plausible node or address, and no knock-on or user-bug line matches any pattern."""

from __future__ import annotations

import configparser
import ipaddress
import re

import pytest

from tests.conftest import REPO

BLAME_DIR = REPO / "jobs" / "lib" / "blame"
FILES = ("slurm.patterns", "lumi.patterns", "nvidia.patterns", "aurora.patterns")
KEYS = {"match", "example", "source", "why"}
LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
HOST = re.compile(rf"{LABEL}(?:\.{LABEL})*")
HOSTLIST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\[[0-9][0-9,-]*\]")

# Lines a healthy rank (or the launcher) prints after something else failed, and user bugs:
# none may blame a node.
KNOCK_ON = (
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
    "Connection closed by peer [10.77.0.12]:23456",
    "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:598] "
    "Connection reset by peer",
    "torch.distributed.DistBackendError: NCCL error in: "
    "../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, remote process exited or there "
    "was a network error, NCCL version 2.21.5",
    "ncclRemoteError: A call failed possibly due to a network error or a remote process "
    "exiting prematurely.",
    "nid001:4242:4300 [0] misc/socket.cc:49 NCCL WARN socketProgress: Connection closed by "
    "remote peer nid002-hsn0<57557>",
    "torch.distributed.DistBackendError: NCCL error in: "
    "../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled system error (run with "
    "NCCL_DEBUG=INFO for details), NCCL version 2.21.5",
    "ubuntu:39964:40075 [0] misc/socket.cc:483 NCCL WARN socketStartConnect: Connect to "
    "10.0.0.2<45763> failed : Software caused connection abort",
    "nid003:812:812 [2] misc/socket.cc:484 NCCL WARN socketStartConnect: Connect to "
    "10.77.0.14<41223> failed : Connection refused",
    "[rank3]:[E1123 18:40:12.345678 4242 ProcessGroupNCCL.cpp:616] [Rank 3] Watchdog caught "
    "collective operation timeout: WorkNCCL(SeqNum=1024, OpType=ALLREDUCE, NumelIn=1048576, "
    "NumelOut=1048576, Timeout(ms)=600000) ran for 600042 milliseconds before timing out.",
    "srun: error: nid001: tasks 0-1: Terminated",
    "srun: error: nid002: task 3: Killed",
    "srun: error: nid002: task 3: Exited with exit code 1",
    "srun: Job step aborted: Waiting up to 32 seconds for job step to finish.",
    "slurmstepd: error: *** STEP 1234.0 ON nid001 CANCELLED AT 2024-04-20T09:09:37 DUE TO NODE "
    "FAILURE, SEE SLURMCTLD LOG FOR DETAILS ***",
    "slurmstepd: error: *** JOB 494583 ON nid001 CANCELLED AT 2024-04-20T09:09:37 DUE TO TIME "
    "LIMIT ***",
    "W0902 15:10:48.626000 819010 torch/distributed/elastic/multiprocessing/api.py:900] Sending "
    "process 819027 closing signal SIGTERM",
    "x4616c3s4b0n0.hostmgmt2616.cm.aurora.alcf.anl.gov: rank 2358 died from signal 15",
    "x4117c3s3b0n0.hsn.cm.aurora.alcf.anl.gov: rank 0 died from signal 6 and dumped core",
    "x4502c1s3b0n0.hsn.cm.aurora.alcf.anl.gov: shepherd died from signal 11",
    "x4610c4s3b0n0.hsn.cm.aurora.alcf.anl.gov: rank 7 exited with code 1",
    "[rank7]: RuntimeError: level_zero backend failed with error: 40 "
    "(UR_RESULT_ERROR_OUT_OF_RESOURCES)",
    "RuntimeError: level_zero backend failed with error: 20 (UR_RESULT_ERROR_DEVICE_LOST)",
    "MPIDI_OFI_handle_cq_error(1075): OFI poll failed "
    "(ofi_events.c:1077:MPIDI_OFI_handle_cq_error:Input/output error - PTLTE_NOT_FOUND)",
    "Memory access fault by GPU node-4 (Agent handle: 0x152e220) on address (nil). Reason: Page "
    "not present or supervisor privilege.",
    "ZeroDivisionError: division by zero",
    'Traceback (most recent call last):',
    '  File "/scratch/project_465000001/train.py", line 42, in <module>',
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
    "capacity of 79.10 GiB of which 1.06 GiB is free.",
    "RuntimeError: HIP out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
    "63.98 GiB of which 1.12 GiB is free.",
    "RuntimeError: CUDA error: an illegal memory access was encountered",
    "RuntimeError: CUDA error: unspecified launch failure",
    "NVRM: Xid (PCI:0000:3b:00): 13, pid=4242, name=python, Graphics Exception: ESR 0x50df30=0x6",
    "NVRM: Xid (PCI:0000:3b:00): 31, pid=4242, name=python, Ch 00000008, intr 10000000. MMU Fault",
)


def load(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None)
    with (BLAME_DIR / name).open(encoding="utf-8") as f:
        parser.read_file(f)
    return parser


def sections() -> list[tuple[str, str, configparser.SectionProxy]]:
    return [(name, sec, load(name)[sec]) for name in FILES for sec in load(name).sections()]


ALL = sections()


def ids(item: tuple[str, str, configparser.SectionProxy]) -> str:
    return f"{item[0]}:{item[1]}"


def test_every_file_exists_says_what_it_covers_and_has_patterns():
    for name in FILES:
        text = (BLAME_DIR / name).read_text(encoding="utf-8")
        assert text.startswith("# Bad-node blame patterns: "), name
        assert load(name).sections(), name
    assert sorted(p.name for p in BLAME_DIR.glob("*.patterns")) == sorted(FILES)


def test_section_names_are_unique_across_files():
    names = [sec for _, sec, _ in ALL]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    # and within a file: configparser refuses duplicates (strict=True), so load() already did


@pytest.mark.parametrize("item", ALL, ids=ids)
def test_pattern_is_complete_compiles_and_matches_its_example(item):
    _, _, section = item
    assert set(section.keys()) == KEYS
    for key in KEYS:
        assert section[key].strip() and "\n" not in section[key], key
    assert section["source"].startswith("https://")
    regex = re.compile(section["match"])
    assert set(regex.groupindex) <= {"node", "addr"}
    assert not ("node" in regex.groupindex and "addr" in regex.groupindex)
    assert regex.search(section["example"]), section["example"]


def plausible_node(value: str) -> bool:
    return bool(HOST.fullmatch(value) or HOSTLIST.fullmatch(value))


def plausible_addr(value: str) -> bool:
    if "<" in value or ">" in value:
        return False
    try:
        ipaddress.ip_address(value.split("%", 1)[0])
    except ValueError:
        return bool(HOST.fullmatch(value))
    return True


@pytest.mark.parametrize("item", ALL, ids=ids)
def test_named_groups_capture_a_host_or_an_address(item):
    _, _, section = item
    found = re.search(section["match"], section["example"])
    assert found
    groups = found.groupdict()
    if "node" in groups:
        assert groups["node"] and plausible_node(groups["node"]), groups["node"]
    if "addr" in groups:
        assert groups["addr"] and plausible_addr(groups["addr"]), groups["addr"]


def test_plausibility_checks_reject_ports_and_gpu_agents():
    assert plausible_addr("10.1.2.3") and plausible_addr("nid002-hsn0")
    assert plausible_addr("fe80::ba59:9f03:fc:765c%ib0")
    assert not plausible_addr("10.1.2.3<43211>")
    assert not plausible_node("node-4 (Agent handle: 0x152e220)")
    assert plausible_node("nid[001-002,007]")
    assert plausible_node("x4502c1s3b0n0.hsn.cm.aurora.alcf.anl.gov")


def test_examples_blame_what_they_should():
    def blame(line: str) -> list[tuple[str, dict[str, str]]]:
        return [(sec, found.groupdict()) for _, sec, section in ALL
                if (found := re.search(section["match"], line))]

    assert blame("srun: error: Node failure on nid002") == [
        ("slurm-node-failure", {"node": "nid002"})]
    assert blame("salloc: error: Node failure on nid[002-003]") == [
        ("slurm-node-failure", {"node": "nid[002-003]"})]
    assert blame(
        "nid001:77:90 [0] misc/socket.cc:484 NCCL WARN socketStartConnect: Connect to "
        "10.1.2.3<43211> failed : Connection timed out"
    ) == [("nvidia-nccl-connect-unreachable", {"addr": "10.1.2.3"})]
    # NCCL >= 2.24: lower-case "connect", the errno text after "returned"
    assert blame(
        "nid001:77:90 [0] os/linux.cc:288 NCCL WARN ncclOsSocketPollConnect: connect to "
        "10.1.2.3<43211> returned No route to host, exceeded error retry count after 35 attempts"
    ) == [("nvidia-nccl-connect-unreachable", {"addr": "10.1.2.3"})]
    # the HSA agent number is not a host: the printing rank's node is blamed
    assert blame("HW Exception by GPU node-1 (Agent handle: 0x3508fba0) reason :ECC") == [
        ("lumi-hsa-hw-exception", {})]
    assert blame("[timestamp] NVRM: Xid (PCI:0000:44:00): 48, pid=4242, DBE (double bit error) "
                 "ECC Error") == [("nvidia-xid-hardware", {})]


@pytest.mark.parametrize("line", KNOCK_ON)
def test_knock_on_and_user_bug_lines_match_no_pattern(line):
    hits = [ids(item) for item in ALL if re.search(item[2]["match"], line)]
    assert hits == [], line

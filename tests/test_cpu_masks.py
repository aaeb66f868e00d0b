"""jobs/lib/cpu-masks: LUMI's documented list, generic layouts, errors, and what srun applies."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import REPO

CPU_MASKS = REPO / "jobs" / "lib" / "cpu-masks"
# The LUMI AI workshop's list (E09 "Extreme scale AI", docs/ai-20241126/E09_ExtremeScale.md in
# Lumi-supercomputer/LUMI-training-materials; LUMI docs, "Distribution and binding"): GCD 0..7 ->
# CCD 6,7,2,3,0,1,4,5, first core of each CCD reserved.
LUMI_LIST = (
    "0x00fe000000000000,0xfe00000000000000,0x0000000000fe0000,0x00000000fe000000,"
    "0x00000000000000fe,0x000000000000fe00,0x000000fe00000000,0x0000fe0000000000"
)


def masks(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CPU_MASKS), *args], capture_output=True, text=True, timeout=10, check=False
    )


def cores_of(mask: str) -> list[int]:
    value = int(mask, 16)
    return [bit for bit in range(value.bit_length()) if value >> bit & 1]


def test_lumi_layout_is_the_documented_list_exactly():
    proc = masks("lumi")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == LUMI_LIST + "\n"
    assert proc.stderr == ""


def test_lumi_layout_gives_each_gcd_the_seven_free_cores_of_its_ccd():
    ccd_of_gcd = [6, 7, 2, 3, 0, 1, 4, 5]
    per_gcd = [cores_of(mask) for mask in masks("lumi").stdout.strip().split(",")]
    assert per_gcd == [list(range(8 * ccd + 1, 8 * ccd + 8)) for ccd in ccd_of_gcd]


def test_generic_form_reproduces_lumi():
    proc = masks(
        "--cores-per-task", "8", "--tasks", "8", "--reserve-first", "--order", "6,7,2,3,0,1,4,5"
    )
    assert proc.stdout.strip() == LUMI_LIST


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--cores-per-task", "1", "--tasks", "2"), "0x1,0x2"),  # the virtual cluster's nodes
        (("--cores-per-task", "2", "--tasks", "2"), "0x3,0xc"),
        (("--cores-per-task", "4", "--tasks", "2", "--first-core", "4"), "0x0f0,0xf00"),
        (("--cores-per-task", "4", "--tasks", "2", "--reserve-first"), "0x0e,0xe0"),
        (("--cores", "0", "1"), "0x1,0x2"),
        (("--cores", "1-7", "9-15"), "0x00fe,0xfe00"),
        (("--cores", "0,2", "1,3"), "0x5,0xa"),
        # beyond 64 cores (bash's integers): built digit by digit
        (("--cores", "0", "64"), "0x00000000000000001,0x10000000000000000"),
    ],
)
def test_generic_layouts(args, expected):
    proc = masks(*args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected + "\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "no layout given"),
        (("frontier",), "unknown layout 'frontier'"),
        (("lumi", "extra"), "takes no further arguments"),
        (("--tasks", "2"), "--cores-per-task is required"),
        (("--cores-per-task", "2"), "--tasks is required"),
        (("--cores-per-task", "x", "--tasks", "2"), "expects a whole number"),
        (("--cores-per-task", "0", "--tasks", "2"), "at least 1"),
        (("--cores-per-task", "1", "--tasks", "2", "--reserve-first"), "nothing would be left"),
        (("--cores-per-task", "1", "--tasks", "2", "--order", "1"), "1 groups for 2 tasks"),
        (("--cores-per-task", "1", "--tasks", "2", "--bogus"), "unknown argument '--bogus'"),
        (("--cores",), "one core list per task"),
        (("--cores", "7-1"), "runs backwards"),
        (("--cores", "1-"), "not a core list"),
        (("--cores", "5000"), "beyond 4095"),
    ],
)
def test_errors_are_one_line_and_exit_2(args, message):
    proc = masks(*args)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("cpu-masks: error: ")
    assert message in lines[0]


@pytest.mark.parametrize(
    "args",
    [("--cores-per-task", "1", "--tasks", "2"), ("--cores", "1", "0"), ("--cores", "0-1", "0-1")],
)
def test_srun_applies_the_printed_masks(cluster, args):
    printed = masks(*args).stdout.strip()
    proc = cluster.srun(
        "-N1", "-n2", "--label", f"--cpu-bind=mask_cpu:{printed}",
        "grep", "Cpus_allowed_list", "/proc/self/status",
    )
    assert proc.returncode == 0, proc.stderr
    applied = {}
    for line in proc.stdout.splitlines():
        task, _, rest = line.partition(": ")
        applied[int(task)] = rest.split()[-1]
    expected = {
        task: ",".join(str(core) for core in cores_of(mask))
        for task, mask in enumerate(printed.split(","))
    }
    # The kernel writes ranges ("0-1"); expand them for the comparison.
    assert {task: expand(cpus) for task, cpus in applied.items()} == expected


def expand(cpu_list: str) -> str:
    cores: list[int] = []
    for item in cpu_list.split(","):
        lo, _, hi = item.partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return ",".join(str(core) for core in cores)

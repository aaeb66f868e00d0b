"""Run the bats suites from pytest, so CI reads one closing line for shell and Python alike."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.conftest import IN_CI, REPO

SUITES = sorted((REPO / "tests" / "bats").glob("*.bats"))


@pytest.mark.parametrize("suite", SUITES, ids=[s.stem for s in SUITES])
def test_bats_suite(suite):
    if not shutil.which("bats"):
        if IN_CI:
            pytest.fail("bats is not installed (make setup installs it)")
        pytest.skip("bats is not installed; run 'make setup'")
    proc = subprocess.run(
        ["bats", "--tap", str(suite)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "not ok" not in proc.stdout
    assert proc.stdout.count("\nok ") + proc.stdout.startswith("ok ") > 0

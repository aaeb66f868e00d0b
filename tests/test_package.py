"""xscale as a package (pyproject.toml): `pip install .` from the checkout into a fresh venv
gives `import xscale` and the `xscale` command, as a user of their own training script gets them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, VENV_BIN


def run(*argv: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(word) for word in argv], capture_output=True, text=True,
                          timeout=300, check=False, cwd=cwd)


def test_pip_install_from_the_checkout_gives_the_package_and_its_command(tmp_path: Path):
    """A wheel built from what the images copy (containers/*.def), installed into a venv that
    has none of xscale's dependencies: the package and the command need none of them to start.
    The test venv's setuptools builds it (--no-build-isolation) and --no-deps installs it, so
    the test needs no package index."""
    source = tmp_path / "source"  # pip builds in the source tree: a copy, not the checkout
    shutil.copytree(REPO / "python" / "xscale", source / "python" / "xscale",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", source)
    built = run(VENV_BIN / "python", "-m", "pip", "wheel", "-q", "--no-deps",
                "--no-build-isolation", "-w", tmp_path / "dist", source)
    assert built.returncode == 0, built.stdout + built.stderr
    wheel = next((tmp_path / "dist").glob("xscale-*.whl"))
    venv = tmp_path / "venv"
    made = run(sys.executable, "-m", "venv", venv)
    assert made.returncode == 0, made.stderr
    installed = run(venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", wheel)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    where = run(venv / "bin" / "python", "-c", "import xscale; print(xscale.__file__)",
                cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout
    help_text = run(venv / "bin" / "xscale", "--help")
    assert help_text.returncode == 0, help_text.stderr
    assert "report" in help_text.stdout and "goodput-model" in help_text.stdout
    model = run(venv / "bin" / "xscale", "goodput-model", "--nodes", "64", "--runs", "1")
    assert model.returncode == 0 and "0 spares:" in model.stdout, model.stderr


def test_the_command_names_an_unknown_subcommand_in_one_line():
    proc = run(VENV_BIN / "xscale", "reprot")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "xscale: error: no command 'reprot' (one of: report, goodput-model)\n"

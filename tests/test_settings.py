"""xscale.shared.settings: the one table of XSCALE_* settings, the page printed from it, the typed
readers, and the warning for a name that is no setting. Fast; no cluster."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch
from xscale import __main__ as cli
from xscale import dist
from xscale.checkpoints import cadence, savers
from xscale.lifecycle import UserError
from xscale.observe import profile_window, stragglers
from xscale.shared import settings

from tests.conftest import REPO
from tests.helpers import assert_python36_code, find_python36

SETTINGS_PY = REPO / "python" / "xscale" / "shared" / "settings.py"
PAGE = REPO / "docs" / "SETTINGS.md"
# Where a setting may be read or set: every program of the project, and its tests.
CODE = ["python", "runscripts", "jobs", "containers", "Makefile", "tests"]
NAME = re.compile(r"XSCALE_[A-Z0-9_]+")
TAGS = {tag for tag, _ in settings.OUTPUT_TAGS}
# Misspellings are built, not written out, so that the code holds no name the table lacks.
SPARE = settings.PREFIX + "SPARE"
FAR = settings.PREFIX + "ZQWV"


def names_in(paths: list[str], exclude: Path | None = None) -> set[str]:
    """Every XSCALE_ name in the checkout's files under PATHS, new files not yet added too."""
    args = ["git", "grep", "--untracked", "-ohE", NAME.pattern, "--", *paths]
    if exclude is not None:
        args.append(f":(exclude){exclude.relative_to(REPO)}")
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, check=False)
    if proc.returncode == 128:
        pytest.skip(f"not a git checkout: {proc.stderr.strip()}")
    return set(proc.stdout.split())


# ---- the page and the table ------------------------------------------------------------------


def test_the_page_is_printed_from_the_table():
    assert PAGE.read_text() == settings.markdown(), (
        "docs/SETTINGS.md is not what the table in python/xscale/shared/settings.py prints: "
        "run `make settings-doc`")


def test_every_name_in_the_code_is_in_the_table():
    unknown, prefixes = set(), set()
    for name in names_in(CODE):
        if name.endswith("_"):  # a family written as a prefix: XSCALE_DOCTOR_<NAME>
            prefixes.add(name)
        elif name not in settings.BY_NAME and name not in TAGS:
            unknown.add(name)
    assert unknown == set(), f"add these to SETTINGS in python/xscale/shared/settings.py: {unknown}"
    orphans = {prefix for prefix in prefixes
               if not any(row.name.startswith(prefix) for row in settings.SETTINGS)}
    assert orphans == set(), orphans


def test_every_setting_in_the_table_is_used_somewhere():
    """The table holds no setting the code forgot: each name is in a file besides the table."""
    used = names_in(CODE, exclude=SETTINGS_PY)
    assert {row.name for row in settings.SETTINGS} - used == set()


def test_the_table_is_well_formed():
    names = [row.name for row in settings.SETTINGS]
    assert len(names) == len(set(names)) and not set(names) & TAGS
    readers = {key for key, _, _ in settings.READERS}
    for row in settings.SETTINGS:
        assert row.name.startswith(settings.PREFIX) and row.reader in readers, row
        assert row.does and "\n" not in row.does, row
        assert row.default is None or row.shown or row.kind.label, row


def test_every_reader_has_its_table_on_the_page():
    page = settings.markdown()
    for _, title, _ in settings.READERS:
        assert f"## {title}\n" in page
    for name in [*settings.BY_NAME, *TAGS]:
        assert f"`{name}`" in page, name


# ---- reading a setting -----------------------------------------------------------------------


def test_an_unset_setting_is_its_default():
    assert settings.value("XSCALE_SPARES", {}) == 0
    assert settings.value("XSCALE_NODE_MTBF_H", {}) == cadence.NODE_MTBF_H
    assert settings.value("XSCALE_FR_DIR", {}) is None
    assert settings.value("XSCALE_EXPAND_ARGS", {}) is True


@pytest.mark.parametrize("name, given, wanted", [
    ("XSCALE_TIMEOUT_S", " 30 ", 30),
    ("XSCALE_STRAGGLER_FACTOR", "1.3", 1.3),
    ("XSCALE_TORCH_PROFILER", "1", True),
    ("XSCALE_TORCH_PROFILER", "0", False),
    ("XSCALE_CHECKPOINT_WRITERS", "all", "all"),
    ("XSCALE_DOCTOR_TIMEOUT_S", "0", 0.0),
    ("XSCALE_STAGE_DIR", "", ""),
])
def test_a_good_value_is_parsed(name, given, wanted):
    assert settings.value(name, {name: given}) == wanted


TYPED = [row for row in settings.SETTINGS if row.kind.complaint]


def refused(row: settings.Setting, text: str) -> bool:
    try:
        row.kind.parse(text)
    except ValueError:
        return True
    return False


@pytest.mark.parametrize("row", TYPED, ids=lambda row: row.name)
def test_a_bad_value_is_one_line_naming_the_setting(row):
    bad_ones = [text for text in ("bogus", "", "-1", "nan", "inf") if refused(row, text)]
    assert len(bad_ones) >= 3, bad_ones
    for bad in bad_ones:
        with pytest.raises(UserError) as caught:
            settings.value(row.name, {row.name: bad})
        message = str(caught.value)
        assert message == f"{row.name}='{bad}' {row.kind.complaint}" and "\n" not in message


def test_the_existing_messages_stay():
    cases = {"XSCALE_CHECKPOINT_MODE": ("Async", "is neither async nor sync"),
             "XSCALE_NODE_MTBF_H": ("inf", "is not a positive number of hours"),
             "XSCALE_STRAGGLER_FACTOR": ("1", "must be a number above 1"),
             "XSCALE_STRAGGLER_INTERVALS": ("0", "must be a whole number of at least 1"),
             "XSCALE_TIMEOUT_S": ("0", "must be a whole number of seconds, at least 1"),
             "XSCALE_SITE": ("lumi2", "is not one of: lumi, aurora, nvidia, "
                                      "nvidia-slingshot, generic")}
    for name, (bad, complaint) in cases.items():
        with pytest.raises(UserError, match=f"^{name}='{re.escape(bad)}' {complaint}$"):
            settings.value(name, {name: bad})


def test_check_reads_every_setting_of_a_reader():
    settings.check(settings.TRAINERS, {})
    with pytest.raises(UserError, match="XSCALE_STRAGGLER_INTERVALS='x'"):
        settings.check(settings.TRAINERS, {"XSCALE_STRAGGLER_INTERVALS": "x"})
    settings.check(settings.TRAINERS, {"XSCALE_GPU_BIND": "x"})  # run.sh's, not the trainers'


def test_a_name_the_table_lacks_is_a_mistake_in_the_code():
    with pytest.raises(KeyError, match="not in xscale.shared.settings.SETTINGS"):
        settings.value(SPARE, {})


@pytest.mark.parametrize("read", [
    lambda env: savers.checkpoint_mode(env),
    lambda env: savers.checkpoint_writers(env),
    lambda env: cadence.node_mtbf_hours(env),
    lambda env: dist.timeout_from_env(env),
    lambda env: stragglers.settings(env),
    lambda env: profile_window.window_from_env(0, torch.device("cpu"), env),
], ids=["mode", "writers", "mtbf", "timeout", "stragglers", "profiling"])
def test_the_readers_go_through_the_table(read):
    """Each converted reader gives the table's default, and refuses the table's bad value."""
    read({})
    bad = {"XSCALE_CHECKPOINT_MODE": "x", "XSCALE_CHECKPOINT_WRITERS": "x",
           "XSCALE_NODE_MTBF_H": "x", "XSCALE_TIMEOUT_S": "x", "XSCALE_STRAGGLER_FACTOR": "x",
           "XSCALE_TORCH_PROFILER": "x"}
    with pytest.raises(UserError, match=r"^XSCALE_[A-Z_]+='x' "):
        read(bad)


def test_the_timeout_and_the_backend_defaults():
    assert dist.timeout_from_env({}).total_seconds() == dist.DEFAULT_TIMEOUT_S == 600
    assert stragglers.settings({}) == (stragglers.DEFAULT_FACTOR, stragglers.DEFAULT_INTERVALS)
    assert settings.value("XSCALE_BACKEND", {}) == ""


# ---- names that are no setting ---------------------------------------------------------------


def test_a_close_misspelling_names_the_setting():
    assert settings.misspelled({SPARE: "1"}) == [
        f"xscale: warning: {SPARE} is not an xscale setting; did you mean XSCALE_SPARES? "
        "(docs/SETTINGS.md)"]


def test_a_far_name_gets_the_plain_warning():
    assert settings.misspelled({FAR: "1", "HOME": "/root"}) == [
        f"xscale: warning: {FAR} is not an xscale setting (docs/SETTINGS.md)"]


def test_xscale_own_names_never_warn():
    environ = {row.name: "1" for row in settings.SETTINGS}
    assert settings.misspelled(environ) == []


def test_a_misspelling_is_not_pointed_at_a_name_xscale_sets():
    progres = settings.PREFIX + "PROGRES"
    assert settings.misspelled({progres: "/tmp/p"}) == [
        f"xscale: warning: {progres} is not an xscale setting (docs/SETTINGS.md)"]


# ---- the command -----------------------------------------------------------------------------


def test_xscale_settings_prints_the_table(capsys):
    assert cli.main(["settings"]) == 0
    out = capsys.readouterr().out
    for row in settings.SETTINGS:
        line = next(line for line in out.splitlines() if line.split()[:1] == [row.name])
        assert row.does in line
    assert cli.main(["settings", "--markdown"]) == 0
    assert capsys.readouterr().out == settings.markdown()


# ---- the batch host's Python -----------------------------------------------------------------


def test_settings_py_is_python36_code():
    """The batch host's programs may load it by path (jobs/lib/shared.py)."""
    assert_python36_code(SETTINGS_PY)


def test_settings_py_runs_under_python36():
    python36 = find_python36()
    if python36 is None:
        pytest.skip("no Python 3.6 found (XSCALE_PYTHON36, python3.6 on PATH, pyenv)")
    load = ("import importlib.util, sys\n"
            "spec = importlib.util.spec_from_file_location('xscale_settings', sys.argv[1])\n"
            "module = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(module)\n"
            "sys.stdout.write(module.markdown())\n")
    proc = subprocess.run([python36, "-c", load, str(SETTINGS_PY)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == settings.markdown()

"""get-master and its hostlist library, checked against Slurm's own `scontrol show hostnames`.

Three answers must agree with scontrol: `get-master LIST` (the bash first-host path),
`get-master --all LIST` (hostlist.py) and `xs_hostlist_first` sourced in-process (what run.sh
calls). scontrol needs only a slurm.conf to expand a list, no daemons; without one it hangs for
about a minute, hence the two-line config and a timeout on every call.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import types
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import assert_python36_code, find_python36

REPO = Path(__file__).resolve().parent.parent
GET_MASTER = REPO / "runscripts" / "get-master"
HOSTLIST_SH = REPO / "runscripts" / "lib" / "hostlist.sh"
HOSTLIST_PY = REPO / "runscripts" / "lib" / "hostlist.py"
IN_CI = os.environ.get("CI") == "true"
TIMEOUT = 60
ERROR_PREFIX = "get-master: error: "

# Lists scontrol (Slurm 22.05) accepts; each answer is compared with scontrol's.
VALID_LISTS = [
    "nid001",
    "nid[005252-005254,005260]",  # ranges and lists, zero padding
    "nid[007]",  # one element in brackets
    "a,b,a",  # duplicates are kept
    "n[1-3],n2",
    "n[1-3,2]",  # a duplicate inside one bracket
    "a[3,1,2]",  # order as written, not sorted
    "x[1-2]y[3-4]",  # several brackets: the last varies fastest
    "node[1-2]-b[3-4]",
    "a[1-2]b[3-4]c[5-6]",  # three: last fastest, then first, then second
    "a[1-2]b[3-4]c[5-6]d[7-8]",
    "a[1-2][3-4]",  # adjacent brackets
    "[1-3]",  # no prefix
    "a1[1-2]",
    "a.b[1-2]",
    "a[1-010]",  # padding comes from the low end: 1..10 unpadded
    "a[01-2]",
    "a[09-100]",
    "a[010-12]",
    "a[0-3],a[00-3]",
    "a[01,2,003]",
    "a[001-009],a10",
    "a[08-09,010]",
    "a[2-2]",
    "a b",  # whitespace separates like ','
    "a, b",
    "a\tb",
    "a\nb,c",
    "  a,b  ",
    "a[1-2],b[3-4],c",
    "a[1-2]b[3-4],c",
    "a[4294967296]",
    "nid[000001-010000]",
    "a[0-65535]",  # Slurm's largest range
]

# Text after the last bracket: Slurm 22.05 rejects these, newer Slurm expands them (see --help).
SUFFIX_LISTS = {
    "node[1-2]-ib": ["node1-ib", "node2-ib"],
    "a[1-2]b": ["a1b", "a2b"],
    "x[1-2]y[3-4]z": ["x1y3z", "x1y4z", "x2y3z", "x2y4z"],
    "c,n[01-02].ib,d": ["c", "n01.ib", "n02.ib", "d"],
}

# Malformed lists: exit 2, one line on stderr naming the list, nothing on stdout, on both paths.
MALFORMED_LISTS = [
    "",
    "   ",
    "a[1-2",  # unbalanced brackets
    "a1-2]",
    "a]",
    "a[1-2]]",
    "a[[1-2]]",
    "a[1[2]]",
    "a[1,b[2]",
    "nid[]",
    "a[5-2]",  # descending
    "a[1-2]b[9-8]",
    "a[a-3]",  # non-numeric
    "a[1-x]",
    "a[ 1-2]",
    "a[+1-2]",
    "a[1-10:2]",
    "a[1-]",
    "a[-3]",
    "a[1--3]",
    "a[1-2-3]",
    "a[1,-2]",
    "a[1-,2]",
    "a,,b",  # empty items
    "a, ,b",
    "a[1,,2]",
    "a[,1]",
    "a[1,]",
    ",a",  # leading / trailing commas
    "a,",
    " , a",
    "a[1-70000]",  # Slurm's 65536-host limit for one range
    "a[1234567890123456789]",  # beyond 18 digits
    "a\n,",
]

# Ranges the first-host path does not check (only the ones that make the first host are): the
# bash path answers, --all (which checks every range) refuses.
ALL_ONLY_ERRORS = {
    "a[1,5-2]": "a1",
    "a[1-2],b[3-1]": "a1",
    "a[1-2,1-70000]": "a1",
    "a[1-40000,1-40000]b[1]": "a1b1",  # Slurm's limit for brackets before the last
}


def clean_env(**extra: str) -> dict[str, str]:
    """The test runner's environment without its own job's node lists (it may run in a job)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PBS_"))}
    env.update(extra)
    return env


def run(args: Sequence[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        list(args), env=env if env is not None else clean_env(), capture_output=True,
        text=True, timeout=TIMEOUT, check=False,
    )


def get_master(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run([str(GET_MASTER), *args], env=env)


def hosts_of(proc: subprocess.CompletedProcess) -> list[str]:
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    return proc.stdout.splitlines()


def assert_one_error_line(proc: subprocess.CompletedProcess, hostlist: str) -> str:
    """Exit 2, nothing on stdout, exactly one stderr line `get-master: error: ...` quoting LIST."""
    assert proc.returncode == 2, (hostlist, proc.stdout, proc.stderr)
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(ERROR_PREFIX), lines
    assert f"'{shown(hostlist)}'" in lines[0]
    return lines[0][len(ERROR_PREFIX):]


def shown(hostlist: str) -> str:
    return hostlist.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")


@pytest.fixture(scope="session")
def scontrol(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list[str] | None]:
    """scontrol's expansion of a list, or None where Slurm calls it an invalid hostlist."""
    if shutil.which("scontrol") is None:
        reason = "scontrol (slurm-wlm) is not installed: it is the reference these tests use"
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    conf = tmp_path_factory.mktemp("slurm") / "slurm.conf"
    conf.write_text("ClusterName=x\nSlurmctldHost=x\n")
    env = clean_env(SLURM_CONF=str(conf))

    def hostnames(hostlist: str) -> list[str] | None:
        proc = run(["scontrol", "show", "hostnames", hostlist], env=env)
        # 22.05 reports a bad list on stderr and still exits 0.
        if proc.returncode != 0 or "Invalid hostlist" in proc.stderr or "error" in proc.stderr:
            return None
        return proc.stdout.splitlines()

    return hostnames


@pytest.fixture(scope="session")
def sourced_first(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Sequence[str]], list]:
    """xs_hostlist_first called in-process by a `set -euo pipefail` script, as run.sh will.

    Returns ("ok", host) or ("error", message) per list. Each list is first tried with a plain
    call under errexit, so a helper that returned non-zero on a good list would show as "bug".
    """
    driver = tmp_path_factory.mktemp("driver") / "first.sh"
    driver.write_text(
        'set -euo pipefail\n'
        'source "$1"\n'
        'shift\n'
        'for list in "$@"; do\n'
        '  set +e\n'
        '  ( set -e; xs_hostlist_first "$list"; printf "ok\\t%s\\n" "$XS_FIRST_HOST" )\n'
        '  rc=$?\n'
        '  set -e\n'
        '  ((rc == 0)) && continue\n'
        '  if xs_hostlist_first "$list"; then echo bug; '
        'else printf "error\\t%s\\n" "$XS_HOSTLIST_ERROR"; fi\n'
        'done\n'
    )

    def first(lists: Sequence[str]) -> list:
        proc = run(["bash", str(driver), str(HOSTLIST_SH), *lists])
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        results = [tuple(line.split("\t", 1)) for line in proc.stdout.splitlines()]
        assert len(results) == len(lists), proc.stdout
        return results

    return first


def load_hostlist_module() -> types.ModuleType:
    """runscripts/lib/hostlist.py as a module, without leaving bytecode next to it."""
    module = types.ModuleType("xs_hostlist")
    module.__file__ = str(HOSTLIST_PY)
    exec(compile(HOSTLIST_PY.read_text(), str(HOSTLIST_PY), "exec"), module.__dict__)
    return module


hostlist_py = load_hostlist_module()


# ---- valid lists: every path gives scontrol's answer ---------------------------------------


@pytest.mark.parametrize("hostlist", VALID_LISTS)
def test_valid_list_matches_scontrol(hostlist, scontrol, sourced_first):
    expected = scontrol(hostlist)
    assert expected, f"scontrol rejects {hostlist!r}: the table is wrong"
    assert hosts_of(get_master("--all", hostlist)) == expected
    assert hosts_of(get_master(hostlist)) == expected[:1]
    assert sourced_first([hostlist]) == [("ok", expected[0])]


@pytest.mark.parametrize("hostlist, expected", SUFFIX_LISTS.items())
def test_suffix_after_last_bracket_expands(hostlist, expected, scontrol, sourced_first):
    slurm = scontrol(hostlist)
    # 22.05 refuses these; should a newer scontrol accept them, it must agree with us.
    assert slurm is None or slurm == expected
    assert hosts_of(get_master("--all", hostlist)) == expected
    assert hosts_of(get_master(hostlist)) == expected[:1]
    assert sourced_first([hostlist]) == [("ok", expected[0])]


# ---- malformed lists: one error line, exit 2, same words on both paths -------------------


@pytest.mark.parametrize("hostlist", MALFORMED_LISTS)
def test_malformed_list_is_one_error_line(hostlist, sourced_first):
    first_reason = assert_one_error_line(get_master(hostlist), hostlist)
    all_reason = assert_one_error_line(get_master("--all", hostlist), hostlist)
    assert first_reason == all_reason
    assert sourced_first([hostlist]) == [("error", first_reason)]


@pytest.mark.parametrize("hostlist, first", ALL_ONLY_ERRORS.items())
def test_bad_range_past_the_first_host_is_caught_by_all(hostlist, first):
    assert hosts_of(get_master(hostlist)) == [first]
    reason = assert_one_error_line(get_master("--all", hostlist), hostlist)
    assert "hosts (Slurm's limit)" in reason or "descending range" in reason


def test_all_refuses_descending_range_anywhere():
    hostlist = "a[1-3],b[1-2,7-9,12-10]"
    reason = assert_one_error_line(get_master("--all", hostlist), hostlist)
    assert reason.endswith("descending range 12-10")


# ---- where the list comes from -------------------------------------------------------------

SLURM_VARIABLES = ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"]


@pytest.mark.parametrize("winner", range(4))
def test_environment_order_step_job_nodelist_pbs(winner, tmp_path):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("pbs2\npbs1\npbs2\n\npbs3\n")
    env = clean_env(PBS_NODEFILE=str(nodefile))
    lists = ["step[1-2]", "job[1-2]", "plain[1-2]"]
    for name, hostlist in list(zip(SLURM_VARIABLES, lists, strict=True))[winner:]:
        env[name] = hostlist
    for name in SLURM_VARIABLES[:winner]:
        env[name] = ""  # empty counts as unset
    if winner < 3:
        stem = lists[winner].split("[")[0]
        expected_all = [f"{stem}1", f"{stem}2"]
    else:
        expected_all = ["pbs2", "pbs1", "pbs3"]  # distinct, in file order
    assert hosts_of(get_master(env=env)) == expected_all[:1]
    assert hosts_of(get_master("--all", env=env)) == expected_all


def test_argument_beats_environment():
    env = clean_env(SLURM_JOB_NODELIST="job[1-2]")
    assert hosts_of(get_master("arg[3-4]", env=env)) == ["arg3"]
    assert hosts_of(get_master("--all", "arg[3-4]", env=env)) == ["arg3", "arg4"]


def test_malformed_environment_list_is_an_error():
    env = clean_env(SLURM_JOB_NODELIST="nid[5-2]")
    assert_one_error_line(get_master(env=env), "nid[5-2]")
    assert_one_error_line(get_master("--all", env=env), "nid[5-2]")


@pytest.mark.parametrize("args", [[], ["--all"]])
def test_no_list_anywhere_is_an_error(args):
    proc = get_master(*args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(ERROR_PREFIX + "no hostlist") and proc.stderr.count("\n") == 1


def test_unreadable_pbs_nodefile_is_an_error(tmp_path):
    proc = get_master(env=clean_env(PBS_NODEFILE=str(tmp_path / "missing")))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(ERROR_PREFIX) and proc.stderr.count("\n") == 1


@pytest.mark.parametrize("args", [["-x"], ["a", "b"]])
def test_bad_usage_is_an_error(args):
    proc = get_master(*args)
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.startswith(ERROR_PREFIX)


def test_symlinked_get_master_finds_its_library(tmp_path):
    link = tmp_path / "get-master"
    link.symlink_to(GET_MASTER)
    assert hosts_of(run([str(link), "nid[007-008]"])) == ["nid007"]


# ---- the sourced library's contract ----------------------------------------------------------


def test_sourcing_defines_only_prefixed_functions(tmp_path):
    before, after = tmp_path / "before", tmp_path / "after"
    script = tmp_path / "source.sh"
    script.write_text(
        "set -euo pipefail\n"
        f'compgen -v >"{before}"\n'
        f'source "{HOSTLIST_SH}"\n'
        f'compgen -v >"{after}"\n'
        "compgen -A function\n"
    )
    proc = run(["bash", str(script)])
    assert proc.returncode == 0 and proc.stdout.strip() and proc.stderr == "", proc.stderr
    assert set(after.read_text().split()) == set(before.read_text().split())
    functions = proc.stdout.split()
    assert "xs_hostlist_first" in functions
    assert all(f.startswith("xs_hostlist_") for f in functions), functions


# Lists that take every path of the library: the quick well-formed test, each reason of the full
# syntax table, the walk over brackets and suffixes, and each numeric check.
NO_FORK_LISTS = [
    "nid[000001-010000]", " a[1-2]b[3-4]-ib,c", "x[1-2][3-4]",
    "", ",a", "a,", "a,,b", "a]", "a[1]]", "a[1[2]", "a[1", "a[]", "a[x]", "a[1,]", "a[,1]",
    "a[1-2-3]", "a[5-2]", "a[0-70000]", "a[1234567890123456789]",
]


def test_library_forks_nothing(tmp_path):
    """On every path, good list or bad, the sourced library starts no process: bash is the only
    one strace sees."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed: it is what sees a fork or an exec")
    script = tmp_path / "calls.sh"
    script.write_text(
        f'source "{HOSTLIST_SH}"\n'
        'for list in "$@"; do\n'
        '  if xs_hostlist_first "$list"; then printf "ok %s\\n" "$XS_FIRST_HOST"\n'
        '  else printf "error %s\\n" "$XS_HOSTLIST_ERROR"; fi\n'
        'done\n'
    )
    trace = tmp_path / "trace"
    proc = run(["strace", "-f", "-qq", "-e", "trace=clone,clone3,fork,vfork,execve",
                "-o", str(trace), "bash", str(script), *NO_FORK_LISTS])
    if proc.returncode != 0 and "ptrace" in proc.stderr:
        pytest.skip(f"strace cannot trace here (ptrace not permitted): {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    # The lists did take every path: three first hosts, then every reason the library gives.
    outcomes = proc.stdout.splitlines()
    assert outcomes[:3] == ["ok nid000001", "ok a1b3-ib", "ok x13"], outcomes
    errors = "\n".join(outcomes[3:])
    reasons = {reason for _, reason in hostlist_py.SYNTAX_CHECKS} | set(NUMERIC_REASONS)
    assert [reason for reason in reasons if reason not in errors] == [], errors
    calls = [line for line in trace.read_text().splitlines() if "(" in line]
    assert len(calls) == 1 and "execve" in calls[0], calls


def test_hostlist_py_is_python36_code():
    """Python 3.6 syntax and library, as the parser can tell."""
    assert_python36_code(HOSTLIST_PY)


def test_hostlist_py_runs_under_python36():
    python36 = find_python36()
    if python36 is None:
        pytest.skip("no Python 3.6 found (XSCALE_PYTHON36, python3.6 on PATH, pyenv)")
    for hostlist in ["a[1-2]b[3-4]c[5-6]", "node[1-2]-ib", "a,b a"]:
        proc = run([python36, str(HOSTLIST_PY), "--all", hostlist])
        assert hosts_of(proc) == list(hostlist_py.expand(hostlist))
    assert_one_error_line(run([python36, str(HOSTLIST_PY), "--all", "a[5-2]"]), "a[5-2]")


# ---- property tests --------------------------------------------------------------------------

# Text around brackets; no leading '-' (scontrol would read the list as an option).
_TEXT = st.text(alphabet="abxyz019._-", min_size=0, max_size=4).filter(
    lambda t: not t.startswith("-")
)


@st.composite
def _bracket(draw) -> str:
    elements = []
    for _ in range(draw(st.integers(1, 3))):
        low = draw(st.integers(0, 30))
        width = draw(st.integers(len(str(low)), 3))
        element = str(low).zfill(width)
        if draw(st.booleans()):
            high = low + draw(st.integers(0, 4))
            element += "-" + str(high).zfill(draw(st.integers(len(str(high)), 3)))
        elements.append(element)
    return "[" + ",".join(elements) + "]"


@st.composite
def _item(draw) -> str:
    texts = [draw(_TEXT)]
    brackets = draw(st.lists(_bracket(), min_size=0, max_size=3))
    for bracket in brackets:
        texts += [bracket, draw(_TEXT)]
    if brackets:
        texts[-1] = ""  # Slurm 22.05 refuses text after the last bracket
    elif not texts[0]:
        texts[0] = "n"
    return "".join(texts)


@st.composite
def valid_hostlists(draw) -> str:
    items = draw(st.lists(_item(), min_size=1, max_size=4))
    out = items[0]
    for item in items[1:]:
        out += draw(st.sampled_from([",", ",", ",", " ", ", "])) + item
    return out


# 40 lists: each costs four processes (scontrol, get-master twice, the sourced function); the
# syntax check's own property test below covers the grammar's corners in one process.
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostlist=valid_hostlists())
def test_random_valid_lists_match_scontrol(hostlist, scontrol, sourced_first):
    expected = scontrol(hostlist)
    assert expected, f"scontrol rejects generated list {hostlist!r}"
    assert hosts_of(get_master("--all", hostlist)) == expected
    assert hosts_of(get_master(hostlist)) == expected[:1]
    assert sourced_first([hostlist]) == [("ok", expected[0])]


# The grammar written out in one piece, to check that the table of local checks shared by both
# paths accepts exactly this language.
_S = r"[ \t\n\v\f\r]"
_GROUP = r"\[[0-9]+(?:-[0-9]+)?(?:,[0-9]+(?:-[0-9]+)?)*\]"
_ITEM = rf"(?:[^\[\], \t\n\v\f\r]|{_GROUP})+"
GRAMMAR = re.compile(rf"{_S}*{_ITEM}(?:(?:{_S}*,{_S}*|{_S}+){_ITEM})*{_S}*")
NUMERIC_REASONS = ("descending range", "hosts (Slurm's limit)", "digits")


# Near misses: mostly well-formed brackets around random contents ("[1-1-1]", "[,1]", "[]"),
# with stray brackets, separators and whitespace between them.
_CONTENT = st.lists(st.sampled_from(["1", "01", "-", ",", "1-2", "a", " ", "[", ""]), max_size=4)
_BRACKETED = _CONTENT.map(lambda pieces: "[" + "".join(pieces) + "]")
_STRAY = st.sampled_from(["a", "1", "-", ",", " ", "\n", "[", "]"])
_PIECE = st.one_of(_BRACKETED, _BRACKETED, _STRAY)
_NEAR_MISSES = st.lists(_PIECE, max_size=6).map("".join)


@settings(max_examples=100, deadline=None)
@given(lists=st.lists(_NEAR_MISSES, min_size=20, max_size=30))
def test_syntax_checks_accept_exactly_the_grammar(lists, sourced_first):
    for hostlist, (status, detail) in zip(lists, sourced_first(lists), strict=True):
        syntax = hostlist_py.syntax_error(hostlist)
        assert (syntax is None) == bool(GRAMMAR.fullmatch(hostlist)), hostlist
        if syntax is not None:
            assert (status, detail) == ("error", f"invalid hostlist '{shown(hostlist)}': {syntax}")
            continue
        try:
            first = next(hostlist_py.expand(hostlist))
        except hostlist_py.HostlistError as error:
            # The bash path checks only the ranges that make the first host; --all checks all.
            assert any(reason in str(error) for reason in NUMERIC_REASONS), str(error)
            assert status == "ok" or any(reason in detail for reason in NUMERIC_REASONS)
            continue
        assert (status, detail) == ("ok", first), hostlist

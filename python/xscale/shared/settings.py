"""Every XSCALE_* setting in one table, and the one place the Python side reads them.

A setting keeps its environment name everywhere: run.sh and the job templates read theirs in
bash, the batch host's programs in Python 3.6, the trainers through value() here. The table says,
for each, its type, its default, what it does and who reads it; docs/SETTINGS.md is printed from
it (`xscale settings --markdown`, `make settings-doc`) and tests/test_settings.py checks that the
page is current and that every XSCALE_ name in the code is in the table.

Bad input, as a user meets it:
- a bad value: value() raises UserError, one line `PROG: error: NAME='VALUE' ...` and exit
  status 2, before training (each reader is called at start-up);
- a name xscale does not know: misspelled() gives one warning line, naming the setting it is
  close to (SPARE for XSCALE_SPARES), because the run would otherwise go on without what was
  asked for.

Standard library only and Python 3.6 syntax: the batch host's programs may load this file by its
path (jobs/lib/shared.py), as they load taglines.py.
"""

import argparse
import difflib
import math
import os
import re
import sys
import textwrap
from typing import NamedTuple

PAGE = "docs/SETTINGS.md"


class UserError(Exception):
    """A mistake the user can fix: one line `PROG: error: ...`, exit 2."""


# ---- types ------------------------------------------------------------------------------------


class Kind(NamedTuple):
    """A setting's type. `label`: what the docs call it; `parse(text)`: the value, or ValueError
    when the text is not one; `complaint`: what the error line says after `NAME='TEXT' `."""

    label: str
    parse: object
    complaint: str


def _or_list(words):
    return ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else words[0]


def choice(*words):
    """Exactly one of WORDS: case and spaces count, so `Async` is a typo rather than async."""

    def parse(given):
        if given not in words:
            raise ValueError(given)
        return given

    if len(words) == 2:
        complaint = "is neither {} nor {}".format(*words)
    else:
        complaint = "is not one of: " + ", ".join(words)
    return Kind(_or_list(words), parse, complaint)


def flag():
    """0 or 1, read as False or True."""
    words = choice("0", "1")
    return Kind("0 or 1", lambda given: words.parse(given) == "1", words.complaint)


_WHOLE = re.compile(r"^\s*[0-9]+\s*$")


def whole(least=0, unit=""):
    """A whole number of at least LEAST (in UNIT, when given); spaces around it are allowed."""

    def parse(given):
        if not _WHOLE.match(given) or int(given) < least:
            raise ValueError(given)
        return int(given)

    counted = f" of {unit}," if unit else " of"
    label = f"whole number >= {least}" + (f" ({unit})" if unit else "")
    return Kind(label, parse, f"must be a whole number{counted} at least {least}")


def whole_or(word, least=0):
    """A whole number of at least LEAST, or WORD (such as auto: the reader decides)."""
    count = whole(least)

    def parse(given):
        return given if given == word else count.parse(given)

    return Kind(f"{count.label} or {word}", parse, f"{count.complaint}, or {word}")


def number(above=None, least=None, unit=""):
    """A finite number above ABOVE, or of at least LEAST (nan and inf are refused: a typo)."""
    of_unit = " of " + unit if unit else ""

    def parse(given):
        amount = float(given)  # ValueError for a word
        inside = amount > above if above is not None else amount >= least
        if not (math.isfinite(amount) and inside):
            raise ValueError(given)
        return amount

    if above == 0:
        return Kind("number > 0" + (f" ({unit})" if unit else ""), parse,
                    "is not a positive number" + of_unit)
    if above is not None:
        return Kind(f"number > {above:g}", parse, f"must be a number above {above:g}")
    return Kind(f"number >= {least:g}", parse,
                f"must be a number{of_unit} of at least {least:g}")


def text(label):
    """Any text (a path, a list of words, a time stamp); its reader checks what it must."""
    return Kind(label, lambda given: given, "")


# ---- the table --------------------------------------------------------------------------------


class Setting(NamedTuple):
    """One XSCALE_* variable. `default`: what value() gives when it is unset (None: unset means
    "not set"); `shown`: the docs' default when `default` cannot say it (bash computes it);
    `reader`: a key of READERS, the program that reads it."""

    name: str
    kind: Kind
    default: object
    does: str
    reader: str
    shown: str = ""


# Who reads a setting, in the docs' order: (key, the docs' heading, what that reader does with a
# bad value).
READERS = (
    ("the trainers", "Read by the trainers",
     "xscale's library reads these on every rank of a trainer (python/xscale); a bad value "
     "stops the run before its first step."),
    ("run.sh", "Read by run.sh",
     "runscripts/run.sh (and run-profile.sh, the doctor) reads these on every rank before the "
     "trainer starts; a bad value is one line and exit status 2, and nothing runs."),
    ("the doctor", "Read by the doctor",
     "runscripts/doctor reads these on every rank (docs/DOCTOR.md); a bad number is refused "
     "like a bad option, exit status 2."),
    ("the supervisor", "Read by the job templates and the supervisor",
     "The batch host reads these (jobs/lib/supervise.sh, supervisor.py; docs/FAILURES.md) "
     "before the first step; a bad value is one line and exit status 2."),
    ("staging", "Read by staging",
     "jobs/lib/stage reads these on the batch host (docs/STAGING.md)."),
    ("gpu-check", "Read by make gpu-check",
     "`make gpu-check` and jobs/lumi/gpu-check.sbatch read these (docs/GPU-CHECK.md)."),
    ("the test bed", "Read by the test bed",
     "The tests, their fakes and the virtual Slurm cluster read these (docs/TESTBED.md)."),
    ("xscale", "Set by xscale, not by users",
     "How one part of xscale hands a fact to the next; none of them warns as a misspelling."),
)

TRAINERS, RUN_SH, DOCTOR, JOBS, STAGING, GPU_CHECK, TEST_BED, XSCALE = (
    key for key, _, _ in READERS)

# A node's mean time between failures: Meta's Llama 3 pretraining saw 419 unexpected
# interruptions in 54 days on 2,048 nodes of 8 GPUs ("The Llama 3 Herd of Models",
# arXiv:2407.21783, section 3.3.4). docs/GOODPUT.md uses the same figure.
NODE_MTBF_H = 54 * 24 * 2048 / 419

PATH = text("path")
CLOCK = text("seconds since 1970")

SETTINGS = (
    # -- the trainers
    Setting("XSCALE_BACKEND", text("nccl, xccl, ccl, gloo or mpi"), "",
            "the process group's backend when the command line names none (--dist-backend "
            "wins); case does not matter", TRAINERS,
            shown="the device's: nccl on CUDA/ROCm, xccl or ccl on XPU, gloo on CPUs"),
    Setting("XSCALE_TIMEOUT_S", whole(1, "seconds"), 600,
            "how long a collective may wait before the job fails instead of hanging (run.sh "
            "exports 600)", TRAINERS),
    Setting("XSCALE_CHECKPOINT_MODE", choice("async", "sync"), "async",
            "async: a checkpoint is written in the background; sync: on the training thread",
            TRAINERS),
    Setting("XSCALE_CHECKPOINT_WRITERS", choice("rank0", "all"), "rank0",
            "rank0: rank 0 writes ckpt-STEP.pt; all: every rank writes its part of "
            "ckpt-STEP.dcp, as it always does for a sharded model (FSDP2)", TRAINERS),
    Setting("XSCALE_NODE_MTBF_H", number(above=0, unit="hours"), NODE_MTBF_H,
            "a node's mean time between failures, for --checkpoint-every auto and "
            "XSCALE_SNAPSHOT_EVERY=auto", TRAINERS,
            shown="6335 (Llama 3's 419 failures in 54 days on 2,048 nodes)"),
    Setting("XSCALE_SNAPSHOT_EVERY", whole_or("auto"), "auto",
            "with live recovery and a sharded model (FSDP2): a peer snapshot every this many "
            "steps, the most a recovery redoes (docs/FAILURES.md); auto: Young's interval from "
            "the cost of the first snapshot, 10 steps in, and XSCALE_NODE_MTBF_H; 0: none, and a "
            "lost node restarts the launch from its checkpoint", TRAINERS),
    Setting("XSCALE_STRAGGLER_FACTOR", number(above=1), 2.0,
            "a rank whose own work per step is this many times the median rank's is named",
            TRAINERS),
    Setting("XSCALE_STRAGGLER_INTERVALS", whole(1), 3,
            "log intervals compared together before a straggler is named", TRAINERS),
    Setting("XSCALE_TORCH_PROFILER", flag(), False,
            "1: torch.profiler records the profiling window (PROFILE_STEP_START, PROFILE_STEPS) "
            "into PROFILE_DIR/rankR and the run's end prints its summary (run-profile.sh's "
            "PROFILER=torch sets it on the profiled ranks; docs/STEPTIME.md)", TRAINERS),
    Setting("XSCALE_PEAK_TFLOPS", number(above=0, unit="TFLOPS"), None,
            "the device's peak, for the MFU in the verdict and the summary (docs/STEPTIME.md)",
            TRAINERS, shown="the published figure for the device's name and precision"),
    Setting("XSCALE_STAGE_DIR", PATH, None,
            "node-local directory the image trainers unpack --stage-tar into", TRAINERS,
            shown="/tmp/USER-xscale-data"),
    # -- run.sh
    Setting("XSCALE_SITE", choice("lumi", "aurora", "nvidia", "nvidia-slingshot", "generic"),
            None, "the site profile (runscripts/sites/SITE.sh) whose defaults run.sh applies",
            RUN_SH, shown="detected from the node's devices"),
    Setting("XSCALE_GPU_BIND", choice("none", "local"), "none",
            "local: narrow ROCR/CUDA_VISIBLE_DEVICES or ZE_AFFINITY_MASK to this rank's GPUs, "
            "unless the scheduler already did", RUN_SH),
    Setting("XSCALE_DEBUG", flag(), False,
            "1: NCCL_DEBUG=INFO (INIT,COLL) and one NCCL_DEBUG_FILE per rank in XSCALE_LOG_DIR",
            RUN_SH),
    Setting("XSCALE_LOG_DIR", PATH, None,
            "where XSCALE_DEBUG's per-rank logs go; created (or refused in one line) when set "
            "or with XSCALE_DEBUG=1", RUN_SH, shown="./xscale-logs"),
    Setting("XSCALE_VERBOSE", flag(), False,
            "1: every rank prints its rank, node, CPU list and visible GPUs on stderr", RUN_SH),
    Setting("XSCALE_EXPAND_ARGS", flag(), True,
            "0: pass the command's arguments on without expanding $NAME per rank", RUN_SH),
    Setting("XSCALE_CACHE_ROOT", PATH, "/tmp",
            "node-local directory the per-step cache directory is made in", RUN_SH),
    Setting("XSCALE_CACHE_DIR", PATH, None,
            "node-local cache (mode 0700) for JIT builds and MIOpen's database; a symlink or "
            "another user's directory is refused", RUN_SH,
            shown="XSCALE_CACHE_ROOT/xscale-USER-JOB.STEP-NODE"),
    Setting("XSCALE_NCCL_NET_GDR_LEVEL", text("an NCCL_NET_GDR_LEVEL value"), None,
            "LUMI's profile: the NCCL_NET_GDR_LEVEL for any image (an exported "
            "NCCL_NET_GDR_LEVEL wins)", RUN_SH, shown="PHB on ROCm before 6.2, else unset"),
    # -- the doctor
    Setting("XSCALE_DOCTOR_MIN_FREE_GB", number(least=0), 1.0,
            "free space wanted in /tmp and XSCALE_CACHE_ROOT (--min-free-gb)", DOCTOR),
    Setting("XSCALE_DOCTOR_MIN_FREE_INODES", number(least=0), 10000.0,
            "free inodes wanted there (--min-free-inodes)", DOCTOR),
    Setting("XSCALE_DOCTOR_SLOW_IMPORT_FACTOR", number(least=0), 3.0,
            "a rank whose `import torch` took this many times the job's median is flagged "
            "(--slow-import-factor)", DOCTOR),
    Setting("XSCALE_DOCTOR_TIMEOUT_S", number(least=0, unit="seconds"), 60.0,
            "seconds for the collective and for rank 0's wait for the reports (--timeout)",
            DOCTOR),
    Setting("XSCALE_DOCTOR_NET_PLUGIN", text("library names"), "",
            "the network plugin libraries the image must have (empty: none expected)", DOCTOR,
            shown="the site profile's (LUMI: librccl-net.so)"),
    Setting("XSCALE_DOCTOR_MIN_BUSBW_GBPS", text("number (GB/s)"), "",
            "all-reduce bus bandwidth below which a job of several nodes gets a WARN (empty: "
            "no floor)", DOCTOR, shown="the site profile's (LUMI: 20)"),
    # -- the job templates and the supervisor
    Setting("XSCALE_ROOT", PATH, None,
            "the xscale checkout the job templates run from; every node must see it", JOBS,
            shown="SLURM_SUBMIT_DIR (Aurora: the working directory)"),
    Setting("XSCALE_RETRY", flag(), False,
            "1: a job whose step failed on nodes it blames is requeued without them", JOBS,
            shown="0 (LUMI training templates: 1)"),
    Setting("XSCALE_MAX_RETRIES", whole(0), 3, "requeues without blamed nodes per job", JOBS),
    Setting("XSCALE_MAX_REQUEUES", whole(0), 20,
            "requeues at the time limit (Slurm's restart count)", JOBS),
    Setting("XSCALE_BLAME", text("words"), "slurm",
            "the pattern files that blame nodes: a word is jobs/lib/blame/WORD.patterns, a word "
            "with a / a path", JOBS, shown="slurm (LUMI templates: slurm lumi)"),
    Setting("XSCALE_RECORDS_DIR", PATH, None,
            "the job's launch logs, node states, retry history and goodput.json", JOBS,
            shown="SUBMIT_DIR/xscale-records/JOB (templates: OUTPUT_DIR/xscale-records)"),
    Setting("XSCALE_SPARES", whole(0), 0,
            "nodes of the allocation that wait idle to replace a failed one (fewer than the "
            "job's nodes)", JOBS),
    Setting("XSCALE_MAX_RESTARTS", whole(0), 3,
            "restarts on spare nodes inside the allocation, per attempt of the job", JOBS),
    Setting("XSCALE_MAX_RANK_RESTARTS", whole(0), 2,
            "with live recovery: how often a rank that failed on its own (its node's other "
            "ranks live on) is started again on its node at one step; one failure more is a "
            "bug, and stops the launch", JOBS),
    Setting("XSCALE_LIVE_RECOVERY", flag(), True,
            "a failed node's ranks are replaced from a spare (XSCALE_SPARES), and a rank that "
            "failed on its own is started again on its node, while the others keep their "
            "processes and train on (docs/FAILURES.md); 0: restart the whole launch", JOBS),
    Setting("XSCALE_MIN_NODES", whole(1), None,
            "with live recovery and no spare left: the fewest nodes the ranks left may train on "
            "without a lost node, each step's global batch dealt over them (default: the job's "
            "nodes minus its spares, halved); below it, the usual restart or requeue", JOBS),
    Setting("XSCALE_GROW_BACK", flag(), True,
            "with live recovery and a smaller world: ask the queue for a node in place of each "
            "lost one (a one-node job named xscale-grow-JOBID, for the job's time left) and take "
            "it into the training once it runs; 0: the world stays smaller", JOBS),
    Setting("XSCALE_HEARTBEAT_S", number(above=0, unit="seconds"), 30.0,
            "with live recovery: a rank silent this long is lost with its node (a frozen node)",
            JOBS),
    # -- staging
    Setting("XSCALE_STAGE_DEST", PATH, None,
            "the node-local directory jobs/lib/stage unpacks into (--dest wins)", STAGING,
            shown="/tmp/USER-xscale-stage-JOBID"),
    Setting("XSCALE_STAGE_WORK", PATH, None,
            "shared directory where a staged directory is packed, once per job", STAGING,
            shown="SUBMIT_DIR/.xscale-stage-JOBID"),
    # -- make gpu-check
    Setting("XSCALE_EXAMPLES_DIR", PATH, None,
            "a pytorch/examples checkout, for the ImageNet comparison row (--examples)",
            GPU_CHECK),
    # -- the test bed
    Setting("XSCALE_CLUSTER_STATE", PATH, "/run/xscale-cluster",
            "the virtual cluster's pid files and node /tmp mounts", TEST_BED),
    Setting("XSCALE_CLUSTER_SUBNET", text("three octets"), "10.77.0",
            "the virtual nodes' network, its first three octets", TEST_BED),
    Setting("XSCALE_CLUSTER_TMP_SIZE", text("size"), "6g", "each virtual node's /tmp",
            TEST_BED),
    Setting("XSCALE_CLUSTER_TIMEOUT_S", whole(1, "seconds"), 60,
            "how long cluster-up and the fault injector wait for idle nodes", TEST_BED),
    Setting("XSCALE_PYTHON36", PATH, None,
            "the Python 3.6 the tests run the batch host's programs with", TEST_BED,
            shown="python3.6 on PATH, else pyenv's"),
    Setting("XSCALE_SHIM_RUNSCRIPTS", PATH, None,
            "the runscripts/ the tests' singularity shim binds at /runscripts", TEST_BED,
            shown="the checkout's runscripts/"),
    Setting("XSCALE_TEST_FAULT", text("NODE_INDEX:HOW[:ARG]"), None,
            "the faulty-python fake: which node's trainer fails, and how", TEST_BED),
    Setting("XSCALE_TEST_SLOW_FSYNC_S", number(least=0, unit="seconds"), 0.0,
            "the slow-storage fake: seconds added to every fsync", TEST_BED),
    # -- set by xscale
    Setting("XSCALE_FR_DIR", PATH, None,
            "the supervisor's: where each rank leaves its flight record when a collective "
            "fails (run.sh points TORCH_FR_DUMP_TEMP_FILE there)", XSCALE),
    Setting("XSCALE_PROGRESS", PATH, None,
            "the supervisor's: the file rank 0 notes its progress in, for the goodput "
            "ledger", XSCALE),
    Setting("XSCALE_RECOVERY", text("host:port"), None,
            "the supervisor's, under live recovery: where its coordinator listens",
            XSCALE),
    Setting("XSCALE_RECOVERY_JOIN", whole(1), None,
            "the supervisor's, on a replacement: the generation of the group it joins", XSCALE),
    Setting("XSCALE_REPLACEMENT", text("NODE_RANK/NNODES[:LOCAL_RANK/PER_NODE]"), None,
            "the supervisor's, on a replacement: the lost node it stands in for, or the one "
            "rank started again on its node (run.sh numbers its ranks from it)", XSCALE),
    Setting("XSCALE_LAUNCH_T", CLOCK, None,
            "the supervisor's (Aurora: jobs/lib/aurora.sh): when it launched the step",
            XSCALE),
    Setting("XSCALE_T_RUNSH", CLOCK, None, "run.sh's: when it began on this rank", XSCALE),
    Setting("XSCALE_T_EXEC", CLOCK, None, "run.sh's: when it exec'd the trainer", XSCALE),
    Setting("XSCALE_LAUNCHER", text("launcher"), None,
            "run.sh's: the launcher it found (slurm, pbs, torchrun, openmpi, pmi, manual, none)",
            XSCALE),
    Setting("XSCALE_PROFILED", flag(), False,
            "run-profile.sh's, on profiled ranks: a profiler wraps the trainer, which marks the "
            "window for it", XSCALE),
    Setting("XSCALE_GPU_VENDOR", text("amd, nvidia, intel or none"), "none",
            "runscripts/doctor's: the site's GPU vendor, for its Python side", XSCALE),
    Setting("XSCALE_CLUSTER_SHARED", PATH, None,
            "the test bed's, as a virtual node boots: the checkout every node shares", XSCALE),
)

BY_NAME = {setting.name: setting for setting in SETTINGS}

# Tags of the machine-readable lines xscale prints (`TAG {json}`): names, but no settings.
OUTPUT_TAGS = (
    ("XSCALE_SUMMARY",
     "rank 0's last line: the run's summary (xscale.observe.runlog, xscale report)"),
    ("XSCALE_RANK", "each rank's own record: its node, steps, start-up phases"),
    ("XSCALE_GOODPUT", "the supervisor's goodput ledger as the job ends"),
    ("XSCALE_CHECK", "the test bed's all-reduce program (tests/programs/allreduce.py)"),
)


# ---- reading ----------------------------------------------------------------------------------


def setting(name):
    """The table's row for NAME; KeyError for a name the table lacks (a mistake in the code)."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not in xscale.shared.settings.SETTINGS") from None


def value(name, environ=None):
    """The setting NAME from ENVIRON (default os.environ), parsed and checked: its default when
    unset; UserError `NAME='TEXT' ...` when the text is not of its type. An empty value is a
    value like any other (an empty XSCALE_CHECKPOINT_MODE is a mistake, not async)."""
    row = setting(name)
    env = os.environ if environ is None else environ
    given = env.get(name)
    if given is None:
        return row.default
    try:
        return row.kind.parse(given)
    except ValueError:
        raise UserError(f"{name}='{given}' {row.kind.complaint}") from None


def check(reader=TRAINERS, environ=None):
    """Read every setting of READER (default: the trainers'), so that a bad one is a UserError
    now, before any work, rather than when its reader first runs."""
    for row in SETTINGS:
        if row.reader == reader:
            value(row.name, environ)


# ---- names that are no setting ----------------------------------------------------------------

PREFIX = "XSCALE_"
# difflib's ratio on the part after XSCALE_: SPARE/SPARES is 0.91, DEBGU/DEBUG 0.8, while
# unrelated names stay well below.
CLOSE_ENOUGH = 0.75


def misspelled(environ):
    """One warning line for each XSCALE_* name in ENVIRON that is no setting, naming the user
    setting it is close to, if any; sorted by name. Names xscale sets itself never warn."""
    suggestions = {row.name[len(PREFIX):]: row.name for row in SETTINGS if row.reader != XSCALE}
    lines = []
    for name in sorted(environ):
        if not name.startswith(PREFIX) or name in BY_NAME:
            continue
        close = difflib.get_close_matches(name[len(PREFIX):], suggestions, n=1,
                                          cutoff=CLOSE_ENOUGH)
        hint = f"; did you mean {suggestions[close[0]]}?" if close else ""
        lines.append(f"xscale: warning: {name} is not an xscale setting{hint} ({PAGE})")
    return lines


# ---- the docs ---------------------------------------------------------------------------------


def shown_default(row):
    """The default as the docs say it."""
    if row.shown:
        return row.shown
    if row.default is None:
        return "unset"
    if isinstance(row.default, bool):
        return "1" if row.default else "0"
    if isinstance(row.default, float):
        return f"{row.default:g}"
    return str(row.default) if row.default != "" else "empty"


def _paragraph(prose):
    """PROSE wrapped at the repository's 100 columns."""
    return textwrap.fill(prose, width=100, break_long_words=False, break_on_hyphens=False)


def _row(name, *cells):
    """A markdown table row: the name as code, then the cells (a `|` in them escaped)."""
    return "| " + " | ".join([f"`{name}`"] + [cell.replace("|", "\\|") for cell in cells]) + " |"


def _section_markdown(reader, title, sentence):
    rows = [row for row in SETTINGS if row.reader == reader]
    own = reader == XSCALE
    lines = ["## " + title, "", _paragraph(sentence), ""]
    if own:
        lines += ["| Variable | Type | What it holds |", "| --- | --- | --- |"]
        lines += [_row(row.name, row.kind.label, row.does) for row in rows]
    else:
        lines += ["| Setting | Type | Default | What it does |", "| --- | --- | --- | --- |"]
        lines += [_row(row.name, row.kind.label, shown_default(row), row.does) for row in rows]
    return lines + [""]


def _example_error():
    """The line a bad value gives, as the docs show it: made here, so it cannot drift."""
    try:
        value("XSCALE_CHECKPOINT_MODE", {"XSCALE_CHECKPOINT_MODE": "Async"})
    except UserError as error:
        return f"mnist_ddp.py: error: {error}"
    raise AssertionError("XSCALE_CHECKPOINT_MODE=Async was accepted")


def markdown():
    """The whole of docs/SETTINGS.md."""
    lines = [
        "# Settings", "",
        _paragraph("Generated by `xscale settings --markdown` (`make settings-doc`) from the "
                   "table in python/xscale/shared/settings.py: do not edit it by hand; change "
                   "the table and regenerate it."), "",
        _paragraph("Every setting is an environment variable named `XSCALE_*`, exported before "
                   "the job or the command that reads it. A bad value is one line and exit "
                   "status 2, before any training:"), "",
        "    " + _example_error(), "",
        _paragraph("An `XSCALE_*` variable that is no setting gets one warning line from the "
                   "trainer's rank 0, naming the setting it is close to:"), "",
        "    " + misspelled({PREFIX + "SPARE": "1"})[0], "",
    ]
    for reader, title, sentence in READERS:
        lines += _section_markdown(reader, title, sentence)
    lines += ["## Output lines", "",
              _paragraph("Not settings: the tags of the machine-readable lines xscale prints, "
                         "`TAG {json}`."), ""]
    lines += [f"- `{tag}`: {what}" for tag, what in OUTPUT_TAGS]
    return "\n".join(lines) + "\n"


def table_text():
    """The table for a terminal: per reader, each setting's name, default and what it does."""
    width = max(len(row.name) for row in SETTINGS)
    lines = []
    for reader, title, _ in READERS:
        lines.append(title + ":")
        for row in SETTINGS:
            if row.reader == reader:
                default = "" if reader == XSCALE else f"[{shown_default(row)}] "
                lines.append("  {:<{}}  {}{}".format(row.name, width, default, row.does))
        lines.append("")
    return "\n".join(lines) + "more: " + PAGE


def main(argv=None, prog="python -m xscale.shared.settings"):
    """`xscale settings [--markdown]`: the table, for a terminal or as docs/SETTINGS.md."""
    parser = argparse.ArgumentParser(prog=prog, description="every XSCALE_* setting: "
                                     "its default and what it does")
    parser.add_argument("--markdown", action="store_true",
                        help="print docs/SETTINGS.md (make settings-doc writes it)")
    args = parser.parse_args(argv)
    sys.stdout.write(markdown() if args.markdown else table_text() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

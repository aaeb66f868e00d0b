"""The one reader of the machine-readable lines xscale prints: `TAG {json}` (XSCALE_SUMMARY from
rank 0, XSCALE_RANK from every rank), as they arrive through `srun --label`, and of the whole
summary a run leaves in its output directory (xscale-summary.json, which the line's
`summary_file` names: the line leaves out the per-phase start-up detail, xscale.observe.runlog).

Shared with the batch host: jobs/lib/supervisor.py reads a step's summary with it to tell a
finished training from a stopped one, and `xscale report` and the tests read the same
lines. So this module runs on the host's system Python too (3.6 on LUMI's and Aurora's login and
batch nodes): standard library only, no syntax newer than 3.6, and no import from the xscale
package, whose other modules need torch or Python 3.10 (jobs/lib/shared.py loads it by path).
"""

import json
import re

# srun --label cuts every output line after 1024 bytes and prints the rest as a line of its own,
# labelled again ("0: AAA...A" then "0: AAA"): the job templates run srun --label. xscale's own
# summary line stays shorter (xscale.observe.runlog.LINE_BUDGET); a trainer's other long lines, and
# the summaries of xscale before it did, are joined again here. Measured with Slurm 22.05
# (tests/test_taglines.py).
SRUN_LABEL_CUT = 1024
SRUN_LABEL = re.compile(r"^ *(\d+): (.*)$")


def label(line):
    """(rank, text) of a line srun --label wrote, or None for srun's own and unlabelled lines."""
    match = SRUN_LABEL.match(line)
    return (int(match.group(1)), match.group(2)) if match else None


def unsplit(lines):
    """LINES with the pieces srun --label cut apart joined again: a labelled line whose text is
    exactly SRUN_LABEL_CUT bytes long goes on in the next line with the same label."""
    joined = []
    cut_open = {}  # label -> index of its cut line in `joined`
    for line in lines:
        match = SRUN_LABEL.match(line)
        if not match:
            joined.append(line)
            continue
        rank, text = match.groups()
        if rank in cut_open:
            index = cut_open.pop(rank)
            joined[index] += text
        else:
            index = len(joined)
            joined.append(line)
        if len(text.encode()) == SRUN_LABEL_CUT:
            cut_open[rank] = index
    return joined


def tagged(lines, tag, skip_invalid=False):
    """Every `TAG {json}` record in LINES, in order, after any `RANK: ` label. A record that is
    not JSON raises ValueError, or is left out with skip_invalid (a log cut short by a crash)."""
    prefix = tag + " "
    found = []
    for line in unsplit(lines):
        if prefix not in line:
            continue
        try:
            found.append(json.loads(line[line.index(prefix) + len(prefix):]))
        except ValueError:
            if not skip_invalid:
                raise
    return found


def whole_summary(record):
    """The whole summary the line RECORD names (its `summary_file`), when that file is still
    the same run's: every field of the line has the same value in it (a later run in the same
    output directory replaces the file). Else RECORD itself; None-safe for old lines."""
    path = record.get("summary_file") if isinstance(record, dict) else None
    if not path:
        return record
    try:
        whole = read_summary_file(path)
    except (OSError, ValueError):
        return record
    if all(whole.get(name, object()) == value for name, value in record.items()):
        return whole
    return record


def read_summary_file(path):
    """A summary file's record; ValueError when it is not one (not JSON, or not an object)."""
    with open(path) as handle:
        record = json.load(handle)
    if not isinstance(record, dict):
        raise ValueError("%s: not a JSON object" % path)
    return record

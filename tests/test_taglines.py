"""xscale.shared.taglines: the one reader of the XSCALE_* lines, as srun --label passes them."""

from __future__ import annotations

import json


def test_report_joins_the_lines_srun_label_cut_after_1024_bytes():
    """`srun --label python -c "print('A' * 3000)"` prints 1024, 1024 and 952 bytes, each piece
    labelled (Slurm 22.05, on the virtual cluster); a summary that long must still parse."""
    from xscale.shared import taglines  # the one reader of these lines: the report's, the host's
    summary = json.dumps({"steps": 7, "pad": "x" * 2500})
    line = f"XSCALE_SUMMARY {summary}"
    pieces = [line[i:i + taglines.SRUN_LABEL_CUT] for i in range(0, len(line), 1024)]
    lines = ["1: other rank"] + [f"0: {piece}" for piece in pieces[:2]] + ["1: between"] + \
        [f"0: {piece}" for piece in pieces[2:]] + ["srun: done"]
    assert taglines.tagged(lines, "XSCALE_SUMMARY") == [json.loads(summary)]
    assert taglines.unsplit(lines) == ["1: other rank", f"0: {line}", "1: between", "srun: done"]

"""`xscale report` (and `python -m xscale report`): the readable summary of a
job's output, its phase table and picture (xscale.observe.picture)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from xscale.observe import startup

from tests.conftest import VENV_BIN
from tests.test_startup import RANKS

# ---------------------------------------------------------------------------------------------
# report: the readable summary of a job's output
# ---------------------------------------------------------------------------------------------


def test_report_reads_a_run_that_resumed_and_took_no_step(tmp_path):
    """A requeued job whose checkpoint was already at the last step logs no loss: the
    summary's losses are null, and the report says so instead of crashing."""
    record = {"trainer": "mnist_ddp", "world_size": 4, "nodes": 2, "start_step": 60,
              "steps": 60, "samples_per_s": 0.0, "tokens_per_s": None, "loss_first": None,
              "loss_last": None, "seconds": 3.5, "stopped_early": False, "accuracy": 0.97}
    output = tmp_path / "job.out"
    output.write_text("xscale: launcher=slurm site=generic nodes=2 master=nid001:29500\n"
                      'XSCALE_RANK {"rank": 0, "node": "nid001"}\n'
                      'XSCALE_RANK {"rank": 2, "node": "nid002"}\n'
                      f"XSCALE_SUMMARY {json.dumps(record)}\n")
    proc = subprocess.run([sys.executable, "-m", "xscale", "report", str(output)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "none logged (0 steps taken, at step 60)" in proc.stdout
    assert "4 ranks on 2 nodes (nid001, nid002)" in proc.stdout
    assert "0 samples/s" in proc.stdout  # tokens_per_s null: the samples' rate instead


def job_output(tmp_path: Path, ranks: list[startup.RankPhases]) -> Path:
    summary = {"trainer": "mnist_ddp", "world_size": len(ranks), "nodes": 2, "start_step": 0,
               "steps": 3, "samples_per_s": 10.0, "tokens_per_s": None, "loss_first": 2.3,
               "loss_last": 2.1, "seconds": 9.5, "stopped_early": False,
               "step_time": {"seconds": 0.0913, "data": 0.003, "compute": 0.19,
                             "communication": 0.789, "checkpoint": 0.004, "other": 0.014},
               "bound": "communication"}
    lines = [f"XSCALE_RANK {json.dumps({'rank': r.rank, 'node': r.node, 'startup': r.phases})}"
             for r in ranks]
    output = tmp_path / "job.out"
    output.write_text("\n".join([*lines, f"XSCALE_SUMMARY {json.dumps(summary)}"]) + "\n")
    return output


def report(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed `xscale` command (pyproject.toml's console script)."""
    return subprocess.run([str(VENV_BIN / "xscale"), "report", *args], capture_output=True,
                          text=True, timeout=60)


def colour_rows(image, colour) -> set[int]:
    """The pixel rows where `colour` appears (the legend's included)."""
    width, height = image.size
    pixels = image.load()
    return {y for y in range(height) for x in range(width) if pixels[x, y] == colour}


def test_report_prints_the_phase_table_and_draws_one_row_per_node(tmp_path):
    from PIL import Image
    from xscale.observe import picture

    proc = report(str(job_output(tmp_path, RANKS)), "--png")
    assert proc.returncode == 0, proc.stderr
    imports = next(line for line in proc.stdout.splitlines() if line.split()[:1] == ["imports"])
    assert imports.split()[1:4] == ["2.600s", "6.100s", "2@nid002"]
    assert ("  step time   91 ms: data 0%, compute 19%, communication 79%, checkpoint 0%, "
            "other 1%: communication-bound (docs/STEPTIME.md)") in proc.stdout.splitlines()
    image = Image.open(tmp_path / "job.out.startup.png")
    assert image.format == "PNG" and image.size[0] == picture.WIDTH
    height = picture.row_height(2)
    bars = range(picture.HEADER, picture.HEADER + 2 * height)
    for phase, colour in picture.COLOURS.items():
        rows = colour_rows(image.convert("RGB"), colour) & set(bars)
        # Every phase is drawn on both nodes' rows (run.sh's 10 ms is a pixel wide at least).
        assert {(y - picture.HEADER) // height for y in rows} == {0, 1}, phase


def test_a_phase_no_rank_recorded_is_left_out_of_the_picture(tmp_path):
    from PIL import Image
    from xscale.observe import picture

    unlaunched = [startup.RankPhases(r.rank, r.node, {**r.phases, "launch": None, "total": None})
                  for r in RANKS]
    proc = report(str(job_output(tmp_path, unlaunched)), "--png")
    assert proc.returncode == 0, proc.stderr
    assert "unknown" in next(line for line in proc.stdout.splitlines()
                             if line.split()[:1] == ["launch"])
    image = Image.open(tmp_path / "job.out.startup.png").convert("RGB")
    bars = set(range(picture.HEADER, image.size[1] - picture.FOOTER))
    assert not colour_rows(image, picture.COLOURS["launch"]) & bars
    assert colour_rows(image, picture.COLOURS["imports"]) & bars


def ink_gaps(text: str) -> list[int]:
    """Widths of the blank pixel columns between the inked ones of TEXT as the picture draws it."""
    from PIL import Image, ImageDraw
    from xscale.observe import picture

    font = picture.text_font()
    width = round(ImageDraw.Draw(Image.new("L", (1, 1))).textlength(text, font=font)) + 8
    image = Image.new("L", (width, 3 * picture.FONT_PIXELS), 0)
    ImageDraw.Draw(image).text((4, 4), text, fill=255, font=font)
    inked = [any(image.getpixel((x, y)) > 64 for y in range(image.size[1]))
             for x in range(width)]
    gaps, run = [], 0
    for column in inked[inked.index(True):]:
        if column and run:
            gaps.append(run)
        run = 0 if column else run + 1
    return gaps


@pytest.mark.parametrize("words", [("its", "slowest"), ("nodes:", "seconds")])
def test_the_pictures_words_stay_apart(words):
    """Its text is legible: a space is wider than any gap between two letters of a word (at
    Pillow's default 10 pixels it was not, and the title read "itsslowest")."""
    within = max(max(ink_gaps(word), default=0) for word in words)
    assert max(ink_gaps(" ".join(words))) > within + 1


@pytest.mark.parametrize("case", ["no file", "no phases", "empty profile directory",
                                  "unreadable trace"])
def test_report_input_errors_are_one_line_and_status_2(tmp_path, case):
    if case == "no file":
        proc = report(str(tmp_path / "missing.out"))
    elif case == "empty profile directory":
        (tmp_path / "rank0").mkdir()
        proc = report("--profile", str(tmp_path))
    elif case == "unreadable trace":  # cut off, as by a full disk
        (tmp_path / "rank0.1.pt.trace.json").write_text('{"traceEvents": [{"ph": "X", ')
        proc = report("--profile", str(tmp_path))
    else:  # an output from before the phases were recorded: fine as text, no picture
        output = tmp_path / "old.out"
        output.write_text('XSCALE_RANK {"rank": 0, "node": "nid001"}\nXSCALE_SUMMARY '
                          '{"trainer": "t", "world_size": 1, "steps": 1, "loss_first": 1.0, '
                          '"loss_last": 1.0, "seconds": 1.0, "samples_per_s": 1.0}\n')
        assert report(str(output)).returncode == 0
        proc = report(str(output), "--png")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("xscale report: error:")


def test_report_reads_the_summary_file_itself_or_through_the_line_that_names_it(tmp_path,
                                                                                capsys):
    """The line leaves the phases to OUTPUT_DIR/xscale-summary.json: with no XSCALE_RANK lines
    the table comes from the file, whether the report is given the job output or the file; a
    file a later run replaced (another `steps`) is not this run's, and is not read."""
    from xscale.observe import runlog

    record = {"trainer": "mnist_ddp", "world_size": 4, "nodes": 2, "start_step": 0,
              "steps": 3, "samples_per_s": 10.0, "tokens_per_s": None, "loss_first": 2.3,
              "loss_last": 2.1, "seconds": 9.5, "stopped_early": False,
              "startup": startup.aggregate(RANKS),
              "summary_file": runlog.summary_path(tmp_path / "run")}
    runlog.emit_summary(record)
    output = tmp_path / "job.out"
    output.write_text(capsys.readouterr().out)
    assert '"startup"' not in output.read_text()
    for given in (output, record["summary_file"]):
        proc = report(str(given))
        assert proc.returncode == 0, proc.stderr
        imports = next(line for line in proc.stdout.splitlines()
                       if line.split()[:1] == ["imports"])
        assert imports.split()[1:4] == ["2.600s", "6.100s", "2@nid002"], proc.stdout
        assert "4 ranks on 2 nodes" in proc.stdout
    replaced = json.loads(record["summary_file"].read_text())
    record["summary_file"].write_text(json.dumps({**replaced, "steps": 9}))
    proc = report(str(output))
    assert proc.returncode == 0 and "start-up" not in proc.stdout, proc.stdout

"""xscale.lifecycle: user errors as one line and status 2, stop signals as a flag, the
clean exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from xscale import lifecycle, runtime
from xscale.lifecycle import UserError

from tests.helpers import run_two_ranks

# ---------------------------------------------------------------------------------------------
# cli: a UserError is one line and exit status 2
# ---------------------------------------------------------------------------------------------


def test_user_error_becomes_one_line_and_status_2(capsys):
    def main() -> int:
        raise UserError("--data '/nowhere': no such directory")

    assert lifecycle.run(main, prog="trainer.py") == 2
    err = capsys.readouterr().err
    assert err == "trainer.py: error: --data '/nowhere': no such directory\n"


def test_cli_run_passes_statuses_through():
    assert lifecycle.run(lambda: None, prog="t") == 0
    assert lifecycle.run(lambda: 3, prog="t") == 3

    def exits() -> int:
        raise SystemExit(2)

    assert lifecycle.run(exits, prog="t") == 2


def test_user_error_in_a_real_process_has_no_traceback(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(
        "from xscale import lifecycle\n"
        "from xscale.lifecycle import UserError\n"
        "def main():\n    raise UserError('bad value')\n"
        "lifecycle.run_and_exit(main, prog='prog.py')\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == "prog.py: error: bad value\n"
    assert proc.stdout == ""


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM])
def test_stop_signal_sets_the_flag_and_the_vote_sees_it(stop_handlers, signum):
    lifecycle.install_stop_handlers()
    assert lifecycle.stop_received() is None
    assert runtime.vote() == runtime.Vote(stop=False, every=None)
    os.kill(os.getpid(), signum)
    deadline = time.monotonic() + 5
    while lifecycle.stop_received() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # the handler runs between bytecodes of the main thread
    assert lifecycle.stop_received() == signum
    assert runtime.vote() == runtime.Vote(stop=True, every=None)
    assert lifecycle.signal_name(lifecycle.stop_received()) == signal.Signals(signum).name


def test_exit_cleanly_keeps_the_status_every_time(tmp_path):
    """The gloo abort at interpreter exit (pytorch/pytorch issue 190489) must never replace the
    chosen status."""
    program = ("from xscale import lifecycle\nfrom xscale.dist import init_distributed\n"
               "import os, torch\nctx = init_distributed()\n"
               "torch.distributed.all_reduce(torch.ones(1))\nprint('done', flush=True)\n"
               "lifecycle.exit_cleanly(int(os.environ['EXIT_WITH']))\n")
    for status in (0, 0, 0, 3):
        runs = run_two_ranks(tmp_path, program, EXIT_WITH=str(status))
        assert [code for code, _, _ in runs] == [status, status], runs
        assert all(out == "done\n" for _, out, _ in runs)

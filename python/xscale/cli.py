"""How a trainer reports a mistake the user can fix: one line, `PROG: error: ...`, exit 2.

A traceback tells a user on rank 713 of a 1024-rank job nothing they can act on, and it is
printed 1024 times; one line per rank that names the bad value is what `grep error:` finds.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

USAGE_ERROR = 2  # argparse's and run.sh's exit status for a bad command line or setting


class UserError(Exception):
    """A wrong path, value or setting: reported as `PROG: error: MESSAGE`, exit status 2."""


def error_line(prog: str, message: str) -> str:
    return f"{prog}: error: {message}"


def run(main: Callable[[], int | None], prog: str) -> int:
    """Call `main()` and return its exit status; a UserError becomes one line on stderr and 2.

    argparse's own exits (--help, a bad option) come back as their status too, so a caller that
    owns the process exit (xscale.shutdown.exit_cleanly) sees every ending the same way.
    """
    try:
        code = main()
    except UserError as error:
        print(error_line(prog, str(error)), file=sys.stderr, flush=True)
        return USAGE_ERROR
    except SystemExit as exiting:
        return exit_status(exiting.code)
    return 0 if code is None else int(code)


def exit_status(code: object) -> int:
    """SystemExit's code as a process status: None is 0, an int itself, a message is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr, flush=True)
    return 1

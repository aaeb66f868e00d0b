"""`xscale COMMAND [ARGS...]`: the package's command line, installed as the console script
`xscale` (pyproject.toml) and also run as `python -m xscale`.

    xscale report JOB_OUTPUT|SUMMARY.json [--png]   a run's readable summary
                                                    (xscale.observe.report)
    xscale report --profile PROFILE_DIR             its profile summarised
                                                    (xscale.observe.profile_report)
    xscale goodput-model [--nodes N ...]            requeue against spares over a long campaign
                                                    (xscale.goodput_model, docs/GOODPUT.md)
    xscale settings [--markdown]                    every XSCALE_* setting, its default and
                                                    what it does (xscale.shared.settings,
                                                    docs/SETTINGS.md)

`python -m xscale COMMAND` is the same; each module also runs as `python -m MODULE` (the
module named above).
Each command's module is imported only when it is chosen: `xscale --help` needs no torch.
"""

from __future__ import annotations

import importlib
import sys

# Command -> (module, one line for --help). Each module has main(argv, prog).
COMMANDS = {
    "report": ("xscale.observe.report",
               "a run's readable summary: its job output or xscale-summary.json, "
               "or its profile (--profile DIR)"),
    "goodput-model": ("xscale.goodput_model",
                      "requeue against spares over a month of training (docs/GOODPUT.md)"),
    "settings": ("xscale.shared.settings",
                 "every XSCALE_* setting: its default and what it does (docs/SETTINGS.md)"),
}


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join(["usage: xscale COMMAND [ARGS...]   (xscale COMMAND --help for its options)",
                      "", "commands:", *lines])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"xscale: error: no command '{command}' (one of: {', '.join(COMMANDS)})",
              file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    return module.main(rest, prog=f"xscale {command}") or 0


if __name__ == "__main__":
    sys.exit(main())

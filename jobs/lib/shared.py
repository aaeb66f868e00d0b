"""What the batch host's programs (supervisor.py, failure_report.py, stage, stage-node) import
from the rest of the checkout, in one place, and the one way they speak: `xscale: ...` on stderr.

They run on the host's system Python (3.6 on LUMI's and Aurora's batch and login nodes), so they
use only modules written for it: runscripts/lib/hostlist.py (Slurm's syntax), and
python/xscale/shared/taglines.py (the reader of XSCALE_SUMMARY), python/xscale/shared/archive.py
(staging's unpack and publish), python/xscale/shared/contract.py (the files, events and variables
the host and the ranks exchange) and python/xscale/shared/settings.py (every XSCALE_* setting, typed
and checked), which the trainers use too. Those four are loaded from their files rather than
imported as `xscale.shared.taglines`: importing the package would run xscale/__init__.py, whose
imports need a newer Python.
"""

import importlib.util
import os
import subprocess
import sys


def say(text):
    print("xscale: " + text, file=sys.stderr, flush=True)


def output_of(argv):
    """ARGV's output (a Slurm command's), or None when it failed (it said why on stderr)."""
    try:
        proc = subprocess.run(argv, stdout=subprocess.PIPE, universal_newlines=True)
    except OSError as error:
        say("%s: %s" % (argv[0], error))
        return None
    return proc.stdout if proc.returncode == 0 else None


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "runscripts", "lib"))

import hostlist  # noqa: E402,F401  (runscripts/lib, shared with get-master and the doctor)


def _xscale_module(name):
    path = os.path.join(ROOT, "python", "xscale", "shared", name + ".py")
    spec = importlib.util.spec_from_file_location("xscale_" + name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


taglines = _xscale_module("taglines")
archive = _xscale_module("archive")
contract = _xscale_module("contract")
settings = _xscale_module("settings")

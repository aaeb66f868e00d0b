"""What a plain trainer imports (mnist_ddp.py), then its first call: prints, as JSON, which heavy
modules (torchvision, torch.distributed.checkpoint) those imports loaded, and
xscale.observe.startup's `imports` moment before and after xscale.start().

tests/test_startup.py (test_importing_xscale_does_no_work_and_the_first_call_marks_the_imports)
runs it.
"""

# The imports are the point: a trainer's, used or not.
import json
import os  # noqa: F401
import sys

import torch  # noqa: F401
import xscale
from xscale import UserError, vision  # noqa: F401
from xscale.observe import startup

heavy = [name for name in ("torchvision", "torch.distributed.checkpoint") if name in sys.modules]
before = startup.moments({})["imports"]
xscale.start()
print(json.dumps({"heavy": heavy, "before": before, "after": startup.moments({})["imports"]}))

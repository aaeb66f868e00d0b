"""One rank's view of what jobs/lib/stage put on its node: it imports xs_staged_pkg (from
PYTHONPATH, the staged venv's site-packages) and prints `RANK host package-file listing labels`,
where listing is what the node's staging directory holds and labels the staged data set's
labels.txt. Arguments: the staged venv's directory and the staged data set's.

tests/test_staging.py (test_stage_once_per_node_reuse_and_import_from_the_node_local_copy) runs
it with srun on every rank of a 4-node job (its STAGE_JOB script, as $PROBE).
"""

import os
import socket
import sys

import xs_staged_pkg

venv, data = sys.argv[1:]
listing = ",".join(sorted(os.listdir(os.path.dirname(venv))))
labels = open(data + "/labels.txt").read().strip()
print("RANK", socket.gethostname(), xs_staged_pkg.__file__, listing, labels)

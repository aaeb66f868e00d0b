"""Which steps a rate leaves out: the warm-up, and the steps torch.compile spent compiling.

The first steps of a run search kernels, start DataLoader workers and fill caches. A compiled
model also compiles at its first or second step (the FLOP count runs the first one eagerly,
xscale.observe.flops), and may compile again at the next when dynamo marks a shape dynamic. Such
a step can take a minute where the others take milliseconds: inside a mean it would be most of
the step time and of the throughput. So the warm-up is the first `steps` steps, then every step
that compiled a graph, until one step compiled none. A compilation after that is the run's own
cost (a new shape at an evaluation, a guard that failed) and is measured.
"""

from __future__ import annotations

import sys


def compiled_graphs() -> int:
    """The graphs torch.compile has captured in this process so far (dynamo's own counter);
    0 while dynamo is not imported: then nothing was compiled."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(dynamo_utils, "counters", None)
    return 0 if counters is None else counters["stats"]["unique_graphs"]


class WarmUp:
    """Call step() after each step: it says when the measurement (re)starts, at that step's end."""

    def __init__(self, steps: int = 1) -> None:
        self.steps = max(steps, 1)
        self._seen = compiled_graphs()
        self._done = 0
        self._settled = False  # a measured step compiled nothing: compilations count from here

    def step(self) -> bool:
        """True when the steps from this one's end on are the ones measured."""
        if self._settled:  # every step from here is measured: dynamo is not read again
            return False
        self._done += 1
        seen, self._seen = self._seen, compiled_graphs()
        if self._done < self.steps:
            return False
        if self._done == self.steps or self._seen != seen:
            return True
        self._settled = True
        return False

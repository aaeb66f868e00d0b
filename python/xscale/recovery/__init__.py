"""Live recovery on the ranks' side: when a node fails, this rank keeps its process and all it
holds (model, optimizer, data position, caches, device context), leaves the broken group, forms
the next one with a replacement from a spare node, and trains on (docs/FAILURES.md, "Live
recovery"; the supervisor's side is jobs/lib/coordinator.py, the messages are
xscale.shared.contract's).

From the bottom up, each module importing only those below it:

    link      this rank's connection to the coordinator; waits that end when the group breaks,
              a framework's blocking collectives too (under xscale.dist and
              xscale.reductions, which use it)
    protocol  Recoverable, what a kind of training implements; Place, where a loop is
    ddp       the kind for a DDP model, in xscale.Loop or Hugging Face's Trainer (xscale.hf)
              (above xscale.dist)
    live      the loop's one object: a kind and the link, and the recovery's steps

A failure anywhere else (a save, an evaluation) raises as it always did, and the supervisor falls
back to a restart of the whole launch.
"""

"""The goodput ledger: what a job's allocated time went to, across its restarts and requeues.

The supervisor keeps, per attempt of the job (XSCALE_RECORDS_DIR/attemptA.json,
jobs/lib/attempt.py), when the attempt started and ended and, per launch of the training, when it
was launched and ended; rank 0 notes its progress in the launch's attemptA-launchL.progress
(python/xscale/shared/contract.py: the first step, each log interval, each checkpoint with the time
training was held up, the end). From them, in seconds:

    allocated    the attempts' wall time, from the job's start on its nodes to the batch
                 script's end
    training     productive: steps that count, from a launch's first step to its end (or, in a
                 launch that failed, to its last checkpoint), less the checkpoint stalls
    startup      each launch to its first step done
    checkpoints  training held up by saves
    snapshots    training held up by peer snapshots (a sharded model's live recovery)
    lost_work    steps done after the last checkpoint of a launch that failed: the resumed one does
                 them again (lost_steps counts them); and the steps after the snapshot a live
                 recovery rolled back to
    restarts     a failed launch's last sign of progress to its end (the failure being noticed:
                 a collective timeout, Slurm's SlurmdTimeout), and from there to the next
                 launch in the same allocation
    recovery     live recoveries (jobs/lib/coordinator.py): from a failure noticed to the group
                 re-formed with the replacement, in training that was kept (one in work that a
                 later failure threw away is lost work); a replicated model's redoes no step
    other        the rest: staging, evaluation, the script's own set-up and clean-up
    queued       not allocated: the wait in the queue after each requeue
    smaller_world  part of training: the kept training after a live recovery with no spare left
                 went on without the lost node (a recovery record's world_size), until one
                 took the lost ranks back in (jobs/lib/grow_back.py)

goodput is training / allocated. The supervisor prints it as the job's script ends,

    xscale: goodput: 91.2% of 14.3 min (start-up 4.1%, checkpoints 0.8%, lost work 1.7%, ...)

with the same numbers as `XSCALE_GOODPUT {json}` (which `xscale report` reads) and in
XSCALE_RECORDS_DIR/goodput.json. A trainer that notes no progress (a script of one's own without
xscale's library) leaves only what the supervisor saw itself: the allocated time, the launches,
their failures, the restarts and requeues (launches_only). Standard library only, Python 3.6
and later.
"""

import json
import os

from shared import contract

CATEGORIES = ("training", "startup", "checkpoints", "snapshots", "lost_work", "restarts",
              "recovery", "other")
LABELS = {"startup": "start-up", "checkpoints": "checkpoints", "snapshots": "snapshots",
          "lost_work": "lost work", "restarts": "restarts", "recovery": "live recovery",
          "other": "other"}
SHOWN_WHEN_SPENT = ("snapshots", "recovery")  # in the line only when some time went to them


def account_launch(launch, events, next_launch):
    """Seconds per category for one launch, and the steps its failure threw away. The live
    recoveries' seconds within its kept training come out of that training, and so do its
    peer snapshots' stalls and the steps a recovery rolled back; within work a later failure
    threw away they are lost work already."""
    spent, lost, trained = _account_launch(launch, events, next_launch)
    if trained is None:
        return spent, lost
    kept = [event for event in events if trained[0] <= event["time"] <= trained[1]]
    recoveries = launch.get("recoveries") or []
    recovery = sum(_overlap(entry, trained) for entry in recoveries)
    _move(spent, "recovery", recovery)
    spent["smaller_world"] = _smaller_world(recoveries, trained)
    _move(spent, "snapshots", sum(event.get("stall_s", 0.0) for event in kept
                                  if event.get("event") == contract.SNAPSHOT))
    rolled_back = [event for event in kept if event.get("event") == contract.ROLLED_BACK]
    _move(spent, "lost_work", sum(event.get("redone_s", 0.0) for event in rolled_back))
    return spent, lost + sum(event.get("redone", 0) for event in rolled_back)


def _move(spent, category, seconds):
    """SECONDS of the training to CATEGORY (no more than the training had)."""
    seconds = min(seconds, spent["training"])
    spent[category] += seconds
    spent["training"] -= seconds


def _smaller_world(recoveries, span):
    """The seconds of SPAN the world trained smaller: from each recovery that left it smaller
    (its group re-formed) to the one that grew it back to the launch's (its failure noticed:
    the pause is the recovery's), or to the span's end."""
    changes = sorted((entry for entry in recoveries
                      if "world_size" in entry and entry.get("noticed") is not None),
                     key=lambda entry: entry["noticed"])
    seconds, since = 0.0, None
    for entry in changes:
        smaller = entry.get("smaller", True)
        if smaller and since is None:
            since = entry["noticed"] + entry.get("joined_s", 0.0)
        elif not smaller and since is not None:
            seconds += _overlap({"noticed": since, "joined_s": entry["noticed"] - since}, span)
            since = None
    if since is not None:
        seconds += _overlap({"noticed": since, "joined_s": span[1] - since}, span)
    return seconds


def _overlap(recovery, span):
    """The seconds of RECOVERY (from its failure noticed to its group re-formed) in SPAN."""
    start = recovery.get("noticed")
    if start is None:
        return 0.0
    end = start + recovery.get("joined_s", 0.0)
    return max(min(end, span[1]) - max(start, span[0]), 0.0)


def _account_launch(launch, events, next_launch):
    """(seconds per category, steps thrown away, the span of its kept training or None)."""
    launched, ended = launch.get("launched"), launch.get("ended")
    spent = dict.fromkeys(CATEGORIES, 0.0)
    if launched is None or ended is None:
        return spent, 0, None
    first = contract.first(events, contract.FIRST_STEP)
    if first is None:
        spent["startup"] = ended - launched
        return spent, 0, None
    spent["startup"] = first["time"] - launched
    saves = [event for event in events if event.get("event") == contract.CHECKPOINT]
    last = max(events, key=lambda event: event["time"])
    if launch.get("status") == 0 or contract.training_finished(events):
        # A launch that failed after its training finished lost none of it (docs/FAILURES.md).
        end = contract.first(events, contract.END)
        finished = last["time"] if end is None else end["time"]
        stalls = sum(event.get("stall_s", 0.0) for event in saves)
        spent["checkpoints"] = stalls
        spent["training"] = max(finished - first["time"] - stalls, 0.0)
        return spent, 0, (first["time"], finished)
    kept = saves[-1] if saves else {"time": first["time"], "step": first["step"] - 1}
    stalls = sum(event.get("stall_s", 0.0) for event in saves)
    spent["checkpoints"] = stalls
    spent["training"] = max(kept["time"] - first["time"] - stalls, 0.0)
    spent["lost_work"] = max(last["time"] - kept["time"], 0.0)
    spent["restarts"] = max(ended - last["time"], 0.0)
    if next_launch is not None:
        spent["restarts"] += max(next_launch - ended, 0.0)
    return spent, max(last.get("step", 0) - kept["step"], 0), (first["time"], kept["time"])


def ledger(attempts, progress_of):
    """The ledger of ATTEMPTS (their attemptA.json, in order); PROGRESS_OF(launch) -> its
    events."""
    total = dict.fromkeys(CATEGORIES, 0.0)
    allocated = queued = 0.0
    lost_steps = 0
    smaller_world = 0.0
    previous_end = None
    for attempt in attempts:
        started, ended = attempt.get("started"), attempt.get("ended")
        if started is None or ended is None:
            continue
        allocated += ended - started
        if previous_end is not None:
            queued += max(started - previous_end, 0.0)
        previous_end = ended
        launches = attempt.get("launches", [])
        for index, launch in enumerate(launches):
            follows = launches[index + 1].get("launched") if index + 1 < len(launches) else None
            spent, lost = account_launch(launch, progress_of(launch), follows)
            lost_steps += lost
            smaller_world += spent.get("smaller_world", 0.0)
            for category in CATEGORIES:
                total[category] += spent[category]
    counted = sum(total[category] for category in CATEGORIES if category != "other")
    total["other"] = max(allocated - counted, 0.0)
    book = {"goodput": total["training"] / allocated if allocated > 0 else None,
            "allocated_s": allocated, "queued_s": queued, "lost_steps": lost_steps,
            "smaller_world_s": smaller_world}
    book.update(("%s_s" % category, seconds) for category, seconds in total.items())
    return book


def line(book):
    """The line the job ends with, after `goodput: ` (also the ledger's "text", which
    xscale.observe.report shows)."""
    allocated = book["allocated_s"]
    if not allocated:
        return "unknown (no training launch ran)"
    shares = ", ".join("%s %.1f%%" % (LABELS[category], 100 * book[category + "_s"] / allocated)
                       for category in CATEGORIES if category != "training"
                       and (category not in SHOWN_WHEN_SPENT or book[category + "_s"]))
    text = "%.1f%% of %.1f min (%s)" % (100 * book["goodput"], allocated / 60, shares)
    if book["lost_steps"]:
        text += "; %d steps redone" % book["lost_steps"]
    if book.get("smaller_world_s"):
        text += "; %.1f min of the training in a smaller world" % (book["smaller_world_s"] / 60)
    if book["queued_s"]:
        text += "; %.1f min queued after requeues" % (book["queued_s"] / 60)
    return text


def launches_only(attempts):
    """The ledger without progress notes: what the supervisor's own records of ATTEMPTS say."""
    launches = [launch for attempt in attempts for launch in attempt.get("launches", [])]
    timed = [attempt for attempt in attempts
             if attempt.get("started") is not None and attempt.get("ended") is not None]
    queued = sum(max(timed[index]["started"] - timed[index - 1]["ended"], 0.0)
                 for index in range(1, len(timed)))
    book = {"goodput": None,
            "allocated_s": sum(attempt["ended"] - attempt["started"] for attempt in timed),
            "queued_s": queued, "launches": len(launches),
            "failed": sum(1 for launch in launches if launch.get("status") not in (0, None)),
            "restarts": sum(attempt.get("restarts", 0) for attempt in attempts),
            "requeues": max(len(attempts) - 1, 0)}
    book["text"] = ("unknown, the training noted no progress: %.1f min allocated, %s, %d failed, "
                    "%d restarted, %d requeued"
                    % (book["allocated_s"] / 60, plural(book["launches"], "launch", "launches"),
                       book["failed"], book["restarts"], book["requeues"]))
    return book


def plural(count, one, many):
    return "%d %s" % (count, one if count == 1 else many)


def write(records_dir, book):
    path = os.path.join(records_dir, "goodput.json")
    partial = path + ".new"
    with open(partial, "w") as handle:
        json.dump(book, handle, indent=1)
    os.replace(partial, path)
    return path

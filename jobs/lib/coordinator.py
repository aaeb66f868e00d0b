"""Live recovery's coordinator, on the batch host: when a node of the launch fails, its healthy
ranks keep their processes, a spare node takes the lost node's ranks, and training goes on; when
a rank fails on its own, it starts again on its node (docs/FAILURES.md, "Live recovery").

The ranks (python/xscale/recovery/) connect to it as they start (contract.RECOVERY_VAR) and
speak the messages contract.py types. A failure is noticed three ways: a rank whose collective
failed says Broken; a rank's connection closes without Bye (its process died); a rank sends no
Beat for XSCALE_HEARTBEAT_S (a frozen node, which sends nothing at all). Then, in order:

1. Abort to every rank: each leaves the broken group at once, not at its collective timeout,
   keeping everything it holds, and says Left. A rank that has not within LEAVE_WINDOW_S is
   lost with the others.
2. Every rank must be live (xscale.Loop with DDP: it can re-enter its loop). A node none of
   whose ranks left is lost: `replace(nodes, generation)` (the supervisor's) launches its ranks
   on spares, with its rank numbers, if a spare is left. A lost rank whose node-mates left
   failed on its own (the node runs: they answered through it): `restart(ranks, generation)`
   starts it again on its node, unless it failed more than `max_rank_restarts` times at that
   step (a bug: the launch stops with the first failure's line), or unless `blamed(nodes)`
   finds a line of the launch's output that blames its node (a bad GPU): then the node is
   lost, its other ranks are dismissed (they exit), and the node is replaced or left out as a
   lost one is. No spare left: the survivors go on as a smaller world, renumbered in their
   order, if every one of them can (it said Live with shrinks: its loop deals each step's
   global batch over the ranks left), rank 0 is among them and at least `min_nodes` nodes are
   left.
3. HostStore to the lowest surviving rank, which answers with its new store's address; Join to
   every rank of the next generation, the replacements as they arrive: the group re-forms there,
   and the replacements get the training state from that rank.
4. Once every rank has Joined, training is under way again; the recovery is noted.

A smaller world grows back when a node is the training's again (`grow(ranks, start, node)`, the
supervisor's once a node it asked the queue for runs, jobs/lib/grow_back.py): the lost ranks
start there and say Hello; once every rank of the generation has begun a step in it (Stepping:
a rank still re-entering its loop after the last recovery would not leave within
LEAVE_WINDOW_S), every rank leaves its generation as after a failure (the step under way is
dropped, none is redone), and the next forms with them, in the launch's numbers.

Anything else (a rank not live, a failure during a recovery, no spare left and no smaller world,
a rank's own failure too often, a replacement that does not join within JOIN_TIMEOUT_S) is a
Fallback: every rank exits, `give_up()` ends the launch, and the supervisor does what it does
without live recovery (docs/FAILURES.md: report, restart on a spare, or requeue).

The batch host is the allocation's first node: if it fails, the job fails with it, so the
coordinator's own loss costs nothing more. One connection per rank; a machine of 10,000s of
ranks would want one relay per node in front of it.

Standard library only, Python 3.6: the batch host's system Python.
"""

import json
import os
import signal
import socket
import socketserver
import subprocess
import threading
import time

import failure_report
import grow_back
import hangs
import launches
from shared import contract, hostlist, say

LEAVE_WINDOW_S = 5.0  # after Abort, for every rank that lives to say Left
STORE_TIMEOUT_S = 30.0  # for the store's address from the rank that hosts it
JOIN_TIMEOUT_S = 300.0  # for a replacement to start (its container, `import torch`) and join
WATCH_EVERY_S = 1.0  # how often heartbeats are checked
GROWN, BUSY, FAILED = "grown", "busy", "failed"  # how a grow ended (Coordinator.grow)


class Peer:
    """One rank's process, as its connection tells of it."""

    def __init__(self, connection, rank, node, pid, generation, now):
        self.connection, self.rank, self.node, self.pid = connection, rank, node, pid
        self.generation = generation
        self.last_beat = now
        self.live = self.bye = self.closed = self.lost = False
        self.shrinks = False  # its loop can go on in a smaller world (it said so with Live)
        self.not_live = None  # why its training cannot be recovered live, as it said
        self.failed = None  # its own error's first line, as it said before it ended
        self.left = self.joined = None  # the generation it last left, and joined
        self.stepping = None  # the generation its loop began a step in (it said Stepping)
        self.left_step = None  # the optimizer steps it had done when it left
        self.timed_out = False  # its collective timed out: a peer never came
        self.store = None  # the address of the store it hosts for the group being formed
        self.send_lock = threading.Lock()

    def send(self, message):
        try:
            with self.send_lock:
                self.connection.sendall(contract.encode(message))
        except OSError:
            pass  # its end shows as a closed connection

    @property
    def current_generation(self):
        """The generation this process is in, or about to join once it left the one before."""
        return self.generation if self.left is None else max(self.generation, self.left + 1)

    def __repr__(self):
        return "rank %d on %s" % (self.rank, self.node)


class Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class Handler(socketserver.StreamRequestHandler):
    def handle(self):
        self.server.coordinator.serve(self.connection, self.rfile)


class Coordinator:
    """WORLD_SIZE ranks. replace(nodes, generation): launch the ranks of NODES on spares, into
    GENERATION; the spares, or None when none are left. restart(ranks, generation): start RANKS
    (as the launch numbered them) again on their own nodes, into GENERATION; None, or why not.
    give_up(why): end the launch (the fallback). heartbeat_s: how long a rank may be silent.
    max_rank_restarts: how often one rank may fail on its own at one step and start again.
    min_nodes: the fewest nodes a smaller world may train on when no spare is left (0: none is
    formed). blamed(nodes): {node: why} for those of NODES that are no place to start a rank
    again (the quick health check); none, without it."""

    def __init__(self, world_size, replace, give_up, heartbeat_s, restart=None,
                 max_rank_restarts=0, now=time.monotonic, min_nodes=0, blamed=None):
        self.world_size, self.replace, self.give_up = world_size, replace, give_up
        self.restart, self.max_rank_restarts = restart, max_rank_restarts
        self.blamed = blamed or (lambda nodes: {})
        self.min_nodes = min_nodes
        self.met = set()  # every rank that said Hello, as the launch numbers them
        self.layout = None  # after a shrink: the launch's numbers of the ranks, in rank order
        self.heartbeat_s, self.now = heartbeat_s, now
        self.own_failures = {}  # (rank, step) -> the first line of each failure of it there
        self.hung = []  # ranks found silent while their node's other ranks answered
        self.peers = {}  # rank -> Peer: the current process of each rank
        self.generation = 0
        self.formed = 0  # the newest generation every rank joined
        self.join = None  # the Join of the generation being formed
        self.recovering = self.fallen_back = False
        self.recoveries = []  # what each recovery took, for the records
        self.launch_world = world_size  # a smaller world's ranks are fewer
        self.arriving = {}  # a grow under way: launch rank -> its Peer once it said Hello
        self.grow_failed = None  # why the ranks of the grow under way will not come
        self.losing = []  # the nodes the recovery under way replaces
        self.unrecovered = []  # those nodes, when that recovery fell back: the launch lost them
        self.changed = threading.Condition()
        self.server = Server(("", 0), Handler)
        self.server.coordinator = self

    @property
    def address(self):
        return "%s:%d" % (socket.gethostname(), self.server.server_address[1])

    def start(self):
        for target in (self.server.serve_forever, self._watch_heartbeats):
            threading.Thread(target=target, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()

    def finished(self, wait_s=0.0):
        """Whether every rank ended its training (Bye) and its process (its connection closed),
        waiting up to WAIT_S for it."""
        with self.changed:
            return self.changed.wait_for(lambda: len(self.peers) == self.world_size and all(
                peer.bye and peer.closed for peer in self.peers.values()), timeout=wait_s)

    # ---- one rank's connection ------------------------------------------------------------

    def serve(self, connection, stream):
        peer = None
        for received in contract.read_messages(stream):
            if peer is None:
                if not isinstance(received, contract.Hello):
                    return
                peer = self._hello(connection, received)
                continue
            self._on_message(peer, received)
        if peer is not None:
            self._closed(peer)

    def _hello(self, connection, hello):
        launch_rank = int(hello.rank)  # a rank knows itself by the launch's number
        with self.changed:
            if launch_rank in self.arriving:  # it joins once every rank has left (grow)
                peer = Peer(connection, launch_rank, str(hello.node), hello.pid,
                            int(hello.generation), self.now())
                self.arriving[launch_rank] = peer
                self.met.add(launch_rank)
                self.changed.notify_all()
                return peer
            if self.layout is not None and launch_rank not in self.layout:
                return None  # of a node the smaller world went on without: no rank of it
            rank = launch_rank if self.layout is None else self.layout.index(launch_rank)
            peer = Peer(connection, rank, str(hello.node), hello.pid, int(hello.generation),
                        self.now())
            self.peers[peer.rank] = peer  # a replacement takes its rank's place
            self.met.add(launch_rank)
            join = self.join
            self.changed.notify_all()
        if join is not None and peer.generation == join.generation:
            peer.send(join)
        return peer

    def _on_message(self, peer, received):
        with self.changed:
            if self.peers.get(peer.rank) is not peer:
                return  # a lost process, replaced (a frozen node thawed): no news
            peer.last_beat = self.now()
            if isinstance(received, contract.Live):
                peer.live, peer.shrinks = True, bool(received.shrinks)
            elif isinstance(received, contract.NotLive):
                peer.not_live = received.why
            elif isinstance(received, contract.Left):
                peer.left, peer.left_step = received.generation, received.step
            elif isinstance(received, contract.Joined):
                peer.joined = received.generation
            elif isinstance(received, contract.Stepping):
                peer.stepping = received.generation
            elif isinstance(received, contract.Store):
                peer.store = received.address
            elif isinstance(received, contract.Bye):
                peer.bye = True
            elif isinstance(received, contract.Failed):
                peer.failed = received.why
                peer.lost = True  # it is ending: the recovery need not wait for it to leave
            self.changed.notify_all()
        if isinstance(received, contract.Broken) and hangs.TIMED_OUT.search(received.why):
            peer.timed_out = True  # news even while a recovery is under way: it names a hang
        if isinstance(received, contract.Broken) and not peer.bye:  # after Bye: training is over
            self._failed("rank %d's collective failed (%s)" % (peer.rank, received.why),
                         received.generation)
        elif isinstance(received, contract.Failed):
            self._failed("%s failed: %s" % (peer, received.why), peer.current_generation)

    def _closed(self, peer):
        with self.changed:
            peer.closed = True
            current = self.peers.get(peer.rank) is peer
            self.changed.notify_all()
        if current and not (peer.bye or peer.lost):
            self._failed("rank %d on %s (pid %s) is gone" % (peer.rank, peer.node, peer.pid),
                         peer.current_generation)

    def _watch_heartbeats(self):
        while not self.fallen_back:
            time.sleep(WATCH_EVERY_S)
            with self.changed:
                silent = [peer for peer in self.peers.values()
                          if not (peer.bye or peer.closed or peer.lost)
                          and self.now() - peer.last_beat > self.heartbeat_s]
                for peer in silent:
                    peer.lost = True  # the recovery need not wait for it to leave
                generation = self.generation
            if silent:
                self._failed("%s sent nothing for %.0f s (XSCALE_HEARTBEAT_S)"
                             % (silent[0], self.heartbeat_s), generation)

    # ---- a failure --------------------------------------------------------------------------

    def _failed(self, why, generation):
        """A failure seen in GENERATION: recover from it, once. A failure of the generation
        being recovered is no news (its other ranks see it too, and the lost ones' connections
        close); one of the next, while it forms, ends live recovery."""
        with self.changed:
            if self.fallen_back or generation < self.generation or (
                    self.recovering and generation == self.generation):
                return
            failed_again = self.recovering
            self.recovering = True
            self.changed.notify_all()  # a grow waiting for its ranks gives way
        if failed_again:
            self.fall_back("%s during the recovery" % why)
            return
        threading.Thread(target=self._recover, args=(why,), daemon=True).start()

    def _recover(self, why):
        noticed, noticed_at = self.now(), time.time()  # the records' times are wall-clock
        generation = self.generation
        unable = self._not_live()
        if unable:
            self.fall_back("%s; %s" % (why, unable))
            return
        say("live recovery: %s; every rank leaves generation %d" % (why, generation))
        self._send_all(contract.Abort(generation=generation))
        survivors, lost = self._leavers(generation, noticed + LEAVE_WINDOW_S)
        for peer in lost:
            if peer is not None:
                peer.lost = True
        refusal = self._hang(lost) or self._refusal(survivors, lost)
        if refusal:
            self.fall_back(refusal)
            return
        on_their_own = self._on_their_own(survivors, lost)
        blamed = self.blamed(sorted({peer.node for peer in on_their_own})) \
            if on_their_own else {}
        if blamed:
            survivors, lost = self._dismiss(blamed, survivors, lost)
            on_their_own = [peer for peer in on_their_own if peer.node not in blamed]
            refusal = self._refusal(survivors, lost)
            if refusal:
                self.fall_back(refusal)
                return
        lost_nodes = sorted({peer.node for peer in lost if peer not in on_their_own})
        self.losing = lost_nodes
        restarted = sorted(self._launch_rank(peer.rank) for peer in on_their_own)
        refusal = self._restart_refusal(on_their_own, survivors[0].left_step)
        if refusal:
            self.fall_back(refusal)
            return
        lost_ranks = sorted(self._launch_rank(peer.rank) for peer in lost)
        spares = (self.replace(lost_nodes, generation + 1) or []) if lost_nodes else []
        before = None
        if lost_nodes and not spares:
            refusal = self._shrink_refusal(survivors, restarted)
            if refusal:
                self.fall_back("no spare node is left for %s, and %s"
                               % (hostlist.compress(lost_nodes), refusal))
                return
            before = self._shrink(survivors)
        refusal = self.restart(restarted, generation + 1) if restarted else None
        if refusal:
            self.fall_back(refusal)
            return
        launched = self.now()
        store = self._host_store(survivors[0], generation + 1)
        if store is None:
            self.fall_back("%s did not host the new group's store" % survivors[0])
            return
        nodes = len({peer.node for peer in survivors} | set(spares))
        joined = self._form(generation + 1, store, survivors[0].rank, spares + restarted, nodes)
        if joined is None:
            return
        record = {"generation": generation + 1, "why": why, "lost": lost_nodes,
                  "spares": spares, "restarted": restarted, "ranks": lost_ranks,
                  "blamed": sorted(blamed),
                  "noticed": round(noticed_at, 3), "left_s": round(launched - noticed, 3),
                  "joined_s": round(joined - noticed, 3)}
        if before is not None:
            record.update(world_size=self.world_size, smaller=True)
        with self.changed:
            self.recoveries.append(record)
        change = what_changed(spares, lost_nodes, restarted) if before is None else \
            went_smaller(survivors, lost_nodes, before)
        say("live recovery: %s; the group re-formed %.1f s after the failure was noticed "
            "(generation %d)" % (change, joined - noticed, generation + 1))

    def _leavers(self, generation, deadline):
        """(the ranks that left GENERATION by DEADLINE, lowest first; the others)."""
        with self.changed:
            self.changed.wait_for(lambda: all(peer.left == generation or peer.closed
                                              or peer.lost for peer in self.peers.values()),
                                  timeout=max(deadline - self.now(), 0.0))
            peers = list(self.peers.values())
        survivors = sorted((peer for peer in peers if peer.left == generation
                            and not (peer.closed or peer.lost)), key=lambda peer: peer.rank)
        lost = [peer for peer in peers if peer not in survivors]
        missing = self.world_size - len(peers)  # never connected: not an xscale rank
        return survivors, (lost if not missing else lost + [None] * missing)

    def _refusal(self, survivors, lost):
        """Why this failure cannot be recovered live, or None."""
        if None in lost:
            return "some ranks never reached the coordinator (not started through xscale)"
        if not lost:
            return "every rank left, none was lost: nothing to replace"
        if not survivors:
            return "no rank survived"
        return None

    def _hang(self, lost):
        """Why this failure is a hang, or None: a rank's collective timed out, and lost ranks
        neither ended nor said anything (a hung process). Its peers' flight records name it in
        the report (jobs/lib/hangs.py), and it is not started again beside itself."""
        silent = [peer for peer in lost if peer is not None and not (peer.closed or peer.failed)]
        with self.changed:
            waited = [peer for peer in self.peers.values() if peer.timed_out]
        if not (silent and waited):
            return None
        self.hung = sorted(peer.rank for peer in silent)
        return ("rank %d's collective timed out and %s never came: a hung process, not started "
                "again beside itself; the report names it" % (waited[0].rank, silent[0]))

    @staticmethod
    def _on_their_own(survivors, lost):
        """The lost ranks that failed on their own: a rank of their node survived, so the node
        runs (the survivor answered the abort through it)."""
        running = {peer.node for peer in survivors}
        return [peer for peer in lost if peer.node in running]

    def _dismiss(self, blamed, survivors, lost):
        """BLAMED's nodes ({node: why}) are lost with every rank on them: the survivors there
        are dismissed (they exit). Returns the survivors and the lost ranks after it."""
        dismissed = [peer for peer in survivors if peer.node in blamed]
        for node, why in sorted(blamed.items()):
            ranks = [str(peer.rank) for peer in dismissed if peer.node == node]
            say("live recovery: %s: the node is lost, and rank%s %s with it" % (
                why, "s" if len(ranks) > 1 else "", ",".join(ranks)))
        for peer in dismissed:
            with self.changed:
                peer.lost = True  # its connection's end is no news
            peer.send(contract.Dismiss(why=blamed[peer.node]))
        return [peer for peer in survivors if peer not in dismissed], lost + dismissed

    def _restart_refusal(self, on_their_own, step):
        """Why the ranks that failed on their own at STEP are not started again, or None. One
        failing at the same step more than max_rank_restarts times is a bug, not bad luck."""
        if not on_their_own:
            return None
        first = on_their_own[0]
        hung = [peer for peer in on_their_own if not (peer.closed or peer.failed)]
        if hung:
            self.hung = sorted(peer.rank for peer in hung)
            return ("%s sent nothing while its node's other ranks live on: a hung process is "
                    "not started again beside itself" % hung[0])
        if self.restart is None or not self.max_rank_restarts:
            return ("%s failed on its own while its node's other ranks live on "
                    "(XSCALE_MAX_RANK_RESTARTS=0: no rank is started again)" % first)
        for peer in on_their_own:
            tries = self.own_failures.setdefault((self._launch_rank(peer.rank), step), [])
            tries.append(peer.failed or "its process ended")
            if len(tries) > self.max_rank_restarts:
                return ("%s failed %d times at step %s (XSCALE_MAX_RANK_RESTARTS=%d): a bug, "
                        "not bad luck; the first time: %s" % (peer, len(tries), step,
                                                              self.max_rank_restarts, tries[0]))
        return None

    def _shrink_refusal(self, survivors, restarted):
        """Why the survivors cannot go on as a smaller world, or None."""
        nodes = {peer.node for peer in survivors}
        unable = [peer for peer in survivors if not peer.shrinks]
        if unable:
            return ("%s cannot go on in a smaller world (only a DDP model under xscale.Loop or "
                    "XscaleTrainer deals a step's batch over fewer ranks)" % unable[0])
        if survivors[0].rank != 0:
            return "rank 0 was lost with it (its log and summary are the run's)"
        if restarted:
            return "a rank failed on its own at the same time"
        if len(nodes) < self.min_nodes:
            return "%d node%s would be left, fewer than XSCALE_MIN_NODES=%d" % (
                len(nodes), "" if len(nodes) == 1 else "s", self.min_nodes)
        return None

    def _shrink(self, survivors):
        """The survivors become the whole world, renumbered in their order; returns their
        numbers before. The next Join tells each rank its place (the launch's numbers, in rank
        order: a rank knows itself by those)."""
        with self.changed:
            before = [peer.rank for peer in survivors]
            self._take_layout({self._launch_rank(peer.rank): peer for peer in survivors})
        return before

    def _take_layout(self, by_launch):
        """The world becomes BY_LAUNCH's ranks ({launch's number: Peer}), numbered in the
        launch's order. Called with the lock held."""
        self.layout = sorted(by_launch)
        self.peers = {}
        for rank, launch_rank in enumerate(self.layout):
            peer = by_launch[launch_rank]
            peer.rank, peer.last_beat = rank, self.now()
            self.peers[rank] = peer
        self.world_size = len(self.layout)
        self.changed.notify_all()

    def _launch_rank(self, rank):
        """RANK as the launch numbered it (the same, unless the world shrank)."""
        return rank if self.layout is None else self.layout[rank]

    def _not_live(self):
        """Why the ranks' training cannot be recovered live, or None: every rank must be in a
        loop that can leave a broken step (it said Live). A rank that said why not is named
        with its words; it also said so as the run started (xscale.recovery.live.for_loop)."""
        with self.changed:
            peers = sorted(self.peers.values(), key=lambda peer: peer.rank)
        for peer in peers:
            if not peer.live:
                return "%s cannot be recovered live: %s" % (peer, peer.not_live or (
                    "it is not (or not yet) in a loop that live recovery can re-enter "
                    "(xscale.Loop or XscaleTrainer with a torch DDP model)"))
        return None

    def _host_store(self, host, generation):
        """The address of the store HOST makes for GENERATION's group; None if none came. One
        it made for an earlier group is not this one: the rank closes it as it makes the new
        one, and a Join naming it would send the ranks to a store that is going away."""
        with self.changed:
            host.store = None
        host.send(contract.HostStore(generation=generation))
        with self.changed:
            self.changed.wait_for(lambda: host.store is not None or host.closed,
                                  timeout=STORE_TIMEOUT_S)
            return host.store

    def _form(self, generation, store, source, started, nodes):
        """Join for GENERATION, on NODES nodes, to every rank of it; when all have joined, or
        None (a fallback)."""
        join = contract.Join(generation=generation, store=store, source=source,
                             ranks=self.layout, nodes=nodes)
        with self.changed:
            self.generation, self.join = generation, join
            ready = [peer for peer in self.peers.values() if peer.generation == generation
                     or peer.left == generation - 1]
        for peer in ready:
            peer.send(join)
        with self.changed:
            done = self.changed.wait_for(
                lambda: len(self.peers) == self.world_size and all(
                    peer.joined == generation for peer in self.peers.values()),
                timeout=JOIN_TIMEOUT_S)
            self.join = None
            if done:
                self.formed = generation
            # The group is whole: a failure from here on is a new one, recovered in its turn
            # (a rank started again that fails at once, as a bug would have it).
            self.recovering = not done
            self.changed.notify_all()  # a grow waiting for the recovery's end goes on
        if not done:
            self.fall_back("the ranks started on %s did not join within %.0f s"
                            % (", ".join(str(place) for place in started), JOIN_TIMEOUT_S))
            return None
        return self.now()

    # ---- a smaller world grows back ------------------------------------------------------

    def grow(self, ranks, start, node):
        """Take the launch's RANKS, which a smaller world went on without, back into the
        training: START(generation) starts them on NODE (one the job holds again) into that
        generation; once each has said Hello, a recovery that came meanwhile is over and every
        rank of the generation steps in it, every rank leaves its generation and the next
        forms with them. GROWN, or BUSY (a recovery is under way: try again), or FAILED (they
        did not come, or the training ended; the world stays as it is)."""
        with self.changed:
            if self.recovering or self.fallen_back or self.layout is None \
                    or set(ranks) & set(self.layout):
                return BUSY
            self.arriving, self.grow_failed = dict.fromkeys(ranks), None
            generation = self.generation
        say("live recovery: %s is the training's again: %s there" % (node, ranks_start(ranks)))
        start(generation + 1)
        if not self._arrivals():
            return FAILED
        generation = self.generation  # a recovery may have come while they started
        noticed, noticed_at = self.now(), time.time()
        say("live recovery: every rank leaves generation %d, and the next forms with them"
            % generation)
        self._send_all(contract.Abort(generation=generation))
        survivors, lost = self._leavers(generation, noticed + LEAVE_WINDOW_S)
        if lost and not survivors and all(peer is not None and peer.bye for peer in lost):
            return self._too_late(node)  # every rank ended its training meanwhile
        if lost:
            self.fall_back("%s did not leave generation %d as %s joined" % (
                lost[0] or "a rank", generation, node))
            return FAILED
        before = self.world_size
        host = self._grown(survivors)
        launched = self.now()
        store = self._host_store(host, generation + 1)
        if store is None:
            self.fall_back("%s did not host the new group's store" % host)
            return FAILED
        nodes = len({peer.node for peer in self.peers.values()})
        joined = self._form(generation + 1, store, host.rank, [node], nodes)
        if joined is None:
            return FAILED
        smaller = self.world_size < self.launch_world
        with self.changed:
            self.recoveries.append({
                "generation": generation + 1, "why": "%s is the training's again" % node,
                "lost": [], "spares": [], "restarted": [], "ranks": sorted(ranks),
                "blamed": [], "grown": [node], "world_size": self.world_size,
                "smaller": smaller, "noticed": round(noticed_at, 3),
                "left_s": round(launched - noticed, 3), "joined_s": round(joined - noticed, 3)})
        say("live recovery: %d ranks on %d nodes%s (%d before); the group re-formed %.1f s "
            "after every rank was told to leave (generation %d)" % (
                self.world_size, nodes, "" if smaller else ", the launch's world again", before,
                joined - noticed, generation + 1))
        return GROWN

    def _arrivals(self):
        """Whether every rank of the grow under way said Hello, with no recovery under way (a
        recovery that came meanwhile is waited for) and every rank of the generation stepping
        in it: the grow goes on, as a recovery. If not, it is given up (the ranks that came are
        dismissed: they exit)."""
        def over():
            return any(peer.bye for peer in self.peers.values())

        def stepping():
            return all(peer.stepping == self.generation for peer in self.peers.values())

        def ready():
            return all(self.arriving.values()) and not self.recovering and stepping()

        with self.changed:
            self.changed.wait_for(lambda: ready() or self.grow_failed or self.fallen_back
                                  or over(), timeout=JOIN_TIMEOUT_S)
            if ready() and not (self.grow_failed or self.fallen_back or over()):
                self.recovering = True  # a failure from here on ends live recovery
                return True
            if self.grow_failed:
                why = self.grow_failed
            elif over():
                why = "the training is over"
            elif self.fallen_back:
                why = "the launch fell back"
            elif not stepping():
                why = "the training did not step within %.0f s" % JOIN_TIMEOUT_S
            else:
                why = "they did not start within %.0f s" % JOIN_TIMEOUT_S
        self._dismiss_arrivals("the training did not take this node back")
        say("live recovery: the lost ranks did not come back (%s); the training goes on as it "
            "is" % why)
        return False

    def _too_late(self, node):
        """The training ended as NODE's ranks were to join: they are dismissed."""
        with self.changed:
            self.recovering = False
        self._dismiss_arrivals("the training ended as this node joined")
        say("live recovery: the training ended as %s was to join" % node)
        return FAILED

    def _dismiss_arrivals(self, why):
        """The grow under way is given up: the ranks that came exit (DISMISS, for WHY)."""
        with self.changed:
            came = [peer for peer in self.arriving.values() if peer is not None]
            self.arriving = {}
        for peer in came:
            peer.send(contract.Dismiss(why=why))

    def abandon_grow(self, why):
        """The ranks of the grow under way will not come (their srun ended), for WHY."""
        with self.changed:
            if self.arriving:
                self.grow_failed = why
                self.changed.notify_all()

    def _grown(self, survivors):
        """The survivors and the ranks that came back become the world, in the launch's numbers
        (a rank knows itself by those); returns the rank that hosts the next group's store, the
        lowest survivor (rank 0: a smaller world keeps it)."""
        with self.changed:
            by_launch = {self.layout[peer.rank]: peer for peer in survivors}
            for peer in self.arriving.values():
                peer.generation = self.generation + 1  # (a recovery may have come meanwhile)
            by_launch.update(self.arriving)
            self.arriving = {}
            self._take_layout(by_launch)
        return survivors[0]

    def fall_back(self, why):
        with self.changed:
            if self.fallen_back:
                return
            self.fallen_back = True
            if self.recovering:
                self.unrecovered = list(self.losing)
            self.changed.notify_all()
        say("live recovery: not possible: %s; the launch ends, and the usual restart or "
            "requeue follows" % why)
        self._send_all(contract.Fallback(why=why))
        self.give_up(why)

    def _send_all(self, message):
        with self.changed:
            peers = [peer for peer in self.peers.values() if not peer.closed]
        for peer in peers:
            peer.send(message)

    def saved(self):
        """The recoveries, as the launch's records keep them."""
        with self.changed:
            return json.loads(json.dumps(self.recoveries))


def tail_lines(handle, size):
    """The whole lines of the last SIZE bytes of HANDLE (a file opened in binary), as text."""
    handle.seek(0, os.SEEK_END)
    start = max(handle.tell() - size, 0)
    handle.seek(start)
    data = handle.read()
    if start:
        data = data.partition(b"\n")[2]  # the first line, cut
    return data.decode(errors="replace").split("\n")  # as a file's lines: only at newlines


def newer(path, than):
    """Whether PATH was written after THAN (False when either is not there)."""
    try:
        return os.stat(path).st_mtime >= os.stat(than).st_mtime
    except OSError:
        return False


def went_smaller(survivors, lost_nodes, before):
    """What a shrink changed, for the job's output: the SURVIVORS go on without LOST_NODES, and
    were the ranks numbered BEFORE."""
    nodes = len({peer.node for peer in survivors})
    return "%d ranks on %d node%s go on without %s (ranks %s before)" % (
        len(survivors), nodes, "" if nodes == 1 else "s", hostlist.compress(lost_nodes),
        ",".join(str(rank) for rank in before))


def end_step(srun):
    """End SRUN and every task of its step: srun ends the step on a second SIGINT within a
    second (srun(1), "Signals and escape sequences"); the pause keeps the two signals apart (a
    signal pending twice is delivered once)."""
    if srun.poll() is None:
        for _ in range(2):
            srun.send_signal(signal.SIGINT)
            time.sleep(0.1)


def ranks_start(ranks):
    """'rank 2 starts' or 'ranks 2,3 start'."""
    return "rank%s %s start%s" % ("s" if len(ranks) > 1 else "",
                                  ",".join(str(rank) for rank in ranks),
                                  "" if len(ranks) > 1 else "s")


def what_changed(spares, lost_nodes, restarted):
    """A recovery's new processes, in words."""
    parts = []
    if spares:
        parts.append("%s in place of %s" % (hostlist.compress(spares),
                                            hostlist.compress(lost_nodes)))
    if restarted:
        parts.append("rank%s %s started again on %s node" % (
            "s" if len(restarted) > 1 else "", ",".join(str(rank) for rank in restarted),
            "their" if len(restarted) > 1 else "its"))
    return "; ".join(parts)


# ---- one launch under live recovery (supervisor.py) ------------------------------------------

END_GRACE_S = 10.0  # after every rank ended: how long the launch's srun may wait for lost tasks
HANG_READ_S = 60.0  # for the hang watch to read a hung rank's stack (settle, then py-spy)
# What the blame check reads of the launch's log: its end, where a rank that just failed left
# its last lines. The whole of a long run's log is read in seconds (2.3 s for 39 MB here), and
# the check lies on the recovery's path.
BLAME_TAIL_BYTES = 8 << 20


class LiveLaunch:
    """Live recovery for one launch: its coordinator, and the replacements it starts on spare
    nodes of ALLOCATION (jobs/lib/allocation.py) or, for a rank that failed on its own, on its
    node, with LINE (the launch's LaunchLine), their output to the job's and to LOG. PATTERNS:
    the lines that blame a node (jobs/lib/blame): a rank is not started again on a node they
    blame. GROW_JOB: the job's id, when a smaller world asks the queue for nodes to grow back
    with (jobs/lib/grow_back.py); None: it stays smaller."""

    def __init__(self, allocation, line, log, heartbeat_s, max_rank_restarts, patterns,
                 min_nodes=0, grow_job=None):
        self.allocation, self.line, self.log = allocation, line, log
        self.patterns = patterns
        self.node_jobs = grow_back.NodeJobs(grow_job) if grow_job else None
        self.in_job = {}  # a node's index -> the node job whose node took its place
        self.growing = None  # the index of the node whose ranks a grow under way starts
        self.ended = threading.Event()
        self.replacements = {}  # a node's index or a rank -> its newest replacement's srun
        self.every_replacement = []  # every replacement's srun, the newest's included
        self.launch_env = {}
        self.main = None  # the launch's srun, once started
        world_size = len(allocation.launch_nodes) * allocation.per_node
        self.coordinator = Coordinator(world_size, self._replace, self._give_up, heartbeat_s,
                                       self._restart, max_rank_restarts, min_nodes=min_nodes,
                                       blamed=self._blamed)

    def start(self):
        self.coordinator.start()
        threading.Thread(target=self._end_when_done, daemon=True).start()

    def environment(self):
        return {contract.RECOVERY_VAR: self.coordinator.address}

    def launch_line(self, placed):
        """The launch's srun keeps its healthy tasks when a node fails (--no-kill) or a task
        ends (--kill-on-bad-exit=0, whatever the template said): the coordinator decides."""
        options = [option for option in placed.options
                   if not option.startswith("--kill-on-bad-exit")]
        return type(placed)(placed.command, options + ["--no-kill", "--kill-on-bad-exit=0"],
                            placed.image, placed.binds, placed.entrypoint, placed.runtime,
                            placed.placement)

    def _replace(self, lost_nodes, generation):
        if len(self.allocation.spares_left()) < len(lost_nodes):
            self.allocation.excluded.update(lost_nodes)
            self._ask_for_nodes(lost_nodes)
            return None  # none started: the ranks left may go on without them
        self._clear_flight_records()
        spares = []
        for node in lost_nodes:
            index = self.allocation.launch_nodes.index(node)
            spare = self.allocation.replace_live(node)
            if spare is None:
                return None
            say("live recovery: the ranks of %s start again on %s" % (node, spare))
            self._start_node(index, "the ranks of " + node,
                             self.line.on(1, self.allocation.per_node, spare, overlap=True),
                             generation)
            spares.append(spare)
        return spares

    def _start_node(self, index, what, line, generation):
        """The ranks of the launch's node INDEX (WHAT, in words) started with LINE, into
        GENERATION."""
        env = dict(self.launch_env, **{
            contract.REPLACEMENT_VAR: "%d/%d" % (index, len(self.allocation.launch_nodes)),
            contract.JOIN_VAR: str(generation)})
        per_node = self.allocation.per_node
        for rank in range(index * per_node, (index + 1) * per_node):
            self.replacements.pop(("rank", rank), None)  # a rank started again there, lost too
        self._start(index, what, line.argv(), env, index * per_node, generation)

    # ---- a smaller world grows back (jobs/lib/grow_back.py) ---------------------------------

    def _ask_for_nodes(self, lost_nodes):
        """A node job for each of LOST_NODES, which the world goes on without; the first
        starts the watch that takes their nodes back."""
        if self.node_jobs is None:
            return
        first = not self.node_jobs.held
        for node in lost_nodes:
            self.node_jobs.ask(self.allocation.launch_nodes.index(node), node)
        if first and self.node_jobs.held:
            threading.Thread(target=self._watch_node_jobs, daemon=True).start()

    def _watch_node_jobs(self):
        """Each node job that runs: its node takes a lost one's place and ranks (BUSY: once
        the recovery under way is over; FAILED: its job is cancelled)."""
        while not (self.ended.wait(grow_back.POLL_S) or self.coordinator.fallen_back):
            for job, index, node in self.node_jobs.running():
                outcome = self._grow(job, index, node)
                if outcome == GROWN:
                    self.node_jobs.taken(job)
                elif outcome == FAILED:
                    self.node_jobs.cancel([job])

    def _grow(self, job, index, node):
        """The ranks of the launch's node INDEX, lost, start on NODE in node job JOB and join;
        how it ended (Coordinator.grow). Not grown, a step they started is ended."""
        per_node = self.allocation.per_node
        lost = self.allocation.launch_nodes[index]

        def start(generation):
            self.growing = index
            say("live recovery: the ranks of %s start again on %s (job %s)" % (lost, node, job))
            self._start_node(index, "the ranks of %s" % lost,
                             self.line.on(1, per_node, node, overlap=False).in_job(job),
                             generation)

        outcome = self.coordinator.grow(list(range(index * per_node, (index + 1) * per_node)),
                                        start, node)
        if outcome == GROWN:
            self.allocation.launch_nodes[index] = node
            self.in_job[index] = job
        elif self.growing is not None:
            end_step(self.replacements.pop(index))  # its ranks are not the training's
        self.growing = None
        return outcome

    def _restart(self, ranks, generation):
        """Start each of RANKS again on its own node, into GENERATION, alone in a step beside
        the launch's; None. (Its node is not blamed: the coordinator asked first. A line that
        blames it arriving later has it fail again there, and its node is then lost.)"""
        per_node, nodes = self.allocation.per_node, self.allocation.launch_nodes
        self._clear_flight_records()
        for rank in ranks:
            index, local_rank = divmod(rank, per_node)
            line = self.line.one_rank(nodes[index], local_rank)
            if index in self.in_job:  # its node stands in for a lost one (grow_back.py)
                line = line.in_job(self.in_job[index])
            env = dict(self.launch_env, **{
                contract.REPLACEMENT_VAR: "%d/%d:%d/%d" % (index, len(nodes), local_rank,
                                                           per_node),
                contract.JOIN_VAR: str(generation)})
            say("live recovery: rank %d starts again on %s, its node" % (rank, nodes[index]))
            self._start(("rank", rank), "rank %d" % rank, line.argv(), env, rank, generation)
        return None

    def _clear_flight_records(self):
        """The survivors' flight records of a failure recovered from: a later one's are its
        own (python/xscale/observe/flight.py, jobs/lib/hangs.py)."""
        fr_dir = contract.launch_file(self.log, contract.FLIGHT_RECORDS)
        for name in hangs.names_in(fr_dir):
            if name.startswith(contract.RECORD_PREFIX) or name == contract.RELEASED:
                try:
                    os.remove(os.path.join(fr_dir, name))
                except OSError:
                    pass

    def _blamed(self, nodes):
        """{node: why} for the nodes of NODES that are no place to start a rank again: a line
        of the launch's output blames them (the quick health check: a node whose other ranks
        answered runs, but a bad GPU there fails the rank started again)."""
        try:
            with open(self.log, "rb") as handle:
                log = failure_report.StepLog(tail_lines(handle, BLAME_TAIL_BYTES))
        except OSError:
            return {}
        blamed = {}
        for blame in failure_report.pattern_blames(log, self.patterns, nodes,
                                                   self.allocation.launch_placement()):
            # Not the line itself: the dismissed ranks repeat these words, and would match.
            blamed.setdefault(blame.node, "%s is blamed by a line of its ranks' output (%s)" % (
                blame.node, blame.reason.partition(": ")[0]))
        return blamed

    def _start(self, place, what, argv, env, first_rank, generation):
        """A replacement's srun (ARGV), its task 0 the launch's FIRST_RANK, its ranks joining
        GENERATION: its output to the job's and to the launch's log, in the launch's rank
        numbers."""
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        log = open(self.log, "ab")
        threading.Thread(target=launches.copy_output, args=(proc.stdout, log),
                         kwargs={"first_rank": first_rank}, daemon=True).start()
        self.replacements[place] = proc
        self.every_replacement.append(proc)
        threading.Thread(target=self._watch_replacement, args=(proc, place, what, generation),
                         daemon=True).start()

    def _watch_replacement(self, proc, place, what, generation):
        """A replacement that ends before its ranks joined GENERATION (no image there, no
        space, a bad node) is a fallback at once, not after JOIN_TIMEOUT_S. One that joined
        and failed later is a failure like any rank's, which its link's end told."""
        status = proc.wait()
        if status == 0 or self.replacements.get(place) is not proc \
                or self.coordinator.formed >= generation:
            return
        why = "%s, started again, ended with status %d before it joined" % (what, status)
        if self.coordinator.recovering:
            self.coordinator.fall_back(why)
        elif place == self.growing:
            self.coordinator.abandon_grow(why)  # before its ranks came: the world stays smaller

    def started(self, proc):
        self.main = proc

    def srun_said(self, line):
        """A line of the launch's srun. A task that ended with an error and whose rank never
        reached the coordinator (a script that does not start through xscale) has nobody to
        recover it, and its peers may wait in a collective until its timeout: the launch ends,
        as the template's --kill-on-bad-exit would have ended it."""
        ended = failure_report.TASK_EXIT.match(line)
        if not ended or self.coordinator.fallen_back:
            return
        ranks = hostlist.expand_numbers(ended.group("ranks"))
        strangers = [rank for rank in ranks if rank not in self.coordinator.met]
        if strangers:
            self.coordinator.fall_back("rank %d ended (%s) and never reached the coordinator "
                                       "(not started through xscale)"
                                       % (strangers[0], ended.group("how").strip()))

    def _tell_hang_watch(self, ranks):
        """The hung RANKS, for the hang watch (which reads their stacks, then releases) and the
        report; returns once the watch has released, or after HANG_READ_S."""
        fr_dir = contract.launch_file(self.log, contract.FLIGHT_RECORDS)
        verdict = os.path.join(fr_dir, contract.HUNG)
        try:
            with open(verdict, "w") as handle:
                json.dump(ranks, handle)
        except OSError:
            return
        released = os.path.join(fr_dir, contract.RELEASED)
        deadline = time.monotonic() + HANG_READ_S
        while time.monotonic() < deadline and not newer(released, verdict):
            time.sleep(WATCH_EVERY_S)

    def _give_up(self, why):
        """The ranks exit on Fallback; the launch ends with them, as a failed one does."""
        threading.Thread(target=self._end_after_fallback, daemon=True).start()

    def _end_after_fallback(self):
        """With --kill-on-bad-exit=0 the launch's srun waits for every task: a rank hung on a
        node whose other ranks have ended (a stopped process holds no connection closed), and
        ranks that never reached the coordinator (they never heard the Fallback), would keep it
        waiting for good. Once every rank that can has ended, or END_GRACE_S on, such a launch
        is ended, as --kill-on-bad-exit would have ended it; with a hung rank, after the hang
        watch has read its stack (jobs/lib/hangs.py). A node lost whole is Slurm's to declare
        failed: srun then ends with its report of the node."""
        coordinator = self.coordinator
        if coordinator.hung:
            self._tell_hang_watch(coordinator.hung)
        with coordinator.changed:
            coordinator.changed.wait_for(lambda: all(
                peer.closed for peer in coordinator.peers.values()), timeout=END_GRACE_S)
            peers = list(coordinator.peers.values())
        running = {peer.node for peer in peers if peer.closed}
        stuck = [peer for peer in peers if not peer.closed and peer.node in running]
        if stuck or len(peers) < coordinator.world_size:
            say("live recovery: %s; ending the launch's step" % (
                "%s has not ended" % stuck[0] if stuck else
                "%d ranks never reached the coordinator" % (coordinator.world_size - len(peers))))
            if self.main is not None:
                end_step(self.main)

    def _end_when_done(self):
        """Once every rank has ended its training, the launch's srun may still wait for the
        tasks of a lost node (a frozen one's never end): it is ended."""
        while not self.coordinator.finished(WATCH_EVERY_S):
            pass
        time.sleep(END_GRACE_S)
        if self.main is not None and self.main.poll() is None and self.coordinator.recoveries:
            say("live recovery: every rank has ended; the launch's srun still waits for the "
                "lost node's tasks: ending it")
            self.main.kill()

    def end(self, status):
        """The launch's status once the srun ended: 0 when, after live recoveries, every rank
        ended its training (the lost tasks' status says nothing more), else STATUS."""
        for proc in self.every_replacement:
            proc.wait()
        self.ended.set()
        if self.node_jobs is not None:
            self.node_jobs.cancel()
        self.coordinator.stop()
        if self.coordinator.recoveries and self.coordinator.finished(wait_s=5.0) \
                and all(proc.returncode == 0 for proc in self.replacements.values()):
            return 0  # a rank started again and failed again was started once more
        return status

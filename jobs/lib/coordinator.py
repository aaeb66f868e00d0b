"""Live recovery's coordinator, on the batch host: when a node of the launch fails, its healthy
ranks keep their processes, a spare node takes the lost node's ranks, and training goes on
(docs/FAILURES.md, "Live recovery").

The ranks (python/xscale/recovery/) connect to it as they start (contract.RECOVERY_VAR) and
speak the messages contract.py types. A failure is noticed three ways: a rank whose collective
failed says Broken; a rank's connection closes without Bye (its process died); a rank sends no
Beat for XSCALE_HEARTBEAT_S (a frozen node, which sends nothing at all). Then, in order:

1. Abort to every rank: each leaves the broken group at once, not at its collective timeout,
   keeping everything it holds, and says Left. A rank that has not within LEAVE_WINDOW_S is
   lost with the others.
2. The lost ranks must be whole nodes, every rank live (xscale.Loop with DDP: it can re-enter
   its loop), and a spare must be left: `replace(nodes, generation)` (the supervisor's) launches
   the lost nodes' ranks on spares, with the lost nodes' rank numbers.
3. HostStore to the lowest surviving rank, which answers with its new store's address; Join to
   every rank of the next generation, the replacements as they arrive: the group re-forms there,
   and the replacements get the training state from that rank.
4. Once every rank has Joined, training is under way again; the recovery is noted.

Anything else (a rank's own error, a lost rank whose node lives on, a failure during a recovery,
no spare left, a replacement that does not join within JOIN_TIMEOUT_S) is a Fallback: every
rank exits, `give_up()` ends the launch, and the supervisor does what it does without live
recovery (docs/FAILURES.md: report, restart on a spare, or requeue).

The batch host is the allocation's first node: if it fails, the job fails with it, so the
coordinator's own loss costs nothing more. One connection per rank; a machine of 10,000s of
ranks would want one relay per node in front of it.

Standard library only, Python 3.6: the batch host's system Python.
"""

import json
import socket
import socketserver
import subprocess
import threading
import time

from shared import contract, hostlist, say

LEAVE_WINDOW_S = 5.0  # after Abort, for every rank that lives to say Left
STORE_TIMEOUT_S = 30.0  # for the store's address from the rank that hosts it
JOIN_TIMEOUT_S = 300.0  # for a replacement to start (its container, `import torch`) and join
WATCH_EVERY_S = 1.0  # how often heartbeats are checked


class Peer:
    """One rank's process, as its connection tells of it."""

    def __init__(self, connection, rank, node, pid, generation, now):
        self.connection, self.rank, self.node, self.pid = connection, rank, node, pid
        self.generation = generation
        self.last_beat = now
        self.live = self.bye = self.closed = self.lost = False
        self.not_live = None  # why its training cannot be recovered live, as it said
        self.left = self.joined = None  # the generation it last left, and joined
        self.send_lock = threading.Lock()

    def send(self, message):
        try:
            with self.send_lock:
                self.connection.sendall(contract.encode(message))
        except OSError:
            pass  # its end shows as a closed connection

    def __repr__(self):
        return "rank %d on %s" % (self.rank, self.node)


class Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class Handler(socketserver.StreamRequestHandler):
    def handle(self):
        self.server.coordinator.serve(self.connection, self.rfile)


class Coordinator:
    """WORLD_SIZE ranks, PER_NODE on each node. replace(nodes, generation): launch the ranks of
    NODES on spares, into GENERATION; the spares, or None when none are left. give_up(why): end
    the launch (the fallback). heartbeat_s: how long a rank may be silent."""

    def __init__(self, world_size, replace, give_up, heartbeat_s, now=time.monotonic):
        self.world_size, self.replace, self.give_up = world_size, replace, give_up
        self.heartbeat_s, self.now = heartbeat_s, now
        self.peers = {}  # rank -> Peer: the current process of each rank
        self.generation = 0
        self.join = None  # the Join of the generation being formed
        self.recovering = self.fallen_back = False
        self.recoveries = []  # what each recovery took, for the records
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
        peer = Peer(connection, int(hello.rank), str(hello.node), hello.pid,
                    int(hello.generation), self.now())
        with self.changed:
            self.peers[peer.rank] = peer  # a replacement takes its rank's place
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
                peer.live = True
            elif isinstance(received, contract.NotLive):
                peer.not_live = received.why
            elif isinstance(received, contract.Left):
                peer.left = received.generation
            elif isinstance(received, contract.Joined):
                peer.joined = received.generation
            elif isinstance(received, contract.Store):
                peer.store = received.address
            elif isinstance(received, contract.Bye):
                peer.bye = True
            self.changed.notify_all()
        if isinstance(received, contract.Broken) and not peer.bye:  # after Bye: training is over
            self._failed("rank %d's collective failed (%s)" % (peer.rank, received.why),
                         received.generation)
        elif isinstance(received, contract.Failed):
            self.fall_back("rank %d on %s failed on its own: %s"
                            % (peer.rank, peer.node, received.why))

    def _closed(self, peer):
        with self.changed:
            peer.closed = True
            current = self.peers.get(peer.rank) is peer
            self.changed.notify_all()
        if current and not (peer.bye or peer.lost):
            self._failed("rank %d on %s (pid %s) is gone" % (peer.rank, peer.node, peer.pid),
                         peer.generation if peer.left is None else peer.left + 1)

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
        refusal = self._refusal(survivors, lost)
        if refusal:
            self.fall_back(refusal)
            return
        lost_nodes = sorted({peer.node for peer in lost})
        spares = self.replace(lost_nodes, generation + 1)
        if not spares:
            self.fall_back("no spare node is left for %s" % hostlist.compress(lost_nodes))
            return
        launched = self.now()
        store = self._host_store(survivors[0], generation + 1)
        if store is None:
            self.fall_back("%s did not host the new group's store" % survivors[0])
            return
        joined = self._form(generation + 1, store, survivors[0].rank, spares)
        if joined is None:
            return
        record = {"generation": generation + 1, "why": why, "lost": lost_nodes,
                  "spares": spares, "ranks": sorted(peer.rank for peer in lost),
                  "noticed": round(noticed_at, 3), "left_s": round(launched - noticed, 3),
                  "joined_s": round(joined - noticed, 3)}
        with self.changed:
            self.recoveries.append(record)
            self.recovering = False
        say("live recovery: %s in place of %s; the group re-formed %.1f s after the failure "
            "was noticed (generation %d)" % (hostlist.compress(spares),
                                            hostlist.compress(lost_nodes), joined - noticed,
                                            generation + 1))

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
        lost_nodes = {peer.node for peer in lost}
        alive = [peer for peer in survivors if peer.node in lost_nodes]
        if alive:
            return ("%s lives on while other ranks of its node were lost: a process failed, "
                    "not its node" % alive[0])
        return None

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
                    "(xscale.Loop with a torch DDP model)"))
        return None

    def _host_store(self, host, generation):
        host.send(contract.HostStore(generation=generation))
        with self.changed:
            self.changed.wait_for(lambda: getattr(host, "store", None) is not None
                                  or host.closed, timeout=STORE_TIMEOUT_S)
            return getattr(host, "store", None)

    def _form(self, generation, store, source, spares):
        """Join for GENERATION to every rank of it; when all have joined, or None (a fallback)."""
        join = contract.Join(generation=generation, store=store, source=source)
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
        if not done:
            self.fall_back("the replacement ranks on %s did not join within %.0f s"
                            % (hostlist.compress(spares), JOIN_TIMEOUT_S))
            return None
        return self.now()

    def fall_back(self, why):
        with self.changed:
            if self.fallen_back:
                return
            self.fallen_back = True
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


# ---- one launch under live recovery (supervisor.py) ------------------------------------------

END_GRACE_S = 10.0  # after every rank ended: how long the launch's srun may wait for lost tasks


class LiveLaunch:
    """Live recovery for one launch: its coordinator, and the replacements it starts on spare
    nodes of ALLOCATION (jobs/lib/allocation.py) with LINE (the launch's LaunchLine), their
    output to the job's and to LOG."""

    def __init__(self, allocation, line, log, heartbeat_s):
        self.allocation, self.line, self.log = allocation, line, log
        self.replacements = []
        self.launch_env = {}
        self.main = None  # the launch's srun, once started
        world_size = len(allocation.launch_nodes) * allocation.per_node
        self.coordinator = Coordinator(world_size, self._replace, self._give_up, heartbeat_s)

    def start(self):
        self.coordinator.start()
        threading.Thread(target=self._end_when_done, daemon=True).start()

    def environment(self):
        return {contract.RECOVERY_VAR: self.coordinator.address}

    def launch_line(self, placed):
        """The launch's srun keeps its healthy tasks when a node fails (--no-kill); a task that
        fails on its own still ends the step (the template's --kill-on-bad-exit)."""
        return type(placed)(placed.command, placed.options + ["--no-kill"], placed.image,
                            placed.binds, placed.entrypoint, placed.runtime, placed.placement)

    def _replace(self, lost_nodes, generation):
        spares = []
        for node in lost_nodes:
            index = self.allocation.launch_nodes.index(node)
            spare = self.allocation.replace_live(node)
            if spare is None:
                return None
            line = self.line.on(1, self.allocation.per_node, spare, overlap=True)
            env = dict(self.launch_env, **{
                contract.REPLACEMENT_VAR: "%d/%d" % (index, len(self.allocation.launch_nodes)),
                contract.JOIN_VAR: str(generation)})
            say("live recovery: the ranks of %s start again on %s" % (node, spare))
            self.replacements.append(self._start(line.argv(), env))
            spares.append(spare)
        return spares

    def _start(self, argv, env):
        import launches  # the supervisor's, imported here: it imports nothing of this file
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        log = open(self.log, "ab")
        threading.Thread(target=launches.copy_output, args=(proc.stdout, log),
                         daemon=True).start()
        threading.Thread(target=self._watch_replacement, args=(proc, env), daemon=True).start()
        return proc

    def _watch_replacement(self, proc, env):
        """A replacement that ends before its ranks joined (no image there, no space, a bad
        node) is a fallback at once, not after JOIN_TIMEOUT_S."""
        status = proc.wait()
        if status != 0 and self.coordinator.recovering:
            self.coordinator.fall_back("the replacement for node %s ended with status %d "
                                       "before its ranks joined"
                                       % (env[contract.REPLACEMENT_VAR], status))

    def started(self, proc):
        self.main = proc

    def _give_up(self, why):
        """The ranks exit on Fallback; the launch ends with them, as a failed one does."""

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
        for proc in self.replacements:
            proc.wait()
        self.coordinator.stop()
        if self.coordinator.recoveries and self.coordinator.finished(wait_s=5.0) \
                and all(proc.returncode == 0 for proc in self.replacements):
            return 0
        return status

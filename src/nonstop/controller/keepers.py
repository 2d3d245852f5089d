"""The controller's side of node memory: a keeper per node, where each keeper copies its ranks'
snapshots (``state.snapshot.replicas`` other nodes), disk checkpoints made complete once all
their parts are written, and emergency saves when the memory is about to be lost."""

from __future__ import annotations

import collections
import dataclasses
import secrets
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from ..decide.replicas import place as place_replicas
from ..protocol import keeper_messages as km
from ..state import checkpoint, wire
from ..state.memory import own
from .checkpoints import DiskCheckpoints
from .ports import Processes

CONNECT_S = 60.0  # a new keeper has this long to listen: a bare Python start, well under 1 s
# alone, but 8 hosts starting together on 2 cores (16 torch imports) took over 15 s (bench scale)


KEEPER_GRACE_S = 1.0  # a node's memory is gone: its ranks dying within this long make it a lost node


class KeeperStartError(RuntimeError):
    """A node's memory did not start: the machine's trouble (too slow, out of memory), not a
    bug of nonstop's."""


@dataclasses.dataclass
class KeeperHandle:
    node: int
    name: str
    wid: int
    pid: int = 0
    link: Any = None  # requests, and what the keeper reports (parts written, replicas made)
    tcp: str | None = None  # where other nodes' keepers push replicas
    killed: bool = False  # ended by nonstop: its exit is not a fault
    lost: bool = False
    lost_at: float = 0.0
    retry_at: float = 0.0  # a new memory that could not be started is tried again from then
    exit_code: int | None = None  # its exit as its agent reported it (None: it stopped answering)


RESTART_RETRY_S = 30.0


class Keepers:
    """The controller's side of node memory (the ranks' side is ``state/memory.NodeMemory``): the
    keepers, where each copies its ranks' snapshots, disk checkpoints, emergency saves. Lives in
    the controller's loop."""

    def __init__(self, policy: Any, agent: Processes, log: Any, display: Any, run_id: str,
                 new_wid: Callable[[], int]):
        cfg = policy.state
        self.enabled = cfg.snapshot.enabled
        self.copies = cfg.snapshot.replicas  # each snapshot on this many other nodes
        self.placed: dict[int, tuple[int, ...]] = {}  # node -> where its ranks' replicas go
        self._short: str | None = None  # why the placement falls short, as last said
        self.held: dict[int, int] = {}  # node -> bytes of other nodes' replicas in its memory
        self._held_said: dict[int, int] = {}
        self.emergency_cfg = cfg.emergency
        self.agent, self.log, self.display = agent, log, display
        self._new_wid = new_wid
        self._base = f"nonstop-{run_id}-{secrets.token_hex(4)}"
        self.keepers: dict[int, KeeperHandle] = {}
        self.disk = DiskCheckpoints(cfg.checkpoint, log, display, self._call, self._keeper_log)
        self.root = self.disk.root
        self.replicas = {"count": 0, "bytes": 0, "seconds": 0.0, "failures": 0}
        self.sharded: bool | None = None  # learnt from the ranks
        self.world = 0

    # == keepers =================================================================================
    def name(self, node: int) -> str | None:
        """The name of a node's memory; a node whose keeper is not started yet (a host that just
        joined) gets the name its keeper will have: a process started there now reaches it
        once it listens, instead of running without memory for its whole life."""
        if node in self.keepers:
            return self.keepers[node].name
        return f"{self._base}-n{node}" if self.enabled else None

    def node_of_wid(self, wid: int) -> int | None:
        for h in self.keepers.values():
            if h.wid == wid:
                return h.node
        return None

    def start(self, nodes: Iterable[int]) -> None:
        if not self.enabled:
            return
        if self.root is not None and not self.keepers:  # (later: parts being written now)
            checkpoint.clean_temp(self.root)
        started = [self._spawn(n) for n in nodes]
        for h in started:
            self._connect(h)
        self.log.write("keepers", nodes={str(h.node): {"pid": h.pid, "replicas_at": h.tcp}
                                         for h in started},
                       checkpoint_dir=str(self.root) if self.root else None)

    def _spawn(self, node: int) -> KeeperHandle:
        old = self.keepers.get(node)
        h = KeeperHandle(node, old.name if old else f"{self._base}-n{node}", self._new_wid())
        proc = self.agent.spawn_keeper(h.wid, node, h.name, writer=self.root is not None)
        h.pid = proc.pid
        self.keepers[node] = h
        return h

    def _connect(self, h: KeeperHandle) -> None:
        try:
            h.link = self.agent.keeper_link(h.node, h.name, time.time() + CONNECT_S)
        except TimeoutError:
            raise KeeperStartError(f"the keeper of node {h.node} did not start within "
                                   f"{CONNECT_S:g} s (see its log)") from None
        h.tcp = h.link.tcp

    def adopt(self, found: list[tuple[int, int, str]]) -> None:
        """Keepers another controller started (a takeover): (node, wid, name) of each alive."""
        if not self.enabled:
            return
        for node, wid, name in found:
            h = self.keepers[node] = KeeperHandle(node, name, wid)
            try:
                self._connect(h)
            except RuntimeError as exc:
                self.log.write("keeper_error", node=node, op="adopt", error=str(exc))
        self.log.write("keepers", nodes={str(h.node): {"wid": h.wid, "replicas_at": h.tcp}
                                         for h in self.keepers.values()}, adopted=True)

    def restart(self, node: int) -> None:
        """A node whose memory was lost keeps working: a new, empty memory."""
        h = self._spawn(node)
        try:
            self._connect(h)
        except RuntimeError:  # ended, lost: tried again later (see ``revive``)
            h.killed, h.lost, h.lost_at = True, True, time.time()
            h.retry_at = h.lost_at + RESTART_RETRY_S
            self.agent.signal(h.wid, signal.SIGKILL)
            raise
        self.log.write("keeper_restarted", node=node, pid=h.pid)

    def try_restart(self, node: int) -> bool:
        """``restart``; one that fails (its host is going too, or the keeper cannot start) is
        said, and the node trains on without memory until it is tried again."""
        try:
            self.restart(node)
            return True
        except RuntimeError as exc:
            self.log.write("keeper_error", node=node, op="restart", error=str(exc))
            return False

    def revive(self, now: float, occupied: Callable[[], set[int]], quiet: bool,
               node_of: Callable[[], dict[int, int]], usable: Callable[[], list[int]]) -> None:
        """A new, empty memory for each usable node that needs one: a node that lost only its
        memory (its ranks still run ``KEEPER_GRACE_S`` later, while the job trains with no
        incident open: ``quiet``; had they died too, the node is lost and the next decision
        moves them), or a node whose keeper nonstop ended where processes run again
        (``occupied()``). The job's view is asked for only when a lost memory is due (this
        runs every turn of the controller's loop)."""
        due = [h for h in self.keepers.values() if h.lost and now >= h.retry_at]
        if not due:
            return
        nodes, busy = usable(), occupied()
        for h in due:
            if h.node not in nodes:
                continue
            needed = (h.node in busy) if h.killed else (quiet and now - h.lost_at > KEEPER_GRACE_S)
            if needed and self.try_restart(h.node):
                self.configure(node_of(), nodes)

    def on_exit(self, wid: int, code: int | None) -> KeeperHandle | None:
        """A keeper ended; returns its handle (None: not a keeper)."""
        node = self.node_of_wid(wid)
        if node is None:
            return None
        h = self.keepers[node]
        if not h.lost:  # not already found gone by ``confirm``
            self._lost(h, code)
        return h

    def confirm(self, nodes: Iterable[int], timeout_s: float = 2.0) -> None:
        """Ask the keepers of ``nodes`` whether they still answer. A keeper killed with its node's
        ranks may still be freeing its memory when their exits are seen (a dying process holds
        its sockets until then): one whose connection ends is lost now, not after the decision.
        One that is only slow to answer is taken as alive."""
        for node in nodes:
            h = self.keepers.get(node)
            if h is not None and not h.lost and h.link is not None \
                    and not h.link.answers(timeout_s):
                self._lost(h, None)

    def _lost(self, h: KeeperHandle, code: int | None) -> None:
        h.lost, h.lost_at, h.exit_code = True, time.time(), code
        self.held.pop(h.node, None)  # the replicas it held are gone with it
        if h.link is not None:
            h.link.close()
        h.link = None
        self.log.write("node_memory_lost", node=h.node, code=code, killed=h.killed)

    def kill(self, node: int, reason: str) -> None:
        h = self.keepers.get(node)
        if h is not None and not h.lost:
            h.killed = True
            self.agent.signal(h.wid, signal.SIGKILL)
            self.log.write("keeper_killed", node=node, pid=h.pid, reason=reason)

    def configure(self, node_of: dict[int, int], usable: list[int]) -> None:
        """Tell each keeper where its ranks' snapshots go: ``copies`` other nodes, in failure
        domains other than its own and each other's where the labels allow
        (``decide/replicas.py``), placed again as nodes are lost or join. A placement that
        falls short (too few nodes or domains) is said once, until it changes. With a single
        node there is none: snapshots survive a rank's death, not the node's."""
        if not self.enabled:
            return
        live = [n for n in sorted(usable) if n in self.keepers and not self.keepers[n].lost]
        weights = collections.Counter(n for n in node_of.values() if n in live)
        domains = {n: self.agent.failure_domain(n) for n in live}
        placement = place_replicas(weights, domains, self.copies, self.placed)
        self.placed = placement.targets
        targets: dict[int, dict[str, list[str]]] = {n: {} for n in live}
        buddies: dict[str, list[int]] = {}
        for rank, node in sorted(node_of.items()):
            to = placement.targets.get(node, ())
            if node in targets and to:
                targets[node][own(rank)] = [self.keepers[t].tcp or "" for t in to]
                buddies[str(rank)] = list(to)
        for node, replicate in targets.items():
            self._call(node, km.Configure(replicate=replicate), wait=False)
        # a job of one node has no other to hold copies: nothing to say (what its snapshots
        # survive is said above); from two nodes on, a placement short of what was asked is
        if placement.short != self._short and placement.short is not None and len(live) > 1:
            self.display.warning(f"snapshot replicas: {placement.short}")
        elif self._short is not None and placement.short is None:  # (hosts joined)
            self.display.info(f"snapshot replicas: {self.copies} of each, in distinct failure "
                              "domains, as asked")
        self._short = placement.short
        self.log.write("replication", buddies=buddies, copies=self.copies,
                       domains={str(n): d for n, d in domains.items()}, short=placement.short)

    def _call(self, node: int, request: km.Request, wait: bool = True) -> Any:
        """A request to a node's keeper: its answer (``request.answer``), or None (the keeper
        is gone, or refused it: logged); ``wait=False``: sent, not waited for (a keeper on a
        host that is gone and not yet known to be must not hold up a recovery)."""
        h = self.keepers.get(node)
        if h is None or h.lost or h.link is None:
            return None
        try:
            return h.link.call(request) if wait else h.link.tell(request)
        except (OSError, ConnectionError, wire.KeeperError) as exc:
            self.log.write("keeper_error", node=node, op=request.op, error=str(exc))
            return None

    # == what the keepers report =================================================================
    def poll(self) -> None:
        """Take in what the keepers report; write again what is due. Raises CheckpointsFailing
        when the policy says the job must end for its checkpoints."""
        self.disk.retry_due()
        for h in list(self.keepers.values()):
            for raw in h.link.events() if h.link is not None else ():
                self._on_report(h.node, raw)
        if self.held != self._held_said:  # (once per turn: a burst of new replicas, one event)
            self._held_said = dict(self.held)
            self.log.write("replica_memory", copies=self.copies,
                           nodes={str(n): b for n, b in sorted(self.held.items())})
        self.disk.check_fatal()

    def _on_report(self, node: int, raw: Any) -> None:
        """One report of node ``node``'s keeper, as it came: one that is not a report this
        version of nonstop sends is logged (``keeper_error``, op ``report``) and passed over."""
        try:
            report = km.decode_report(raw)
        except km.BadKeeperMessage as exc:
            self.log.write("keeper_error", node=node, op="report",
                           error=f"a malformed report: {exc}")
            return
        match report:
            case km.Replicated():
                self.replicas["count"] += 1
                self.replicas["bytes"] += report.bytes
                self.replicas["seconds"] += report.seconds
            case km.ReplicationFailed():
                self.replicas["failures"] += 1
                self.log.write("replication_failed", node=node, holder=report.holder,
                               step=report.step, to=report.to, error=report.error)
            case km.ReplicationBehind():
                self.log.write("replication_behind", node=node, holder=report.holder,
                               step=report.step, to=report.to, waited_s=report.waited_s)
            case km.RequestFailed():  # a request nobody waited for (across hosts)
                self.log.write("keeper_error", node=node, op=report.op, error=report.error)
            case km.PartDone():
                self.disk.part_done(report.job, report.part, node)
            case km.PartFailed():
                self.disk.part_failed(node, report)
            case km.ReplicasHeld():
                self.held[node] = report.bytes
            case km.PeerRefused() | km.ReplicaRefused():
                pass  # the listener logs a peer refused; a replica refused is the sender's failure

    def _keeper_log(self, node: int) -> Path | None:
        h = self.keepers.get(node)
        proc = self.agent.procs.get(h.wid) if h is not None else None
        return None if proc is None else proc.log_path

    def settled(self, step: int | None) -> bool:
        """Whether the last step's checkpoint is written or given up. A node whose memory is gone
        (and is not restarted once training has completed) can write no part of it: the step
        is given up at once rather than waited for until ``timeouts.finish_s``."""
        if step is not None and not self.disk.settled(step):
            now = time.time()
            gone = sorted(n for n, h in self.keepers.items()
                          if h.lost and now - h.lost_at > KEEPER_GRACE_S)
            if gone:
                self.disk.unwritable(step, f"node(s) {', '.join(map(str, gone))} lost their "
                                           "memory (keeper) as training ended")
        return self.disk.settled(step)

    def wait(self, step: int, deadline: float, tick: Callable[[], None]) -> bool:
        self.disk.waiting = True
        try:
            while not self.disk.settled(step) and time.time() < deadline:
                tick()
                self.poll()
        finally:
            self.disk.waiting = False
        return step in self.disk.completed

    # == emergency saves =========================================================================
    def emergency(self, reason: str, faulty: set[int], kill_node: Callable[[int], None],
                  wait_s: float | None, tick: Callable[[], None]) -> dict[str, Any]:
        """Persist the newest snapshot every rank has in healthy memory. A faulty node whose state
        is held elsewhere writes nothing and is shut down at once. With ``wait_s``, return once
        the checkpoint is complete (or that long has passed)."""
        record: dict[str, Any] = {"reason": reason, "faulty": sorted(faulty)}
        if self.root is None or not self.enabled or self.sharded is None or not self.world:
            record["skipped"] = "no checkpoint directory" if self.root is None else "no state"
            self.log.write("emergency_checkpoint", **record)
            return record
        if self.disk.failures.fatal:  # the give-up is for the checkpoints themselves
            record["skipped"] = "checkpoints cannot be written"
            self.log.write("emergency_checkpoint", **record)
            return record
        t0 = time.time()
        copies = self._copies()
        choice = self._choose(copies, faulty)
        on_disk = checkpoint.complete_steps(self.root)
        if choice is None or (on_disk and choice[0] <= on_disk[0]):
            for node in faulty:
                kill_node(node)
            record["skipped"] = ("nothing in memory" if choice is None else
                                 f"step {choice[0]} is on disk already")
            self.log.write("emergency_checkpoint", **record)
            return record
        step, sources = choice
        used = {node for node, _ in sources.values()}
        for node in sorted(faulty - used):
            kill_node(node)  # its state is held elsewhere: it goes now, saving nothing
        for rank, (node, holder) in sorted(sources.items()):
            self._call(node, km.Persist(part=km.DiskPart(
                holder=holder, step=step, root=str(self.root), rank=rank, world=self.world,
                sharded=self.sharded, reason=reason, node=node)))
        record.update(step=step, sources={str(r): f"{h} on node {n}" for r, (n, h) in sources.items()})
        self.display.info(f"emergency checkpoint of step {step} ({reason}) to {self.root}")
        if wait_s is not None:
            record["complete"] = self.wait(step, time.time() + wait_s, tick)
            record["seconds"] = round(time.time() - t0, 3)
            if not record["complete"] and not self.disk.settled(step):  # not failed: late
                self.log.deadline("emergency_checkpoint", wait_s, waited_s=record["seconds"],
                                  step=step, reason=reason)
        self.log.write("emergency_checkpoint", **record)
        return record

    def _copies(self) -> dict[int, dict[int, list[tuple[int, str]]]]:
        """rank -> step -> [(node, holder)] over every live keeper's memory."""
        out: dict[int, dict[int, list[tuple[int, str]]]] = {}
        for node, h in sorted(self.keepers.items()):
            listing = self._call(node, km.ListHolders())
            for name, entry in (listing.holders if listing is not None else {}).items():
                rank = int(name[3:]) if name.startswith("rep") else int(name[1:])
                for info in entry.slots:
                    if info is not None:
                        out.setdefault(rank, {}).setdefault(info.step, []).append((node, name))
        return out

    def _choose(self, copies: dict[int, dict[int, list[tuple[int, str]]]], faulty: set[int]
                ) -> tuple[int, dict[int, tuple[int, str]]] | None:
        """The newest step to save and, per part, the copy to save it from: a healthy node's
        before a faulty one's, the rank's own snapshot before a replica."""
        def best(options: list[tuple[int, str]]) -> tuple[int, str]:
            return min(options, key=lambda o: (o[0] in faulty, o[1].startswith("rep"), o[0]))

        if self.sharded:
            if any(r not in copies for r in range(self.world)):
                return None
            common = set.intersection(*(set(copies[r]) for r in range(self.world)))
            if not common:
                return None
            step = max(common)
            return step, {r: best(copies[r][step]) for r in range(self.world)}
        by_step: dict[int, list[tuple[int, tuple[int, str]]]] = {}
        for rank, steps in copies.items():
            for step, options in steps.items():
                by_step.setdefault(step, []).extend((rank, o) for o in options)
        if not by_step:
            return None
        step = max(by_step)
        rank, where = min(by_step[step], key=lambda ro: (ro[1][0] in faulty, ro[1][1].startswith("rep"), ro[0]))
        return step, {rank: where}

    def summary(self) -> dict[str, Any]:
        done = self.disk.completed
        return {"checkpoints": len(done), "last_checkpoint": max(done) if done else None,
                "checkpoint_dir": str(self.root) if self.root else None,
                "checkpoint": self.disk.summary(),
                "replicas": dict(self.replicas, seconds=round(self.replicas["seconds"], 3),
                                 copies=self.copies,
                                 held_bytes={str(n): b for n, b in sorted(self.held.items())})}

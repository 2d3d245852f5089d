"""The job's placement, carried out: which process holds each rank (the plan), the nodes, the warm
spares, and each generation's assignments sent to its ranks.

The state machine (``machine.py``) decides where ranks go; this is where that happens: spares are
taken, processes started, nodes isolated, and every rank told its assignment."""

from __future__ import annotations

import collections
import time
from typing import Any

from .. import protocol
from ..decide import takeover
from ..decide.ladder import Decision, Level
from ..observe.incidents import Incident
from ..protocol import events
from ..protocol.hosts import JournalRecord
from .placement import spare_nodes
from .workers import Worker, WorkerTable


WORLDS_KEPT = 64  # generations whose world size each assignment carries (snapshots' sizes)


class RankPlan(dict):
    """rank -> wid, for the current generation; ``version`` changes with every change."""

    version = 0

    def __setitem__(self, rank: int, wid: int) -> None:
        self.version += 1
        super().__setitem__(rank, wid)

    def __delitem__(self, rank: int) -> None:
        self.version += 1
        super().__delitem__(rank)

    def clear(self) -> None:
        self.version += 1
        super().clear()

    def update(self, *args: Any, **kwargs: Any) -> None:
        self.version += 1
        super().update(*args, **kwargs)

    def pop(self, *args: Any) -> Any:
        self.version += 1
        return super().pop(*args)

    def popitem(self) -> tuple[int, int]:
        self.version += 1
        return super().popitem()

    def setdefault(self, rank: int, wid: int) -> int:  # type: ignore[override]
        self.version += 1
        return super().setdefault(rank, wid)

    def __ior__(self, other: Any) -> "RankPlan":  # type: ignore[override]
        self.update(other)
        return self


class Generations:
    def __init__(self, *, world: int, spares: int, nodes: int, spare_nodes: int, policy: Any,
                 mail: Any, table: WorkerTable, memory: Any, watchers: Any, log: Any,
                 display: Any):
        self.world = world  # ranks now (fewer than target after a scale-in)
        self.target = world  # ranks the job was started with
        self.trained_world = world  # the newest generation in which every rank stepped: its size
        self.worlds: dict[int, int] = {}  # generation -> world size (the recent ones)
        # a mesh sharded along its first dimension, none replicating it (plain FSDP, FSDP x TP),
        # as its ranks said: the ranks per index of that dimension (0: not such a job). Its
        # generations are laid out over their own world, and it changes size by new processes
        self.regrid_unit = 0
        self.not_after: int | None = None  # no rank resumes from state newer (a corruption)
        self.spares_target = spares
        self.total_nodes = nodes + spare_nodes  # nodes that hold ranks at the start, then spares
        self.slots = world // nodes  # ranks per node
        self.policy, self.mail, self.table, self.memory = policy, mail, table, memory
        self.watchers, self.log, self.display = watchers, log, display
        self.workers = table.workers
        self.plan: RankPlan = RankPlan()  # rank -> wid
        self.replacements = [0] * world
        self.claimed: dict[str, int] = {}  # injected faults fired: index -> times
        self._nodes: tuple[int, dict[int, int], frozenset[int]] = (-1, {}, frozenset())

    def node_of(self) -> dict[int, int]:
        """Each rank's node (not to be changed: it is kept until the plan changes; the loop
        asks every turn, and a job of 16,384 ranks would build it every 2 ms)."""
        if self._nodes[0] != self.plan.version:
            node_of = {r: self.workers[wid].node for r, wid in self.plan.items()}
            self._nodes = (self.plan.version, node_of, frozenset(node_of.values()))
        return self._nodes[1]

    def busy_nodes(self) -> frozenset[int]:
        """The nodes that hold ranks."""
        self.node_of()
        return self._nodes[2]

    def first_plan(self) -> None:
        """The first generation's processes: ranks in order, ``slots`` per node."""
        for rank in range(self.world):
            self.plan[rank] = self.table.new(spare=False, node=rank // self.slots).wid
        for w in (self.workers[wid] for wid in self.plan.values()):
            self.table.spawn(w)

    def adopt(self, adoption: Any, seen: list[Any], journal: JournalRecord) -> None:
        """The placement of a job another controller ran, as its hosts report it and its journal
        across hosts says; the processes the plan no longer names are ended."""
        self.workers.update(adopted_workers(adoption, seen, journal))
        self.plan.clear()
        self.plan.update(adoption.plan)
        self.replacements = list(journal.replacements) or self.replacements
        self.replacements += [0] * (len(self.plan) - len(self.replacements))
        self.claimed = dict(journal.claimed)
        self.worlds = dict(journal.worlds)
        self.trained_world = journal.trained_world or self.trained_world
        self.regrid_unit = journal.regrid_unit or self.regrid_unit
        for wid in adoption.orphans:
            self.table.kill(self.workers[wid], "assigned by the controller before, not in the "
                                               "job's plan")

    def spare_nodes(self, isolated: set[int]) -> list[int]:
        """Healthy nodes that hold no rank: they can take over a failed node's ranks."""
        return spare_nodes(self.node_of(), self.total_nodes, isolated)

    def node_joined(self, node: int) -> None:
        """A new host: a spare node from now on, its health checked and its memory started."""
        self.total_nodes = max(self.total_nodes, node + 1)
        self.watchers.start([node])
        try:
            self.memory.start([node])
        except RuntimeError as exc:  # its memory did not start: it holds no snapshots
            self.log.write("keeper_error", node=node, op="start", error=str(exc))
        self.log.write("node_joined", node=node)
        self.display.info(f"node {node} joined: a spare node")

    def node_lost(self, node: int, why: str, usable: list[int]) -> bool:
        """A host gone: no more checks there, replicas go elsewhere. Whether it held ranks."""
        self.watchers.remove_node(node)
        self.log.write("node_lost", node=node, reason=why)
        node_of = self.node_of()
        self.memory.configure(node_of, usable)
        return node in set(node_of.values())

    # == generations =============================================================================
    def publish(self, gen: int, initial: bool, level: str, usable: list[int]) -> None:
        """Send every rank its assignment for ``gen``; the nodes' memory follows the plan."""
        node_of = self.node_of()
        where = self.mail.generation_store(gen, node_of[0])
        self.world = self.memory.world = len(self.plan)
        self.worlds[gen] = self.world
        self.worlds = {g: w for g, w in self.worlds.items() if g > gen - WORLDS_KEPT}
        local = self.local_ranks(node_of)
        worlds = {str(g): n for g, n in self.worlds.items()}  # (shared by every rank's record)
        claimed = dict(self.claimed)
        reshard_from = self.trained_world if self.trained_world != self.world else 0
        # what every rank's assignment says alike, made once; each rank's own fields over it
        # (16,384 assignments built one by one took a tenth of a second)
        alike = protocol.mail_record(protocol.Assign(
            gen=gen, rank=0, world=self.world, full_world=self.target, reshard_from=reshard_from,
            regrid=self.regrid_unit > 0, worlds=worlds, initial=initial, not_after=self.not_after,
            claimed=claimed, **where))
        # a node that keeps working after losing its memory gets a new one - before its ranks
        # enter: their restore and their first snapshots find it (a snapshot into a memory
        # still starting fails, and until the next one nothing is held that a corruption found
        # meanwhile could roll back to)
        for node in usable:
            h = self.memory.keepers.get(node)
            if h is not None and h.lost and time.time() >= h.retry_at:
                self.memory.try_restart(node)
        with self.mail.batch(alike):  # across hosts: one frame per host, what is alike once
            for rank, wid in sorted(self.plan.items()):
                w = self.workers[wid]
                w.rank = rank
                own = {"rank": rank, "replacements": self.replacements[rank]}
                own.update(local[rank])
                self.table.send_record(w, own)
                # processes already running (survivors, ready spares) join within milliseconds
                if w.ready or w.entered >= 0:
                    w.warm_gen = gen
        self.memory.configure(node_of, usable)
        self.log.write("generation", gen=gen, level=level,
                       ranks={str(r): w for r, w in sorted(self.plan.items())})

    def local_ranks(self, node_of: dict[int, int]) -> dict[int, dict[str, int]]:
        """torchrun's per-host view of each rank: LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK (the
        index of its host among the hosts that hold ranks, in rank order). Nodes simulated on one
        host are one host: a rank's LOCAL_RANK picks its device there. (All ranks at once: one
        rank at a time would cost the job's size squared.)"""
        by_host: dict[int, list[int]] = {}  # in the order of each host's lowest rank
        for r in sorted(node_of):
            by_host.setdefault(self.mail.host_of(node_of[r]), []).append(r)
        out: dict[int, dict[str, int]] = {}
        for group, ranks in enumerate(by_host.values()):
            for i, r in enumerate(ranks):
                out[r] = {"local_rank": i, "local_world": len(ranks), "group_rank": group}
        return out

    def move(self, decision: Decision, placement: dict[int, int], inc: Incident | None,
             isolated: set[int]) -> list[Worker]:
        """Each replaced rank to a process on its node (``placement``): a warm spare there (the
        ranks moving to a spare node take only its spares: they stay together), else a new one.
        Returns the workers still to be started."""
        spare_nodes = set(self.spare_nodes(isolated))
        new: list[Worker] = []
        for rank in sorted(decision.replace):
            old = self.workers[self.plan[rank]]
            if not old.dead:  # a live process at fault (a level escalated): a fresh one instead
                self.table.kill(old, f"rank {rank} moves to a new process")
            node = placement[rank]
            # a spare node's processes stay whole for a node replacement: a rank of a node with
            # no spare left takes a ready one on another node that holds ranks, else starts cold
            w = self.table.take_spare(node, only=node in spare_nodes, avoid=spare_nodes,
                                      rank=rank)
            cold = w is None
            if w is None:
                w = self.table.new(spare=False, node=node)
                new.append(w)
            w.spare, w.home = False, None
            self.plan[rank] = w.wid
            self.replacements[rank] += 1
            if inc is not None:
                inc.replaced.append(rank)
            self.log.write("replace", rank=rank, wid=w.wid, node=node, warm=w.ready, cold=cold)
        return new

    def resize(self, decision: Decision, placement: dict[int, int], isolated: set[int]
               ) -> list[Worker]:
        """Scale-in: the dropped ranks leave the plan (a live process among them stays, as a
        warm spare) and the others are numbered again in order. Scale-out: the new ranks
        (``placement``) take the ready spares on their nodes. Returns workers still to start."""
        new: list[Worker] = []
        if decision.level is Level.SCALE_IN:
            keep = [r for r in sorted(self.plan) if r not in decision.drop]
            for r in sorted(decision.drop):
                w = self.workers[self.plan[r]]
                if decision.reshard and not w.dead:  # its mesh was built for the old world
                    self.table.kill(w, f"rank {r} dropped by a scale-in (its shards are resharded)")
                elif not w.dead and w.node not in isolated:  # it goes on waiting, as a spare
                    group = w.entered_ev.replica_group if w.entered_ev is not None else None
                    if group and r in group:  # (sharded: only its own position fits it)
                        w.home = (group.index(r), len(group))
                    w.spare, w.ready, w.rank = True, True, None
                else:
                    self.table.kill(w, f"rank {r} dropped by a scale-in")
            moved = {r: self.plan[r] for r in keep}
            self.replacements = [self.replacements[r] for r in keep]
            self.plan.clear()
            self.plan.update({i: moved[r] for i, r in enumerate(keep)})
            self.log.write("scale_in", dropped=sorted(decision.drop), world=len(keep),
                           target=self.target, renumbered={str(r): i for i, r in enumerate(keep)})
            return self._restart([i for i, r in enumerate(keep) if r in decision.replace],
                                 warm=not decision.reshard)
        new = self._restart(sorted(decision.replace))
        for rank, node in sorted(placement.items()):
            w = self.table.take_spare(node, only=True, rank=rank)
            if w is None:
                w = self.table.new(spare=False, node=node)
                new.append(w)
            w.spare, w.home = False, None
            self.plan[rank] = w.wid
            self.replacements.append(0)
        self.log.write("scale_out", added=sorted(placement), world=len(self.plan),
                       target=self.target, ranks={str(r): self.plan[r] for r in sorted(placement)})
        return new

    def _restart(self, ranks: list[int], warm: bool = False) -> list[Worker]:
        """New processes, on the same nodes, for ``ranks`` of a world that changed size: those
        whose live processes hold a mesh built for the old one (they cannot be sharded again),
        cold, since a warm spare is kept for a place the world grows by; or (``warm``) those
        lost while the world shrank, a warm spare on their node first. Returns those to start."""
        new: list[Worker] = []
        for rank in ranks:
            old = self.workers[self.plan[rank]]
            if not old.dead:
                self.table.kill(old, f"rank {rank}: a new process for the resharded world"
                                if not warm else f"rank {rank} moves to a new process")
            w = self.table.take_spare(old.node, only=True, rank=rank) if warm else None
            if w is None:
                w = self.table.new(spare=False, node=old.node)
                new.append(w)
            w.spare, w.home = False, None
            self.plan[rank] = w.wid
            self.replacements[rank] += 1
            self.log.write("replace", rank=rank, wid=w.wid, node=old.node, warm=w.ready,
                           cold=w in new)
        return new

    def ready_spares(self) -> dict[int, int]:
        """Warm spares ready now, per node."""
        out: dict[int, int] = {}
        for w in self.table.spares():
            if w.ready:
                out[w.node] = out.get(w.node, 0) + 1
        return out

    def announce(self, decision: Decision, gen: int) -> None:
        if decision.level in (Level.SCALE_IN, Level.SCALE_OUT):  # ``replace``: the old numbers
            moved = (f"{len(decision.replace)} rank(s) in new processes, their shards cut from "
                     "the old world's" if decision.reshard else
                     f"rank(s) {', '.join(map(str, sorted(decision.replace)))} in new processes"
                     if decision.replace else "")
        else:
            moved = ", ".join(f"rank {r} -> worker {self.plan[r]}"
                              + (f" (node {self.workers[self.plan[r]].node})"
                                 if self.total_nodes > 1 else "")
                              for r in sorted(decision.replace))
        if decision.passed_over:
            self.display.info("passed over: " + "; ".join(decision.passed_over))
        self.display.info(f"{decision.level.value} (generation {gen})"
                          + (f": {moved}" if moved else "") + f" [{decision.reason}]")

    # == nodes and spares ========================================================================
    def isolate(self, node: int, planned: bool = False) -> None:
        """Never place a rank or a spare on this node again in this job: its processes end.
        ``planned``: it leaves by the scheduler's word (a preemption), not for a fault."""
        for w in list(self.workers.values()):
            if w.node == node and not w.dead:
                self.table.kill(w, f"node {node} isolated")
        self.watchers.remove_node(node)
        self.log.write("isolate", node=node, planned=planned)
        self.display.info(f"node {node} leaves the job as its scheduler asked (preempted)"
                          if planned else
                          f"node {node} isolated: no rank will be placed there again")

    def shut_node(self, node: int) -> None:
        """A faulty node goes at once: its processes and its memory."""
        for w in list(self.workers.values()):
            if w.node == node and not w.dead:
                self.table.kill(w, f"node {node} is faulty: shut down")
        self.memory.kill(node, "faulty node shut down")

    def refill_spares(self, isolated: set[int]) -> None:
        """Warm spares: ``--spares`` spread over the nodes that hold ranks, and a full node's
        worth on each spare node (ready to take over a failed node)."""
        node_of = self.node_of()
        busy = sorted(set(node_of.values()) - set(isolated))
        targets = {n: 0 for n in busy}
        for i in range(self.spares_target if busy else 0):
            targets[busy[i % len(busy)]] += 1
        if len(node_of) < self.target:  # after a scale-in: a process for each place left
            held = collections.Counter(node_of.values())  # (counted once: 16,384 ranks)
            for n in busy:
                targets[n] += max(self.slots - held[n], 0)
        for n in self.spare_nodes(isolated):
            targets[n] = self.slots
        self.table.refill(targets, self.policy.rules.spare_failures)

    def spare_lost(self, w: Worker, code: int | None) -> None:
        self.table.spare_failures += 1
        report = w.exit_report
        at_import = report is not None and report.import_error
        if at_import:
            self.spares_wait(report)
        self.log.write("spare_lost", wid=w.wid, code=code, ready=w.ready, at_import=at_import,
                       spare_failures=self.table.spare_failures)
        if not at_import:
            self.display.info(f"spare worker {w.wid} exited (code {code}); refilling the pool")

    def spares_wait(self, report: events.Exiting) -> None:
        """The script failed at import in a process that ran it without a rank (a warm spare): it
        may need one there. From now on spares run it only once they hold a rank, so they cannot
        fail that way again (no refill loop), and a rank's own failure at import stops the job."""
        if self.table.spare_mode != "script":
            return
        self.table.spare_mode = "import"
        self.log.write("spare_mode", mode="import", error=report.error)
        self.display.info("warm spares now wait for a rank before running the script: it failed "
                          f"in a spare before reaching nonstop.wrap ({report.error})")


def adopted_workers(adoption: takeover.Adoption, seen: list[takeover.Seen],
                    journal: JournalRecord | None) -> dict[int, Worker]:
    """The controller's records of the job's processes: each one a host reports, as it reports
    it, and a dead record for each rank whose process is gone with its host (to be replaced)."""
    out = {s.wid: Worker(wid=s.wid, spare=s.spare and s.alive, node=s.node, seq=s.seq, rank=s.rank,
                         dead=not s.alive) for s in seen if s.keeper is None}
    node_of = journal.node_of if journal is not None else {}
    for rank, wid in adoption.plan.items():
        if wid not in out:
            out[wid] = Worker(wid=wid, spare=False, node=node_of.get(rank, 0), rank=rank,
                              dead=True)
        out[wid].rank = rank
        if rank in adoption.finished:  # it ran to the end (its Done, if wrapped, is replayed)
            out[wid].done = adoption.gen
    return out

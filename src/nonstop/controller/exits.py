"""How the controller (``controller.py``) takes the end of a process: a rank (a fault, unless
nonstop ended it or expected it), a warm spare (the pool is refilled), a node's memory (a keeper:
a new one takes over). The last step a rank completed, read by its agent once it is gone, counts
as reached. A mixin of ``Controller``: the same state, one concept per module."""

from __future__ import annotations

import time
from typing import Any

from ..agent.agent import Proc
from ..decide.faults import exit_fault
from ..decide.ladder import Fault
from .phase import ENDING, Phase
from .workers import Worker


class ProcessExits:
    def _on_exit(self, proc: Proc) -> None:
        if self.memory.node_of_wid(proc.wid) is not None:
            self._on_keeper_exit(proc)
            return
        w = self.workers.get(proc.wid)
        if w is None:  # not ours: a predecessor's process whose exit its host reported late
            self.log.write("exit", wid=proc.wid, code=proc.returncode, unknown=True)
            return
        was_killed = w.killed
        w.dead = True
        code = proc.returncode
        last = proc.last
        self.log.write("exit", wid=w.wid, rank=w.rank, spare=w.spare, code=code, killed=was_killed,
                       **({"last_step": last.get("step"), "last_gen": last.get("gen")}
                          if last else {}))
        if last and w.rank is not None and not w.spare:
            self._take_last_step(w, last)
        if w.spare:
            self._on_spare_exit(w, code)
            return
        if self.phase is Phase.FINISHING:
            # a process nonstop ended (a hung rank, replaced) may exit after the others finished
            if code != 0 and not was_killed and self.outcome.diagnosis is None:
                self.outcome.diagnosis = (f"rank {w.rank} exited with code {code} after "
                                          "training completed")
            return
        if was_killed or w.rank is None or self.plan.get(w.rank) != w.wid:
            return  # an exit we caused or expected
        if not self.managed and code == 0:
            w.done = self.gen
            if all(self.workers[x].done >= self.gen for x in self.plan.values()):
                self._training_complete(time.time())
            return
        self._fault(self._exit_fault(w, code))

    def _take_last_step(self, w: Worker, last: dict[str, Any]) -> None:
        """The step a rank that is gone completed last, read by its agent: steps it completed
        since it last published count as reached (and, if rolled back, as lost)."""
        step = w.take_progress(last, self.gen)
        self.max_step = max(self.max_step, step)
        self.progress.take(w.wid, w.rank, w.node, last)
        if self.incident is not None and step:
            self.incident.step_before = max(self.incident.step_before, step)

    def _on_keeper_exit(self, proc: Proc) -> None:
        """A node's memory is gone. With its ranks gone too, the node is lost (the next decision
        says so); otherwise a new, empty memory takes over and training goes on."""
        h = self.memory.on_exit(proc.wid, proc.returncode)
        if h is None or h.killed or self.phase in ENDING:
            return
        if h.node in self.counters.isolated or h.node in self.preempts.told:
            return  # its host is leaving (isolated, released, preempted): expected, not news
        self.display.info(f"node {h.node}: its memory (keeper) is gone (code {proc.returncode})")
        # the other nodes stop copying their snapshots to it now, not once it is replaced
        self.memory.configure(self.gens.node_of(), self.state.usable_nodes(self.total_nodes))

    def _check_keepers(self, now: float) -> None:
        if self.phase in ENDING:
            return
        self.memory.revive(now, lambda: {w.node for w in self.workers.values() if not w.dead},
                           self.phase is Phase.RUNNING and self.incident is None,
                           self.gens.node_of, lambda: self.state.usable_nodes(self.total_nodes))

    def _exit_fault(self, w: Worker, code: int | None) -> Fault:
        report = w.exit_report
        if report is not None and report.import_error and not report.assigned:
            self.gens.spares_wait(report)  # it ran the script without its rank: spares must not
        first = self.max_step == 0 if self.managed else self.gen == 0
        return exit_fault(report, code, w.rank, before_any_step=first)

    def _on_spare_exit(self, w: Worker, code: int | None) -> None:
        if self.phase in ENDING or w.killed:
            return
        self.gens.spare_lost(w, code)
        self._refill_spares()

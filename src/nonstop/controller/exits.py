"""What the end of a process means for the job: a rank's (a fault, unless nonstop ended it or
expected it), a warm spare's (the pool is refilled), a node's memory's (a keeper: a new one takes
over). The last step a rank completed, read by its agent once it is gone, counts as reached.

``ProcessExits`` is the controller's (``controller.py``) collaborator for it: it keeps the
process records up to date and says what the exit means as records (``Exited``'s fields), which
the controller carries out; it never steps the machine or reads the controller's state, only the
facts it is given (``JobView``).
"""

from __future__ import annotations

import dataclasses
import time

from ..agent.agent import Proc
from ..observe.display import Display
from ..observe.events import EventLog
from ..observe.progress import ProgressLog
from ..protocol.last_step import LastStep
from ..decide.faults import exit_fault
from ..decide.ladder import Fault
from .generations import Generations
from .keepers import Keepers
from .facts import JobView
from .phase import ENDING, Phase
from .workers import Worker


@dataclasses.dataclass(frozen=True)
class Exited:
    """What one exit means: each field an order for the controller (none: nothing to do)."""
    fault: Fault | None = None  # a rank failed: the machine hears of it
    reached: int | None = None  # the newest step a gone rank completed
    complete_at: float | None = None  # every rank of a plain script exited 0: training is over
    refill_spares: bool = False  # a warm spare is gone
    diagnosis: str | None = None  # a rank failed after training completed (kept if none yet)


NOTHING = Exited()


class ProcessExits:
    def __init__(self, workers: dict[int, Worker], memory: Keepers, gens: Generations,
                 progress: ProgressLog, log: EventLog, display: Display):
        self.workers, self.memory, self.gens = workers, memory, gens
        self.progress, self.log, self.display = progress, log, display

    def on_exit(self, proc: Proc, job: JobView) -> Exited:
        if self.memory.node_of_wid(proc.wid) is not None:
            self._on_keeper_exit(proc, job)
            return NOTHING
        w = self.workers.get(proc.wid)
        if w is None:  # not ours: a predecessor's process whose exit its host reported late
            self.log.write("exit", wid=proc.wid, code=proc.returncode, unknown=True)
            return NOTHING
        was_killed = w.killed
        w.dead = True
        code = proc.returncode
        last = proc.last
        self.log.write("exit", wid=w.wid, rank=w.rank, spare=w.spare, code=code, killed=was_killed,
                       **({"last_step": last.step, "last_gen": last.gen} if last else {}))
        reached = None
        if last is not None and w.rank is not None and not w.spare:
            reached = self._take_last_step(w, last, job.gen)
        if w.spare:
            if job.phase in ENDING or w.killed:
                return NOTHING
            self.gens.spare_lost(w, code)
            return Exited(refill_spares=True)
        if job.phase is Phase.FINISHING:
            # a process nonstop ended (a hung rank, replaced) may exit after the others finished
            if code != 0 and not was_killed:
                return Exited(reached=reached, diagnosis=f"rank {w.rank} exited with code {code} "
                              "after training completed")
            return Exited(reached=reached)
        if was_killed or w.rank is None or job.plan.get(w.rank) != w.wid:
            return Exited(reached=reached)  # an exit we caused or expected
        if not job.managed and code == 0:
            w.done = job.gen
            done = all(self.workers[x].done >= job.gen for x in job.plan.values())
            return Exited(reached=reached, complete_at=time.time() if done else None)
        return Exited(fault=self._exit_fault(w, code, job, reached), reached=reached)

    def _take_last_step(self, w: Worker, last: LastStep, gen: int) -> int:
        """The step a rank that is gone completed last, read by its agent: steps it completed
        since it last published count as reached (and, if rolled back, as lost)."""
        step = w.take_progress(last, gen)
        self.progress.take(w.wid, w.rank, w.node, last)
        return step

    def _on_keeper_exit(self, proc: Proc, job: JobView) -> None:
        """A node's memory is gone. With its ranks gone too, the node is lost (the next decision
        says so); otherwise a new, empty memory takes over and training goes on."""
        h = self.memory.on_exit(proc.wid, proc.returncode)
        if h is None or h.killed or job.phase in ENDING:
            return
        if h.node in job.state.counters.isolated or h.node in job.leaving:
            return  # its host is leaving (isolated, released, preempted): expected, not news
        self.display.info(f"node {h.node}: its memory (keeper) is gone (code {proc.returncode})")
        # the other nodes stop copying their snapshots to it now, not once it is replaced
        self.memory.configure(self.gens.node_of(), job.state.usable_nodes(job.total_nodes))

    def _exit_fault(self, w: Worker, code: int | None, job: JobView, reached: int | None) -> Fault:
        report = w.exit_report
        if report is not None and report.import_error and not report.assigned:
            self.gens.spares_wait(report)  # it ran the script without its rank: spares must not
        max_step = max(job.max_step, reached or 0)
        first = max_step == 0 if job.managed else job.gen == 0
        return exit_fault(report, code, w.rank, before_any_step=first)

"""The incidents as they are measured: the open one, those closed, and when each fault began.

The state machine (``machine.py``) says when an incident opens, when its attempt is interrupted and
when it recovers; this book keeps the times (``observe/incidents.py`` turns them into MTTR by
phase and steps lost) and writes the records."""

from __future__ import annotations

import re

from typing import Any

from ..decide.faults import Domain
from ..decide.ladder import Fault
from ..observe.incidents import Incident, restore_record, skipped_once
from ..protocol import events

INJECT_MEMORY_S = 30.0  # an injection reported this long before a fault is taken as its start
# injections whose moment starts no incident (a node's memory killed alone opens none: an
# incident that follows within moments is not timed from it)
UNTIMED = ("corrupt", "slow", "jitter", "keeper_crash")


_SOURCE = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|cu|h|hpp):\d+\] ?")  # gloo's "[/path/pair.cc:553] "


def short(text: str, limit: int = 160) -> str:
    """One line of a fault's text: the first, without a library's source path."""
    line = _SOURCE.sub("", text.strip().splitlines()[0]) if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


class IncidentBook:
    def __init__(self, log: Any, display: Any):
        self.log, self.display = log, display
        self.open: Incident | None = None
        self.closed: list[Incident] = []
        self.base = 0  # incidents of the controllers before this one (across hosts)
        self._injects: list[float] = []  # when recent injected faults fired
        self._regroup: dict[str, Any] | None = None  # a scale-out under way
        # incidents closed before the run showed whether its steps can be counted (a fault
        # before the first step): their steps lost are said once it has
        self._unsaid: list[Incident] = []

    @property
    def count(self) -> int:
        return len(self.closed) + (self.open is not None)

    def injected(self, t: float, kind: str | None = None) -> None:
        """An injected fault fired at ``t``: the next incident is measured from it. Not one that
        fires inside an open incident (it is part of that one: kept, it would date an unrelated
        incident much later), nor one whose moment is not a failure's (a snapshot corrupted is
        found at a restore, if ever; a straggler is slow, not failed)."""
        if self.open is None and kind not in UNTIMED:
            self._injects.append(t)

    def begin(self, now: float, gen: int, max_step: int, t_fault: float | None = None) -> Incident:
        """The open incident, opened now if there is none: it began at the injection we were
        told of (else now), or at ``t_fault`` where the caller knows better (a hang: the last
        progress)."""
        if self.open is not None:
            self._injects.clear()  # part of this incident: not the start of the next
            return self.open
        self._regroup = None  # a scale-out a fault cut short is not measured as one
        recent = [t for t in self._injects if now - t < INJECT_MEMORY_S]
        self._injects.clear()
        t0 = min(recent) if recent else now
        if t_fault is not None:
            t0 = min(t0, t_fault)
        self.open = Incident(id=self.base + len(self.closed) + 1, t_fault=t0, t_detect=now,
                             gen_from=gen, step_before=max_step)
        return self.open

    def fault(self, fault: Fault, now: float, gen: int, max_step: int,
              t_fault: float | None = None) -> None:
        """A fault taken in: logged, shown, added to the open incident (opened if need be)."""
        inc = self.begin(now, gen, max_step, t_fault)
        if fault.kind == "peer":  # a symptom: the cause is another rank's fault
            inc.symptoms.append(short(fault.describe()))
        elif fault.domain is Domain.NODE:  # a host lost or unwell: the cause, said first
            inc.faults.insert(0, short(fault.describe()))
        else:
            inc.faults.append(short(fault.describe()))
        self.log_fault(fault, gen, incident=inc.id)
        if fault.kind != "peer":
            self.display.info(f"fault: {short(fault.describe())}")

    def log_fault(self, fault: Fault, gen: int, incident: int | None = None) -> None:
        self.log.write("fault", kind=fault.kind, code=fault.fault_code, rank=fault.rank,
                       node=fault.node, domain=fault.domain.value, exit_code=fault.code,
                       attribution=fault.attribution.value, message=fault.message[:500],
                       incident=incident if incident is not None else
                       (self.open.id if self.open else None), gen=gen)

    def interrupt(self, now: float, phase: str, gen: int) -> None:
        """A fault while the incident's recovery was under way: that attempt ends here, in the
        phase it had reached, and the incident goes on with the next decision."""
        if self.open is None:
            return
        self.open.interrupt(now, phase)
        self.log.write("attempt_interrupted", incident=self.open.id, gen=gen, phase=phase,
                       level=self.open.levels[-1] if self.open.levels else None)

    def formed(self, evs: list[events.EnteredGeneration], resume_step: int | None) -> None:
        """Every rank entered the new generation: when each phase ended on the latest rank (a
        plain script's rank says only when it was assigned: its entry's time stands for the
        rest)."""
        inc = self.open
        inc.t_assigned = max(e.t_assigned for e in evs)
        inc.t_pg = max(e.t if e.t_pg is None else e.t_pg for e in evs)
        inc.t_restored = max(e.t if e.t_restored is None else e.t_restored for e in evs)
        inc.resume_step = resume_step

    def retry_opened(self, step: int, now: float, gen: int, max_step: int) -> None:
        """Non-finite gradients at ``step``: an incident (the ranks wait, nothing torn down)."""
        f = Fault("nan", message=f"non-finite gradients at step {step}")
        inc = self.begin(now, gen, max_step)
        inc.faults.append(f.describe())
        self.log_fault(f, gen, incident=inc.id)

    def retried(self, decision: Any, step: int, now: float) -> None:
        """The step is redone (or skipped) in place: every phase up to the first step is now."""
        inc = self.open
        inc.levels.append(decision.level.value)
        inc.t_decide = inc.t_decide or now
        inc.t_torn = inc.t_assigned = inc.t_pg = inc.t_restored = now
        inc.resume_step = step + 1 if decision.skip else step
        inc.step_before = max(inc.step_before, step)

    def restored(self, gen: int, evs: list[events.EnteredGeneration | None], ledger: Any,
                 node_of: dict[int, int] | None = None) -> None:
        """Where every rank's state came from in generation ``gen`` (a replica: on which node,
        ``node_of`` the generation's), and a resumed job says so."""
        entered = [e for e in evs if e is not None and not e.plain]
        if not entered:
            return
        rec = restore_record(entered, node_of)
        self.log.write("restore", gen=gen, **rec)
        for s in skipped_once(entered):
            whose = f"rank {s.rank}" if s.rank is not None else f"shard {s.shard}"
            self.display.info(f"{whose}: {s.source} copy of step {s.step} skipped: {s.why}")
        if gen == 0:
            ledger.resumed_step = rec["step"] or 0
            if rec["step"]:
                how = sorted(set(rec["sources"].values()))
                self.display.info(f"resumed at step {rec['step']} (from {', '.join(how)})")

    def close(self, t_first: float, resume_step: int | None, steps_known: bool,
              undecided: bool = False) -> None:
        """The open incident recovered. ``undecided``: the run has not yet shown whether its
        steps can be counted - its steps lost are said when it has (``steps_decided``), not
        called unknown now and 0 in the summary."""
        inc = self.open
        if inc is None:
            return
        inc.t_first_step = t_first
        if resume_step is not None:
            inc.resume_step = resume_step
        inc.steps_known = steps_known
        inc.closed = True
        self.closed.append(inc)
        self.open = None
        self._injects.clear()
        self.log.write("incident", **inc.to_record())
        said = f"incident {inc.id} recovered in {inc.mttr:.3f} s ({', '.join(inc.levels)})"
        if undecided:
            self._unsaid.append(inc)
            self.display.info(f"{said}; steps lost: counted at its first step")
            return
        self.display.info(f"{said}, steps lost: "
                          f"{'unknown' if inc.steps_lost is None else inc.steps_lost}")

    def steps_decided(self, known: bool) -> None:
        """The run has shown whether its steps can be counted: the steps lost of the incidents
        closed before it did."""
        unsaid, self._unsaid = self._unsaid, []
        for inc in unsaid:
            inc.steps_known = known
            self.display.info(f"incident {inc.id}: steps lost: "
                              f"{'unknown' if inc.steps_lost is None else inc.steps_lost}")

    def give_up(self) -> None:
        if self.open is None:
            return
        self.open.outcome = "gave up"
        self.closed.append(self.open)
        self.log.write("incident", **self.open.to_record())
        self.open = None

    # == scale-out: not an incident, but a pause worth measuring ==================================
    def regrouped(self, t: float, gen: int, world: int, max_step: int,
                  drain: str | None = None) -> None:
        """The ranks of ``gen`` were asked to leave at a step boundary, to grow the world or
        (``drain``: what, and why) to move ranks to spares."""
        self._regroup = {"t": t, "gen": gen, "world": world, "step": max_step, "drain": drain}
        self.log.write("regroup", gen=gen, world=world, step=max_step, drain=drain)
        if drain:
            self.display.info(f"draining {drain}: at the next step boundary")

    def left_to_grow(self, t: float, step: int) -> None:
        """A rank left at a step boundary to grow the world: training paused from the first."""
        r = self._regroup
        if r is not None and (r.get("t_left") is None or t < r["t_left"]):
            r.update(t_left=t, step=step)

    def grown(self, t_first: float, gen: int, world: int) -> None:
        """Every rank of ``gen`` completed a step: a scale-out that led here is over."""
        r = self._regroup
        if r is None or gen <= r["gen"]:
            return
        self._regroup = None
        pause = t_first - (r.get("t_left") or r["t"])
        if r.get("drain"):
            self.log.write("drain_done", gen=gen, drained=r["drain"], pause_s=round(pause, 4),
                           step=r["step"], to_boundary_s=round((r.get("t_left") or r["t"]) - r["t"], 4))
            self.display.info(f"drained {r['drain'].split(':')[0]} (generation {gen}): training "
                              f"paused {pause:.3f} s")
            return
        self.log.write("scale_out_done", gen=gen, world_from=r["world"], world=world,
                       pause_s=round(pause, 4), step=r["step"],
                       to_boundary_s=round((r.get("t_left") or r["t"]) - r["t"], 4))
        self.display.info(f"grew from {r['world']} to {world} ranks (generation {gen}): training "
                          f"paused {pause:.3f} s")

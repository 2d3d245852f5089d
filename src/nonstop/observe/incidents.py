"""Measuring incidents: MTTR by phase, steps lost, goodput.

An incident runs from its fault (the injection, or the first sign of it) to the first step completed
by every rank after recovery. Its phases partition that time: each phase ends at the latest moment
any rank finished it, clamped so the phases add up to the MTTR exactly.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Iterable

from ..protocol.events import EnteredGeneration, SkippedCopy
from ..protocol.records import plain

PHASES = ("detect", "decide", "teardown", "replace", "rendezvous", "restore", "first_step")


@dataclasses.dataclass
class Incident:
    id: int
    t_fault: float
    t_detect: float
    faults: list[str] = dataclasses.field(default_factory=list)
    symptoms: list[str] = dataclasses.field(default_factory=list)  # e.g. a peer's failed collective
    levels: list[str] = dataclasses.field(default_factory=list)
    replaced: list[int] = dataclasses.field(default_factory=list)
    gen_from: int = 0
    gen_to: int | None = None
    step_before: int = 0  # newest step any rank is known to have completed when it began
    resume_step: int | None = None
    t_decide: float | None = None
    t_torn: float | None = None  # every surviving rank has left the old generation
    t_assigned: float | None = None  # every rank of the new generation holds its assignment
    t_pg: float | None = None  # the new group is formed on every rank
    t_restored: float | None = None  # every rank holds the agreed state
    t_first_step: float | None = None  # every rank completed a step
    closed: bool = False
    steps_known: bool = True  # False: the ranks do not iterate ctx.steps; what was lost is unknown
    outcome: str = "recovered"
    # A fault that strikes while the incident is being recovered ends that attempt: its time is
    # kept, by phase, and the next attempt starts at that moment (see ``interrupt``).
    t_round: float | None = None  # when the current attempt began (None: at t_fault)
    interrupted: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def _points(self) -> list[float | None]:
        return [self.t_round or self.t_fault, self.t_detect, self.t_decide, self.t_torn,
                self.t_assigned, self.t_pg, self.t_restored, self.t_first_step]

    def timeline(self) -> list[float]:
        """The current attempt's points, each at or after the one before."""
        out: list[float] = []
        last = self.t_round or self.t_fault
        for p in self._points():
            last = max(last, p) if p is not None else last
            out.append(last)
        return out

    def interrupt(self, now: float, phase: str) -> None:
        """Another fault ended the current attempt at ``now``, in ``phase`` (one of PHASES):
        the attempt's phases are kept and a new attempt, detected now, begins."""
        tl = self.timeline()
        reached = sum(p is not None for p in self._points()[1:7])  # points before the failure
        spent = {name: tl[i + 1] - tl[i] for i, name in enumerate(PHASES) if i + 1 <= reached}
        spent[phase] = spent.get(phase, 0.0) + max(0.0, now - tl[reached])
        self.interrupted.append({"phase": phase, "at": now, "from": tl[reached],
                                 "phases_s": {k: round(v, 6) for k, v in spent.items()}})
        self.t_round, self.t_detect = now, now
        self.t_decide = self.t_torn = self.t_assigned = self.t_pg = self.t_restored = None

    def group_formed(self, t_pg: float) -> None:
        """A rank of the interrupted attempt says its group had formed at ``t_pg``: the part of
        that attempt's rendezvous after it was spent restoring state."""
        if not self.interrupted or self.interrupted[-1]["phase"] not in ("rendezvous", "restore"):
            return
        a = self.interrupted[-1]
        if not a["from"] <= t_pg <= a["at"]:
            return
        a["t_pg"] = max(a.get("t_pg", t_pg), t_pg)
        spent = a["phases_s"]
        before = {k: v for k, v in spent.items() if k not in ("rendezvous", "restore")}
        before["rendezvous"] = round(a["t_pg"] - a["from"], 6)
        before["restore"] = round(a["at"] - a["t_pg"], 6)
        a["phases_s"], a["phase"] = before, "restore"

    def phases(self) -> dict[str, float]:
        """Seconds by phase over every attempt: they add up to the MTTR."""
        tl = self.timeline()
        out = {name: tl[i + 1] - tl[i] for i, name in enumerate(PHASES)}
        for attempt in self.interrupted:
            for name, secs in attempt["phases_s"].items():
                out[name] += secs
        return {name: round(v, 6) for name, v in out.items()}

    @property
    def mttr(self) -> float | None:
        if self.t_first_step is None:
            return None
        return max(0.0, self.t_first_step - self.t_fault)

    @property
    def steps_lost(self) -> int | None:
        if self.resume_step is None or not self.steps_known:
            return None
        return max(0, self.step_before - self.resume_step)

    def to_record(self) -> dict[str, Any]:
        return {"id": self.id, "faults": self.faults or self.symptoms[:1], "levels": self.levels,
                "replaced": self.replaced, "gen_from": self.gen_from, "gen_to": self.gen_to,
                "t_fault": self.t_fault, "mttr_s": self.mttr, "phases_s": self.phases(),
                "step_before": self.step_before, "resume_step": self.resume_step,
                "steps_lost": self.steps_lost, "outcome": self.outcome,
                "interrupted": [{"phase": a["phase"], "phases_s": a["phases_s"]}
                                for a in self.interrupted]}


def distribution(values: Iterable[float]) -> dict[str, float] | None:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": vals[0], "max": vals[-1], "n": len(vals)}


def continuation(previous: list[dict[str, Any]], resumed_step: int | None) -> dict[str, Any] | None:
    """How an attempt continues the earlier ones of its run directory (``events.attempts``):
    the steps it redid are those between the newest step any earlier attempt reached and the
    step it resumed from. None for a first attempt that started at step 0; ``steps_lost`` None
    where either is unknown - as for a first attempt resumed from a checkpoint, written by a run
    this directory keeps no record of."""
    if not previous:
        if not resumed_step:
            return None
        return {"attempt": 1, "previous_step": None, "resumed_step": resumed_step,
                "steps_lost": None, "previous_exit_code": None, "previous_diagnosis": None}
    reached = [a.get("steps") for a in previous]
    newest = None if reached[-1] is None else max(r for r in reached if r is not None)
    lost = None
    if newest is not None and resumed_step is not None:
        lost = max(0, newest - resumed_step)
    last = previous[-1]
    return {"attempt": len(previous) + 1, "previous_step": newest, "resumed_step": resumed_step,
            "steps_lost": lost, "previous_exit_code": last.get("exit_code"),
            "previous_diagnosis": last.get("diagnosis")}


def summarize(incidents: list[dict[str, Any]], wall_s: float, productive_s: float | None,
              steps: int | None, exit_code: int,
              continues: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run's summary from closed-incident records (``Incident.to_record``). ``steps_lost``
    is None (unknown) when a recovered incident's, or the resumption's, is; ``continues``
    (``continuation``) for an attempt after the first: its resumption's loss counts too."""
    mttrs = [i["mttr_s"] for i in incidents if i.get("mttr_s") is not None]
    lost = [i.get("steps_lost") for i in incidents if i.get("outcome", "recovered") == "recovered"]
    if continues is not None:
        lost.append(continues.get("steps_lost"))
    by_phase = {p: round(sum(i["phases_s"][p] for i in incidents if i.get("mttr_s") is not None), 6)
                for p in PHASES}
    goodput = None
    if productive_s is not None and wall_s > 0:
        goodput = max(0.0, min(1.0, productive_s / wall_s))
    return {
        "exit_code": exit_code,
        "steps": steps,
        "wall_s": round(wall_s, 3),
        "incidents": len(incidents),
        "mttr_s": distribution(mttrs),
        "mttr_by_phase_s": by_phase,
        "steps_lost": None if None in lost else sum(lost),
        "goodput": None if goodput is None else round(goodput, 4),
        "attempt": 1 if continues is None else continues["attempt"],
        "continues": continues,
        "incident_list": incidents,
    }


def skipped_once(entered: list[EnteredGeneration]) -> list[SkippedCopy]:
    """The copies a generation's restore did not use, each once (every rank learnt of each)."""
    skipped: list[SkippedCopy] = []
    for s in (s for e in entered for s in e.skipped):
        if s not in skipped:
            skipped.append(s)
    return skipped


def restore_record(entered: list[EnteredGeneration],
                   node_of: dict[int, int] | None = None) -> dict[str, Any]:
    """A generation's restore from its ranks' "entered" reports: the step, where each rank's
    state came from - and, for a replica (``buddy``), the node whose memory held it (the
    sender's, or the rank's own: ``node_of``, the generation's) -, the copies that were skipped
    (each once), the slowest rank's seconds and the bytes moved."""
    where = node_of or {}
    held = {str(e.rank): where.get(e.rank if e.holder is None else e.holder)
            for e in entered if e.source == "buddy"}
    return {"step": entered[0].step, "sources": {str(e.rank): e.source for e in entered},
            "buddy_nodes": held, "skipped": [plain(s) for s in skipped_once(entered)],
            "seconds": max(e.restore_s or 0.0 for e in entered),
            "bytes": sum(e.nbytes or 0 for e in entered)}

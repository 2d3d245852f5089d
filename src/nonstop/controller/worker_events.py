"""What the ranks report (their events: entered, first step, left, done, NaN, injections, silent
corruption...; and their progress) and what each means for the job.

``RankReports`` is the controller's (``controller.py``) collaborator for it. It keeps the records
it is given up to date (the workers, the ledger, the incident book, the replicas' comparisons)
and says what the job must do as orders (``Order``), which the controller carries out one event
at a time, so that each event is judged against the job as the events before it left it; it never
steps the machine or reads the controller's state, only the facts it is given (``JobView``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .ports import Processes
from ..decide import sdc as sdc_verdicts
from ..decide.ladder import Decision, Fault, Level
from ..decide.sdc import Judge as SdcJudge
from ..observe.display import Display
from ..observe.events import EventLog
from ..observe.progress import ProgressLog, sample_every
from ..protocol import events
from .book import IncidentBook
from .facts import JobView
from .generations import Generations
from .keepers import Keepers
from .ledger import SdcBook, TrainingLedger
from .observations import Attributed, Entered, RankFact, RetryAsked
from .phase import ACTIVE, Phase
from .watchers import Watchers
from .workers import Worker, WorkerTable

DEFERRED = ("entered", "first_step")  # judged after a run of them (RankReports.take_run)
# events about a generation: taken only from a rank of the current one
ABOUT_GEN = (events.EnteredGeneration, events.FirstStep, events.LeftGeneration, events.NanFound,
             events.LossRuleFired, events.Done)


# == orders: what the controller carries out ======================================================
@dataclasses.dataclass(frozen=True)
class Faulted:
    fault: Fault


@dataclasses.dataclass(frozen=True)
class GiveUp:
    decision: Decision


@dataclasses.dataclass(frozen=True)
class Reached:
    """A rank completed ``step``. ``before_fault``: reported as a rank left a failed generation,
    so the open incident counts it as reached (and, rolled back past, lost)."""
    step: int
    before_fault: bool = False


@dataclasses.dataclass(frozen=True)
class CloseIncident:
    t_first: float
    resume_step: int | None


@dataclasses.dataclass(frozen=True)
class Complete:
    """Every rank has finished training."""
    t: float


@dataclasses.dataclass(frozen=True)
class GroupFormed:
    """A rank that left had formed its group at ``t_pg``: a phase of the open incident (once any
    fault the leaving raised has opened it)."""
    t_pg: float


# what the ranks' reports ask of the controller; the facts the machine takes as they are
# (every rank entered, a step retry asked, a corruption attributed) are its own observations
Order = (RankFact | Faulted | GiveUp | Reached | CloseIncident | Complete | GroupFormed)


class RankReports:
    def __init__(self, *, table: WorkerTable, ledger: TrainingLedger, book: IncidentBook,
                 gens: Generations, memory: Keepers, sdc: SdcBook, sdc_judge: SdcJudge,
                 watchers: Watchers, progress: ProgressLog, agent: Processes, log: EventLog,
                 display: Display):
        self.table, self.workers = table, table.workers
        self.ledger, self.book, self.gens, self.memory = ledger, book, gens, memory
        self.sdc, self.sdc_judge, self.watchers, self.progress = sdc, sdc_judge, watchers, progress
        self.agent, self.log, self.display = agent, log, display
        self.nccl = False  # a rank said its groups run NCCL (its aborts take NCCL's time)
        self._progress_at = 0  # where in the plan the next share of progress is read from
        self.final_persist: int | None = None  # the last step's checkpoint, awaited at the end
        self.snap_stats: dict[str, Any] | None = None  # rank 0's snapshot numbers
        self.last_entered: events.EnteredGeneration | None = None  # the newest entry
        # a sharded job's replica groups, as its ranks said (rank -> the ranks of its group):
        # read by the ladder, updated in place (never copied: 16,384 ranks)
        self.replica_groups: dict[int, tuple[int, ...]] = {}
        self._run: set[str] = set()  # the kinds of a run of events judged after its last
        self._named: dict[int, int] = {}  # a corruption's step -> the rank a replay named

    # == events ==================================================================================
    # A run of "entered" and "first_step" events is judged once, after its last one: what the job
    # as a whole does next depends on all of its ranks, and judging after each of 16,384 ranks
    # would cost the job's size squared. Any other event ends the run first, so the order of what
    # the controller does is the events' order. (Within a run, a rank's first step follows its
    # entry: the entries are judged first.)
    def ends_run(self, ev: events.RankEvent) -> bool:
        """Whether the run of deferred events must be judged before ``ev``."""
        return bool(self._run) and ev.type not in DEFERRED

    def take_run(self) -> tuple[bool, bool]:
        """The run to judge now: whether it held entries, and first steps. The controller
        judges the entries (``entries``) and carries that out before the first steps
        (``first_steps``): the generation may have formed meanwhile."""
        kinds, self._run = self._run, set()
        return "entered" in kinds, "first_step" in kinds

    def entries(self, job: JobView) -> list[Order]:
        # (the machine forms the generation once every rank has entered it, and does nothing
        # else on an entry: the job's view is built only then)
        if job.phase is Phase.RENDEZVOUS and \
                not self.table.some_rank("enter", job.plan, lambda w: w.entered < job.gen):
            return [Entered()]
        return []

    def on_event(self, ev: events.RankEvent, job: JobView) -> list[Order]:
        """One event (its kind deferred to the run's judgement where it can be)."""
        w = self.workers.get(ev.wid)
        if w is None:
            return []
        if isinstance(ev, ABOUT_GEN) and (ev.gen != job.gen or job.plan.get(ev.rank) != w.wid):
            return []  # about an older generation
        w.take_event(ev)
        match ev:
            # (the kinds a big job's ranks send by the thousand first: a match tries its cases
            # in order)
            case events.FirstStep():
                stepless = not ev.steps  # its marks are its steps (no ctx.steps)
                self.ledger.first_step(stepless)
                self._steps_learned()
                self.watchers.signals.on_first_step(w, ev.t, stepless=stepless)
                self._run.add(ev.type)
                return [Reached(ev.step)]
            case events.LeftGeneration():
                return self._on_left(w, ev, job)
            case events.EnteredGeneration():
                if ev.sharded is not None:
                    self.memory.sharded = ev.sharded
                if ev.nccl:  # its aborts take NCCL's time: the teardown allows for it
                    self.nccl = True
                if ev.replica_group is not None:
                    self.replica_groups[ev.rank] = tuple(ev.replica_group)
                if ev.replica_group is not None or ev.regrid_unit is not None:
                    self.memory.disk.expect_dtensors()  # a mesh: its state is DTensors
                if ev.regrid_unit is not None:  # (its generations are laid out so)
                    self.gens.regrid_unit = ev.regrid_unit
                self.last_entered = ev
                self._run.add(ev.type)
                odd = [s for s in ev.skipped if s.cause == "sdc"]
                if odd:  # found at the restore: every rank went back to a snapshot that agreed
                    return self._on_sdc_at_restore(ev, odd, job)
            case events.Done():
                return self._on_done(ev, job)
            case events.Ready():
                if w.spare:
                    self.table.spare_failures = 0
            case events.Wrapped():
                self.ledger.managed = True
            case events.FaultFired():
                self._on_inject(w, ev)
            case events.SdcReplayed():
                return self._on_replayed(ev, job)
            case events.SdcMismatch(gen=gen, step=step, suspects=suspects):
                if self.sdc.mismatch(gen, step, suspects, False):
                    self.display.warning(f"the replicas' parameters differ at step {step} (rank(s) "
                                         f"{suspects}); detect.sdc.action is report: training "
                                         "goes on")
            case events.NoSteps():
                return self._on_no_steps(ev, job)
            case events.StateNotKept():
                if (warning := self.ledger.state_not_kept(ev)) is not None:
                    self.display.warning(warning)
            case events.NanFound():
                return [RetryAsked()]
            case events.LossRuleFired():
                text, action = self.watchers.loss_rule_fired(ev)
                if action == "restart":
                    return [Faulted(Fault("loss_rule", rank=ev.rank, message=text))]
                if action == "fail":
                    return [GiveUp(Decision(Level.FAIL, reason="loss rule", diagnosis=text))]
        return []

    def _steps_learned(self) -> None:
        """The run may have just shown whether its steps can be counted: the incidents closed
        before it did say their steps lost."""
        if not self.ledger.steps_undecided():
            self.book.steps_decided(self.ledger.steps_known())

    def _on_done(self, ev: events.Done, job: JobView) -> list[Order]:
        self.ledger.done(ev)
        self._steps_learned()
        self._sdc_report(ev.gen, ev.sdc)
        if ev.final_persist is not None:
            self.final_persist = max(self.final_persist or 0, ev.final_persist)
        orders: list[Order] = [Reached(ev.step)]
        if job.phase is Phase.RUNNING and all(self.workers[x].done >= job.gen
                                              for x in job.plan.values()):
            if job.incident is not None:
                orders.append(CloseIncident(ev.t, ev.step))
            orders.append(Complete(ev.t))
        return orders

    def _on_inject(self, w: Worker, ev: events.FaultFired) -> None:
        if not ev.replay:  # an old one, replayed to a controller taking over: no start
            self.book.injected(ev.t, ev.kind)
        if ev.index is not None:  # fired once in the job: never again (any host)
            key = str(ev.index)
            self.gens.claimed[key] = self.gens.claimed.get(key, 0) + 1
        if ev.kind == "node_crash":  # the rest of the node dies with it
            for x in self.workers.values():
                if x.node == w.node and not x.dead:
                    # dead now, as on a machine that died: a rank that already left the
                    # generation (its peer gone) must not be taken for a survivor by a decision
                    # made before its SIGKILL's exit is read (its exit is still a crash)
                    x.dead = True
                    # the one that fired kills the node's memory, then itself: killed here
                    # first, the memory lived on (a node lost whole taken for ranks lost alone)
                    if x is not w:
                        self.agent.signal(x.wid)

    def first_steps(self, job: JobView) -> list[Order]:
        """After first steps: once every rank has taken one in this generation, the job has
        grown (or recovered, and the open incident closes)."""
        if job.phase is not Phase.RUNNING or \
                self.table.some_rank("first_step", job.plan, lambda w: w.first_gen != job.gen):
            return []  # (not every rank has stepped: nothing to do yet)
        ranks = [self.workers[wid] for wid in job.plan.values()]
        self.gens.trained_world = len(ranks)  # sharded state now has this size
        t_first = max(x.t_first for x in ranks)
        if job.incident is None:
            self.book.grown(t_first, job.gen, len(ranks))
            return []
        if not job.incident.levels:
            # nothing carried out for it yet (non-finite gradients reported by some ranks, not
            # all): these first steps were taken before its fault - a controller taking over
            # hears them replayed - and show no recovery
            return []
        return [CloseIncident(t_first, job.incident.resume_step)]

    def _on_left(self, w: Worker, ev: events.LeftGeneration, job: JobView) -> list[Order]:
        self._sdc_report(ev.gen, ev.sdc)
        orders: list[Order] = [Reached(ev.step, before_fault=True)]
        match ev.reason:
            case "regroup":
                self.book.left_to_grow(ev.t_caught, ev.step)
            case "exception":
                orders.append(Faulted(Fault("exception", rank=w.rank, message=ev.error or "",
                                            traceback=ev.traceback)))
            case "sdc":
                orders += self._on_sdc(ev, job)
            case "cuda_oom" if ev.cuda is not None:
                orders.append(Faulted(Fault(ev.cuda.kind, rank=w.rank, message=ev.cuda.describe(),
                                            tag=ev.cuda.name, traceback=ev.traceback)))
            case "internal":  # nonstop's own state code failed: not the training code's error
                orders.append(Faulted(Fault("internal", rank=w.rank, message=ev.error or "",
                                            traceback=ev.traceback)))
            case "setup":  # the script must change: a retry would fail the same way
                orders.append(Faulted(Fault("setup", rank=w.rank, message=ev.error or "",
                                            traceback=ev.traceback)))
            case "no_state":
                orders.append(Faulted(Fault("no_state", rank=w.rank, message=ev.error or "")))
            case _ if job.phase in ACTIVE:
                orders.append(Faulted(Fault("peer", rank=w.rank, message=ev.error or "")))
        if ev.t_pg is not None:  # after any fault it raised
            orders.append(GroupFormed(ev.t_pg))
        return orders

    def _on_sdc(self, ev: events.LeftGeneration, job: JobView) -> list[Order]:
        """The replicas' parameters differ (every rank found the same, at a comparison). A
        corruption: no rank may resume from state newer than the last snapshot, which was
        compared and agreed, and every rank goes back to it in its own process - none is
        replaced yet: with two replicas the digests cannot say which one is wrong, and with
        more, the restore repairs the parameters as a new process would, on the same device.
        Redone from the same inputs, the steps name the faulty rank (``_on_replayed``). Found
        at such a replay, with one rank's passes parting first: that rank's fault recurs - it
        gets a new process, and the job goes back again. A divergence (the twins split into
        groups, or differ again the same way after a rollback): the job stops with a diagnosis
        - no rank or node is at fault."""
        if ev.sdc_step is None:
            return []
        step, suspects = ev.sdc_step, list(ev.suspects or [])
        digests = dict(enumerate(ev.digests or []))
        twins = dict(enumerate(ev.twins)) if ev.twins is not None else None
        if not self.sdc.mismatch(job.gen, step, suspects):
            return []
        found = None
        if ev.sdc_evidence is not None:
            candidates = range(len(job.plan)) if ev.sdc_scheduled else \
                self.sdc_judge.candidates(step)
            found = sdc_verdicts.attribute(step, candidates, _parted(ev.sdc_evidence),
                                           agreed=False)
            if found is not None:
                self._attributed(found, job.gen, ev.sdc_evidence, digests, ev.sdc_scheduled)
        named = found.rank if found is not None else None
        if ev.sdc_scheduled:
            if named is None:  # no two passes alike on every rank, none of them first
                return self._irreproducible(step, found, job)
            self.sdc.found[-1].update(verdict=sdc_verdicts.CORRUPTION)
        else:
            verdict, orders = self._judge_sdc(step, digests, suspects, job.gen + 1, job, twins,
                                              named)
            if verdict is None:
                return orders
        self.gens.not_after = step - 1
        if named is not None:
            return [Faulted(Fault("sdc", rank=named, message=(
                f"its replay of the steps to {step} differs again ({found.why}): it gets a new "
                "process, and every rank resumes from the last snapshot that agreed")))]
        ranks = ", ".join(map(str, suspects))
        return [Faulted(Fault("sdc", message=(
            f"rank(s) {ranks}: parameters differ from their {'twins' if twins else 'replicas'}' "
            f"at step {step} (digests {ev.digests}): every rank resumes in place from the last "
            "snapshot that agreed, and the replay of the steps names the faulty rank")))]

    def _on_replayed(self, ev: events.SdcReplayed, job: JobView) -> list[Order]:
        """Rank 0: a replay of the steps to a comparison agreed, with every rank's evidence -
        the twins again after a corruption's rollback, or a majority of three passes at a
        replay check of the policy's. The rank whose passes part first is named (transient:
        its fault did not recur), logged with the evidence, and counted against its node."""
        candidates: Any = range(len(ev.digests)) if ev.scheduled else \
            self.sdc_judge.candidates(ev.step)
        if not candidates:
            return []  # (no mismatch known at that step)
        found = sdc_verdicts.attribute(ev.step, candidates, _parted(ev.evidence), agreed=True)
        if found is None or (found.rank is None and ev.step in self._named):
            return []  # (its rank named already: replaced, the replay after it agreed)
        if ev.scheduled:  # found by the check itself, and repaired by the majority of passes
            self.sdc.mismatch(ev.gen, ev.step, [found.rank] if found.rank is not None
                              else list(candidates))
            self.sdc.found[-1].update(verdict=sdc_verdicts.CORRUPTION)
        self._attributed(found, ev.gen, ev.evidence, dict(enumerate(ev.digests)), ev.scheduled,
                         ev.struck)
        if found.rank is None:
            return []
        return [Attributed(Fault("sdc", rank=found.rank, message=found.why))]

    def _attributed(self, found: sdc_verdicts.Attribution, gen: int,
                    evidence: list[events.ReplayEvidence], digests: dict[int, int],
                    scheduled: bool, struck: int | None = None) -> None:
        """The replay's verdict in the event log (``sdc_attributed``), with its evidence, and
        in the summary's record of the mismatch."""
        if found.rank is not None:
            self._named[found.step] = found.rank
        node = self.gens.node_of().get(found.rank) if found.rank is not None else None
        original = {} if scheduled else self.sdc_judge.original(found.step)
        self.log.write("sdc_attributed", step=found.step, gen=gen, verdict=found.verdict,
                       rank=found.rank, node=node, candidates=list(found.candidates),
                       at=None if found.at is None else {"step": found.at[0],
                                                         "point": found.at[1]},
                       why=found.why, scheduled=scheduled, struck=struck,
                       original={str(r): d for r, d in sorted(original.items())},
                       replayed={str(r): d for r, d in sorted(digests.items())},
                       evidence=[dataclasses.asdict(e) for e in evidence])
        for f in self.sdc.found:  # (a corruption found again as it was redone: each record)
            if f["step"] == found.step and (found.rank is not None or "attributed" not in f):
                f.update(attributed=found.rank, attribution=found.verdict)
        where = f" (node {node})" if node is not None else ""
        said = (f"rank {found.rank}{where}" if found.rank is not None else "no single rank")
        self.display.warning(f"silent corruption at step {found.step}: the replay names {said}: "
                             f"{found.why}")

    def _irreproducible(self, step: int, found: sdc_verdicts.Attribution | None,
                        job: JobView) -> list[Order]:
        """A replay check of the policy's found three passes over a step, no two alike on every
        rank and no rank first: the step does not replay bit for bit (or a fault struck every
        rank alike). No rank or node is at fault; the job stops with a diagnosis."""
        self.sdc.found[-1].update(verdict=sdc_verdicts.DIVERGENCE, repaired=False)
        why = found.why if found is not None else "no rank's passes differ"
        diagnosis = (f"step {step - 1} does not replay bit for bit: three passes over it from the "
                     f"same state came out differently ({why}). A replay check "
                     "(detect.sdc.replay_every) needs training that is reproducible bit for bit - "
                     "data, dropout and every other random draw a function of the step "
                     "(ctx.steps(reseed=...)), every object that changes with the steps "
                     "registered in the nonstop.State; no rank or node was isolated for it")
        self.log.write("sdc_divergence", step=step, gen=job.gen, groups=[], diagnosis=diagnosis)
        if job.over:
            return []
        return [GiveUp(Decision(Level.FAIL, reason="a step does not replay bit for bit",
                                diagnosis=diagnosis))]

    def _on_sdc_at_restore(self, ev: events.EnteredGeneration, odd: list[events.SkippedCopy],
                           job: JobView) -> list[Order]:
        """Live states of one step differed when a generation formed (each rank reports the same
        finding): every rank was restored from a snapshot that agreed - or the replicas diverge.
        Each odd copy carries the digests of its twin group (the ranks holding its part, at its
        step): judged group by group."""
        first = odd[0]
        step = first.step if first.step is not None else (ev.step or 0)
        ranks = [s.rank for s in odd if s.rank is not None]
        if not self.sdc.mismatch(ev.gen, step, ranks):
            return []
        digests: dict[int, int] = {}
        twins: dict[int, int] = {}
        for part, s in enumerate(odd):
            for r, d in (s.digests or {}).items():
                if int(r) not in digests:
                    digests[int(r)], twins[int(r)] = d, part
        verdict, orders = self._judge_sdc(step, digests, ranks, ev.gen, job, twins)
        if verdict is not None:
            self.display.warning(f"rank(s) {ranks}: live parameters differed from their replicas' "
                                 f"at step {step}: every rank restored from a snapshot that agreed")
        return orders

    def _sdc_report(self, gen: int, stats: events.DigestChecks | None) -> None:
        """A rank's comparisons in a generation it leaves or ends: for the summary, and - some
        agreed - the corruption rolled back before them happened once."""
        self.sdc.report(gen, stats)
        if stats is not None and stats.checks:
            self.sdc_judge.agreed(gen)

    def _judge_sdc(self, step: int, digests: dict[int, int], suspects: list[int],
                   redo_gen: int, job: JobView, twins: dict[int, int] | None = None,
                   named: int | None = None) -> tuple[Any, list[Order]]:
        """A corruption's verdict (None: a divergence, and the order to stop the job for it).
        ``redo_gen``: the first generation that redoes the steps after its rollback; ``twins``:
        the part each rank holds (each twin group judged on its own); ``named``: the rank a
        replay found faulty again."""
        if not any(len(set(p.values())) > 1 for p in sdc_verdicts.twin_groups(digests, twins)):
            # not said: each suspect alone, the others agreeing
            world = max(len(job.plan), max(suspects, default=0) + 1)
            digests = {r: (r + 1 if r in suspects else 0) for r in range(world)}
            twins = None
        verdict = self.sdc_judge.judge(step, digests, self.gens.node_of(), redo_gen, twins,
                                       named)
        self.sdc.found[-1]["verdict"] = verdict.kind
        if verdict.kind == sdc_verdicts.CORRUPTION:
            return verdict, []
        self.sdc.found[-1]["repaired"] = False
        self.log.write("sdc_divergence", step=step, gen=job.gen,
                       groups=[list(g) for g in verdict.groups], diagnosis=verdict.diagnosis)
        if job.over:
            return None, []
        return None, [GiveUp(Decision(Level.FAIL, reason="the replicas diverge",
                                      diagnosis=verdict.diagnosis))]

    def _on_no_steps(self, ev: events.NoSteps, job: JobView) -> list[Order]:
        diagnosis, warning = self.ledger.no_steps(ev)
        self._steps_learned()
        if diagnosis is not None and not job.over:
            return [GiveUp(Decision(Level.FAIL, reason="injected faults cannot fire",
                                    usage_error=True, diagnosis=diagnosis))]
        if warning is not None:
            self.display.warning(warning)
        return []

    # == progress ================================================================================
    def read_progress(self, job: JobView, share: float = 1.0) -> list[Order]:
        """The ranks' newest progress records: their steps, rank 0's snapshot numbers, the
        hang and straggler signals (and the hang timeout, tuned from the steps' times).

        ``share``: the part of the plan's ranks read now (at least one), on from where the last
        share ended: a controller of 16,384 ranks reads a slice at each turn of its loop rather
        than all of them at once (0.1-0.2 s), so that a fault is never kept waiting that long."""
        wids = list(job.plan.values())
        n = len(wids)
        if share < 1.0 and n:
            k = min(n, max(1, math.ceil(n * share)))
            at = self._progress_at % n
            wids = wids[at:at + k] + wids[:max(0, at + k - n)]
            self._progress_at = (at + k) % n
        ranks = [self.workers[wid] for wid in wids]
        self.progress.every_s = sample_every(n)
        newest = 0
        for w, rec in self.table.read_progress(ranks):
            newest = max(newest, w.take_progress(rec, job.gen))
            self.progress.take(w.wid, w.rank, w.node, rec)
            if w.rank == 0 and rec.snap is not None:  # (for the summary and the metrics)
                self.snap_stats = dataclasses.asdict(rec.snap)
            self.watchers.signals.on_progress(w, rec, job.gen)
        tuned = self.watchers.signals.timeout_changed()
        if tuned is not None:
            self.log.write("hang_timeout", timeout_s=round(tuned, 3),
                           first_step_s=round(self.watchers.signals.hang.first_step_timeout(), 3))
        return [Reached(newest)] if newest else []


def _parted(evidence: list[events.ReplayEvidence]) -> dict[int, tuple[int, int] | None]:
    """Where each rank's passes first differ, as ``attribute`` takes it (a rank with no record
    of its first pass left out)."""
    return {e.rank: None if e.step is None or e.point is None else
            (e.step, sdc_verdicts.POINTS.index(e.point)) for e in evidence if e.compared}

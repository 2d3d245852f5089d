"""What the ranks report to the controller (``controller.py``): their events (entered, first
step, left, done, NaN, injections, silent corruption...) and their progress, and what each means
for the job. A mixin of ``Controller``: the same state, one concept per module."""

from __future__ import annotations

from typing import Any

from ..decide.ladder import Decision, Fault, Level
from ..observe.progress import sample_every
from ..protocol import events
from . import machine as mc
from .phase import ACTIVE, Phase
from .workers import Worker

DEFERRED = ("entered", "first_step")  # judged after a run of them (_read_events)
# events about a generation: taken only from a rank of the current one
ABOUT_GEN = (events.EnteredGeneration, events.FirstStep, events.LeftGeneration, events.NanFound,
             events.LossRuleFired, events.Done)


class WorkerEvents:
    # == worker events ==========================================================================
    def _read_events(self) -> None:
        # A run of "entered" and "first_step" events is judged once, after its last one: what
        # the job as a whole does next depends on all of its ranks, and judging after each of
        # 16,384 ranks would cost the job's size squared. Any other event ends the run first, so
        # the order of what the controller does is the events' order. (Within a run, a rank's
        # first step follows its entry: the entries are judged first.)
        self._deferred = set()
        for ev in self.table.read_events():
            if self._deferred and ev.type not in DEFERRED:
                self._judge_deferred()
            self._on_event(ev, defer=True)
        self._judge_deferred()
        refused, self.table.refused = self.table.refused, []
        for text in refused:
            self.display.warning(text)

    def _judge_deferred(self) -> None:
        kinds, self._deferred = self._deferred, set()
        # (the machine forms the generation once every rank has entered it, and does nothing
        # else on an entry: the job's view is built only then)
        if "entered" in kinds and self.phase is Phase.RENDEZVOUS and \
                not self._some_rank("enter", lambda w: w.entered < self.gen):
            self._step(mc.Entered(self._seen()))
        if "first_step" in kinds:
            self._first_steps()

    def _on_event(self, ev: events.RankEvent, defer: bool = False) -> None:
        w = self.workers.get(ev.wid)
        if w is None:
            return
        if isinstance(ev, ABOUT_GEN) and (ev.gen != self.gen or self.plan.get(ev.rank) != w.wid):
            return  # about an older generation
        w.take_event(ev)
        match ev:
            case events.Ready():
                if w.spare:
                    self.table.spare_failures = 0
            case events.Wrapped():
                self.ledger.managed = True
            case events.FaultFired():
                self._on_inject(w, ev)
            case events.SdcMismatch(gen=gen, step=step, suspects=suspects):
                if self.sdc.mismatch(gen, step, suspects, False):
                    self.display.warning(f"the replicas' parameters differ at step {step} (rank(s) "
                                         f"{suspects}); detect.sdc.action is report: training "
                                         "goes on")
            case events.NoSteps():
                self._on_no_steps(ev)
            case events.EnteredGeneration():
                if ev.sharded is not None:
                    self.memory.sharded = ev.sharded
                if ev.nccl:  # its aborts take NCCL's time: the teardown allows for it
                    self.nccl = True
                odd = [s for s in ev.skipped if s.cause == "sdc"]
                if odd:  # found at the restore: every rank went back to a snapshot that agreed
                    self._on_sdc_at_restore(ev, odd)
                self._last_entered = ev
                if defer:
                    self._deferred.add(ev.type)
                else:
                    self._step(mc.Entered(self._seen()))
            case events.FirstStep():
                self._on_first_step(w, ev)
                if defer:
                    self._deferred.add(ev.type)
                else:
                    self._first_steps()
            case events.LeftGeneration():
                self._on_left(w, ev)
            case events.NanFound():
                self._step(mc.RetryAsked(self._seen()))
            case events.LossRuleFired():
                self._on_loss_rule(ev)
            case events.Done():
                self.ledger.done(ev)
                self._sdc_report(ev.gen, ev.sdc)
                if ev.final_persist is not None:
                    self.final_persist = max(self.final_persist or 0, ev.final_persist)
                self.max_step = max(self.max_step, ev.step)
                if self.phase is Phase.RUNNING and all(self.workers[x].done >= self.gen
                                                       for x in self.plan.values()):
                    if self.incident is not None:
                        self._close_incident(ev.t, ev.step)
                    self._training_complete(ev.t)

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
                    self.agent.signal(x.wid)

    def _on_first_step(self, w: Worker, ev: events.FirstStep) -> None:
        stepless = not ev.steps  # its marks are its steps (no ctx.steps)
        self.ledger.first_step(stepless)
        self.watchers.signals.on_first_step(w, ev.t, stepless=stepless)
        self.max_step = max(self.max_step, ev.step)

    def _first_steps(self) -> None:
        """After first steps: once every rank has taken one in this generation, the job has
        grown (or recovered, and the open incident closes)."""
        if self.phase is not Phase.RUNNING or \
                self._some_rank("first_step", lambda w: w.first_gen != self.gen):
            return  # (not every rank has stepped: nothing to do yet)
        ranks = self._ranks()
        self.gens.trained_world = len(ranks)  # sharded state now has this size
        if self.incident is None:
            self.book.grown(max(x.t_first for x in ranks), self.gen, len(ranks))
        else:
            self._close_incident(max(x.t_first for x in ranks), self.incident.resume_step)

    def _on_loss_rule(self, ev: events.LossRuleFired) -> None:
        text, action = self.watchers.loss_rule_fired(ev)
        if action == "restart":
            self._fault(Fault("loss_rule", rank=ev.rank, message=text))
        elif action == "fail":
            self._fail(Decision(Level.FAIL, reason="loss rule", diagnosis=text))

    def _on_left(self, w: Worker, ev: events.LeftGeneration) -> None:
        self.max_step = max(self.max_step, ev.step)
        self._sdc_report(ev.gen, ev.sdc)
        if self.incident is not None:
            self.incident.step_before = max(self.incident.step_before, ev.step)
        match ev.reason:
            case "regroup":
                self.book.left_to_grow(ev.t_caught, ev.step)
            case "exception":
                self._fault(Fault("exception", rank=w.rank, message=ev.error or "",
                                  traceback=ev.traceback))
            case "sdc":
                self._on_sdc(ev)
            case "cuda_oom" if ev.cuda is not None:
                self._fault(Fault(ev.cuda.kind, rank=w.rank, message=ev.cuda.describe(),
                                  tag=ev.cuda.name, traceback=ev.traceback))
            case "no_state":
                self._fault(Fault("no_state", rank=w.rank, message=ev.error or ""))
            case _ if self.phase in ACTIVE:
                self._fault(Fault("peer", rank=w.rank, message=ev.error or ""))
        if self.incident is not None and ev.t_pg is not None:  # after any fault it raised
            self.incident.group_formed(ev.t_pg)

    def _on_sdc(self, ev: events.LeftGeneration) -> None:
        """The replicas' parameters differ (every rank found the same, at a snapshot step). A
        corruption: the ranks that differ are at fault, and no rank may resume from state newer
        than the last snapshot, which was compared and agreed. A divergence (the replicas split
        into groups, or differ again after a rollback): the job stops with a diagnosis - no rank
        or node is at fault."""
        if ev.sdc_step is None:
            return
        step, suspects = ev.sdc_step, list(ev.suspects or [])
        digests = dict(enumerate(ev.digests or []))
        if not self.sdc.mismatch(self.gen, step, suspects):
            return
        verdict = self._judge_sdc(step, digests, suspects, self.gen + 1)
        if verdict is None:
            return
        self.gens.not_after = step - 1
        for r in verdict.suspects:
            self._fault(Fault("sdc", rank=r, message=(
                f"its parameters differ from its replicas' at step {step} (digests "
                f"{ev.digests}): every rank resumes from the last snapshot that agreed")))

    def _on_sdc_at_restore(self, ev: events.EnteredGeneration,
                           odd: list[events.SkippedCopy]) -> None:
        """Live states of one step differed when a generation formed (each rank reports the same
        finding): every rank was restored from a snapshot that agreed - or the replicas diverge."""
        first = odd[0]
        step = first.step if first.step is not None else (ev.step or 0)
        ranks = [s.rank for s in odd if s.rank is not None]
        if not self.sdc.mismatch(ev.gen, step, ranks):
            return
        digests = {int(r): d for r, d in (first.digests or {}).items()}
        if self._judge_sdc(step, digests, ranks, ev.gen) is not None:
            self.display.warning(f"rank(s) {ranks}: live parameters differed from their replicas' "
                                 f"at step {step}: every rank restored from a snapshot that agreed")

    def _sdc_report(self, gen: int, stats: events.DigestChecks | None) -> None:
        """A rank's comparisons in a generation it leaves or ends: for the summary, and - some
        agreed - the corruption rolled back before them happened once."""
        self.sdc.report(gen, stats)
        if stats is not None and stats.checks:
            self.sdc_judge.agreed(gen)

    def _judge_sdc(self, step: int, digests: dict[int, int], suspects: list[int],
                   redo_gen: int) -> Any:
        """A corruption's verdict (None: a divergence, and the job is being stopped for it).
        ``redo_gen``: the first generation that redoes the steps after its rollback."""
        from ..decide import sdc

        if len(set(digests.values())) < 2:  # not said: each suspect alone, the others agreeing
            world = max(len(self.plan), max(suspects, default=0) + 1)
            digests = {r: (r + 1 if r in suspects else 0) for r in range(world)}
        verdict = self.sdc_judge.judge(step, digests, self.gens.node_of(), redo_gen)
        self.sdc.found[-1]["verdict"] = verdict.kind
        if verdict.kind == sdc.CORRUPTION:
            return verdict
        self.sdc.found[-1]["repaired"] = False
        self.log.write("sdc_divergence", step=step, gen=self.gen,
                       groups=[list(g) for g in verdict.groups], diagnosis=verdict.diagnosis)
        if self.outcome.exit_code is None:
            self._fail(Decision(Level.FAIL, reason="the replicas diverge",
                                diagnosis=verdict.diagnosis))
        return None

    def _on_no_steps(self, ev: events.NoSteps) -> None:
        diagnosis, warning = self.ledger.no_steps(ev)
        if diagnosis is not None and self.outcome.exit_code is None:
            self._fail(Decision(Level.FAIL, reason="injected faults cannot fire", usage_error=True,
                                diagnosis=diagnosis))
        elif warning is not None:
            self.display.warning(warning)

    def _waiting_for_a_rank_to_leave(self, now: float) -> bool:
        """A generation tears down, before its deadline, and a rank has still to leave it: the
        machine's tick has nothing to do. Told from the workers' records (a job of 16,384 ranks
        would otherwise be judged whole every turn of the loop, 2 ms apart, while their events
        come in)."""
        s = self.state
        if s.phase is not Phase.TEARING_DOWN or now > s.deadline:
            return False
        return self._some_rank("leave", lambda w: mc.still_to_leave(w, s.gen, self.managed))

    def _some_rank(self, what: str, pred: Any) -> bool:
        """Whether ``pred`` holds for some rank of the plan, looked for from the rank where the
        last look for ``what`` found one: asked after every batch of events while thousands of
        ranks report one by one, this stays about one test per rank in all, not one per rank
        per batch."""
        wids = list(self.plan.values())
        if not wids:
            return False
        start = self._hints.get(what, 0) % len(wids)
        for i in range(len(wids)):
            k = (start + i) % len(wids)
            if pred(self.workers[wids[k]]):
                self._hints[what] = k
                return True
        return False

    # == progress ===============================================================================
    def _read_progress(self) -> None:
        ranks = self._ranks()
        self.progress.every_s = sample_every(len(ranks))
        for w, rec in self.table.read_progress(ranks):
            self.max_step = max(self.max_step, w.take_progress(rec, self.gen))
            self.progress.take(w.wid, w.rank, w.node, rec)
            if w.rank == 0 and rec.get("snap"):
                self.snap_stats = rec["snap"]
            self.watchers.signals.on_progress(w, rec, self.gen)
        tuned = self.watchers.signals.timeout_changed()
        if tuned is not None:
            self.log.write("hang_timeout", timeout_s=round(tuned, 3),
                           first_step_s=round(self.watchers.signals.hang.first_step_timeout(), 3))

    def snapshot(self) -> dict[str, Any]:
        return {"gen": self.gen, "phase": self.phase, **self.table.status(self.plan),
                "incidents": self.book.count, "max_step": self.max_step}

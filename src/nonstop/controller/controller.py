"""The controller: the executor of the job's state machine (``machine.py``), and its measurements.

One loop, top to bottom: wait for process exits and output (the agent), read the ranks' events from
the mail, check deadlines. What it sees becomes an observation; the machine answers with the new
state and commands (abort a generation, kill a process, carry out a decision, publish the next
generation, give up), which are carried out here and in ``generations.py``. The incidents are
measured in ``book.py``.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import signal
import time
from pathlib import Path
from typing import Any

from .. import protocol
from ..decide.ladder import Counters, Decision, Fault, Level
from ..decide import preemption
from ..decide.sdc import Judge as SdcJudge
from ..observe.events import EventLog
from ..observe.incidents import Incident
from ..observe.progress import ProgressLog
from ..observe.status import StatusWriter
from ..policy import Policy
from ..protocol import hosts as keys
from ..protocol.hosts import progress_every
from ..protocol.requests import DrainRequest
from .keepers import Keepers
from . import machine as mc
from .account import JobAccount
from .book import IncidentBook
from .ending import Outcome
from .generations import Generations
from .hearing import HeardAgain, Hearing, Unheard
from .ledger import SdcBook, TrainingLedger
from .requests import Preemptions, RefusedRequest, Requests
from .phase import ACTIVE, ENDING, Phase
from .ports import Processes
from .watchers import Command, Watchers
from .exits import ProcessExits
from . import worker_events as reports
from .workers import Worker, WorkerTable

TICK_BUSY_S = 0.002  # loop period while survivors leave a failed generation
TICK_WAIT_S = 0.02  # ...while a generation forms
TICK_IDLE_S = 0.05  # ...while it trains
# While a recovery is under way, the ranks' progress is read this many times less often (and not
# at all while the generation is torn down): the events that drive it come first (reading 16,384
# ranks' records takes the loop 0.1-0.2 s), and what the recovery's own checks read from progress
# (a rank stuck in its code while its group forms) is judged over seconds.
PROGRESS_SLOWER_IN_RECOVERY = 3
SCAN_PER_RANK_S = 10e-6  # the whole job is looked at no more often than this, a rank (_check)
# the loop did not look at the job this long (a slow call, its process paused, a starved
# machine): what it read since is stale, and that time is not counted against the ranks (the
# steady hang timeout's floor)
STALL_S = 1.0


class Controller:
    def __init__(self, *, world: int, spares: int, policy: Policy, mail: Any, agent: Processes,
                 log: EventLog, display: Any, managed: bool, nodes: int = 1, spare_nodes: int = 0,
                 run_dir: Path | None = None):
        self.world = world
        self.watchers = Watchers(policy, log, display)
        self.ledger = TrainingLedger(managed)
        self.sdc = SdcBook()  # the replicas' comparisons, for the summary
        self.sdc_judge = SdcJudge()  # a corruption, or a divergence (decide/sdc.py)
        self.policy = policy
        self.mail = mail
        self.agent = agent
        self.log = log
        self.display = display
        run_id = (run_dir.name if run_dir is not None else "") or "run"
        self.memory = Keepers(policy, agent, log, display, run_id, agent.new_wid)
        self.table = WorkerTable(agent, mail, log, "script" if managed else "import",
                                 keeper_of=self.memory.name)
        self.workers = self.table.workers
        self.book = IncidentBook(log, display)
        self.state = mc.JobState()
        self._dispatching = False  # the machine's commands are being carried out (_step)
        self.gens = Generations(world=world, spares=spares, nodes=nodes, spare_nodes=spare_nodes,
                                policy=policy, mail=mail, table=self.table, memory=self.memory,
                                watchers=self.watchers, log=log, display=display)
        self.plan = self.gens.plan  # rank -> wid, for the current generation
        self._next_scan = 0.0  # when the whole job is looked at again (_check)
        self._t_running = 0.0  # when the current generation formed on every rank
        self._t_retry = 0.0  # when its ranks were last told to redo a step
        self.hearing = Hearing(STALL_S)  # whether it can prove it hears the job
        self.progress = ProgressLog(run_dir)  # the ranks' steps as they completed
        self.job_account = JobAccount(self.progress)  # the whole job's time, counted
        self.exits = ProcessExits(self.workers, self.memory, self.gens, self.progress, log, display)
        self.reports = reports.RankReports(
            table=self.table, ledger=self.ledger, book=self.book, gens=self.gens,
            memory=self.memory, sdc=self.sdc, sdc_judge=self.sdc_judge, watchers=self.watchers,
            progress=self.progress, agent=agent, log=log, display=display)
        self.metrics: Any = None  # observe.metrics.JobMetrics, with --metrics-port
        self.status = StatusWriter(run_dir)  # for nonstop status
        self.outcome = Outcome(policy=policy, log=log, display=display, agent=agent,
                               table=self.table, memory=self.memory, book=self.book,
                               run_dir=run_dir)
        self._last_progress = 0.0
        self._progress_turn = 0.0  # when the last share of the ranks' progress was counted
        self._progress_owed = 0.0  # the share of them owed a read since (1.0: all)
        self.max_step = 0
        self.resumed_at: int | None = None  # the step the job last resumed from (an incident's)
        self.resumed_gen = 0  # ...in this generation
        self.requests = Requests(run_dir)  # from outside the job: nonstop drain
        self.preempts = Preemptions(self.log)  # hosts a scheduler told to stop
        self._release: set[int] = set()  # isolated nodes whose hosts go once a generation formed

    # == what others read ========================================================================
    @property
    def managed(self) -> bool:
        """Whether the ranks run inside nonstop.wrap (a plain script cannot leave a collective)."""
        return self.ledger.managed

    @property
    def phase(self) -> Phase:
        return self.state.phase

    @property
    def gen(self) -> int:
        return self.state.gen

    @property
    def counters(self) -> Counters:
        return self.state.counters

    @property
    def incident(self) -> Incident | None:
        return self.book.open

    @property
    def incidents(self) -> list[Incident]:
        return self.book.closed

    @property
    def total_nodes(self) -> int:
        return self.gens.total_nodes

    @property
    def _recovering(self) -> bool:
        """A generation is being left or formed, or has not completed its first step."""
        return self.phase in (Phase.TEARING_DOWN, Phase.RENDEZVOUS) or self.book.open is not None

    @property
    def _progress_s(self) -> float:
        """How often the ranks' progress is read: as often as the hosts send it (a big job's
        less often; one host's every 0.1 s)."""
        return progress_every(self.gens.total_nodes)

    # == the loop ===============================================================================
    def run(self) -> int:
        if self.gen < 0:  # a new job (a controller taking over has adopted one: see adopt)
            self._start()
        while self.outcome.exit_code is None:
            tick = (TICK_BUSY_S if self.phase is Phase.TEARING_DOWN else
                    TICK_IDLE_S if self.phase is Phase.RUNNING else TICK_WAIT_S)
            exited = self.agent.poll(tick)
            self._read_events()
            for proc in exited:
                self._on_exit(proc)
            now = time.time()
            self._read_progress(now)
            if now - self._last_progress >= self._progress_s:
                self._last_progress = now
                if self.display.wants_status(now):
                    self.display.status(self.snapshot())
                if self.metrics is not None:
                    self.metrics.update(self, now)
                self.status.maybe(self, now)
            self._check(now)
            if self.outcome.exit_code is None:
                # a node already faulted in the open incident is not reported again
                self._act(self.watchers.poll_health(now, self.state.faulty_nodes,
                                                    self.gens.busy_nodes))
            self.memory.poll()
            self._check_keepers(now)
            self.log.flush()
        self.watchers.close()
        return self.outcome.exit_code

    def _on_exit(self, proc: Any) -> None:
        """A process ended: what it means (``exits.py``), carried out."""
        what = self.exits.on_exit(proc, self)
        if what.reached is not None:
            self._reached_step(what.reached)
        if what.diagnosis is not None and self.outcome.diagnosis is None:
            self.outcome.diagnosis = what.diagnosis
        if what.refill_spares:
            self._refill_spares()
        if what.complete_at is not None:
            self._training_complete(what.complete_at)
        if what.fault is not None:
            self._fault(what.fault)

    # == the facts its collaborators judge against (a facts.JobView) ===========================
    @property
    def leaving(self) -> set[int]:
        """Nodes whose hosts were told to stop (preempted)."""
        return self.preempts.told

    @property
    def over(self) -> bool:
        """The job's exit code is known: it is ending."""
        return self.outcome.exit_code is not None

    # == what the ranks report (worker_events.py) ================================================
    def _read_events(self) -> None:
        """The ranks' new events, each judged against the job as the ones before it left it; a
        run of entries and first steps judged once, after its last (``RankReports``)."""
        r = self.reports
        for ev in self.table.read_events():
            if r.ends_run(ev):
                self._judge_run()
            self._carry_out_orders(r.on_event(ev, self))
        self._judge_run()
        refused, self.table.refused = self.table.refused, []
        for text in refused:
            self.display.warning(text)

    def _judge_run(self) -> None:
        entries, first_steps = self.reports.take_run()
        if entries:
            self._carry_out_orders(self.reports.entries(self))
        if first_steps:  # (the generation may have formed on the entries)
            self._carry_out_orders(self.reports.first_steps(self))

    def _read_progress(self, now: float) -> None:
        """A share of the ranks' progress at each turn, every rank's once a period
        (``_progress_s``; slower while a recovery is under way, and not at all while a generation
        is torn down: its ranks' leaving says what the teardown needs, their steps included, and
        a newest record waits in the mail until it is read)."""
        if self.phase is Phase.TEARING_DOWN:
            self._progress_turn = now
            return
        period = self._progress_s * (PROGRESS_SLOWER_IN_RECOVERY if self._recovering else 1)
        self._progress_owed += (now - self._progress_turn) / period
        self._progress_turn = now
        if self._progress_owed * len(self.plan) >= 1.0:
            share, self._progress_owed = min(self._progress_owed, 1.0), 0.0
            self._carry_out_orders(self.reports.read_progress(self, share))

    def _carry_out_orders(self, orders: list[reports.Order]) -> None:
        """What the ranks' reports say the job must do, in order."""
        for o in orders:
            match o:
                case mc.Entered() | mc.RetryAsked() | mc.Attributed():
                    self._step(dataclasses.replace(o, seen=self._seen()))
                case reports.Faulted(fault=fault):
                    self._fault(fault)
                case reports.GiveUp(decision=decision):
                    self._fail(decision)
                case reports.Reached(step=step, before_fault=True):
                    self._reached_step(step)
                case reports.Reached(step=step):
                    self.max_step = max(self.max_step, step)
                case reports.CloseIncident(t_first=t, resume_step=step):
                    self._close_incident(t, step)
                case reports.Complete(t=t):
                    self._training_complete(t)
                case reports.GroupFormed(t_pg=t_pg):
                    if self.book.open is not None:
                        self.book.open.group_formed(t_pg)
                case _:
                    raise TypeError(f"the controller has no case for {type(o).__name__}")

    def _waiting_for_a_rank_to_leave(self, now: float) -> bool:
        """A generation tears down, before its deadline, and a rank has still to leave it: the
        machine's tick has nothing to do. Told from the workers' records (a job of 16,384 ranks
        would otherwise be judged whole every turn of the loop, 2 ms apart, while their events
        come in)."""
        s = self.state
        if s.phase is not Phase.TEARING_DOWN or now > s.deadline:
            return False
        return self.table.some_rank("leave", self.plan,
                                    lambda w: mc.still_to_leave(w, s.gen, self.managed))

    def snapshot(self) -> dict[str, Any]:
        """The job's status, for the console."""
        return {"gen": self.gen, "phase": self.phase, **self.table.status(self.plan),
                "incidents": self.book.count, "max_step": self.max_step}

    def _reached_step(self, step: int) -> None:
        """A rank completed ``step``: the newest the job has reached (and, should the open
        incident roll back past it, lost)."""
        self.max_step = max(self.max_step, step)
        if self.incident is not None and step:
            self.incident.step_before = max(self.incident.step_before, step)

    def _check_keepers(self, now: float) -> None:
        if self.phase in ENDING:
            return
        self.memory.revive(now, lambda: {w.node for w in self.workers.values() if not w.dead},
                           self.phase is Phase.RUNNING and self.incident is None,
                           self.gens.node_of, lambda: self.state.usable_nodes(self.total_nodes))

    def _seen(self, now: float | None = None) -> mc.Seen:
        """The job as the machine sees it now."""
        now = time.time() if now is None else now
        ranks_seen = self.table.ranks_seen(self.plan, self.state.gen,
                                           self.state.phase is Phase.RENDEZVOUS)
        # a memory whose exit its host's agent reported, while that agent answers, is the memory
        # alone: the host is not lost (one that stopped answering may be the host cut off)
        lost = frozenset(n for n, h in self.memory.keepers.items() if h.lost and not h.killed
                         and not (h.exit_code is not None and self.agent.host_up(n)))
        busy = self.gens.busy_nodes()  # (kept until the plan changes: 16,384 ranks, every 2 ms)
        away = frozenset(n for n in range(self.gens.total_nodes)
                         if n not in busy and self.agent.host_away(n))
        return mc.Seen(now=now, ranks=ranks_seen, managed=self.managed,
                       total_nodes=self.gens.total_nodes, slots=self.gens.slots, lost_memory=lost,
                       slowest_step_s=self.watchers.signals.hang.slowest_step(),
                       abort_s=self.policy.timeouts.abort_s if self.reports.nccl else 0.0,
                       target_world=self.gens.target, ready_spares=self.gens.ready_spares(),
                       replica_groups=self.reports.replica_groups,
                       regrid_unit=self.gens.regrid_unit, replicas_on=self.memory.placed,
                       away=away, hosts_join=self.agent.takes_hosts)

    def _step(self, ob: mc.Observation) -> None:
        """One observation through the machine, its commands carried out in order; what a
        command's handler observed in turn (a probe's answer, an incident closed, the end) is fed
        next, once the commands before it are carried out: the machine is never re-entered while
        it is dispatching."""
        if self._dispatching:
            raise RuntimeError(f"the machine was re-entered with {type(ob).__name__} while it "
                               "dispatched: a handler must return what it observed")
        self._dispatching = True
        try:
            pending = [ob]
            while pending:
                self.state, commands = mc.step(self.state, pending.pop(0), self.policy)
                for c in commands:
                    pending += self._carry_out(c)
        finally:
            self._dispatching = False

    def _carry_out(self, c: mc.Command) -> list[mc.Observation]:
        """One command of the machine, by its type (tests/test_machine.py checks that every
        command type has its case here); what its handler observed."""
        match c:
            case mc.Raise():
                return self._do_Raise(c)
            case mc.Ignore():
                return self._do_Ignore(c)
            case mc.Interrupt():
                return self._do_Interrupt(c)
            case mc.AbortGeneration():
                return self._do_AbortGeneration(c)
            case mc.Kill():
                return self._do_Kill(c)
            case mc.Probe():
                return self._do_Probe(c)
            case mc.Decide():
                return self._do_Decide(c)
            case mc.CarryOut():
                return self._do_CarryOut(c)
            case mc.Regroup():
                return self._do_Regroup(c)
            case mc.DrainRefused():
                return self._do_DrainRefused(c)
            case mc.Publish():
                return self._do_Publish(c)
            case mc.Formed():
                return self._do_Formed(c)
            case mc.RetryOpened():
                return self._do_RetryOpened(c)
            case mc.WaitForHosts():
                return self._do_WaitForHosts(c)
            case mc.RedoStep():
                return self._do_RedoStep(c)
            case mc.Fail():
                return self._do_Fail(c)
            case mc.Finish():
                return self._do_Finish(c)
            case mc.JobOver():
                return self._do_JobOver(c)
            case mc.Missed():
                return self._do_Missed(c)
            case mc.Overdue():
                return self._do_Overdue(c)
            case _:
                raise TypeError(f"the controller has no handler for {type(c).__name__}")

    def _fault(self, fault: Fault, t_fault: float | None = None) -> None:
        self._step(mc.Faulted(self._seen(), fault, t_fault))

    def _act(self, commands: list[Command]) -> None:
        """Carry out what the watchers (health checks, log rules) found."""
        for c in commands:
            if c.action == "isolate":  # a node that holds no rank: just stop using it
                self._isolate(c.node)
                self._refill_spares()
            elif c.action == "hang":
                # the ranks holding the job up are ended at once: no need to wait for them to
                # fail to leave; the others, in a collective, leave when the generation aborts
                for wid, why in c.culprits.items():
                    self.table.kill(self.workers[wid], f"hung: {why}")
                self._fault(c.fault, t_fault=c.t_fault)
            elif c.action == "drain":  # a straggler, a failed health check: moved, no fault
                if c.fault.rank is not None:
                    self.drain((c.fault.rank,), why=f"{c.fault.kind}: {c.fault.message}")
                else:
                    self.drain(node=c.fault.node, why=c.fault.message)
            elif c.action == "replace":  # a straggler
                self.table.kill(self.workers[self.plan[c.fault.rank]], "straggler", dump=True)
                self._fault(c.fault)
            else:
                self._fault(c.fault)

    def prespawn(self) -> None:
        """Start the nodes' memory, the ranks and the warm spares. Called before the store is
        up (the launcher imports torch meanwhile): they connect to it once it is."""
        if self.plan:
            return
        self.log.write("run_start", attempt=self.log.attempt, pid=os.getpid(),
                       world=self.world, spares=self.gens.spares_target,
                       managed=self.managed, policy=self.policy.model_dump())
        self.memory.world = self.world
        self.memory.start(range(self.total_nodes))
        self.gens.first_plan()
        self._refill_spares()

    def _start(self) -> None:
        self.watchers.start(range(self.total_nodes), self.agent.health)
        self.prespawn()
        self._step(mc.Start(self._seen()))

    # == commands ================================================================================
    def _do_Raise(self, c: mc.Raise) -> list[mc.Observation]:
        self.book.fault(c.fault, time.time(), self.gen, self._reached(), c.t_fault)
        return []

    def _do_Ignore(self, c: mc.Ignore) -> list[mc.Observation]:
        self.log.write("fault_ignored", fault=c.fault.describe(), phase=self.phase)
        return []

    def _do_Interrupt(self, c: mc.Interrupt) -> list[mc.Observation]:
        self.book.interrupt(time.time(), c.phase, self.gen)
        return []

    def _do_AbortGeneration(self, c: mc.AbortGeneration) -> list[mc.Observation]:
        inc = self.book.open
        if inc is not None and inc.t_decide is None:
            inc.t_decide = self.state.t_abort
        if c.managed:
            self.mail.abort(c.gen, list(self.plan.values()))
        else:  # a plain script cannot leave a collective: end every rank process
            for wid in self.plan.values():
                self.workers[wid].killed = True  # its exit is ours, not a new fault
                self.agent.signal(wid, signal.SIGTERM)
        self.log.write("abort", gen=c.gen, managed=c.managed)
        return []

    def _do_Kill(self, c: mc.Kill) -> list[mc.Observation]:
        w = self.workers[c.wid]
        self.table.kill(w, c.why, dump=c.dump)
        if c.fault is not None:  # it overstayed the teardown
            if self.agent.host_away(w.node):
                # its host is away (cut off, lost): nothing reached it, no stack was dumped
                self.display.info(f"rank {w.rank} did not leave generation {self.gen} within "
                                  f"{c.late_s:.2f} s: its host (node {w.node}) does not answer; "
                                  "it is given up with its host")
            else:
                self.display.info(f"rank {w.rank} did not leave generation {self.gen} within "
                                  f"{c.late_s:.2f} s: killed; its stacks are in "
                                  f"{self.agent.procs[w.wid].log_path}")
            self.book.log_fault(c.fault, self.gen)
        return []

    def _do_Probe(self, c: mc.Probe) -> list[mc.Observation]:
        self.memory.confirm(c.nodes)
        return [mc.Tick(self._seen())]  # the decision, with what the memory said

    def _do_Decide(self, c: mc.Decide) -> list[mc.Observation]:
        d = c.decision
        extra = {"step": c.step} if c.step is not None else {
            "replace": sorted(d.replace), "isolate": sorted(d.isolate),
            "passed_over": list(d.passed_over), "escalated_from": c.escalated_from}
        self.log.write("decision", gen=c.gen, level=d.level.value, reason=d.reason, **extra,
                       counters=self.counters.record())
        inc = self.book.open
        if inc is not None and c.step is None:
            inc.t_torn = time.time()
            inc.levels.append(d.level.value)
        return []

    def _do_CarryOut(self, c: mc.CarryOut) -> list[mc.Observation]:
        d = c.decision
        for node in sorted(d.isolate):  # (the machine counts them isolated already)
            self._set_aside(node)
        if d.level is Level.JOB_RESTART:
            for wid in self.plan.values():
                self.table.kill(self.workers[wid], "job restart")
            if self.policy.state.emergency.on_job_restart:  # the memory survives; disk insures
                self.memory.emergency("job restart", self.state.faulty_nodes | set(d.isolate),
                                      self.gens.shut_node, wait_s=None, tick=lambda: None)
        isolated = self.counters.isolated
        if d.level in (Level.SCALE_IN, Level.SCALE_OUT):
            new = self.gens.resize(d, c.placement, isolated)
        else:
            new = self.gens.move(d, c.placement, self.book.open, isolated)
        self.gens.announce(d, c.gen)
        self.gens.publish(c.gen, initial=d.level is Level.JOB_RESTART, level=d.level.value,
                          usable=self.state.usable_nodes(self.total_nodes))
        if self.book.open is not None:
            self.book.open.gen_to = c.gen
        for w in new:
            self.table.spawn(w)
        self._refill_spares()
        return []

    def _do_Regroup(self, c: mc.Regroup) -> list[mc.Observation]:
        self.mail.abort(c.gen, list(self.plan.values()), regroup=True)
        self.book.regrouped(time.time(), c.gen, len(self.plan), self.max_step, c.drain)
        return []

    def _do_DrainRefused(self, c: mc.DrainRefused) -> list[mc.Observation]:
        self.log.write("drain_refused", asked=c.asked, why=c.why)
        self.display.warning(f"cannot drain {c.asked}: {c.why}")
        return []

    def drain(self, ranks: tuple[int, ...] = (), node: int | None = None, why: str = "asked") -> None:
        """Move ranks (or a node's) to warm spares at the next step boundary (``nonstop drain``,
        a preemption notice); refused, with a line, when it cannot be done now."""
        self._step(mc.Drain(self._seen(), ranks, node, why))

    def _do_Publish(self, c: mc.Publish) -> list[mc.Observation]:
        self.gens.publish(c.gen, initial=c.initial, level=c.level,
                          usable=self.state.usable_nodes(self.total_nodes))
        return []

    def _do_Formed(self, c: mc.Formed) -> list[mc.Observation]:
        # What the job holds now (every rank's record, its entry...) lives until the next
        # generation: out of the collector's sight. With 16,384 ranks a full collection took
        # 0.1-0.15 s every 0.7 s, in the middle of recoveries.
        gc.freeze()
        for node in sorted(self._release):
            self.agent.release(node, f"node {node} preempted: its ranks moved, the job goes on"
                               if node in self.preempts.told else
                               f"node {node} isolated: the job goes on without it")
        self._release.clear()
        ev = self.reports.last_entered
        assert ev is not None  # (formed: every rank entered)
        ranks = self._ranks()
        self._t_running = time.time()
        self.job_account.formed(self._t_running)
        self.watchers.logs.start(self._t_running, self.plan.keys())
        if not ev.replay:
            self.book.restored(self.gen, [x.entered_ev for x in ranks], self.ledger,
                               {x.rank: x.node for x in ranks})
        inc = self.book.open
        if inc is None:
            return []
        evs = [x.entered_ev for x in ranks if x.entered_ev is not None]
        self.book.formed(evs, ev.step)
        if ev.plain or not self.ledger.progress_seen:
            # no step or mark seen in this run (a plain script, or a function that shows
            # progress only by its collectives): recovered once it runs again, steps lost unknown
            return self._incident_closed(max(e.t for e in evs), None)
        return []

    def _do_RetryOpened(self, c: mc.RetryOpened) -> list[mc.Observation]:
        self.book.retry_opened(c.step, time.time(), self.gen, self._reached())
        return []

    def _do_RedoStep(self, c: mc.RedoStep) -> list[mc.Observation]:
        self._t_retry = time.time()
        self.book.retried(c.decision, c.step, self._t_retry)
        self.display.info(f"{c.decision.level.value} (generation {self.gen}) [{c.decision.reason}]")
        for wid in self.plan.values():
            w = self.workers[wid]
            w.retry_step, w.first_gen = None, -1  # the incident closes at the next step of all
            self.table.send(w, protocol.Retry(skip=c.decision.skip))
        return []

    def _do_WaitForHosts(self, c: mc.WaitForHosts) -> list[mc.Observation]:
        d = c.decision
        self.log.write("waiting_for_hosts", gen=self.gen, wanting=d.wanting, limit_s=c.limit_s,
                       reason=d.reason, diagnosis=d.diagnosis)
        self.display.warning(f"{d.diagnosis}: waiting up to {c.limit_s:g} s for hosts to join "
                         "(hosts.capacity_wait_s)")
        # the healthy hosts' memory holds the newest state: to disk too, should none join
        self.memory.emergency("waiting for hosts", self.state.faulty_nodes,
                              self.gens.shut_node, wait_s=None, tick=lambda: None)
        return []

    def _do_Fail(self, c: mc.Fail) -> list[mc.Observation]:
        return self._given_up(c.decision)

    def _do_Finish(self, c: mc.Finish) -> list[mc.Observation]:
        self.outcome.finish(self.gen, self.max_step, self._ranks(), self.managed,
                            self.ledger.unfired)
        return []

    def _do_JobOver(self, c: mc.JobOver) -> list[mc.Observation]:
        return self._ended(0 if self.outcome.diagnosis is None else 1)

    def _do_Missed(self, c: mc.Missed) -> list[mc.Observation]:
        self.log.deadline(c.what, c.limit_s, gen=c.gen, ranks=list(c.ranks), detail=c.detail)
        return []

    def _do_Overdue(self, c: mc.Overdue) -> list[mc.Observation]:
        self.outcome.overdue([self.workers[w] for w in c.wids], self.reports.final_persist)
        return self._ended(1)

    # == workers, spares, nodes ==================================================================
    def _refill_spares(self) -> None:
        if self.phase not in ENDING:
            self.gens.refill_spares(self.counters.isolated)

    def _isolate(self, node: int) -> None:
        """Never place a rank or a spare on this node again in this job; its host is released
        once the next generation has formed (its memory may still serve the restore)."""
        self._step(mc.Isolate(self._seen(), node))
        self._set_aside(node)

    def _set_aside(self, node: int) -> None:
        """An isolated node: no rank or spare placed on it again; its host released once the
        next generation has formed."""
        self.gens.isolate(node, planned=node in self.preempts.told)
        self._release.add(node)

    def _preempt(self, node: int) -> None:
        """A host told to stop (``decide.preemption``): a spare host is let go at once; one with
        ranks is drained at the next step boundary - to spare nodes, or the world shrinks
        without it (released once the new generation formed). While the job is busy, again."""
        s = self.state
        isolated = set(self.counters.isolated)
        action = preemption.choose(
            node, isolated=isolated, busy_nodes=self.gens.busy_nodes(),
            job_busy=(s.phase is not Phase.RUNNING or bool(s.incident) or bool(s.regroup)
                      or s.retry_deadline is not None),
            ranks_here=sum(1 for n in self.gens.node_of().values() if n == node),
            spare_nodes=self.gens.spare_nodes(isolated | {node}),
            ready=self.gens.ready_spares(), late=self.preempts.late(node, time.time()))
        match action:
            case preemption.Preempt.FORGET:
                self.preempts.done(node)
            case preemption.Preempt.RELEASE:
                self.preempts.done(node)
                self._isolate(node)
                self._release.discard(node)
                self.agent.release(node, f"node {node} preempted: it held no rank")
            case preemption.Preempt.DRAIN:
                self.preempts.done(node)
                self._step(mc.Drain(self._seen(), (), node, "preempted (SIGTERM)", pressed=True))

    # == across hosts: what a successor continues from =========================================
    def journal(self, epoch: int) -> keys.JournalRecord:
        """This controller's state as a standby would continue from it (etcd ``journal``)."""
        return keys.JournalRecord(
            epoch=epoch, gen=self.gen, plan=dict(self.plan),
            nodes={n: keys.NodeHost(host=link.rec.host_id, incarnation=link.rec.incarnation,
                                    addr=link.rec.addr, port=link.rec.ctl_port)
                   for n, link in self.agent.links.items()},
            isolated=tuple(sorted(self.counters.isolated)),
            replacements=tuple(self.gens.replacements), max_step=self.max_step,
            node_of=self.gens.node_of(), claimed=dict(self.gens.claimed),
            next_wid=self.agent.next_wid, worlds=dict(self.gens.worlds),
            trained_world=self.gens.trained_world, regrid_unit=self.gens.regrid_unit,
            counters=self.counters.record(),
            # closed, the predecessors' too: an open one goes on after us
            incidents=self.book.base + len(self.incidents),
            job=self.job_account.so_far(time.time(), self.ledger.incident_records(self.incidents),
                                        self.incident))

    # == taking over a running job (across hosts) ===============================================
    def adopt(self, adoption: Any, seen: list[Any], journal: keys.JournalRecord | None,
              lost: set[int], last: keys.LastWord | None = None) -> None:
        """Continue a job another controller ran: its generation, plan and processes as the hosts
        report them, its budgets from the journal, the newest step from its last status
        (``last``). A job that trains goes on untouched; one caught mid-recovery (or missing a
        rank) recovers from here."""
        from ..decide import takeover

        j = journal or keys.JournalRecord()
        self.log.write("takeover", gen=adoption.gen, steady=adoption.steady,
                       missing=adoption.missing, finished=adoption.finished,
                       orphans=adoption.orphans,
                       spares=adoption.spares, journal_gen=journal.gen if journal else None,
                       lost=sorted(lost))
        self.gens.adopt(adoption, seen, j)
        self.book.base = j.incidents  # incidents keep their numbers
        if j.job is not None:
            self.job_account.adopt(j.job)
        now = time.time()
        counters = Counters.from_record(j.counters, set(j.isolated) | lost)
        # (not the journal's step alone: it is written at generations, and a job whose every
        # rank went would lose none)
        then = takeover.resume(adoption, journal, last, lost, self.gens.node_of(),
                               counters.isolated, self.agent.host_up, now)
        self.max_step = then.max_step
        # in rendezvous until the replayed events show every rank in
        self.state = mc.JobState(
            phase=Phase.RENDEZVOUS, gen=adoption.gen, t_gen=now,
            deadline=now + self.policy.timeouts.rendezvous_s, counters=counters,
            degraded_since=now if len(self.plan) < self.gens.target else None)
        self.watchers.start(range(self.total_nodes), self.agent.health)
        self.memory.world = self.world
        self.memory.adopt([(s.node, s.wid, s.keeper) for s in seen if s.keeper and s.alive])
        if adoption.over:  # the predecessor died as training ended: the job ends here
            self._training_complete(time.time())
            return
        for f in then.faults:
            self._fault(f, t_fault=then.t_fault)
        self._refill_spares()
        self._release.update(then.release)

    # == hosts joining and leaving (across hosts a node is a host) ===============================
    def node_joined(self, node: int) -> None:
        """A new host: a spare node from now on, warm, ready to take over a failed host's ranks."""
        self.gens.node_joined(node)
        self.memory.configure(self.gens.node_of(), self.state.usable_nodes(self.total_nodes))
        self._refill_spares()

    def node_lost(self, node: int, why: str) -> None:
        """A host is gone (its lease expired): never used again; its ranks move."""
        if node in self.counters.isolated:  # given up already (its memory stopped answering)
            self.log.write("node_lost", node=node, reason=why, isolated=True)
            return
        self._step(mc.Isolate(self._seen(), node))
        held = self.gens.node_lost(node, why, self.state.usable_nodes(self.total_nodes))
        if held and self.phase not in ENDING:
            self._fault(Fault("node_lost", node=node, message=f"node {node} is gone ({why})"))
        else:
            self.display.info(f"node {node} is gone ({why}): it held no rank")
            self._refill_spares()

    # == deadlines ==============================================================================
    def _check(self, now: float) -> None:
        self.table.kill_due(now)
        for req in self.requests.poll(now):
            match req:
                case DrainRequest(ranks=ranks, node=node, why=why):
                    self.drain(tuple(ranks), node, why or "asked")
                case RefusedRequest(request=raw, why=why):
                    self.log.write("request_refused", request=raw, why=why)
        for missed in self.agent.deadlines():
            self.log.deadline(missed.what, missed.limit_s, **missed.fields())
        for node, grace_s in self.agent.preempted():
            self.preempts.add(node, grace_s, now)
        for node in self.preempts.due(now):
            self._preempt(node)
        if self.phase is Phase.FINISHING:
            self._step(mc.Settled(self._seen(now), self.memory.settled(self.reports.final_persist)))
            return
        if self._unheard(now):
            return
        # The whole job is looked at (its deadlines, its ranks' hangs) at most every
        # SCAN_PER_RANK_S a rank: 2 ranks at every turn, 16,384 every 0.16 s (each look is
        # about 10 ms then). The end of a teardown is acted on at once.
        scan = now >= self._next_scan
        if scan:
            self._next_scan = now + SCAN_PER_RANK_S * len(self.plan)
        # (a tick would do nothing while a rank has still to leave, or while the job trains
        # with no deadline due: the view of every rank is not built then)
        if not self._waiting_for_a_rank_to_leave(now) \
                and not mc.idle(self.state, now, self.policy) \
                and (scan or self.phase is not Phase.RENDEZVOUS):
            self._step(mc.Tick(self._seen(now)))
        if self.outcome.exit_code is None and self.phase is Phase.RUNNING and self.managed \
                and self.state.retry_deadline is None:
            # a redone step (a step retry) gets the first step's allowance from the retry on;
            # no step is awaited from before the controller last heard the job again
            self._act((self.watchers.steps(self._ranks(), self.gen,
                                           max(self._t_running, self._t_retry, self.hearing.t_heard), now,
                                           self.agent.silent_hosts())
                       if scan else []) + self.watchers.tick(now))

    def _unheard(self, now: float) -> bool:
        """Whether the controller cannot prove it hears the job now (``hearing``): then no
        deadline, no hang is judged; heard again, the deadlines move on by the time it could
        not, and each rank's next step is awaited a whole timeout from then."""
        match self.hearing.look(now, self.agent.deaf()):
            case Unheard(first=first):
                if first:
                    self.log.write("unheard", gen=self.gen, phase=self.phase)
                    self.display.info("the controller hears no host and not etcd: it judges "
                                      "nothing until it hears again")
                return True
            case HeardAgain(gap=gap, why=why):
                self.log.write("heard", gen=self.gen, unheard_s=round(gap, 3), why=why)
                self._step(mc.Heard(self._seen(now), gap))
                if why == "deaf":
                    self.display.info(f"the controller hears again (after {gap:.1f} s)")
        return False

    # == log lines, the end of training, recovery ===============================================
    def on_output(self, wid: int, line: str) -> None:
        """A line a process printed: checked against the policy's log rules."""
        w = self.workers.get(wid)
        rank = None if w is None or w.spare else w.rank
        self._act(self.watchers.line(rank, line, time.time(), self.phase in ACTIVE))

    def _training_complete(self, t: float) -> None:
        self.outcome.t_train_end = t
        self._step(mc.Completed(self._seen(), self.policy.timeouts.finish_s))

    def _close_incident(self, t_first: float, resume_step: int | None) -> None:
        for ob in self._incident_closed(t_first, resume_step):
            self._step(ob)

    def _incident_closed(self, t_first: float, resume_step: int | None) -> list[mc.Observation]:
        """The open incident is over: measured and closed; the machine hears it recovered."""
        if self.book.open is None:
            return []
        self.book.close(t_first, resume_step, self.ledger.steps_known(),
                        undecided=self.ledger.steps_undecided())
        if resume_step is not None:
            self.resumed_at, self.resumed_gen = resume_step, self.gen
        self.gens.not_after = None  # resumed: what the ranks hold now is trusted again
        return [mc.Recovered(self._seen(), progressed=resume_step is not None)]

    # == the end =================================================================================
    def give_up(self, reason: str, diagnosis: str) -> None:
        """Stop the job with a diagnosis, for a cause found outside the loop (the launcher's)."""
        self._fail(Decision(Level.FAIL, reason=reason, diagnosis=diagnosis))

    def _fail(self, decision: Decision) -> None:
        for ob in self._given_up(decision):
            self._step(ob)

    def _given_up(self, decision: Decision) -> list[mc.Observation]:
        code = self.outcome.give_up(decision, self.gen, self.max_step, self._ranks(),
                                    self.state.faulty_nodes, self.gens.shut_node)
        return [] if code is None else self._ended(code)

    def emergency(self, reason: str) -> None:
        """The memory is about to be lost (a signal to the launcher): save the newest state."""
        self.outcome.emergency(reason, self._ranks(), self.state.faulty_nodes, self.gens.shut_node)

    def _ended(self, code: int) -> list[mc.Observation]:
        """Every process ends; the machine hears the job is over."""
        self.outcome.ended(code)
        return [mc.Over()]

    def _ranks(self) -> list[Worker]:
        return [self.workers[wid] for wid in self.plan.values()]

    def _reached(self) -> int:
        """The newest step the job has reached since it last resumed: what a fault now can undo.
        Not the newest ever reached: after a rollback, the steps up to there are being redone
        - counted lost once, by the incident that rolled back - and a fault meanwhile that
        resumes where the job stands loses none of them again."""
        since = self.resumed_gen
        steps = [w.step for w in self.workers.values()
                 if w.step is not None and w.step_gen >= since]
        return max(steps, default=self.max_step if self.resumed_at is None else self.resumed_at)

"""The controller: turns exits, reports and timeouts into generations, and measures each incident.

One loop, top to bottom: wait for process exits and output (the agent), read the ranks' events from
the store, check deadlines. A fault opens an incident and aborts the generation; once every
surviving rank has left it, the ladder decides and the next generation is published.
"""

from __future__ import annotations

import signal
import time
from typing import Any

from .. import protocol
from ..agent.agent import Agent, Proc
from ..observe.events import EventLog
from ..decide.faults import exit_fault
from ..decide.ladder import Counters, Decision, Fault, Level
from ..observe.incidents import Incident, restore_record
from ..policy import Policy
from .ledger import TrainingLedger
from .phase import ACTIVE, ENDING, Phase
from .recovery import Recovery
from ..decide.liveness import Signals
from ..state.service import Keepers
from .watchers import Command, Watchers
from .workers import DUMP_GRACE_S, Worker, WorkerTable

TICK_BUSY_S = 0.002  # loop period while survivors leave a failed generation
TICK_WAIT_S = 0.02  # ...while a generation forms
TICK_IDLE_S = 0.05  # ...while it trains
PROGRESS_EVERY_S = 0.1


class Controller(Recovery):
    def __init__(self, *, world: int, spares: int, policy: Policy, mail: Any, agent: Agent,
                 log: EventLog, display: Any, managed: bool, nodes: int = 1, spare_nodes: int = 0,
                 run_dir: Any = None):
        self.world = world
        self.spares_target = spares
        self.nodes = nodes  # nodes that hold ranks at the start
        self.total_nodes = nodes + spare_nodes  # and the spare nodes after them
        self.slots = world // nodes  # ranks per node
        self.run_dir = run_dir
        self.watchers = Watchers(policy, log, display)
        self.ledger = TrainingLedger(managed)
        self.policy = policy
        self.mail = mail
        self.agent = agent
        self.log = log
        self.display = display
        run_id = getattr(run_dir, "name", None) or "run"
        self.memory = Keepers(policy, agent, log, display, run_id, agent.new_wid)
        self.table = WorkerTable(agent, mail, log, "script" if managed else "import",
                                 keeper_of=self.memory.name)
        self.workers = self.table.workers
        self.final_persist: int | None = None  # the last step's checkpoint, awaited at the end
        self._sick_nodes: set[int] = set()  # nodes with a node-level fault in this incident
        self._failing = False  # the job is being given up (its state saved meanwhile)
        self.snap_stats: dict[str, Any] | None = None  # rank 0's snapshot numbers
        self.plan: dict[int, int] = {}  # rank -> wid, for self.gen
        self.gen = -1
        self.phase = Phase.STARTING
        self.deadline = float("inf")
        self.counters = Counters()
        self.signals = Signals(policy)
        self._t_running = 0.0  # when the current generation formed on every rank
        self._nan_deadline: float | None = None  # every rank must report its non-finite step by then
        self.incident: Incident | None = None
        self.incidents: list[Incident] = []
        self.incident_base = 0  # incidents of the controllers before this one (across hosts)
        self.round: list[Fault] = []
        self.replacements = [0] * world
        self.exit_code: int | None = None
        self.diagnosis: str | None = None
        self.traceback: str | None = None
        self.usage_error = False
        self.t_start = time.time()
        self.t_train_end: float | None = None
        self._last_progress = 0.0
        self._recent_injects: list[dict[str, Any]] = []
        self.claimed: dict[str, int] = {}  # injected faults fired: index -> times
        self._gen_t0 = 0.0
        self._warm: set[int] = set()
        self.max_step = 0

    @property
    def managed(self) -> bool:
        """Whether the ranks run inside nonstop.wrap (a plain script cannot leave a collective)."""
        return self.ledger.managed

    # == the loop ===============================================================================
    def run(self) -> int:
        if self.gen < 0:  # a new job (a controller taking over has adopted one: see adopt)
            self._start()
        while self.exit_code is None:
            tick = (TICK_BUSY_S if self.phase is Phase.TEARING_DOWN else
                    TICK_IDLE_S if self.phase is Phase.RUNNING else TICK_WAIT_S)
            exited = self.agent.poll(tick)
            self._read_events()
            for proc in exited:
                self._on_exit(proc)
            now = time.time()
            if now - self._last_progress >= PROGRESS_EVERY_S:
                self._last_progress = now
                self._read_progress()
                self.display.status(self.snapshot())
            self._check(now)
            if self.exit_code is None:
                # a node already faulted in the open incident is not reported again
                self._act(self.watchers.poll_health(now, self._faulty_nodes(),
                                                    set(self._node_of().values())))
            self.memory.poll()
            self._check_keepers(now)
        self.watchers.close()
        return self.exit_code

    def _act(self, commands: list[Command]) -> None:
        """Carry out what the watchers (health checks, log rules) found."""
        for c in commands:
            if c.action == "isolate":  # a node that holds no rank: just stop using it
                self._isolate(c.node)
                self._refill_spares()
            elif c.action == "straggler":
                self._straggler(c.fault)
            else:
                self._fault(c.fault)

    def prespawn(self) -> None:
        """Start the nodes' memory, the ranks and the warm spares. Called before the store is
        up (the launcher imports torch meanwhile): they connect to it once it is."""
        if self.plan:
            return
        self.log.write("run_start", attempt=getattr(self.log, "attempt", 1),
                       world=self.world, spares=self.spares_target,
                       managed=self.managed, policy=self.policy.model_dump())
        self.memory.world = self.world
        self.memory.start(range(self.total_nodes))
        for rank in range(self.world):
            self.plan[rank] = self.table.new(spare=False, node=rank // self.slots).wid
        for w in (self.workers[wid] for wid in self.plan.values()):
            self.table.spawn(w)
        self._refill_spares()

    def _start(self) -> None:
        self.watchers.start(range(self.total_nodes), getattr(self.agent, "health", None))
        self.prespawn()
        self._publish(0, initial=True, level="start")

    # == workers and spares ====================================================================
    def _refill_spares(self) -> None:
        """Warm spares: ``--spares`` spread over the nodes that hold ranks, and a full node's
        worth on each spare node (ready to take over a failed node)."""
        if self.phase in ENDING:
            return
        busy = sorted(set(self._node_of().values()) - self.counters.isolated)
        targets = {n: 0 for n in busy}
        for i in range(self.spares_target if busy else 0):
            targets[busy[i % len(busy)]] += 1
        for n in self._spare_node_ids():
            targets[n] = self.slots
        self.table.refill(targets, self.policy.rules.spare_failures)

    # == process exits ==========================================================================
    def _on_exit(self, proc: Proc) -> None:
        if self.memory.node_of_wid(proc.wid) is not None:
            self._on_keeper_exit(proc)
            return
        w = self.workers[proc.wid]
        was_killed = w.killed
        w.dead = True
        code = proc.returncode
        self.log.write("exit", wid=w.wid, rank=w.rank, spare=w.spare, code=code, killed=was_killed)
        if w.spare:
            self._on_spare_exit(w, code)
            return
        if self.phase is Phase.FINISHING:
            # a process nonstop ended (a hung rank, replaced) may exit after the others finished
            if code != 0 and not was_killed and self.diagnosis is None:
                self.diagnosis = f"rank {w.rank} exited with code {code} after training completed"
            return
        if was_killed or w.rank is None or self.plan.get(w.rank) != w.wid:
            return  # an exit we caused or expected
        if not self.managed and code == 0:
            w.done = self.gen
            if all(self.workers[x].done >= self.gen for x in self.plan.values()):
                self._training_complete(time.time())
            return
        self._fault(self._exit_fault(w, code))

    def _on_keeper_exit(self, proc: Proc) -> None:
        """A node's memory is gone. With its ranks gone too, the node is lost (the next decision
        says so); otherwise a new, empty memory takes over and training goes on."""
        h = self.memory.on_exit(proc.wid, proc.returncode)
        if h is None or h.killed or self.phase in ENDING:
            return
        self.display.info(f"node {h.node}: its memory (keeper) is gone (code {proc.returncode})")

    def _check_keepers(self, now: float) -> None:
        if self.phase in ENDING:
            return
        occupied = {w.node for w in self.workers.values() if not w.dead}
        self.memory.revive(now, occupied, self.phase is Phase.RUNNING and self.incident is None,
                           self._node_of(), self._usable_nodes())

    # == taking over a running job (across hosts) ===============================================
    def adopt(self, adoption: Any, seen: list[Any], journal: dict[str, Any] | None,
              lost: set[int]) -> None:
        """Continue a job another controller ran: its generation, plan and processes as the hosts
        report them, its budgets from the journal. A job that trains goes on untouched; one
        caught mid-recovery (or missing a rank) recovers from here."""
        from ..decide import takeover

        j = journal or {}
        self.log.write("takeover", gen=adoption.gen, steady=adoption.steady,
                       missing=adoption.missing, orphans=adoption.orphans,
                       spares=adoption.spares, journal_gen=j.get("gen"), lost=sorted(lost))
        self.workers.update(takeover.workers(adoption, seen, j))
        self.plan = dict(adoption.plan)
        self.gen = adoption.gen
        self.replacements = list(j.get("replacements") or self.replacements)
        self.counters = Counters.from_record(j.get("counters"), set(j.get("isolated") or []) | lost)
        self.incident_base = int(j.get("incidents") or 0)  # incidents keep their numbers
        self.max_step = int(j.get("max_step") or 0)
        self.claimed = dict(j.get("claimed") or {})
        self.phase = Phase.RENDEZVOUS  # until the replayed events show every rank in
        self._gen_t0 = time.time()
        self.deadline = self._gen_t0 + self.policy.timeouts.rendezvous_s
        self._warm = set()
        self.watchers.start(range(self.total_nodes), getattr(self.agent, "health", None))
        self.memory.world = self.world
        self.memory.adopt([(s.node, s.wid, s.keeper) for s in seen if s.keeper and s.alive])
        for wid in adoption.orphans:
            self.table.kill(self.workers[wid], "assigned by the controller before, not in the "
                                               "job's plan")
        for node in sorted(lost & set(self._node_of().values())):
            self._fault(Fault("node_lost", node=node, message=f"node {node} is gone (its lease "
                                                              "expired while no controller was "
                                                              "in office)"))
        for rank in adoption.missing:
            w = self.workers[self.plan[rank]]
            self._fault(Fault("crash", rank=rank, node=w.node, message=(
                f"rank {rank}'s process is gone (found by the controller taking over)")))
        if not adoption.steady and not adoption.missing and self.phase is Phase.RENDEZVOUS:
            # every rank's process lives, not all in the newest generation: the one the
            # controller before was forming; it is formed again, from where they are
            self._fault(Fault("takeover", message=(
                f"generation {adoption.gen} was forming when the controller changed")))
        self._refill_spares()

    # == hosts joining and leaving (across hosts a node is a host) ===============================
    def node_joined(self, node: int) -> None:
        """A new host: a spare node from now on, warm, ready to take over a failed host's ranks."""
        self.total_nodes = max(self.total_nodes, node + 1)
        self.watchers.start([node])
        try:
            self.memory.start([node])
        except RuntimeError as exc:  # its memory did not start: it holds no snapshots
            self.log.write("keeper_error", node=node, op="start", error=str(exc))
        self.log.write("node_joined", node=node)
        self.display.info(f"node {node} joined: a spare node")
        self._refill_spares()

    def node_lost(self, node: int, why: str) -> None:
        """A host is gone (its lease expired): never used again; its ranks move."""
        if node in self.counters.isolated:
            return
        self.counters.isolated.add(node)
        self.watchers.remove_node(node)
        self.log.write("node_lost", node=node, reason=why)
        self.memory.configure(self._node_of(), self._usable_nodes())  # replicas go elsewhere
        if node in set(self._node_of().values()) and self.phase not in ENDING:
            self._fault(Fault("node_lost", node=node, message=f"node {node} is gone ({why})"))
        else:
            self.display.info(f"node {node} is gone ({why}): it held no rank")
            self._refill_spares()

    def _usable_nodes(self) -> list[int]:
        return [n for n in range(self.total_nodes) if n not in self.counters.isolated]

    def _shut_node(self, node: int) -> None:
        """A faulty node goes at once: its processes and its memory."""
        for w in list(self.workers.values()):
            if w.node == node and not w.dead:
                self.table.kill(w, f"node {node} is faulty: shut down")
        self.memory.kill(node, "faulty node shut down")

    def _faulty_nodes(self) -> set[int]:
        return set(self.counters.isolated) | self._sick_nodes

    def _exit_fault(self, w: Worker, code: int | None) -> Fault:
        report = w.exit_report
        if report is not None and report.get("import_error") and not report.get("assigned"):
            self._spares_wait(report)  # it ran the script without its rank: spares must not
        first = self.max_step == 0 if self.managed else self.gen == 0
        return exit_fault(report, code, w.rank, before_any_step=first)

    def _on_spare_exit(self, w: Worker, code: int | None) -> None:
        if self.phase in ENDING or w.killed:
            return
        self.table.spare_failures += 1
        report = w.exit_report
        at_import = bool(report and report.get("import_error"))
        if at_import:
            self._spares_wait(report)
        self.log.write("spare_lost", wid=w.wid, code=code, ready=w.ready, at_import=at_import,
                       spare_failures=self.table.spare_failures)
        if not at_import:
            self.display.info(f"spare worker {w.wid} exited (code {code}); refilling the pool")
        self._refill_spares()

    def _spares_wait(self, report: dict[str, Any]) -> None:
        """The script failed at import in a process that ran it without a rank (a warm spare): it
        may need one there. From now on spares run it only once they hold a rank, so they cannot
        fail that way again (no refill loop), and a rank's own failure at import stops the job."""
        if self.table.spare_mode != "script":
            return
        self.table.spare_mode = "import"
        self.log.write("spare_mode", mode="import", error=report.get("error"))
        self.display.info("warm spares now wait for a rank before running the script: it failed "
                          f"in a spare before reaching nonstop.wrap ({report.get('error')})")

    # == worker events ==========================================================================
    def _read_events(self) -> None:
        for ev in self.table.read_events():
            self._on_event(ev)

    def _on_event(self, ev: dict[str, Any]) -> None:
        w = self.workers.get(ev.get("wid", -1))
        if w is None:
            return
        kind = ev["type"]
        gen = ev.get("gen")
        if kind in ("ready", "entered", "left", "done", "inject", "exit", "first_step", "wrapped",
                    "joining", "snapshot_interval", "snapshot_failed", "no_steps") \
                and not ev.get("replay"):  # a replayed one is in the log of the controller before
            self.log.write(f"rank_{kind}", **{k: v for k, v in ev.items() if k != "type"})
        if kind == "ready":
            w.ready = True
            if w.spare:
                self.table.spare_failures = 0
        elif kind == "wrapped":
            w.wrapped = True
            self.ledger.managed = True
        elif kind == "joining":
            w.joining = max(w.joining, gen)
        elif kind == "inject":
            self._recent_injects.append(ev)
            if ev.get("index") is not None:  # fired once in the job: never again (any host)
                key = str(ev["index"])
                self.claimed[key] = self.claimed.get(key, 0) + 1
            if ev.get("kind") == "node_crash":  # the rest of the node dies with it
                for x in self.workers.values():
                    if x.node == w.node and not x.dead:
                        self.agent.signal(x.wid)
        elif kind == "exit":
            w.exit_report = ev
        elif kind == "no_steps":
            self._on_no_steps(ev)
        elif gen != self.gen or self.plan.get(ev.get("rank", -1)) != w.wid:
            return  # about an older generation
        elif kind == "entered":
            self._on_entered(w, ev)
        elif kind == "first_step":
            self._on_first_step(w, ev)
        elif kind == "left":
            self._on_left(w, ev)
        elif kind == "nan":
            w.retry_step, w.retry_loss = ev.get("step"), ev.get("output")
            self._on_nan()
        elif kind == "loss_rule":
            self._on_loss_rule(ev)
        elif kind == "done":
            w.done = gen
            w.busy = ev.get("busy", w.busy)
            self.ledger.done(ev)
            if ev.get("final_persist") is not None:
                self.final_persist = max(self.final_persist or 0, ev["final_persist"])
            w.step = ev.get("step", w.step)
            self.max_step = max(self.max_step, ev.get("step") or 0)
            if self.phase is Phase.RUNNING and all(self.workers[x].done >= self.gen
                                               for x in self.plan.values()):
                if self.incident is not None:
                    self._close_incident(ev["t"], ev.get("step"))
                self._training_complete(ev["t"])

    def _on_entered(self, w: Worker, ev: dict[str, Any]) -> None:
        if ev.get("sharded") is not None:
            self.memory.sharded = bool(ev["sharded"])
        w.entered = self.gen
        w.entered_ev = ev
        w.joining = max(w.joining, self.gen)
        w.step, w.step_gen, w.t_step = ev.get("step", 0), self.gen, ev["t"]
        if self.phase is not Phase.RENDEZVOUS:
            return
        ranks = [self.workers[x] for x in self.plan.values()]
        if not all(x.entered >= self.gen for x in ranks):
            return
        self.phase = Phase.RUNNING
        self._t_running = time.time()
        self.watchers.logs.start(self._t_running, self.plan.keys())
        self.deadline = float("inf")
        if not ev.get("replay"):
            self._log_restore(ranks)
        inc = self.incident
        if inc is None:
            return
        evs = [x.entered_ev for x in ranks if x.entered_ev is not None]
        inc.t_assigned = max(e.get("t_assigned", e["t"]) for e in evs)
        inc.t_pg = max(e.get("t_pg", e["t"]) for e in evs)
        inc.t_restored = max(e.get("t_restored", e["t"]) for e in evs)
        inc.resume_step = ev.get("step")
        if ev.get("plain") or not self.ledger.progress_seen:
            # no step or mark seen in this run (a plain script, or a function that shows
            # progress only by its collectives): recovered once it runs again, steps lost unknown
            self._close_incident(max(e["t"] for e in evs), None)

    def _log_restore(self, ranks: list[Worker]) -> None:
        """Where every rank's state came from in this generation (and a resumed job says so)."""
        evs = [x.entered_ev for x in ranks if x.entered_ev is not None and not x.entered_ev.get("plain")]
        if not evs:
            return
        rec = restore_record(evs)
        self.log.write("restore", gen=self.gen, **rec)
        step, sources, skipped = rec["step"], rec["sources"], rec["skipped"]
        for s in skipped:
            self.display.info(f"rank {s.get('rank')}: {s.get('source')} copy of step "
                              f"{s.get('step')} skipped: {s.get('why')}")
        if self.gen == 0:
            self.ledger.resumed_step = step or 0
        if self.gen == 0 and step:
            how = sorted(set(sources.values()))
            self.display.info(f"resumed at step {step} (from {', '.join(how)})")

    def _on_first_step(self, w: Worker, ev: dict[str, Any]) -> None:
        w.step, w.step_gen, w.t_step = ev["step"], self.gen, ev["t"]
        w.first_gen, w.t_first = self.gen, ev["t"]
        stepless = ev.get("steps") is False  # its marks are its steps (no ctx.steps)
        self.ledger.first_step(stepless)
        self.signals.on_first_step(w, ev["t"], stepless=stepless)
        self.max_step = max(self.max_step, ev["step"])
        if self.incident is None or self.phase is not Phase.RUNNING:
            return
        ranks = [self.workers[x] for x in self.plan.values()]
        if all(x.first_gen == self.gen for x in ranks):
            self._close_incident(max(x.t_first for x in ranks), self.incident.resume_step)

    def _on_loss_rule(self, ev: dict[str, Any]) -> None:
        text = (f"loss rule '{ev.get('rule')}' on rank {ev.get('rank')} at step {ev.get('step')} "
                f"(loss {ev.get('loss')})")
        self.log.write("loss_rule_fired", **{k: v for k, v in ev.items() if k != "type"})
        self.display.info(text)
        action = ev.get("action")
        if action == "restart":
            self._fault(Fault("loss_rule", rank=ev.get("rank"), message=text))
        elif action == "fail":
            self._fail(Decision(Level.FAIL, reason="loss rule", diagnosis=text))

    def _on_left(self, w: Worker, ev: dict[str, Any]) -> None:
        w.left = self.gen
        self.max_step = max(self.max_step, ev.get("step") or 0)
        if self.incident is not None:
            self.incident.step_before = max(self.incident.step_before, ev.get("step") or 0)
        reason = ev.get("reason")
        if reason == "exception":
            self._fault(Fault("exception", rank=w.rank, message=ev.get("error", ""),
                              traceback=ev.get("traceback")))
        elif reason == "no_state":
            self._fault(Fault("no_state", rank=w.rank, message=ev.get("error", "")))
        elif self.phase in ACTIVE:
            self._fault(Fault("peer", rank=w.rank, message=ev.get("error", "")))
        if self.incident is not None and ev.get("t_pg") is not None:  # after any fault it raised
            self.incident.group_formed(ev["t_pg"])

    # == deadlines ==============================================================================
    def _check(self, now: float) -> None:
        self.table.kill_due(now)
        if self.phase is Phase.TEARING_DOWN:
            pending = self._pending_teardown()
            if not pending:
                self._finish_teardown()
            elif now > self.deadline:
                for w in pending:
                    self.table.kill(w, "did not leave the generation in time", dump=True)
                    self.display.info(f"rank {w.rank} did not leave generation {self.gen} within "
                                      f"{self.deadline - self.incident.t_decide:.2f} s: killed; its stacks "
                                      f"are in {self.agent.procs[w.wid].log_path}")
                    self.round.append(Fault("teardown_timeout", rank=w.rank,
                                            message=f"still in generation {self.gen} after "
                                                    f"{self.deadline - self.incident.t_decide:.2f} s"))
                    self.log.write("fault", kind="teardown_timeout", code="TEARDOWN_TIMEOUT",
                                   rank=w.rank, node=w.node, domain="rank",
                                   attribution="infrastructure", gen=self.gen)
        elif self.phase is Phase.RENDEZVOUS:
            self._check_rendezvous(now)
        if self.incident is not None and self.incident.level_deadline is not None and \
                now > self.incident.level_deadline and self.phase in ACTIVE:
            level = self.incident.current_level
            self.incident.level_deadline = None
            self._fault(Fault("deadline", message=f"{level} did not recover within its deadline "
                                                  "(recover.levels)"))
            return
        if self.phase is Phase.RUNNING and self.managed:
            if self._nan_deadline is not None:
                if now > self._nan_deadline:  # not every rank saw it: the coarse way
                    self._nan_deadline = None
                    self._fault(Fault("nan", message="not every rank reported the non-finite step"))
                return
            self._check_hang(now)
            self._act(self.watchers.tick(now))
        elif self.phase is Phase.FINISHING:
            ranks_alive = [self.workers[x] for x in self.plan.values() if not self.workers[x].dead]
            if not ranks_alive and self.memory.settled(self.final_persist):
                self._end(0 if self.diagnosis is None else 1)
            elif now > self.deadline:
                self.diagnosis = self.diagnosis or (
                    f"rank(s) {', '.join(str(w.rank) for w in ranks_alive)} did not end "
                    f"{self.policy.timeouts.finish_s:g} s after training completed (their stacks "
                    "are in their logs)" if ranks_alive else
                    f"the checkpoint of the last step ({self.final_persist}) was not written "
                    f"{self.policy.timeouts.finish_s:g} s after training completed")
                for w in ranks_alive:
                    self.agent.signal(w.wid, signal.SIGUSR1)
                time.sleep(DUMP_GRACE_S)
                self._end(1)

    # == outside the steps: log lines, hangs, stragglers ============================================
    def on_output(self, wid: int, line: str) -> None:
        """A line a process printed: checked against the policy's log rules."""
        w = self.workers.get(wid)
        rank = None if w is None or w.spare else w.rank
        self._act(self.watchers.line(rank, line, time.time(), self.phase in ACTIVE))

    def _check_hang(self, now: float) -> None:
        ranks = [self.workers[x] for x in self.plan.values()]
        fault, culprits = self.signals.check_hang(ranks, self.gen, self._t_running, now)
        if fault is not None:
            # the ranks holding the job up are ended at once: no need to wait for them to fail
            # to leave; the others, waiting in a collective, leave when the generation is aborted
            for wid, why in culprits.items():
                self.table.kill(self.workers[wid], f"hung: {why}")
            self.log.write("hang_detected", timeout_s=round(self.signals.last_limit, 3),
                           frozen={str(self.workers[w].rank): why for w, why in culprits.items()},
                           where=fault.traceback, last_progress=self.signals.last_progress)
            # the hang began after the stalled ranks' last progress, not when it was noticed
            self._fault(fault, t_fault=self.signals.last_progress)
            return
        for f in self.signals.check_stragglers(ranks, now):
            self._straggler(f)

    def _straggler(self, fault: Fault) -> None:
        action = self.policy.detect.straggler.action
        self.log.write("straggler", rank=fault.rank, message=fault.message, action=action)
        self.display.info(f"straggler: rank {fault.rank}: {fault.message}"
                          + (" - replacing it" if action == "replace" else ""))
        if action == "replace":
            self.table.kill(self.workers[self.plan[fault.rank]], "straggler", dump=True)
            self._fault(fault)

    def _training_complete(self, t: float) -> None:
        self.t_train_end = t
        self.phase = Phase.FINISHING
        self.deadline = time.time() + self.policy.timeouts.finish_s
        self.log.write("training_complete", gen=self.gen, step=self.max_step)
        for f in self.ledger.unfired:
            self.log.write("inject_unfired", fault=f, step=self.max_step)
            self.display.warning(f"--inject {f} never fired: the run ended at step {self.max_step}")
        for wid in self.plan.values():
            w = self.workers[wid]
            if not w.dead and self.managed:
                self.table.send(w, {"type": protocol.COMPLETE})
        for w in self.table.spares():
            self.table.send(w, {"type": protocol.EXIT})

    # == progress ===============================================================================
    def _read_progress(self) -> None:
        ranks = [self.workers[x] for x in self.plan.values()]
        for w, rec in self.table.read_progress(ranks):
            self.max_step = max(self.max_step, w.take_progress(rec, self.gen))
            if w.rank == 0 and rec.get("snap"):
                self.snap_stats = rec["snap"]
            self.signals.on_progress(w, rec, self.gen)
        tuned = self.signals.timeout_changed()
        if tuned is not None:
            self.log.write("hang_timeout", timeout_s=round(tuned, 3),
                           first_step_s=round(self.signals.hang.first_step_timeout(), 3))

    def snapshot(self) -> dict[str, Any]:
        return {"gen": self.gen, "phase": self.phase, **self.table.status(self.plan),
                "incidents": len(self.incidents) + (self.incident is not None),
                "max_step": self.max_step}

    def _on_no_steps(self, ev: dict[str, Any]) -> None:
        diagnosis, warning = self.ledger.no_steps(ev)
        if diagnosis is not None and self.exit_code is None:
            self._fail(Decision(Level.FAIL, reason="injected faults cannot fire", usage_error=True,
                                diagnosis=diagnosis))
        elif warning is not None:
            self.display.warning(warning)

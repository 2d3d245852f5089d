"""The controller: turns exits, reports and timeouts into generations, and measures each incident.

One loop, top to bottom: wait for process exits and output (the agent), read the ranks' events from
the store, check deadlines. A fault opens an incident and aborts the generation; once every
surviving rank has left it, the ladder decides and the next generation is published.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from typing import Any

from . import ladder, protocol
from .agent import Agent, Proc
from .events import EventLog
from .ladder import Counters, Decision, Fault, Level
from .metrics import Incident
from .policy import Policy
from .workers import Worker, WorkerTable

TICK_BUSY_S = 0.002  # loop period while survivors leave a failed generation
TICK_WAIT_S = 0.02  # ...while a generation forms
TICK_IDLE_S = 0.05  # ...while it trains
PROGRESS_EVERY_S = 0.1


def _short(text: str, limit: int = 160) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


class Controller:
    def __init__(self, *, world: int, spares: int, policy: Policy, store: Any, agent: Agent,
                 log: EventLog, display: Any, managed: bool, faults_known: bool = False):
        self.world = world
        self.spares_target = spares
        self.policy = policy
        self.store = store
        self.agent = agent
        self.log = log
        self.display = display
        self.managed = managed
        self.table = WorkerTable(agent, store, log, "script" if managed else "import")
        self.workers = self.table.workers
        self.plan: dict[int, int] = {}  # rank -> wid, for self.gen
        self.gen = -1
        self.phase = "starting"
        self.deadline = float("inf")
        self.counters = Counters()
        self.incident: Incident | None = None
        self.incidents: list[Incident] = []
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
        self._gen_stores: dict[int, Any] = {}
        self._gen_t0 = 0.0
        self._warm: set[int] = set()
        self._busy_done = 0.0  # busy seconds of rank-0 processes that are gone
        self.max_step = 0

    # == the loop ===============================================================================
    def run(self) -> int:
        self._start()
        while self.exit_code is None:
            tick = (TICK_BUSY_S if self.phase == "tearing_down" else
                    TICK_IDLE_S if self.phase == "running" else TICK_WAIT_S)
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
        return self.exit_code

    def _start(self) -> None:
        self.log.write("run_start", world=self.world, spares=self.spares_target,
                       managed=self.managed, policy=self.policy.model_dump())
        for rank in range(self.world):
            self.plan[rank] = self.table.new(spare=False).wid
        self._publish(0, initial=True, level="start")
        for w in (self.workers[wid] for wid in self.plan.values()):
            self.table.spawn(w)
        self._refill_spares()

    # == workers and spares ====================================================================
    def _refill_spares(self) -> None:
        if self.phase not in ("finishing", "over"):
            self.table.refill(self.spares_target, self.policy.budgets.spare_failures)

    # == generations =============================================================================
    def _publish(self, gen: int, initial: bool, level: str) -> None:
        """Send every rank its assignment for ``gen``."""
        import torch.distributed as dist

        self.gen = gen
        # A plain script rendezvouses through MASTER_PORT with unprefixed keys: give it a fresh
        # store per generation so no key is ever reused.
        gen_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self._gen_stores[gen] = gen_store
        for old in [g for g in self._gen_stores if g < gen - 1]:
            del self._gen_stores[old]
        for rank, wid in sorted(self.plan.items()):
            w = self.workers[wid]
            w.rank = rank
            self.table.send(w, {"type": protocol.ASSIGN, "gen": gen, "rank": rank, "world": self.world,
                           "replacements": self.replacements[rank], "port": gen_store.port,
                           "initial": initial})
        self.phase = "rendezvous"
        # processes already running (survivors, ready spares) join within milliseconds
        self._warm = {wid for wid in self.plan.values()
                      if self.workers[wid].ready or self.workers[wid].entered >= 0}
        self._gen_t0 = time.time()
        self.deadline = self._gen_t0 + self.policy.timeouts.rendezvous_s
        self.log.write("generation", gen=gen, level=level,
                       ranks={str(r): w for r, w in sorted(self.plan.items())})

    def _begin_teardown(self) -> None:
        if self.phase == "tearing_down":
            return
        now = time.time()
        if self.incident is not None and self.incident.t_decide is None:
            self.incident.t_decide = now
        self.phase = "tearing_down"
        if self.managed:
            keys = [protocol.abort_key(self.gen, wid) for wid in self.plan.values()]
            self.store.multi_set(keys, [protocol.ABORT] * len(keys))
            self.deadline = now + self.policy.timeouts.teardown_s
        else:  # a plain script cannot leave a collective: end every rank process
            for wid in self.plan.values():
                self.workers[wid].killed = True  # its exit is ours, not a new fault
                self.agent.signal(wid, signal.SIGTERM)
            self.deadline = now + self.policy.timeouts.terminate_grace_s
        self.log.write("abort", gen=self.gen, managed=self.managed)

    def _pending_teardown(self) -> list[Worker]:
        out = []
        for wid in self.plan.values():
            w = self.workers[wid]
            if w.dead or w.left >= self.gen or w.done >= self.gen:
                continue
            if self.managed and w.joining < self.gen:
                continue  # never joined: it will take the newest assignment
            out.append(w)
        return out

    def _finish_teardown(self) -> None:
        dead = {r for r, wid in self.plan.items() if self.workers[wid].dead}
        faults = self.round or [Fault("exit", message="a rank left its generation")]
        decision = ladder.decide(faults, dead, self.world, self.managed, self.policy, self.counters)
        self.counters = ladder.charge(decision, faults, self.counters)
        self.round = []
        inc = self.incident
        if inc is not None:
            inc.t_torn = time.time()
            inc.levels.append(decision.level.value)
        self.log.write("decision", gen=self.gen, level=decision.level.value, reason=decision.reason,
                       replace=sorted(decision.replace), counters=dataclasses.asdict(self.counters))
        if decision.level is Level.FAIL:
            self._fail(decision)
            return
        if decision.level is Level.JOB_RESTART:
            for wid in self.plan.values():
                self.table.kill(self.workers[wid], "job restart")
        new: list[Worker] = []
        for rank in sorted(decision.replace):
            spare = self.table.take_spare()
            if spare is None:
                spare = self.table.new(spare=False)
                new.append(spare)
            spare.spare = False
            self.plan[rank] = spare.wid
            self.replacements[rank] += 1
            if inc is not None:
                inc.replaced.append(rank)
            self.log.write("replace", rank=rank, wid=spare.wid, warm=spare.ready,
                           cold=spare in new)
        self._announce(decision)
        self._publish(self.gen + 1, initial=decision.level is Level.JOB_RESTART,
                      level=decision.level.value)
        if inc is not None:
            inc.gen_to = self.gen
        for w in new:
            self.table.spawn(w)
        self._refill_spares()

    def _announce(self, decision: Decision) -> None:
        moved = ", ".join(f"rank {r} -> worker {self.plan[r]}" for r in sorted(decision.replace))
        self.display.info(f"{decision.level.value} (generation {self.gen + 1})"
                          + (f": {moved}" if moved else "") + f" [{decision.reason}]")

    # == faults and incidents ====================================================================
    def _fault(self, fault: Fault, t_fault: float | None = None) -> None:
        now = time.time()
        if self.phase in ("finishing", "over"):
            self.log.write("fault_ignored", fault=fault.describe(), phase=self.phase)
            return
        if self.incident is None:
            t0 = self._fault_time(now) if t_fault is None else t_fault
            self.incident = Incident(id=len(self.incidents) + 1, t_fault=t0, t_detect=now,
                                     gen_from=self.gen, step_before=self.max_step)
        if fault.kind == "peer":  # a symptom: the cause is another rank's fault
            self.incident.symptoms.append(_short(fault.describe()))
        else:
            self.incident.faults.append(_short(fault.describe()))
        self.round.append(fault)
        self.log.write("fault", kind=fault.kind, rank=fault.rank, code=fault.code,
                       attribution=fault.attribution.value, message=fault.message[:500],
                       incident=self.incident.id, gen=self.gen)
        if fault.kind != "peer":
            self.display.info(f"fault: {_short(fault.describe())}")
        if self.phase in ("running", "rendezvous"):
            self._begin_teardown()

    def _fault_time(self, now: float) -> float:
        """When the fault happened: an injection we were told about, else when we saw it."""
        recent = [e["t"] for e in self._recent_injects if now - e["t"] < 30]
        self._recent_injects.clear()
        return min(recent) if recent else now

    def _close_incident(self, t_first: float, resume_step: int | None) -> None:
        inc = self.incident
        if inc is None:
            return
        inc.t_first_step = t_first
        if resume_step is not None:
            inc.resume_step = resume_step
        inc.closed = True
        self.incidents.append(inc)
        self.incident = None
        self.counters = ladder.progressed(self.counters)
        rec = inc.to_record()
        self.log.write("incident", **rec)
        self.display.info(f"incident {inc.id} recovered in {inc.mttr:.3f} s "
                          f"({', '.join(inc.levels)}), steps lost: {inc.steps_lost}")

    def _fail(self, decision: Decision) -> None:
        self.diagnosis = decision.diagnosis or decision.reason
        self.traceback = decision.traceback
        self.usage_error = decision.usage_error
        if self.incident is not None:
            self.incident.outcome = "gave up"
            self.incidents.append(self.incident)
            self.log.write("incident", **self.incident.to_record())
            self.incident = None
        self.log.write("give_up", diagnosis=self.diagnosis, usage_error=self.usage_error)
        self._end(2 if self.usage_error else 1)

    def _end(self, code: int) -> None:
        self.phase = "over"
        if self.t_train_end is None:
            self.t_train_end = time.time()
        self.agent.end_all(self.policy.timeouts.terminate_grace_s if code == 0 else 0.0)
        self.exit_code = code

    # == process exits ==========================================================================
    def _on_exit(self, proc: Proc) -> None:
        w = self.workers[proc.wid]
        was_killed = w.killed
        w.dead = True
        code = proc.returncode
        self.log.write("exit", wid=w.wid, rank=w.rank, spare=w.spare, code=code, killed=was_killed)
        if w.rank is not None and w.rank == 0 and not w.spare:
            self._busy_done += w.busy
        if w.spare:
            self._on_spare_exit(w, code)
            return
        if self.phase == "finishing":
            if code != 0 and self.diagnosis is None:
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

    def _exit_fault(self, w: Worker, code: int | None) -> Fault:
        report = w.exit_report
        if report is not None and report.get("collective"):
            return Fault("peer", rank=w.rank, code=code, message=report.get("error", ""))
        if report is not None:
            kind = "import_error" if report.get("import_error") and self.max_step == 0 else "exception"
            return Fault(kind, rank=w.rank, code=code, message=report.get("error", ""),
                         traceback=report.get("traceback"))
        if code is not None and code < 0:
            return Fault("crash", rank=w.rank, code=code)
        return Fault("exit", rank=w.rank, code=code)

    def _on_spare_exit(self, w: Worker, code: int | None) -> None:
        if self.phase in ("finishing", "over"):
            return
        self.table.spare_failures += 1
        report = w.exit_report
        if report and self.table.spare_mode == "script" and not w.ready:
            self.table.spare_mode = "import"
            self.display.info("warm spares now wait before running the script: the script failed "
                              f"in a spare before reaching nonstop.wrap ({report.get('error')})")
        self.log.write("spare_lost", wid=w.wid, code=code, ready=w.ready,
                       spare_failures=self.table.spare_failures)
        self.display.info(f"spare worker {w.wid} exited (code {code}); refilling the pool")
        self._refill_spares()

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
                    "joining"):
            self.log.write(f"rank_{kind}", **{k: v for k, v in ev.items() if k != "type"})
        if kind == "ready":
            w.ready = True
            if w.spare:
                self.table.spare_failures = 0
        elif kind == "wrapped":
            w.wrapped = True
            self.managed = True
        elif kind == "joining":
            w.joining = max(w.joining, gen)
        elif kind == "inject":
            self._recent_injects.append(ev)
        elif kind == "exit":
            w.exit_report = ev
        elif gen != self.gen or self.plan.get(ev.get("rank", -1)) != w.wid:
            return  # about an older generation
        elif kind == "entered":
            self._on_entered(w, ev)
        elif kind == "first_step":
            self._on_first_step(w, ev)
        elif kind == "left":
            self._on_left(w, ev)
        elif kind == "done":
            w.done = gen
            w.busy = ev.get("busy", w.busy)
            w.step = ev.get("step", w.step)
            self.max_step = max(self.max_step, ev.get("step") or 0)
            if self.phase == "running" and all(self.workers[x].done >= self.gen
                                               for x in self.plan.values()):
                if self.incident is not None:
                    self._close_incident(ev["t"], ev.get("step"))
                self._training_complete(ev["t"])

    def _on_entered(self, w: Worker, ev: dict[str, Any]) -> None:
        w.entered = self.gen
        w.entered_ev = ev
        w.joining = max(w.joining, self.gen)
        w.step, w.step_gen, w.t_step = ev.get("step", 0), self.gen, ev["t"]
        if self.phase != "rendezvous":
            return
        ranks = [self.workers[x] for x in self.plan.values()]
        if not all(x.entered >= self.gen for x in ranks):
            return
        self.phase = "running"
        self.deadline = float("inf")
        inc = self.incident
        if inc is None:
            return
        evs = [x.entered_ev for x in ranks if x.entered_ev is not None]
        inc.t_assigned = max(e.get("t_assigned", e["t"]) for e in evs)
        inc.t_pg = max(e.get("t_pg", e["t"]) for e in evs)
        inc.t_restored = max(e.get("t_restored", e["t"]) for e in evs)
        inc.resume_step = ev.get("step")
        if ev.get("plain"):  # no step reporting in a plain script: recovered once it runs again
            self._close_incident(max(e["t"] for e in evs), None)

    def _on_first_step(self, w: Worker, ev: dict[str, Any]) -> None:
        w.step, w.step_gen, w.t_step = ev["step"], self.gen, ev["t"]
        w.first_gen, w.t_first = self.gen, ev["t"]
        self.max_step = max(self.max_step, ev["step"])
        if self.incident is None or self.phase != "running":
            return
        ranks = [self.workers[x] for x in self.plan.values()]
        if all(x.first_gen == self.gen for x in ranks):
            self._close_incident(max(x.t_first for x in ranks), self.incident.resume_step)

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
        elif self.phase in ("running", "rendezvous"):
            self._fault(Fault("peer", rank=w.rank, message=ev.get("error", "")))

    # == deadlines ==============================================================================
    def _check(self, now: float) -> None:
        self.table.kill_due(now)
        if self.phase == "tearing_down":
            pending = self._pending_teardown()
            if not pending:
                self._finish_teardown()
            elif now > self.deadline:
                for w in pending:
                    self.table.kill(w, "did not leave the generation in time", dump=True)
                    self.display.info(f"rank {w.rank} did not leave generation {self.gen} within "
                                      f"{self.policy.timeouts.teardown_s:g} s: killed; its stacks "
                                      f"are in {self.agent.procs[w.wid].log_path}")
                    self.round.append(Fault("teardown_timeout", rank=w.rank,
                                            message=f"still in generation {self.gen} after "
                                                    f"{self.policy.timeouts.teardown_s:g} s"))
                    self.log.write("fault", kind="teardown_timeout", rank=w.rank,
                                   attribution="infrastructure", gen=self.gen)
        elif self.phase == "rendezvous":
            self._check_rendezvous(now)
        elif self.phase == "running" and self.managed:
            self._check_hang(now)
        elif self.phase == "finishing":
            ranks_alive = [self.workers[x] for x in self.plan.values() if not self.workers[x].dead]
            if not ranks_alive:
                self._end(0 if self.diagnosis is None else 1)
            elif now > self.deadline:
                self.diagnosis = self.diagnosis or "the script did not end after training completed"
                self._end(1)

    def _check_rendezvous(self, now: float) -> None:
        t = self.policy.timeouts
        ranks = [self.workers[x] for x in self.plan.values()]
        if now > self.deadline:  # the generation did not form at all
            culprits = [w for w in ranks if w.joining < self.gen] or \
                       [w for w in ranks if w.entered < self.gen]
            why, limit = "did not join the generation in time", t.rendezvous_s
        elif now > self._gen_t0 + t.join_s:  # a process that was already running should be quick
            culprits = [w for w in ranks if w.wid in self._warm and w.joining < self.gen]
            why, limit = "did not start to join the generation in time", t.join_s
        else:
            return
        if not culprits:
            return
        for w in culprits:
            self.table.kill(w, why, dump=True)
        self._fault(Fault("rendezvous_timeout", rank=culprits[0].rank,
                          message=f"rank(s) {', '.join(str(w.rank) for w in culprits)} {why} "
                                  f"({limit:g} s, generation {self.gen})"))

    def _check_hang(self, now: float) -> None:
        t = self.policy.timeouts
        stalled = []
        for wid in self.plan.values():
            w = self.workers[wid]
            if w.done >= self.gen:
                continue
            stepped = w.first_gen == self.gen
            limit = t.hang_s if stepped else t.first_step_s
            since = w.t_step if stepped else self._gen_t0
            if now - since > limit:
                stalled.append(w)
        if stalled:
            self._fault(Fault("hang", rank=None, message=(
                f"no step completed for {t.hang_s:g} s (rank(s) "
                f"{', '.join(str(w.rank) for w in stalled)} stalled)")))

    def _training_complete(self, t: float) -> None:
        self.t_train_end = t
        self.phase = "finishing"
        self.deadline = time.time() + self.policy.timeouts.finish_s
        self.log.write("training_complete", gen=self.gen, step=self.max_step)
        for wid in self.plan.values():
            w = self.workers[wid]
            if not w.dead and self.managed:
                self.table.send(w, {"type": protocol.COMPLETE})
        for w in self.table.spares():
            self.table.send(w, {"type": protocol.EXIT})

    # == progress ===============================================================================
    def _read_progress(self) -> None:
        self.max_step = max(self.max_step, self.table.read_progress(
            [self.workers[x] for x in self.plan.values()], self.gen))

    def snapshot(self) -> dict[str, Any]:
        ranks = []
        for rank, wid in sorted(self.plan.items()):
            w = self.workers[wid]
            ranks.append({"rank": rank, "wid": wid, "step": w.step, "loss": w.loss,
                          "alive": not w.dead})
        return {"gen": self.gen, "phase": self.phase, "ranks": ranks,
                "spares": len(self.table.spares()), "spares_ready": sum(w.ready for w in self.table.spares()),
                "incidents": len(self.incidents) + (self.incident is not None),
                "max_step": self.max_step}

    def productive_s(self) -> float | None:
        if not self.managed:
            return None  # a plain script reports no steps
        rank0 = self.workers.get(self.plan.get(0, -1))
        busy = self._busy_done + (rank0.busy if rank0 is not None and not rank0.dead else 0.0)
        return busy

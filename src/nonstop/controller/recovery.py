"""Recovery, the half of the controller that acts: generations, teardown, the ladder's decisions
carried out, incidents opened and closed, giving up.

A mixin of ``Controller``: it shares the controller's state (plan, workers, incident, counters).
"""

from __future__ import annotations

import signal
import time
from typing import TYPE_CHECKING

from ..decide import ladder
from .. import protocol
from ..decide.ladder import Decision, Fault, JobView, Level
from ..observe.incidents import Incident
from .workers import Worker
from .phase import ACTIVE, ENDING, Phase

if TYPE_CHECKING:
    from .controller import Controller as _Base
else:
    _Base = object


def _short(text: str, limit: int = 160) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


class Recovery(_Base):
    # == generations =============================================================================
    def _publish(self, gen: int, initial: bool, level: str) -> None:
        """Send every rank its assignment for ``gen``."""
        self.gen = gen
        node_of = self._node_of()
        where = self.mail.generation_store(gen, node_of[0])
        for rank, wid in sorted(self.plan.items()):
            w = self.workers[wid]
            w.rank = rank
            self.table.send(w, {"type": protocol.ASSIGN, "gen": gen, "rank": rank, "world": self.world,
                                "replacements": self.replacements[rank], "initial": initial,
                                "claimed": self.claimed, **where,
                                **self._local_ranks(rank, node_of)})
        self.phase = Phase.RENDEZVOUS
        usable = self._usable_nodes()
        for node in usable:  # a node that keeps working after losing its memory gets a new one
            h = self.memory.keepers.get(node)
            if h is not None and h.lost:
                self.memory.restart(node)
        self.memory.configure(self._node_of(), usable)
        # processes already running (survivors, ready spares) join within milliseconds
        self._warm = {wid for wid in self.plan.values()
                      if self.workers[wid].ready or self.workers[wid].entered >= 0}
        self._gen_t0 = time.time()
        self.deadline = self._gen_t0 + self.policy.timeouts.rendezvous_s
        self.log.write("generation", gen=gen, level=level,
                       ranks={str(r): w for r, w in sorted(self.plan.items())})

    def _local_ranks(self, rank: int, node_of: dict[int, int]) -> dict[str, int]:
        """torchrun's per-host view of a rank: LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK (the
        index of its host among the hosts that hold ranks, in rank order). Nodes simulated on one
        host are one host: a rank's LOCAL_RANK picks its device there."""
        host_of = {r: self.mail.host_of(n) for r, n in node_of.items()}
        local = sorted(r for r, h in host_of.items() if h == host_of[rank])
        groups = list(dict.fromkeys(host_of[r] for r in sorted(host_of)))
        return {"local_rank": local.index(rank), "local_world": len(local),
                "group_rank": groups.index(host_of[rank])}

    def _begin_teardown(self) -> None:
        if self.phase is Phase.TEARING_DOWN:
            return
        now = time.time()
        if self.incident is not None and self.incident.t_decide is None:
            self.incident.t_decide = now
        self.phase = Phase.TEARING_DOWN
        if self.managed:
            self.mail.abort(self.gen, list(self.plan.values()))
            self.deadline = now + self._teardown_allowance()
        else:  # a plain script cannot leave a collective: end every rank process
            for wid in self.plan.values():
                self.workers[wid].killed = True  # its exit is ours, not a new fault
                self.agent.signal(wid, signal.SIGTERM)
            self.deadline = now + self.policy.timeouts.terminate_grace_s
        self.log.write("abort", gen=self.gen, managed=self.managed)

    def _teardown_allowance(self) -> float:
        """How long survivors get to leave. In a hang the survivors are already blocked in a
        collective and leave within milliseconds; after a crash one may be mid-step and only
        notices at its next collective."""
        base = self.policy.timeouts.teardown_s
        if any(f.kind == "hang" for f in self.round):
            return base
        return base + 2 * self.signals.hang.slowest_step()

    def _pending_teardown(self) -> list[Worker]:
        out = []
        for wid in self.plan.values():
            w = self.workers[wid]
            if w.dead or w.left >= self.gen or w.done >= self.gen or w.retry_step is not None:
                continue
            if self.managed and w.joining < self.gen:
                continue  # never joined: it will take the newest assignment
            out.append(w)
        return out

    def _finish_teardown(self) -> None:
        now = time.time()
        dead = {r for r, wid in self.plan.items() if self.workers[wid].dead}
        faults = self.round or [Fault("exit", message="a rank left its generation")]
        dead_nodes = sorted({self.workers[wid].node for r, wid in self.plan.items() if r in dead})
        self.memory.confirm(dead_nodes)
        for node in dead_nodes:
            h = self.memory.keepers.get(node)
            if h is not None and h.lost and not h.killed:  # its ranks and its memory: the node
                faults = faults + [Fault("node_lost", node=node, message=(
                    f"node {node}'s ranks and its memory (keeper) are gone"))]
                self._sick_nodes.add(node)
        inc = self.incident
        escalate = None
        if inc is not None and inc.current_level and any(
                f.kind in ("deadline", "rendezvous_timeout") for f in faults):
            escalate = Level(inc.current_level)  # that level did not work: go coarser
        self.counters = ladder.quiet(self.counters, now, self.policy)
        decision = ladder.decide(faults, dead, self._view(), self.policy, self.counters, now,
                                 escalate_from=escalate)
        self.counters = ladder.charge(decision, faults, self.counters, now)
        self.round = []
        if inc is not None:
            inc.t_torn = now
            inc.levels.append(decision.level.value)
        self.log.write("decision", gen=self.gen, level=decision.level.value, reason=decision.reason,
                       replace=sorted(decision.replace), isolate=sorted(decision.isolate),
                       passed_over=list(decision.passed_over), escalated_from=escalate,
                       counters=self.counters.record())
        if decision.level is Level.FAIL:
            self._fail(decision)
            return
        new = self._carry_out(decision)
        self._announce(decision)
        self._publish(self.gen + 1, initial=decision.level is Level.JOB_RESTART,
                      level=decision.level.value)
        if inc is not None:
            inc.gen_to = self.gen
            inc.current_level = decision.level.value
            inc.level_deadline = time.time() + ladder.level_policy(self.policy, decision.level).deadline_s
        for w in new:
            self.table.spawn(w)
        self._refill_spares()

    def _carry_out(self, decision: Decision) -> list[Worker]:
        """Move ranks to new processes as decided; returns the workers still to be started."""
        inc = self.incident
        for node in sorted(decision.isolate):
            self._isolate(node)
        if decision.level is Level.JOB_RESTART:
            for wid in self.plan.values():
                self.table.kill(self.workers[wid], "job restart")
            if self.policy.state.emergency.on_job_restart:  # the memory survives; disk is insurance
                self.memory.emergency("job restart", self._faulty_nodes() | set(decision.isolate),
                                      self._shut_node, wait_s=None, tick=lambda: None)
        targets = self._placement(decision)
        new: list[Worker] = []
        for rank in sorted(decision.replace):
            old = self.workers[self.plan[rank]]
            if not old.dead:  # a live process at fault (a level escalated): a fresh one instead
                self.table.kill(old, f"rank {rank} moves to a new process")
            node = targets[rank]
            w = self.table.take_spare(node, only=node in self._spare_node_ids())
            if w is None:
                w = self.table.new(spare=False, node=node)
                new.append(w)
            w.spare = False
            self.plan[rank] = w.wid
            self.replacements[rank] += 1
            if inc is not None:
                inc.replaced.append(rank)
            self.log.write("replace", rank=rank, wid=w.wid, node=node, warm=w.ready,
                           cold=w in new)
        return new

    def _placement(self, decision: Decision) -> dict[int, int]:
        """The node each replaced rank goes to: its own node for a rank replacement, a spare
        node for a node replacement, the healthy nodes in order for a job restart."""
        node_of = self._node_of()
        if decision.level is Level.REPLACE_RANK:
            return {r: node_of[r] for r in decision.replace}
        if decision.level is Level.REPLACE_NODE:
            # the ranks of a node given up go to a spare node, together; a rank that died on a
            # healthy node meanwhile is replaced where it was
            spare_nodes = iter(self._spare_node_ids())
            moved: dict[int, int] = {}
            out = {}
            for r in sorted(decision.replace):
                old = node_of[r]
                if old not in decision.isolate:
                    out[r] = old
                    continue
                if old not in moved:
                    moved[old] = next(spare_nodes)
                out[r] = moved[old]
            return out
        healthy = [n for n in range(self.total_nodes) if n not in self.counters.isolated]
        return {r: healthy[i // self.slots] for i, r in enumerate(sorted(decision.replace))}

    def _isolate(self, node: int) -> None:
        """Never place a rank or a spare on this node again in this job."""
        self.counters.isolated.add(node)
        for w in list(self.workers.values()):
            if w.node == node and not w.dead:
                self.table.kill(w, f"node {node} isolated")
        self.watchers.remove_node(node)
        self.log.write("isolate", node=node)
        self.display.info(f"node {node} isolated: no rank will be placed there again")

    def _node_of(self) -> dict[int, int]:
        return {r: self.workers[wid].node for r, wid in self.plan.items()}

    def _spare_node_ids(self) -> list[int]:
        """Healthy nodes that hold no rank: they can take over a failed node's ranks."""
        busy = set(self._node_of().values())
        return [n for n in range(self.total_nodes)
                if n not in busy and n not in self.counters.isolated]

    def _view(self) -> JobView:
        healthy = [n for n in range(self.total_nodes) if n not in self.counters.isolated]
        return JobView(world=self.world, managed=self.managed, node_of=self._node_of(),
                       spare_nodes=len(self._spare_node_ids()), capacity=len(healthy) * self.slots, slots=self.slots)

    def _announce(self, decision: Decision) -> None:
        moved = ", ".join(f"rank {r} -> worker {self.plan[r]}"
                          + (f" (node {self.workers[self.plan[r]].node})" if self.total_nodes > 1 else "")
                          for r in sorted(decision.replace))
        if decision.passed_over:
            self.display.info("passed over: " + "; ".join(decision.passed_over))
        self.display.info(f"{decision.level.value} (generation {self.gen + 1})"
                          + (f": {moved}" if moved else "") + f" [{decision.reason}]")

    # == faults and incidents ====================================================================
    def _fault(self, fault: Fault, t_fault: float | None = None) -> None:
        if self.phase in ENDING:
            self.log.write("fault_ignored", fault=fault.describe(), phase=self.phase)
            return
        if self.incident is not None and self.incident.t_torn is not None and \
                self.phase in ACTIVE:
            self._interrupt_attempt()
        self._open_incident(fault, t_fault)
        if fault.kind == "peer":  # a symptom: the cause is another rank's fault
            self.incident.symptoms.append(_short(fault.describe()))
        else:
            self.incident.faults.append(_short(fault.describe()))
        self.round.append(fault)
        if fault.domain.value == "node" and fault.node is not None:
            self._sick_nodes.add(fault.node)
        self.log.write("fault", kind=fault.kind, code=fault.fault_code, rank=fault.rank,
                       node=fault.node, domain=fault.domain.value, exit_code=fault.code,
                       attribution=fault.attribution.value, message=fault.message[:500],
                       incident=self.incident.id, gen=self.gen)
        if fault.kind != "peer":
            self.display.info(f"fault: {_short(fault.describe())}")
        if self.phase in ACTIVE:
            self._begin_teardown()

    def _interrupt_attempt(self) -> None:
        """A fault while the incident's recovery was under way: that attempt ends here, in the
        phase it had reached, and the incident goes on with the next decision."""
        if self.phase is Phase.RUNNING:
            phase = "first_step"
        elif all(self.workers[w].joining >= self.gen for w in self.plan.values()):
            phase = "rendezvous"  # refined into restore when the ranks say their group formed
        else:
            phase = "replace"
        self.incident.interrupt(time.time(), phase)
        self.log.write("attempt_interrupted", incident=self.incident.id, gen=self.gen, phase=phase,
                       level=self.incident.current_level)

    def _open_incident(self, fault: Fault, t_fault: float | None = None) -> None:
        if self.incident is not None:
            self._recent_injects.clear()  # part of this incident: not the start of the next
            return
        now = time.time()
        t0 = self._fault_time(now)  # an injection we were told of, else now
        if t_fault is not None:  # the caller knows better (a hang: the last progress)
            t0 = min(t0, t_fault)
        self.incident = Incident(id=self.incident_base + len(self.incidents) + 1, t_fault=t0,
                                 t_detect=now,
                                 gen_from=self.gen, step_before=self.max_step)
        if fault.kind == "nan":
            self.incident.faults.append(_short(fault.describe()))
            self.log.write("fault", kind=fault.kind, code=fault.fault_code, rank=fault.rank,
                           domain=fault.domain.value, message=fault.message,
                           attribution=fault.attribution.value, incident=self.incident.id,
                           gen=self.gen)

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
        inc.steps_known = self.ledger.steps_known()
        inc.closed = True
        self.incidents.append(inc)
        self.incident = None
        self._sick_nodes.clear()
        if resume_step is not None:  # steps were seen: the in-a-row counters start over
            self.counters = ladder.progressed(self.counters)
        rec = inc.to_record()
        self.log.write("incident", **rec)
        self.display.info(f"incident {inc.id} recovered in {inc.mttr:.3f} s "
                          f"({', '.join(inc.levels)}), steps lost: "
                          f"{'unknown' if inc.steps_lost is None else inc.steps_lost}")

    def give_up(self, reason: str, diagnosis: str) -> None:
        """Stop the job with a diagnosis, for a cause found outside the loop (the launcher's)."""
        self._fail(Decision(Level.FAIL, reason=reason, diagnosis=diagnosis))

    def _fail(self, decision: Decision) -> None:
        if self._failing:  # a second cause while saving the state for the first: one diagnosis
            return
        self._failing = True
        self.diagnosis = decision.diagnosis or decision.reason
        self.traceback = decision.traceback
        self.usage_error = decision.usage_error
        if self.incident is not None:
            self.incident.outcome = "gave up"
            self.incidents.append(self.incident)
            self.log.write("incident", **self.incident.to_record())
            self.incident = None
        self.log.write("give_up", diagnosis=self.diagnosis, usage_error=self.usage_error)
        if not self.usage_error and self.policy.state.emergency.on_give_up:
            self.emergency("give up")
        hook = self.policy.hooks.on_give_up
        if not self.usage_error and (hook.command or hook.url):
            from ..observe.hooks import run_give_up_hook

            report = {"diagnosis": self.diagnosis, "exit_code": 1, "run_dir": str(self.run_dir),
                      "generation": self.gen, "step": self.max_step,
                      "incidents": [i.to_record() for i in self.incidents],
                      "traceback": self.traceback}
            for record in run_give_up_hook(hook, report):
                self.log.write("hook", **record)
                if not record["ok"]:
                    self.display.info(f"give-up hook {record['action']} failed: {record['detail']}")
        self._end(2 if self.usage_error else 1)

    def emergency(self, reason: str) -> None:
        """The memory is about to be lost: persist the newest snapshot, waiting up to the grace.
        The ranks stop first: a step completed after the snapshot would be lost anyway, and the
        node's CPU and memory bandwidth go to the save."""
        for wid in self.plan.values():
            self.table.kill(self.workers[wid], f"emergency checkpoint ({reason})")
        self.memory.poll()
        self.memory.emergency(reason, self._faulty_nodes(), self._shut_node,
                              wait_s=self.policy.state.emergency.grace_s,
                              tick=lambda: self.agent.poll(0.02))

    def _end(self, code: int) -> None:
        self.phase = Phase.OVER
        if self.t_train_end is None:
            self.t_train_end = time.time()
        self.agent.end_all(self.policy.timeouts.terminate_grace_s if code == 0 else 0.0)
        self.exit_code = code

    def _on_nan(self) -> None:
        """Non-finite gradients: every rank skipped its optimizer step and waits. Once all have
        said so for the same step, redo (or skip) it in place: no teardown, nothing lost."""
        ranks = [self.workers[x] for x in self.plan.values()]
        waiting = [w for w in ranks if w.retry_step is not None]
        if self.incident is None:
            first = waiting[0]
            self._open_incident(Fault("nan", message=(
                f"non-finite gradients at step {first.retry_step}")))
            self._nan_deadline = time.time() + self.policy.levels.step_retry.deadline_s
        if len(waiting) < len(ranks):
            return
        steps = {w.retry_step for w in waiting}
        if len(steps) > 1:  # they disagree: the coarse way
            self._fault(Fault("nan", message=f"non-finite gradients at different steps {sorted(steps)}"))
            return
        step = steps.pop()
        decision = ladder.decide_nan(step, {w.rank: w.retry_loss for w in waiting}, self.policy,
                                     self.counters)
        self.counters = ladder.charge(decision, [], self.counters, time.time())
        self.log.write("decision", gen=self.gen, level=decision.level.value, reason=decision.reason,
                       step=step, counters=self.counters.record())
        self._nan_deadline = None
        if decision.level is Level.FAIL:
            self._fail(decision)
            return
        inc = self.incident
        now = time.time()
        inc.levels.append(decision.level.value)
        inc.t_decide = inc.t_decide or now
        inc.t_torn = inc.t_assigned = inc.t_pg = inc.t_restored = now
        inc.resume_step = step + 1 if decision.skip else step
        inc.step_before = max(inc.step_before, step)
        self.display.info(f"{decision.level.value} (generation {self.gen}) [{decision.reason}]")
        for w in ranks:
            w.retry_step, w.first_gen = None, -1  # the incident closes at the next step of all
            self.table.send(w, {"type": protocol.RETRY, "skip": decision.skip})

    def _stuck_in_rendezvous(self, ranks: list[Worker], now: float) -> dict[int, str]:
        """Ranks that joined the generation and cannot finish forming it: stopped (the kernel
        says so; a silent heartbeat is no proof here, since forming a gloo group holds the GIL),
        or in their own code for longer than a running process may take to start joining -
        between its assignment and its entry a rank only runs nonstop's and torch's code. The
        others wait on them in the group's set-up, which nothing else ends before the rendezvous
        timeout."""
        out: dict[int, str] = {}
        for w in ranks:
            if w.dead or w.joining < self.gen or w.entered >= self.gen:
                continue
            if self.agent.stopped(w.wid):
                out[w.wid] = "frozen (the process is stopped)"
            elif w.hb and w.where == "python" and w.same_s > self.policy.timeouts.join_s:
                out[w.wid] = f"stuck for {w.same_s:.1f} s at {w.loc or '?'}"
        return out

    def _check_rendezvous(self, now: float) -> None:
        t = self.policy.timeouts
        ranks = [self.workers[x] for x in self.plan.values()]
        stuck = self._stuck_in_rendezvous(ranks, now)
        if stuck:
            for wid, why in stuck.items():
                self.table.kill(self.workers[wid], f"hung while forming generation {self.gen}: {why}",
                                dump=True)
            first = self.workers[next(iter(stuck))]
            self._fault(Fault("hang", rank=first.rank, message="; ".join(
                f"rank {self.workers[w].rank} {why}" for w, why in stuck.items())
                + f" (forming generation {self.gen})"))
            return
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


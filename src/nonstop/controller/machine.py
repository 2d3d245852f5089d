"""The controller's decisions over time, as a pure state machine.

``step(state, observation, policy) -> (state, commands)``: the job's control state (its phase and
generation, the deadline of that phase, the faults of the current round, the budgets spent) and one
observation go in; the new state and what to carry out come out. Nothing here reads a clock, a
process or a socket: an observation carries the time and what the controller saw of its ranks, so
every transition and every deadline is unit-tested on a fake clock (tests/test_machine.py).

The controller (``controller.py``) is the executor: it turns exits, events and ticks into
observations, and commands into signals, messages and processes. What outlives a controller is
in the journal across hosts (``controller/elected.py``): the generation, the plan and the counters.

The phases of a generation::

    STARTING -> RENDEZVOUS -> RUNNING -> FINISHING -> OVER
                   ^   |        |
                   |   v        v
                   +-- TEARING_DOWN   (a fault: survivors leave; then the ladder decides)
                   |       |
                   |       v
                   +-- WAITING_FOR_HOSTS  (across hosts: too few healthy hosts until one joins)
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

from ..decide import elastic, ladder
from ..decide.ladder import Counters, Decision, Fault, Level
from .phase import ACTIVE, ENDING, Phase
from .placement import free_slots, place, spare_nodes, view  # noqa: F401 - spare_nodes: callers
from .commands import (  # noqa: F401 - the machine's commands, named as mc.<Command>
    Raise, Ignore, Interrupt, AbortGeneration, Kill, Probe,
    Decide, CarryOut, Regroup, DrainRefused, Publish, Formed,
    RetryOpened, RedoStep, WaitForHosts, Fail, Finish, JobOver, Overdue,
    Missed, Command)
from .observations import (  # noqa: F401 - what it observes, named as mc.<Observation>
    RankSeen, Seen, Tick, Start, Faulted, Entered,
    RetryAsked, Attributed, Isolate, Drain, Recovered, Completed, Settled,
    Over, Heard, Observation, RankFact)


# == the state ====================================================================================


@dataclasses.dataclass(frozen=True)
class JobState:
    phase: Phase = Phase.STARTING
    gen: int = -1
    deadline: float = math.inf  # of the current phase
    t_gen: float = 0.0  # when the generation was published
    t_abort: float = 0.0  # when its survivors were told to leave
    round: tuple[Fault, ...] = ()  # faults since the last decision
    counters: Counters = dataclasses.field(default_factory=Counters)
    incident: bool = False  # an incident is open
    attempt: bool = False  # ...and a decision for it is carried out (an attempt under way)
    level: str | None = None  # the level that attempt tries
    level_deadline: float | None = None  # ...and by when it must have recovered
    retry_deadline: float | None = None  # every rank must report its non-finite step by then
    finish_s: float = 0.0  # how long the end may take once training completed
    sick: frozenset[int] = frozenset()  # nodes with a node-level fault in the open incident
    probed: bool = False  # the dead ranks' memory was asked, for this teardown
    regroup: bool = False  # the ranks leave at a step boundary to grow the world (no fault)...
    forced: bool = False  # ...and, too slow to, were told to leave at once
    degraded_since: float | None = None  # trains with fewer ranks than it started with, since
    # a drain under way: ranks, node, why, and the ranks a smaller world goes on without (None:
    # they move to spares)
    migrate: tuple[tuple[int, ...], int | None, str, frozenset[int] | None] | None = None
    t_wait: float | None = None  # waiting for hosts since (WAITING_FOR_HOSTS)
    patient: bool = False  # the teardown's deadline passed with no rank out: it waits once more

    @property
    def faulty_nodes(self) -> set[int]:
        return set(self.counters.isolated) | set(self.sick)

    def usable_nodes(self, total_nodes: int) -> list[int]:
        return [n for n in range(total_nodes) if n not in self.counters.isolated]


def _with(s: JobState, **kw: Any) -> JobState:
    return dataclasses.replace(s, **kw)


# == the transitions ============================================================================

def step(s: JobState, ob: Observation, policy: Any) -> tuple[JobState, list[Command]]:
    """The new state and what to carry out, for one observation."""
    if isinstance(ob, RankFact) and ob.seen is None:  # not yet stepped with what is seen
        raise ValueError(f"{type(ob).__name__} stepped without what is seen")
    if isinstance(ob, Tick):
        return _tick(s, ob.seen, policy)
    if isinstance(ob, Faulted):
        return fault(s, ob.fault, ob.seen, policy, ob.t_fault)
    if isinstance(ob, Start):
        return _publish(s, ob.seen, policy, 0), [Publish(0, initial=True, level="start")]
    if isinstance(ob, Entered):
        return _entered(s, ob.seen)
    if isinstance(ob, RetryAsked):
        return _retry(s, ob.seen, policy)
    if isinstance(ob, Drain):
        return _drain(s, ob, policy)
    if isinstance(ob, Attributed):
        return attributed(s, ob.fault, ob.seen, policy)
    if isinstance(ob, Isolate):
        return _with(s, counters=s.counters.but(isolated=s.counters.isolated | {ob.node})), []
    if isinstance(ob, Recovered):
        counters = ladder.progressed(s.counters) if ob.progressed else s.counters
        return _with(s, incident=False, attempt=False, level=None, level_deadline=None,
                     sick=frozenset(), counters=counters), []
    if isinstance(ob, Completed):
        return (_with(s, phase=Phase.FINISHING, deadline=ob.seen.now + ob.finish_s,
                      finish_s=ob.finish_s), [Finish()])
    if isinstance(ob, Settled):
        return _settle(s, ob.seen, ob.settled)
    if isinstance(ob, Over):
        return _with(s, phase=Phase.OVER, deadline=math.inf), []
    if isinstance(ob, Heard):
        return unheard(s, ob.unheard_s, ob.seen.now), []
    raise TypeError(f"not an observation: {ob!r}")


def fault(s: JobState, f: Fault, seen: Seen, policy: Any, t_fault: float | None = None
          ) -> tuple[JobState, list[Command]]:
    """A fault: it joins the current round; in an active phase the generation is aborted."""
    if s.phase in ENDING:
        return s, [Ignore(f)]
    cmds: list[Command] = []
    if s.incident and s.attempt and s.phase in ACTIVE:
        cmds.append(Interrupt(_attempt_phase(s, seen)))
        s = _with(s, attempt=False)
    cmds.append(Raise(f, t_fault))
    sick = s.sick | {f.node} if f.domain.value == "node" and f.node is not None else s.sick
    s = _with(s, incident=True, round=s.round + (f,), sick=frozenset(sick))
    if s.phase in ACTIVE:
        s, more = _abort(s, seen, policy)
        cmds += more
    return s, cmds


def attributed(s: JobState, f: Fault, seen: Seen, policy: Any) -> tuple[JobState, list[Command]]:
    """A corruption's rank named by its replay: counted against its node (``ladder.charge``'s
    record of it), with no recovery - its rank holds the replayed state its twins agree on -
    unless the rules that isolate failing hardware now say to isolate the node: then it is a
    fault like any, and the ladder moves the node's ranks."""
    if s.phase in ENDING:
        return s, [Ignore(f)]
    now = seen.now
    counters = ladder.quiet(s.counters, now, policy)
    if ladder.isolations([f], view(set(counters.isolated), seen), policy, counters, now):
        return fault(s, f, seen, policy)
    node = seen.node_of.get(f.rank) if f.rank is not None else f.node
    return _with(s, counters=counters.but(
        recent=counters.recent + [(now, f.fault_code, f.rank, node)], last_fault_t=now)), []


def _attempt_phase(s: JobState, seen: Seen) -> str:
    """How far the interrupted attempt had come."""
    if s.phase is Phase.RUNNING:
        return "first_step"
    if all(r.joining >= s.gen for r in seen.ranks):
        return "rendezvous"  # refined into restore when the ranks say their group formed
    return "replace"


def _abort(s: JobState, seen: Seen, policy: Any) -> tuple[JobState, list[Command]]:
    now = seen.now
    if seen.managed:
        deadline = now + teardown_allowance(s.round, seen.slowest_step_s, policy, seen.abort_s)
    else:  # a plain script cannot leave a collective: its ranks are ended
        deadline = now + policy.timeouts.terminate_grace_s
    return (_with(s, phase=Phase.TEARING_DOWN, deadline=deadline, t_abort=now, probed=False,
                  patient=False),
            [AbortGeneration(s.gen, seen.managed)])


#: how many teardown_s a teardown waits again when its deadline passed with no rank out
TEARDOWN_PATIENCE = 4


def teardown_allowance(faults: tuple[Fault, ...], slowest_step_s: float, policy: Any,
                       abort_s: float = 0.0) -> float:
    """How long survivors get to leave. In a hang the survivors are already blocked in a
    collective and leave within milliseconds; after a crash one may be mid-step and only notices
    at its next collective. With NCCL, a rank leaves once the abort of its communicators has
    returned (~0.5 s measured): ``abort_s``, the abort's own deadline, is allowed on top."""
    base = policy.timeouts.teardown_s + abort_s
    if any(f.kind == "hang" for f in faults):
        return base
    return base + 2 * slowest_step_s


def still_to_leave(r: Any, gen: int, managed: bool) -> bool:
    """Whether a rank (a ``RankSeen``, or a worker's record: the same fields) has still to leave
    the aborted generation ``gen``."""
    if r.dead or r.left >= gen or r.done >= gen or r.retry_step is not None:
        return False
    return not (managed and r.joining < gen)  # never joined: it will take the newest assignment


def pending_teardown(s: JobState, seen: Seen) -> list[RankSeen]:
    """The ranks still to leave the aborted generation."""
    return [r for r in seen.ranks if still_to_leave(r, s.gen, seen.managed)]


def _tick(s: JobState, seen: Seen, policy: Any) -> tuple[JobState, list[Command]]:
    cmds: list[Command] = []
    if s.phase is Phase.WAITING_FOR_HOSTS:
        return _decide(s, seen, policy)
    if s.phase is Phase.TEARING_DOWN:
        pending = pending_teardown(s, seen)
        if not pending:
            return _after_teardown(s, seen, policy)
        if seen.now > s.deadline and s.regroup and not s.forced:
            # not at a step boundary in time (a loop without ctx.steps, a long step): now
            missed = Missed("step_boundary", round(s.deadline - s.t_abort, 3), s.gen,
                            tuple(r.rank for r in pending), "the regroup is forced: ranks aborted")
            return (_with(s, forced=True, deadline=seen.now + policy.timeouts.teardown_s),
                    [missed, AbortGeneration(s.gen, seen.managed)])
        if seen.now > s.deadline and seen.managed and not s.patient and \
                not any(r.left >= s.gen and not r.dead for r in seen.ranks):
            # Not one rank out: what is late is more likely the abort itself (its delivery on a
            # loaded machine, just after a takeover) than every rank stuck at once - and killed,
            # they would take the only live copy of the state with them (a restore from an
            # older snapshot). They get one more, longer wait.
            again = policy.timeouts.teardown_s * TEARDOWN_PATIENCE + seen.abort_s
            missed = Missed("teardown", round(s.deadline - s.t_abort, 3), s.gen,
                            tuple(r.rank for r in pending),
                            f"no rank has left yet: {again:.2f} s more before they are killed")
            return _with(s, patient=True, deadline=seen.now + again), [missed]
        if seen.now > s.deadline:
            late = s.deadline - s.t_abort
            faults = []
            for r in pending:
                f = Fault("teardown_timeout", rank=r.rank, node=r.node,
                          message=f"still in generation {s.gen} after {late:.2f} s")
                faults.append(f)
                cmds.append(Kill(r.wid, "did not leave the generation in time", dump=True,
                                 fault=f, late_s=late))
            cmds.insert(0, Missed("teardown", round(late, 3), s.gen,
                                  tuple(r.rank for r in pending), "killed"))
            s = _with(s, round=s.round + tuple(faults), deadline=math.inf)
        return s, cmds
    if s.phase is Phase.RENDEZVOUS:
        s, cmds = _check_rendezvous(s, seen, policy)
        if cmds:
            return s, cmds
    if _level_due(s, seen.now):
        level = s.level
        limit = ladder.level_policy(policy, Level(level)).deadline_s if level else None
        s = _with(s, level_deadline=None)
        s, cmds = fault(s, Fault("deadline", message=f"{level} did not recover within its deadline "
                                                  "(recover.levels)"), seen, policy)
        return s, [Missed("recovery_level", limit, s.gen, detail=f"{level}: escalated")] + cmds
    if _retry_due(s, seen.now):
        s = _with(s, retry_deadline=None)  # not every rank saw it: the coarse way
        missed = Missed("step_retry", policy.levels.step_retry.deadline_s, s.gen,
                        tuple(r.rank for r in seen.ranks if r.retry_step is None),
                        "not every rank reported the non-finite step")
        s, cmds = fault(s, Fault("nan", message="not every rank reported the non-finite step"),
                        seen, policy)
        return s, [missed] + cmds
    if _growth_due(s, seen.now, policy) and seen.managed and _growth(s, seen, policy):
        deadline = seen.now + policy.timeouts.teardown_s + 3 * seen.slowest_step_s
        return (_with(s, phase=Phase.TEARING_DOWN, deadline=deadline, t_abort=seen.now,
                      probed=False, regroup=True, forced=False, patient=False), [Regroup(s.gen)])
    return s, cmds


def unheard(s: JobState, seconds: float, now: float) -> JobState:
    """The controller could not hear the job for the ``seconds`` up to ``now`` (every host
    silent at once, and etcd too: its own ears may have failed, not the ranks'; or its loop held
    up); it judged nothing meanwhile, and that time is not counted against the ranks: the
    phase's times and deadlines move on by it - by as much of it as came after they began (a
    generation published in the middle of it moves on to now, not past it)."""
    def moved(t: float) -> float:
        return min(seconds, max(0.0, now - t))

    def later(t: float | None, by: float) -> float | None:
        return t + by if t is not None and math.isfinite(t) else t

    gen_by, abort_by = moved(s.t_gen), moved(s.t_abort)
    phase_by = abort_by if s.phase is Phase.TEARING_DOWN else gen_by
    return _with(s, deadline=later(s.deadline, phase_by), t_gen=s.t_gen + gen_by,
                 t_abort=s.t_abort + abort_by, level_deadline=later(s.level_deadline, gen_by),
                 retry_deadline=later(s.retry_deadline, seconds))


def idle(s: JobState, now: float, policy: Any) -> bool:
    """Whether a tick now does nothing, whatever the ranks are: the job trains and no deadline
    or growth is due (the controller then does not build its view of every rank)."""
    return s.phase is Phase.RUNNING and not _level_due(s, now) and not _retry_due(s, now) \
        and not _growth_due(s, now, policy)


def _level_due(s: JobState, now: float) -> bool:
    return bool(s.incident) and s.level_deadline is not None and now > s.level_deadline \
        and s.phase in ACTIVE


def _retry_due(s: JobState, now: float) -> bool:
    return s.phase is Phase.RUNNING and s.retry_deadline is not None and now > s.retry_deadline


def _growth_due(s: JobState, now: float, policy: Any) -> bool:
    return s.phase is Phase.RUNNING and not s.incident and s.retry_deadline is None \
        and elastic.due(s.degraded_since, now, policy)


def _growth(s: JobState, seen: Seen, policy: Any) -> dict[int, int]:
    """The ranks a larger world would add now, and their nodes (empty: none)."""
    nodes = elastic.room(seen.node_of, seen.total_nodes, seen.slots, s.counters.isolated,
                         seen.ready_spares)
    groups = seen.replica_groups  # a sharded job comes back by whole replica groups
    unit = seen.regrid_unit if seen.regrid_unit > 0 else \
        len(next(iter(groups.values()))) if groups else 1
    return elastic.grow(len(seen.ranks), seen.target, nodes, policy, unit)


def _after_teardown(s: JobState, seen: Seen, policy: Any) -> tuple[JobState, list[Command]]:
    """Every survivor left: the dead ranks' memory is asked once, then the ladder decides."""
    dead = {r.rank for r in seen.ranks if r.dead}
    dead_nodes = tuple(sorted({r.node for r in seen.ranks if r.dead}))
    if s.regroup and not s.round and not dead:  # every rank left at a step boundary
        if s.migrate is not None:
            return _migrate(_with(s, regroup=False, forced=False), seen, policy)
        return _grow(_with(s, regroup=False, forced=False), seen, policy)
    s = _with(s, regroup=False, forced=False, migrate=None)  # a fault came first: the ladder's
    if dead_nodes and not s.probed:
        return _with(s, probed=True), [Probe(dead_nodes)]
    return _decide(s, seen, policy)


def _decide(s: JobState, seen: Seen, policy: Any) -> tuple[JobState, list[Command]]:
    """The ladder decides the round, and its decision is carried out - or, across hosts, when
    the healthy hosts cannot hold the ranks (hosts lost faster than new ones joined: a scheduler
    brings new machines in a while), the job waits for a host to join, deciding again on every
    tick with the same faults, and fails only once ``hosts.capacity_wait_s`` has passed."""
    now = seen.now
    dead = {r.rank for r in seen.ranks if r.dead}
    dead_nodes = tuple(sorted({r.node for r in seen.ranks if r.dead}))
    faults = list(s.round) or [Fault("exit", message="a rank left its generation")]
    sick = set(s.sick)
    alive_on = {r.node for r in seen.ranks if not r.dead}
    for node in dead_nodes:
        # its ranks and its memory: the node. A rank of it still alive says the node is not
        # (its memory died alone, and a new one takes over): the dead ranks are replaced there,
        # and the living one's state is not thrown away by a node replacement or a job restart
        if node in seen.lost_memory and node not in alive_on:
            faults.append(Fault("node_lost", node=node, message=(
                f"node {node}'s ranks and its memory (keeper) are gone")))
            sick.add(node)
    escalate = None
    if s.incident and s.level and any(f.kind in ("deadline", "rendezvous_timeout") for f in faults):
        escalate = Level(s.level)  # that level did not work: go coarser
    counters = ladder.quiet(s.counters, now, policy)
    decision = ladder.decide(faults, dead, view(set(s.counters.isolated), seen), policy, counters, now,
                             escalate_from=escalate)
    wait_s = policy.hosts.capacity_wait_s
    if decision.level is Level.FAIL and decision.wanting and seen.hosts_join and wait_s > 0:
        if s.phase is not Phase.WAITING_FOR_HOSTS:
            return (_with(s, phase=Phase.WAITING_FOR_HOSTS, t_wait=now, deadline=now + wait_s,
                          sick=frozenset(sick)), [WaitForHosts(decision, wait_s)])
        if now <= s.deadline:
            return s, []
        decision = dataclasses.replace(decision, diagnosis=(
            f"{decision.diagnosis}; no host joined that could take them within {wait_s:g} s "
            "(hosts.capacity_wait_s)"))
    counters = ladder.charge(decision, faults, counters, now, seen.node_of)
    s = _with(s, round=(), counters=counters, sick=frozenset(sick), attempt=True,
              deadline=math.inf, t_wait=None)
    cmds: list[Command] = [Decide(decision, s.gen, escalate.value if escalate else None)]
    if decision.level is Level.FAIL:
        return s, cmds + [Fail(decision)]
    gen = s.gen + 1
    placement = place(decision, seen, s.counters.isolated)
    level_deadline = now + ladder.level_policy(policy, decision.level).deadline_s
    s = _publish(s, seen, policy, gen)
    s = _with(s, level=decision.level.value, level_deadline=level_deadline)
    if decision.level is Level.SCALE_IN:
        s = _with(s, degraded_since=s.degraded_since or now)
    return s, cmds + [CarryOut(decision, placement, gen)]


def _grow(s: JobState, seen: Seen, policy: Any) -> tuple[JobState, list[Command]]:
    """The ranks left for a larger world: the ready spares join as new ranks."""
    placement = _growth(s, seen, policy)  # empty if the spares went meanwhile: the same world
    world = len(seen.ranks) + len(placement)
    stay = ladder.restarted(view(set(s.counters.isolated), seen), set(range(len(seen.ranks))))
    decision = Decision(Level.SCALE_OUT, reason=f"{len(placement)} rank(s) ready: {len(seen.ranks)} "
                        f"-> {world} of {seen.target}", replace=frozenset(stay) if placement
                        else frozenset(), reshard=bool(stay) and bool(placement))
    gen = s.gen + 1
    s = _with(_publish(s, seen, policy, gen), level=None, level_deadline=None,
              degraded_since=s.degraded_since if world < seen.target else None)
    return s, [Decide(decision, s.gen - 1), CarryOut(decision, placement, gen)]


def _drain(s: JobState, ob: Drain, policy: Any) -> tuple[JobState, list[Command]]:
    """A drain asked for: the ranks leave at their next step boundary if warm spares are ready
    to take their places (the same node's for ranks, a spare node's for a node)."""
    seen = ob.seen
    asked = f"node {ob.node}" if ob.node is not None else \
        "rank " + ", ".join(map(str, ob.ranks))
    refuse = lambda why: (s, [DrainRefused(asked, why)])  # noqa: E731
    if not seen.managed:
        return refuse("the script does not use nonstop.wrap: its ranks cannot stop at a step boundary")
    if s.phase is not Phase.RUNNING or s.incident or s.regroup or s.retry_deadline is not None:
        return refuse(f"the job is busy ({s.phase.value}{', an incident is open' if s.incident else ''})")
    drop: frozenset[int] | None = None
    if ob.node is not None:
        ranks = tuple(sorted(r for r, n in seen.node_of.items() if n == ob.node))
        if not ranks:
            return refuse(f"node {ob.node} holds no rank")
        free = spare_nodes(seen.node_of, seen.total_nodes, set(s.counters.isolated) | {ob.node})
        # or warm spares where the nodes holding ranks have places left
        places = free_slots(seen.node_of, seen.slots, set(s.counters.isolated) | {ob.node})
        warm = sum(min(k, seen.ready_spares.get(n, 0)) for n, k in places.items())
        if not any(seen.ready_spares.get(n, 0) >= len(ranks) for n in free) and warm < len(ranks):
            if not ob.pressed:
                return refuse(f"no spare node has {len(ranks)} warm spare(s) ready")
            room = sum(seen.slots for n in free if n not in seen.away) + sum(places.values())
            if free and room >= len(ranks):  # placed as a node replacement: the spare nodes'
                # warm spares, then cold starts there, then places left on the other nodes
                return _draining(s, seen, policy, asked, ranks, ob, None)
            cfg = policy.levels.scale_in
            lost, why_not = ladder.shrink(set(), {ob.node}, view(set(s.counters.isolated), seen), policy)
            if not cfg.enabled or s.counters.used(Level.SCALE_IN) >= cfg.budget:
                why_not = "scale-in is off or its budget spent"
            if why_not:
                return refuse(f"no spare node has {len(ranks)} warm spare(s) ready, and no "
                              f"scale-in: {why_not}")
            drop = frozenset(lost)
    else:
        ranks = tuple(sorted(set(ob.ranks)))
        unknown = [r for r in ranks if r not in seen.node_of]
        if unknown or not ranks:
            return refuse(f"no rank {unknown[0] if unknown else ''} in a world of {len(seen.ranks)}")
        need = collections.Counter(seen.node_of[r] for r in ranks)
        short = [n for n, k in sorted(need.items()) if seen.ready_spares.get(n, 0) < k]
        if short:
            return refuse(f"node {short[0]} has {seen.ready_spares.get(short[0], 0)} warm spare(s) "
                          f"ready, {need[short[0]]} needed")
    return _draining(s, seen, policy, asked, ranks, ob, drop)


def _draining(s: JobState, seen: Seen, policy: Any, asked: str, ranks: tuple[int, ...],
              ob: Drain, drop: frozenset[int] | None) -> tuple[JobState, list[Command]]:
    """The ranks told to leave at their next step boundary (``_migrate`` then places them)."""
    deadline = seen.now + policy.timeouts.teardown_s + 3 * seen.slowest_step_s
    return (_with(s, phase=Phase.TEARING_DOWN, deadline=deadline, t_abort=seen.now, probed=False,
                  regroup=True, forced=False, patient=False,
                  migrate=(ranks, ob.node, ob.why, drop)),
            [Regroup(s.gen, drain=f"{asked}: {ob.why}")])


def _migrate(s: JobState, seen: Seen, policy: Any) -> tuple[JobState, list[Command]]:
    """The ranks left at a step boundary for a drain: the drained ones move to warm spares."""
    ranks, node, why, drop = s.migrate  # type: ignore[misc]
    isolate = frozenset({node}) if node is not None else frozenset()
    level = Level.REPLACE_NODE if node is not None else Level.REPLACE_RANK
    reason = f"drain {'node ' + str(node) if node is not None else 'rank(s)'}: {why}"
    if drop is not None:  # no spare node: the world goes on without the node's ranks
        stay = set(range(len(seen.ranks))) - drop
        again = ladder.restarted(view(isolate, seen), stay)
        decision = Decision(Level.SCALE_IN, isolate=isolate, drop=drop, reason=reason,
                            replace=frozenset(again), reshard=bool(again))
    else:
        decision = Decision(level, replace=frozenset(ranks), isolate=isolate, reason=reason)
    counters = s.counters.but(isolated=s.counters.isolated | isolate)
    placement = place(decision, seen, counters.isolated)
    gen = s.gen + 1
    s = _with(_publish(s, seen, policy, gen), level=None, level_deadline=None, migrate=None,
              counters=counters)
    if drop is not None:
        s = _with(s, degraded_since=s.degraded_since or seen.now)
    return s, [Decide(decision, s.gen - 1), CarryOut(decision, placement, gen)]


def _publish(s: JobState, seen: Seen, policy: Any, gen: int) -> JobState:
    return _with(s, phase=Phase.RENDEZVOUS, gen=gen, t_gen=seen.now,
                 deadline=seen.now + policy.timeouts.rendezvous_s)


def _entered(s: JobState, seen: Seen) -> tuple[JobState, list[Command]]:
    if s.phase is not Phase.RENDEZVOUS or not all(r.entered >= s.gen for r in seen.ranks):
        return s, []
    return _with(s, phase=Phase.RUNNING, deadline=math.inf), [Formed(s.gen)]


def _check_rendezvous(s: JobState, seen: Seen, policy: Any) -> tuple[JobState, list[Command]]:
    """Ranks that joined and cannot finish forming the group (stopped, or stuck in their own
    code: the others wait on them in the group's set-up, which nothing else ends before the
    rendezvous timeout); ranks that did not join in time."""
    t = policy.timeouts
    # time in its own code before the generation was published is not time stuck forming it:
    # a survivor that waited in the old generation's collective (while a controller taking over
    # was away) is still at that place of its code when it comes to join
    since_gen = seen.now - s.t_gen
    stuck = [r for r in seen.ranks if not r.dead and r.joining >= s.gen and r.entered < s.gen
             and (r.stopped or min(r.own_code_s, since_gen) > t.join_s)]
    if stuck:
        whys = {r.wid: "frozen (the process is stopped)" if r.stopped else
                f"stuck for {min(r.own_code_s, since_gen):.1f} s at {r.loc or '?'}"
                for r in stuck}
        cmds: list[Command] = [Kill(r.wid, f"hung while forming generation {s.gen}: {whys[r.wid]}",
                                    dump=True) for r in stuck]
        f = Fault("hang", rank=stuck[0].rank, message="; ".join(
            f"rank {r.rank} {whys[r.wid]}" for r in stuck) + f" (forming generation {s.gen})")
        s, more = fault(s, f, seen, policy)
        return s, cmds + more
    if seen.now > s.deadline:  # the generation did not form at all
        culprits = [r for r in seen.ranks if r.joining < s.gen] or \
                   [r for r in seen.ranks if r.entered < s.gen]
        why, limit = "did not join the generation in time", t.rendezvous_s
    elif seen.now > s.t_gen + t.join_s:  # a process that was already running should be quick
        culprits = [r for r in seen.ranks if r.warm and r.joining < s.gen]
        why, limit = "did not start to join the generation in time", t.join_s
    else:
        return s, []
    culprits = [r for r in culprits if not r.dead]
    if not culprits:
        return s, []
    cmds = [Missed("rendezvous", limit, s.gen, tuple(r.rank for r in culprits), why)]
    cmds += [Kill(r.wid, why, dump=True) for r in culprits]
    s, more = fault(s, Fault("rendezvous_timeout", rank=culprits[0].rank, message=(
        f"rank(s) {', '.join(str(r.rank) for r in culprits)} {why} "
        f"({limit:g} s, generation {s.gen})")), seen, policy)
    return s, cmds + more


def _retry(s: JobState, seen: Seen, policy: Any) -> tuple[JobState, list[Command]]:
    """Non-finite gradients: every rank skipped its optimizer step and waits. Once all have said
    so for the same step, redo (or skip) it in place: no teardown, nothing lost."""
    waiting = [r for r in seen.ranks if r.retry_step is not None]
    cmds: list[Command] = []
    if not waiting:
        return s, cmds
    if not s.incident:
        cmds.append(RetryOpened(waiting[0].retry_step))
        s = _with(s, incident=True, retry_deadline=seen.now + policy.levels.step_retry.deadline_s)
    if len(waiting) < len(seen.ranks):
        return s, cmds
    steps = {r.retry_step for r in waiting}
    if len(steps) > 1:  # they disagree: the coarse way
        s, more = fault(s, Fault("nan", message=(
            f"non-finite gradients at different steps {sorted(steps)}")), seen, policy)
        return s, cmds + more
    at = steps.pop()
    decision = ladder.decide_nan(at, {r.rank: r.retry_loss for r in waiting}, policy, s.counters)
    s = _with(s, counters=ladder.charge(decision, [], s.counters, seen.now), retry_deadline=None)
    cmds.append(Decide(decision, s.gen, step=at))
    if decision.level is Level.FAIL:
        return s, cmds + [Fail(decision)]
    return _with(s, attempt=True, level=decision.level.value), cmds + [RedoStep(decision, at)]


def _settle(s: JobState, seen: Seen, settled: bool) -> tuple[JobState, list[Command]]:
    if s.phase is not Phase.FINISHING:
        return s, []
    alive = tuple(r.wid for r in seen.ranks if not r.dead)
    if not alive and settled:
        return s, [JobOver()]
    if seen.now > s.deadline:
        missed = Missed("finish", s.finish_s, s.gen, tuple(r.rank for r in seen.ranks if not r.dead),
                        "ranks still alive, or the last checkpoint unwritten")
        return _with(s, deadline=math.inf), [missed, Overdue(alive)]
    return s, []

"""The recovery ladder as pure decision logic: faults + history + policy -> one decision.

Levels, finest first: step retry, in-process restart, rank replacement, node replacement,
scale-in, job restart, fail. A fault starts at the finest level that can handle it; a level that
is disabled, out of budget or not possible right now hands over to the next coarser one, and so
does a level that failed or missed its deadline (``escalate_from``). Rules about repetition
(isolate a node, blame the user's code, stop after repeated hangs) are checked first.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

from .faults import Attribution, Domain, Fault
from ..policy import Policy

__all__ = ["Attribution", "Counters", "Decision", "Fault", "LadderView", "Level", "charge", "decide",
           "decide_nan", "isolations", "progressed", "quiet"]


class Level(str, enum.Enum):
    STEP_RETRY = "step retry"
    IN_PROCESS = "in-process restart"
    REPLACE_RANK = "rank replacement"
    REPLACE_NODE = "node replacement"
    SCALE_IN = "scale-in"
    JOB_RESTART = "job restart"
    FAIL = "fail"
    SCALE_OUT = "scale-out"  # not a rung: capacity came back, the world grows (no fault)


LADDER = [Level.STEP_RETRY, Level.IN_PROCESS, Level.REPLACE_RANK, Level.REPLACE_NODE,
          Level.SCALE_IN, Level.JOB_RESTART]
_FIELD = {Level.STEP_RETRY: "step_retry", Level.IN_PROCESS: "in_process",
          Level.REPLACE_RANK: "rank_replacement", Level.REPLACE_NODE: "node_replacement",
          Level.SCALE_IN: "scale_in", Level.JOB_RESTART: "job_restart"}
_ESCALATING = ("rendezvous_timeout", "deadline")  # faults that mean "this level did not work"
# faults whose rank is given a new process even when it is alive: its parameters cannot be
# trusted, its CUDA context is unusable, or its communicators would not abort
_NEW_PROCESS = ("sdc", "cuda_assert", "cuda_error", "gpu_hardware", "abort_timeout")


def level_policy(policy: Policy, level: Level) -> Any:
    return getattr(policy.levels, _FIELD[level])


@dataclasses.dataclass
class Counters:
    """What the job has spent and seen so far; budgets count per job, not per process."""

    spent: dict[str, int] = dataclasses.field(default_factory=dict)  # level -> times (ranks) used
    user_errors_in_a_row: int = 0  # user exceptions with no step completed since
    nan_in_a_row: int = 0  # step retries for non-finite gradients, no step completed since
    hangs_in_a_row: int = 0  # hang recoveries, no step completed since
    restarts_without_infra: int = 0  # job restarts in a row with no infrastructure fault
    recent: list[tuple[float, str, int | None, int | None]] = dataclasses.field(default_factory=list)
    isolated: set[int] = dataclasses.field(default_factory=set)  # nodes never used again
    last_fault_t: float = 0.0

    def used(self, level: Level) -> int:
        return self.spent.get(level.value, 0)

    def but(self, **changes: Any) -> Counters:
        """A copy with ``changes``: its collections are its own, so changing the copy never
        changes the counters it was made from (the controller keeps both across a decision)."""
        fields = {"spent": dict(self.spent), "recent": list(self.recent),
                  "isolated": set(self.isolated), **changes}
        return dataclasses.replace(self, **fields)

    _IN_A_ROW = ("user_errors_in_a_row", "nan_in_a_row", "hangs_in_a_row", "restarts_without_infra")

    def record(self) -> dict[str, Any]:
        """What outlives the controller (the event log, the journal across hosts)."""
        return {"spent": self.spent, **{n: getattr(self, n) for n in self._IN_A_ROW},
                "isolated": sorted(self.isolated)}

    @classmethod
    def from_record(cls, rec: dict[str, Any] | None, isolated: set[int] = frozenset()) -> Counters:
        """The counters a record kept (a controller taking over: budgets are the job's, not a
        term's), with ``isolated`` nodes added."""
        rec = rec or {}
        return cls(spent=dict(rec.get("spent") or {}),
                   **{n: int(rec.get(n) or 0) for n in cls._IN_A_ROW},
                   isolated=set(rec.get("isolated") or []) | set(isolated))

    # kept for the event log and older callers
    @property
    def rank_replacements(self) -> int:
        return self.used(Level.REPLACE_RANK)

    @property
    def job_restarts(self) -> int:
        return self.used(Level.JOB_RESTART)

    @property
    def step_retries(self) -> int:
        return self.used(Level.STEP_RETRY)


@dataclasses.dataclass(frozen=True)
class LadderView:
    """What the ladder needs to know of the job's placement."""

    world: int
    managed: bool = True  # the ranks run inside nonstop.wrap
    node_of: dict[int, int] = dataclasses.field(default_factory=dict)  # rank -> node
    spare_nodes: int = 0  # healthy nodes with no rank on them, able to take a node's ranks
    capacity: int | None = None  # ranks the healthy nodes can hold (None: enough)
    slots: int = 0  # ranks one node holds (0: unknown)
    ready_spares: dict[int, int] = dataclasses.field(default_factory=dict)  # node -> warm, ready
    # node -> places left on a healthy node that holds ranks (after scale-in and scale-out the
    # ranks need not fill their nodes: a lost node's ranks can go there when no node is spare)
    free_slots: dict[int, int] = dataclasses.field(default_factory=dict)
    # a sharded job's replica groups (rank -> its group's ranks; empty: none)
    replica_groups: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    # a mesh sharded along its first dimension, none replicating it (plain FSDP, FSDP x TP):
    # the ranks per index of that dimension (0: not such a job). Its world changes by whole
    # blocks of them, and every rank of the new world is a new process (``restarted``); -1: a
    # mesh with no replicated dimension whose size is fixed (it cannot shrink)
    regrid_unit: int = 0


@dataclasses.dataclass(frozen=True)
class Decision:
    level: Level
    # ranks that get a new process (SCALE_IN, SCALE_OUT: the ranks that stay, a mesh job whose
    # processes cannot be sharded again: ``restarted``)
    replace: frozenset[int] = frozenset()
    isolate: frozenset[int] = frozenset()  # nodes never used again
    reason: str = ""
    diagnosis: str | None = None  # for FAIL: what to tell the user
    traceback: str | None = None  # for FAIL on a user error: shown once
    usage_error: bool = False  # FAIL caused by bad input (exit code 2)
    skip: bool = False  # STEP_RETRY: skip the batch instead of redoing it
    drop: frozenset[int] = frozenset()  # SCALE_IN: ranks the smaller world goes on without
    # SCALE_IN, SCALE_OUT: the mesh is sharded along the dimension that changes, so every rank
    # of the new world is a new process (``restarted``); otherwise ``replace`` holds only ranks
    # lost on a node that stays, each given a new process in its own place
    reshard: bool = False
    passed_over: tuple[str, ...] = ()  # finer levels that could not take it, and why
    # FAIL for want of places: the healthy nodes lack this many ranks' places (a host joining
    # may bring them: across hosts the job waits for one, ``hosts.capacity_wait_s``)
    wanting: int = 0


def _fail(reason: str, diagnosis: str, **kw: Any) -> Decision:
    return Decision(Level.FAIL, reason=reason, diagnosis=diagnosis, **kw)


def isolations(faults: list[Fault], view: LadderView, policy: Policy, counters: Counters,
                now: float) -> set[int]:
    """Nodes whose ranks (or which) saw the same fault code ``isolate.times`` times within the
    window, this round included: treated as failing hardware."""
    rule = policy.rules.isolate
    out = set()
    for f in faults:
        if f.attribution is not Attribution.INFRA:
            continue
        node = f.node if f.node is not None else view.node_of.get(f.rank) if f.rank is not None else None
        if node is None or node in counters.isolated:
            continue
        # a rank failing again on the node it failed on, or the node itself failing again; a
        # rank failing again on another node (it moved to a spare there) points at its own
        # code or data, not at that node's hardware
        same = 1 + sum(1 for t, code, rank, n in counters.recent
                       if now - t <= rule.window_s and code == f.fault_code
                       and ((n == node and (rank is None or f.rank is None or rank == f.rank))
                            or (n is None and rank is not None and rank == f.rank)))
        if same >= rule.times:
            out.add(node)
    return out


def decide(faults: list[Fault], dead: set[int], view: LadderView, policy: Policy,
           counters: Counters, now: float = 0.0, escalate_from: Level | None = None) -> Decision:
    """Decide one round of an incident.

    Args:
        faults: what was observed in this round (at least one).
        dead: ranks whose process is gone (died, or killed for missing a deadline).
        view: the job's placement.
        policy: levels, budgets and rules.
        counters: what was spent so far (not modified; see ``charge``).
        now: the time, for the isolation window.
        escalate_from: the level that was tried and failed; only coarser levels are considered.
    """
    rules = policy.rules
    # a rank whose process cannot be trusted (its parameters silently differ) gets a new one
    dead = set(dead) | {f.rank for f in faults if f.kind in _NEW_PROCESS and f.rank is not None}
    if counters.user_errors_in_a_row:  # out of GPU memory again: a new process, a new allocator
        dead |= {f.rank for f in faults if f.kind == "cuda_oom" and f.rank is not None}
    if policy.recover.failure_domain == "replica_group" and view.replica_groups:
        # torchft's model: a lost rank's whole replica group gets new processes (their shards
        # come from their twins in the other groups)
        dead |= {r for d in dead for r in view.replica_groups.get(d, (d,))}
    user = [f for f in faults if f.attribution is Attribution.USER]
    infra = [f for f in faults if f.attribution is Attribution.INFRA]
    imports = [f for f in faults if f.kind == "import_error"]
    if imports:  # the same code fails the same way on every attempt: retrying cannot help
        return _fail("the script fails at import", f"the script failed at import: {imports[0].message}",
                     usage_error=True, traceback=imports[0].traceback)
    setup = [f for f in faults if f.kind == "setup"]
    if setup:  # every restart meets the same setup: the script must change
        return _fail("the script's setup", f"rank {setup[0].rank}: {setup[0].message}",
                     usage_error=True)
    own = [f for f in faults if f.attribution is Attribution.NONSTOP]
    if own:  # its state cannot be trusted to be kept: a retry would fail on, in the user's code
        f = own[0]
        return _fail("nonstop's own error",
                     f"nonstop's own state code raised {f.message} on rank {f.rank} - a bug in "
                     "nonstop (or a kind of state it does not handle yet), not in the training "
                     "code: please report it with the traceback; the job stops (a retry cannot "
                     "keep its state either)", traceback=f.traceback)
    if user and counters.user_errors_in_a_row >= rules.user_error_retries:
        f = user[0]
        return _fail("user error budget spent",
                     f"rank {f.rank} raised {f.message} on {counters.user_errors_in_a_row + 1} "
                     f"attempts in a row; giving up (rules.user_error_retries="
                     f"{rules.user_error_retries})", traceback=f.traceback)
    if any(f.kind == "hang" for f in faults) and counters.hangs_in_a_row >= rules.hang_restarts:
        return _fail("hung again and again",
                     f"the job hung {counters.hangs_in_a_row + 1} times in a row with no step "
                     f"completed in between (rules.hang_restarts={rules.hang_restarts}); last: "
                     f"{_last(faults)}")
    if any(f.kind in _ESCALATING for f in faults) and escalate_from is None:
        escalate_from = Level.REPLACE_RANK if dead else Level.IN_PROCESS
    isolate = isolations(faults, view, policy, counters, now)
    sick_nodes = isolate | {f.node for f in faults if f.domain is Domain.NODE and f.node is not None}
    if not view.managed or any(f.kind == "no_state" for f in faults) or len(dead) >= view.world:
        base = Level.JOB_RESTART
    elif sick_nodes:
        base = Level.REPLACE_NODE
    elif dead:
        base = Level.REPLACE_RANK
    else:
        base = Level.IN_PROCESS
    start = LADDER.index(base)
    if escalate_from is not None and escalate_from in LADDER:
        start = max(start, LADDER.index(escalate_from) + 1)
    # the ranks a coarser level would give new processes besides the dead ones
    at_fault = {f.rank for f in faults if f.rank is not None and f.domain is Domain.RANK
                and f.kind != "peer"}
    passed: list[str] = []
    for level in LADDER[start:]:
        cfg = level_policy(policy, level)
        replace: set[int] = set()
        if level is Level.IN_PROCESS and dead:
            passed.append(f"{level.value}: rank processes are gone")
            continue
        if level is Level.REPLACE_RANK:
            replace = set(dead) | at_fault
            if not view.managed:
                passed.append(f"{level.value}: the script does not use nonstop.wrap")
                continue
            if not replace:
                passed.append(f"{level.value}: no rank at fault")
                continue
            if _prefer_shrink(replace, view, policy, counters, sick_nodes):
                passed.append(f"{level.value}: no warm spare ready (scale_in.when: "
                              "no_warm_spare)")
                continue
        if level is Level.REPLACE_NODE:
            nodes = sick_nodes or {view.node_of[r] for r in set(dead) | at_fault if r in view.node_of}
            if not nodes:
                passed.append(f"{level.value}: no node at fault")
                continue
            replace = {r for r, n in view.node_of.items() if n in nodes} | set(dead)
            moved = sum(1 for r, n in view.node_of.items() if n in nodes)
            room = view.spare_nodes * view.slots + sum(
                k for n, k in view.free_slots.items() if n not in nodes)
            if view.spare_nodes < len(nodes) and room < moved:
                passed.append(f"{level.value}: no spare node")
                continue
            isolate = isolate | nodes
        if level is Level.SCALE_IN:
            lost_capacity = bool(sick_nodes) and view.spare_nodes < len(sick_nodes)
            if policy.levels.scale_in.when == "no_capacity" and not lost_capacity:
                passed.append(f"{level.value}: the lost place can be refilled "
                              "(scale_in.when: no_capacity)")
                continue
            lost = set(dead) | at_fault
            # nodes lost with no spare: the world goes on without them. A rank lost meanwhile
            # on a node that stays (a survivor killed for not leaving in time) does not take its
            # node with it: its place is free, and a new process takes it
            again = {r for r in lost if view.node_of.get(r) not in sick_nodes} \
                if sick_nodes else set()
            drop, why_not = shrink(lost - again, sick_nodes, view, policy)
            if why_not:
                passed.append(f"{level.value}: {why_not}")
                continue
            isolate = isolate | sick_nodes
            stay = set(range(view.world)) - drop
            replace = restarted(view, stay) | (again & stay)
        if level is Level.JOB_RESTART:
            replace = set(range(view.world))
            # the nodes this decision isolates are gone too
            capacity = None if view.capacity is None else \
                view.capacity - view.slots * len(isolate - counters.isolated)
            if capacity is not None and capacity < view.world:
                return _fail("not enough healthy nodes",
                             f"{len(counters.isolated | isolate)} node(s) isolated: the healthy "
                             f"nodes cannot hold {view.world} ranks; last: {_last(faults)}",
                             passed_over=tuple(passed), wanting=view.world - capacity)
            if not infra and counters.restarts_without_infra >= rules.user_code_job_restarts:
                return _fail("the user's code",
                             f"{counters.restarts_without_infra} job restarts in a row with no "
                             f"infrastructure fault: the training code itself fails "
                             f"(rules.user_code_job_restarts={rules.user_code_job_restarts}); "
                             f"last: {_last(faults)}",
                             traceback=user[0].traceback if user else None, passed_over=tuple(passed))
        cost = len(replace) if level is Level.REPLACE_RANK else 1
        if not cfg.enabled:
            passed.append(f"{level.value}: disabled")
            continue
        if counters.used(level) + cost > cfg.budget:
            passed.append(f"{level.value}: budget of {cfg.budget} spent")
            continue
        reason = "; ".join(f.describe() for f in faults if f.kind != "peer") or _last(faults)
        return Decision(level, replace=frozenset(replace), isolate=frozenset(isolate),
                        reason=reason, passed_over=tuple(passed),
                        drop=frozenset(drop) if level is Level.SCALE_IN else frozenset(),
                        reshard=level is Level.SCALE_IN and view.regrid_unit > 0)
    return _fail("no level left", f"no recovery level left ({'; '.join(passed)}); last: "
                 f"{_last(faults)}", traceback=user[0].traceback if user else None,
                 passed_over=tuple(passed))


def shrink(lost: set[int], sick_nodes: set[int], view: LadderView, policy: Policy
           ) -> tuple[set[int], str | None]:
    """The ranks a scale-in goes on without, or why it cannot: the lost ranks (across nodes,
    every rank of their nodes: the world shrinks by whole nodes), and then the highest ranks
    until the world is an allowed size. (drop, None) or (set(), why not)."""
    cfg = policy.levels.scale_in
    nodes = sick_nodes | {view.node_of[r] for r in lost if r in view.node_of}
    if len(set(view.node_of.values())) > 1:  # host granularity
        drop = {r for r, n in view.node_of.items() if n in nodes} | set(lost)
    else:
        drop = set(lost) | {r for r, n in view.node_of.items() if n in sick_nodes}
    if not drop:
        return set(), "no rank lost"
    if view.regrid_unit < 0:
        return set(), ("the mesh has no dimension that replicates the state and no free first "
                       "dimension (-1) that shards it: its size is fixed")
    if view.regrid_unit:  # its first dimension shrinks: a lost rank's whole block leaves
        unit = view.regrid_unit
        drop |= {r for d in set(drop) for r in range(d - d % unit, d - d % unit + unit)}
        group = unit
    elif view.replica_groups:  # a sharded job: a lost rank's whole replica group leaves with it
        drop |= {r for d in set(drop) for r in view.replica_groups.get(d, (d,))}
        group = len(next(iter(view.replica_groups.values())))
    else:
        group = 1
    left = view.world - len(drop)
    allowed = left - left % math.lcm(cfg.multiple_of, group)
    keep = sorted(r for r in range(view.world) if r not in drop)
    drop |= set(keep[allowed:])  # the highest ranks go too: the world stays an allowed size
    if allowed < max(cfg.min_world, 1):
        size = f"{allowed} rank(s)" + (f" (a multiple of {cfg.multiple_of})"
                                       if cfg.multiple_of > 1 else "")
        return set(), f"{size} would be left, below the minimum of {cfg.min_world} (scale_in.min_world)"
    return drop, None


def restarted(view: LadderView, ranks: set[int]) -> set[int]:
    """The ranks of a world that changes size which need new processes: every one, for a mesh
    sharded along the dimension that changes (``regrid_unit``: its processes cannot be sharded
    again, and the new ones cut their shards from the old); none otherwise (they go on live)."""
    return set(ranks) if view.regrid_unit > 0 else set()


def _prefer_shrink(replace: set[int], view: LadderView, policy: Policy, counters: Counters,
                   sick_nodes: set[int]) -> bool:
    """Whether a scale-in goes first instead of starting new processes for ``replace``: the
    policy says so when no warm spare is ready for them, and a scale-in can be done."""
    cfg = policy.levels.scale_in
    if cfg.when != "no_warm_spare" or not cfg.enabled or counters.used(Level.SCALE_IN) >= cfg.budget:
        return False
    need: dict[int, int] = {}
    for r in replace:
        node = view.node_of.get(r, 0)
        need[node] = need.get(node, 0) + 1
    if all(view.ready_spares.get(n, 0) >= k for n, k in need.items()):
        return False
    return shrink(replace, sick_nodes, view, policy)[1] is None


def _last(faults: list[Fault]) -> str:
    real = [f for f in faults if f.kind != "peer"] or faults
    return real[-1].describe() if real else "no fault"


def decide_nan(step: int, outputs: dict[int, Any], policy: Policy, counters: Counters) -> Decision:
    """Every rank found non-finite gradients at ``step`` (they were reduced together, so all
    agree). Redo or skip the step from its in-memory start, until the policy says enough."""
    nan = policy.detect.nan
    bad = sorted(r for r, out in outputs.items()
                 if out is not None and not (isinstance(out, (int, float)) and math.isfinite(out)))
    who = (f"non-finite forward output on rank(s) {', '.join(map(str, bad))}" if bad
           else "every rank's forward output was finite")
    if nan.action == "fail":
        return _fail("detect.nan.action is fail", f"non-finite gradients at step {step} ({who})")
    if counters.nan_in_a_row >= nan.max_consecutive:
        return _fail("non-finite gradients again and again",
                     f"non-finite gradients at step {step} on {counters.nan_in_a_row + 1} attempts "
                     f"in a row ({who}); no earlier snapshot to roll back to")
    level = policy.levels.step_retry
    if not level.enabled or counters.used(Level.STEP_RETRY) >= level.budget:
        return _fail("step retry disabled or its budget spent",
                     f"non-finite gradients at step {step} ({who}) and no step retry left "
                     "(recover.levels.step_retry)")
    skip = nan.action == "skip_batch"
    return Decision(Level.STEP_RETRY, skip=skip,
                    reason=f"non-finite gradients at step {step} ({who}): "
                           + ("skipping the batch" if skip else "redoing the step"))


def charge(decision: Decision, faults: list[Fault], counters: Counters, now: float = 0.0,
           node_of: dict[int, int] | None = None) -> Counters:
    """The counters after carrying out ``decision`` (pure). ``node_of``: where each rank was
    when it failed (a fault is counted towards isolating that node)."""
    out = counters.but(last_fault_t=now)
    level = decision.level
    if level is Level.STEP_RETRY:
        out.nan_in_a_row += 1
    if level in _FIELD:
        out.spent[level.value] = out.used(level) + (len(decision.replace)
                                                    if level is Level.REPLACE_RANK else 1)
    if any(f.attribution is Attribution.USER and f.kind != "nan" for f in faults):
        out.user_errors_in_a_row += 1
    if any(f.kind == "hang" for f in faults):
        out.hangs_in_a_row += 1
    if level is Level.JOB_RESTART:
        infra = any(f.attribution is Attribution.INFRA for f in faults)
        out.restarts_without_infra = 0 if infra else out.restarts_without_infra + 1
    for f in faults:
        if f.kind != "peer":
            node = f.node if f.node is not None or f.rank is None else (node_of or {}).get(f.rank)
            out.recent.append((now, f.fault_code, f.rank, node))
    out.isolated |= set(decision.isolate)
    return out


def progressed(counters: Counters) -> Counters:
    """Every rank completed a step after recovery: the in-a-row counters start over."""
    return counters.but(user_errors_in_a_row=0, nan_in_a_row=0, hangs_in_a_row=0,
                        restarts_without_infra=0)


def quiet(counters: Counters, now: float, policy: Policy) -> Counters:
    """De-escalation: after ``rules.quiet_period_s`` with no fault, old faults stop counting
    towards isolation and the in-a-row counters start over (isolated nodes stay isolated)."""
    if counters.last_fault_t and now - counters.last_fault_t > policy.rules.quiet_period_s:
        out = progressed(counters)
        return out.but(recent=[], last_fault_t=0.0)
    return counters.but()

"""Scale-in and scale-out as pure decisions: which ranks a smaller world goes on without, when
the ladder prefers it, when and onto which spares the world grows back, and the state machine's
regroup at a step boundary, on a fake clock."""

from __future__ import annotations

import dataclasses

import pytest

from nonstop.controller import machine as mc
from nonstop.controller.phase import Phase
from nonstop.decide import elastic, ladder
from nonstop.decide.faults import Fault
from nonstop.decide.ladder import Counters, LadderView, Level
from nonstop.policy import Policy

P = Policy()
ONE_HOST = LadderView(world=4, node_of={r: 0 for r in range(4)}, spare_nodes=0, slots=4)
TWO_HOSTS = LadderView(world=4, node_of={0: 0, 1: 0, 2: 1, 3: 1}, spare_nodes=0, capacity=4,
                    slots=2)


def pol(**scale_in):
    return P.with_overrides(**{f"recover.levels.scale_in.{k}": v for k, v in scale_in.items()})


def decide(faults, dead, view=ONE_HOST, policy=P, counters=None):
    return ladder.decide(list(faults), set(dead), view, policy, counters or Counters(), 100.0)


CRASH1 = Fault("crash", rank=1, code=-9)


# == the ladder ==================================================================================
def test_one_host_replaces_a_crashed_rank_unless_told_to_prefer_a_scale_in():
    assert decide([CRASH1], {1}).level is Level.REPLACE_RANK  # no_capacity: a process can start
    d = decide([CRASH1], {1}, policy=pol(when="no_warm_spare"))
    assert d.level is Level.SCALE_IN and d.drop == {1} and d.replace == frozenset()
    assert any("no warm spare ready" in p for p in d.passed_over)
    warm = dataclasses.replace(ONE_HOST, ready_spares={0: 1})
    assert decide([CRASH1], {1}, view=warm, policy=pol(when="no_warm_spare")).level \
        is Level.REPLACE_RANK


def test_across_nodes_a_lost_node_shrinks_the_world_by_the_whole_node():
    lost = Fault("node_lost", node=1, message="host gone")
    d = decide([lost], {2, 3}, view=TWO_HOSTS)
    assert d.level is Level.SCALE_IN and d.drop == {2, 3} and 1 in d.isolate
    assert any("node replacement: no spare node" in p for p in d.passed_over)
    # a crashed rank on a healthy node takes its node's other rank with it (host granularity)
    d = decide([Fault("crash", rank=2, code=-9)], {2}, view=TWO_HOSTS,
               policy=pol(when="no_warm_spare"))
    assert d.level is Level.SCALE_IN and d.drop == {2, 3} and not d.isolate


def test_a_rank_lost_on_a_node_that_stays_while_another_node_is_lost_gets_a_new_process():
    """A node lost with no spare node, and at the same moment a survivor on the other node
    killed for not leaving in time: the world goes on without the lost node only; the killed
    rank's node still has its place (and its memory), so a new process takes it. Before, it
    took its node with it, no rank was left and the job restarted whole."""
    lost = Fault("node_lost", node=1, message="host gone")
    late = Fault("teardown_timeout", rank=0, node=0, message="still in generation 0")
    d = decide([lost, Fault("crash", rank=3, code=-9), late], {0, 2, 3}, view=TWO_HOSTS)
    assert d.level is Level.SCALE_IN and d.drop == {2, 3} and d.isolate == {1}
    assert d.replace == {0} and not d.reshard  # rank 1 goes on live
    # a mesh sharded along the dimension that shrinks: every rank that stays is new anyway
    d = decide([lost, late], {0, 2, 3}, view=dataclasses.replace(TWO_HOSTS, regrid_unit=2))
    assert d.level is Level.SCALE_IN and d.drop == {2, 3} and d.replace == {0, 1} and d.reshard
    # with no node lost, a crash on a node still takes its node with it (host granularity)
    d = decide([late], {0}, view=TWO_HOSTS, policy=pol(when="no_warm_spare"))
    assert d.level is Level.SCALE_IN and d.drop == {0, 1} and d.replace == set()


def test_the_world_stays_a_multiple_of_the_model_parallel_size():
    view = dataclasses.replace(ONE_HOST, world=6, node_of={r: 0 for r in range(6)})
    d = decide([CRASH1], {1}, view=view, policy=pol(when="no_warm_spare", multiple_of=2))
    assert d.level is Level.SCALE_IN and d.drop == {1, 5}  # 4 left: the highest healthy rank goes


def test_below_the_minimum_the_ladder_goes_on_and_says_why():
    p = pol(when="no_warm_spare", min_world=3)
    view = dataclasses.replace(ONE_HOST, world=3, node_of={r: 0 for r in range(3)})
    d = decide([CRASH1], {1}, view=view, policy=p)
    assert d.level is Level.REPLACE_RANK  # a scale-in is not possible: a new process it is
    no_more = p.with_overrides(**{"recover.levels.rank_replacement.enabled": False,
                                  "recover.levels.job_restart.enabled": False})
    d = decide([CRASH1], {1}, view=view, policy=no_more)
    assert d.level is Level.FAIL
    assert "scale-in: 2 rank(s) would be left, below the minimum of 3" in d.diagnosis


def test_by_default_only_a_lost_place_shrinks_the_world():
    p = P.with_overrides(**{"recover.levels.rank_replacement.enabled": False})
    d = decide([CRASH1], {1}, policy=p)
    assert d.level is Level.JOB_RESTART  # the place is there: not a capacity loss
    assert "scale-in: the lost place can be refilled (scale_in.when: no_capacity)" in d.passed_over
    spare_node = dataclasses.replace(TWO_HOSTS, spare_nodes=1)
    off = P.with_overrides(**{"recover.levels.node_replacement.enabled": False})
    d = decide([Fault("node_lost", node=1, message="gone")], {2, 3}, view=spare_node, policy=off)
    assert d.level is not Level.SCALE_IN  # a spare node is there, though not to be used
    assert "scale-in: the lost place can be refilled (scale_in.when: no_capacity)" in d.passed_over


def test_a_spent_scale_in_budget_falls_back_to_a_new_process():
    p = pol(when="no_warm_spare", budget=1)
    c = ladder.charge(decide([CRASH1], {1}, policy=p), [CRASH1], Counters())
    assert c.used(Level.SCALE_IN) == 1
    assert decide([CRASH1], {1}, policy=p, counters=c).level is Level.REPLACE_RANK


# == growing back ================================================================================
def test_room_counts_free_places_and_whole_spare_nodes_only():
    node_of = {0: 0, 1: 0, 2: 0}  # node 0 holds 3 of its 4 places
    assert elastic.room(node_of, 1, 4, set(), {0: 2}) == [0]
    # node 1 holds no rank: it joins with a full node's worth of ready spares, or not at all
    assert elastic.room({0: 0, 1: 0}, 2, 2, set(), {1: 1}) == []
    assert elastic.room({0: 0, 1: 0}, 3, 2, {1}, {1: 2, 2: 2}) == [2, 2]


def test_grow_fills_up_to_the_target_in_allowed_sizes():
    assert elastic.grow(3, 4, [0, 0], P) == {3: 0}
    assert elastic.grow(2, 6, [1, 1, 2, 2], pol(multiple_of=2)) == {2: 1, 3: 1, 4: 2, 5: 2}
    assert elastic.grow(2, 6, [1], pol(multiple_of=2)) == {}  # 3 is not allowed
    assert elastic.grow(4, 4, [0], P) == {}
    assert elastic.due(10.0, 12.0, pol(grow_after_s=2.0))
    assert not elastic.due(10.0, 11.9, pol(grow_after_s=2.0)) and not elastic.due(None, 99.0, P)


# == the state machine ===========================================================================
def rank_seen(n, gen, **kw):
    return tuple(mc.RankSeen(rank=r, wid=100 + r, node=0, joining=gen, entered=gen, **kw)
                 for r in range(n))


def degraded(now=50.0, p=P):
    """Generation 1 trains with 3 of 4 ranks since ``now``."""
    s = mc.JobState(phase=Phase.RUNNING, gen=1, degraded_since=now)
    return s, lambda t, rs, ready=None: mc.Seen(now=t, ranks=rs, total_nodes=1, slots=4,
                                                  target_world=4, ready_spares=ready or {},
                                                  slowest_step_s=0.1)


def test_a_scale_in_marks_the_job_degraded():
    s = mc.JobState(phase=Phase.RUNNING, gen=0)
    rs = rank_seen(4, 0)
    dead = tuple(dataclasses.replace(r, dead=True) if r.rank == 1 else r for r in rs)
    see = lambda t, x: mc.Seen(now=t, ranks=x, total_nodes=1, slots=4)  # noqa: E731
    p = pol(when="no_warm_spare")
    s, _ = mc.step(s, mc.Faulted(see(10.0, dead), CRASH1), p)
    left = tuple(dataclasses.replace(r, left=0) if not r.dead else r for r in dead)
    s, cmds = mc.step(s, mc.Tick(see(10.1, left)), p)
    assert kinds(cmds) == ["Probe"]
    s, cmds = mc.step(s, mc.Tick(see(10.2, left)), p)
    assert kinds(cmds) == ["Decide", "CarryOut"] and cmds[1].decision.level is Level.SCALE_IN
    assert cmds[1].placement == {} and s.degraded_since == 10.2 and s.gen == 1


def test_grow_waits_for_its_time_and_a_ready_spare_then_regroups_at_a_step_boundary():
    p = pol(grow_after_s=5.0)
    s, see = degraded(50.0, p)
    rs = rank_seen(3, 1)
    assert mc.step(s, mc.Tick(see(60.0, rs)), p)[1] == []  # no spare ready
    assert mc.step(s, mc.Tick(see(54.0, rs, {0: 1})), p)[1] == []  # too early
    s, cmds = mc.step(s, mc.Tick(see(55.0, rs, {0: 1})), p)
    assert cmds == [mc.Regroup(1)] and s.phase is Phase.TEARING_DOWN and s.regroup
    assert not s.incident  # growing is no fault
    assert s.deadline == 55.0 + p.timeouts.teardown_s + 3 * 0.1
    left = tuple(dataclasses.replace(r, left=1) for r in rs)
    s, cmds = mc.step(s, mc.Tick(see(55.2, left, {0: 1})), p)
    assert kinds(cmds) == ["Decide", "CarryOut"]
    assert cmds[1].decision.level is Level.SCALE_OUT and cmds[1].placement == {3: 0}
    assert s.gen == 2 and s.phase is Phase.RENDEZVOUS and s.degraded_since is None
    assert not s.regroup and s.level is None  # a growth that fails is a fault like any other


def test_ranks_too_slow_to_reach_a_step_boundary_are_told_to_leave_at_once():
    s, see = degraded(0.0)
    rs = rank_seen(3, 1)
    s, cmds = mc.step(s, mc.Tick(see(1.0, rs, {0: 1})), P)
    assert cmds == [mc.Regroup(1)]
    allowance = round(s.deadline - s.t_abort, 3)
    s, cmds = mc.step(s, mc.Tick(see(s.deadline + 0.01, rs, {0: 1})), P)
    missed, abort = cmds  # the deadline that fired, as an event, then the abort
    assert missed == mc.Missed("step_boundary", allowance, 1, (0, 1, 2), missed.detail)
    assert abort == mc.AbortGeneration(1, managed=True) and s.forced and s.phase is Phase.TEARING_DOWN
    s, cmds = mc.step(s, mc.Tick(see(s.deadline + 0.01, rs, {0: 1})), P)
    assert kinds(cmds) == ["Missed"] and s.patient  # and then as after any fault: with not
    s, cmds = mc.step(s, mc.Tick(see(s.deadline + 0.01, rs, {0: 1})), P)  # one out, once more
    assert kinds(cmds) == ["Missed"] + ["Kill"] * 3


def test_a_fault_during_the_regroup_is_recovered_as_a_fault():
    s, see = degraded(0.0, pol(when="no_warm_spare"))
    p = pol(when="no_warm_spare")
    rs = rank_seen(3, 1)
    s, _ = mc.step(s, mc.Tick(see(1.0, rs, {0: 1})), p)
    dead = tuple(dataclasses.replace(r, dead=True) if r.rank == 2 else
                 dataclasses.replace(r, left=1) for r in rs)
    s, cmds = mc.step(s, mc.Faulted(see(1.1, dead, {0: 1}), Fault("crash", rank=2, code=-9)), p)
    assert kinds(cmds) == ["Raise"] and s.incident  # already leaving: no second abort
    s, cmds = mc.step(s, mc.Tick(see(1.2, dead, {0: 1})), p)
    assert kinds(cmds) == ["Probe"] and not s.regroup
    s, cmds = mc.step(s, mc.Tick(see(1.3, dead, {0: 1})), p)
    assert cmds[1].decision.level is Level.REPLACE_RANK  # the ready spare takes rank 2


def kinds(cmds):
    return [type(c).__name__ for c in cmds]


def test_nnodes_min_max_sets_the_smallest_world():
    from nonstop.launch.hosts import with_min_hosts

    assert with_min_hosts(P, 2, 4, 8).levels.scale_in.min_world == 16
    assert with_min_hosts(pol(min_world=24), 2, 4, 8).levels.scale_in.min_world == 24
    assert with_min_hosts(P, 4, 4, 8) is P  # --nnodes N: the policy as it is


def test_the_context_splits_the_global_batch_for_any_world():
    from nonstop.runtime.context import Context
    from nonstop.runtime.registered import _StepOnly

    def ctx(rank, world, full=4, scale_lr=False):
        return Context(rank, world, 0, 1, 0, _StepOnly(), full_world_size=full, scale_lr=scale_lr)

    for world in (1, 3, 4, 7):
        shares = [ctx(r, world).share(64) for r in range(world)]
        assert [i for s in shares for i in s] == list(range(64))  # contiguous, all, once
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert ctx(0, 3).share(64) == range(0, 22) and ctx(2, 3).share(64) == range(43, 64)
    assert ctx(0, 3).micro_batches(64, 16) == [range(0, 16), range(16, 22)]
    assert ctx(3, 4).micro_batches(64, 16) == [range(48, 64)]
    assert ctx(0, 3).full_world_size == 4 and ctx(0, 3).lr_scale == 1.0
    assert ctx(0, 3, scale_lr=True).lr_scale == 0.75
    with pytest.raises(ValueError):
        ctx(0, 3).share(0)


def test_a_preempted_node_with_no_spare_node_leaves_a_smaller_world_at_a_step_boundary():
    # two nodes of 2 ranks, no spare node: node 1 is preempted (its host told to stop)
    s = mc.JobState(phase=Phase.RUNNING, gen=3)
    rs = tuple(mc.RankSeen(rank=r, wid=100 + r, node=r // 2, joining=3, entered=3)
               for r in range(4))
    see = lambda t, x: mc.Seen(now=t, ranks=x, total_nodes=2, slots=2,  # noqa: E731
                               slowest_step_s=0.1)
    asked = mc.Drain(see(10.0, rs), (), 1, "preempted (SIGTERM)", pressed=True)
    # a planned drain with nowhere to go is refused; a preemption shrinks the world instead
    refused = mc.step(s, dataclasses.replace(asked, pressed=False), P)[1]
    assert kinds(refused) == ["DrainRefused"]
    off = pol(enabled=False)
    (no,) = mc.step(s, asked, off)[1]
    assert isinstance(no, mc.DrainRefused) and "scale-in is off" in no.why
    s, cmds = mc.step(s, asked, P)
    assert kinds(cmds) == ["Regroup"] and s.regroup and not s.incident
    left = tuple(dataclasses.replace(r, left=3) for r in rs)
    s, cmds = mc.step(s, mc.Tick(see(10.2, left)), P)
    assert kinds(cmds) == ["Decide", "CarryOut"]
    d = cmds[1].decision
    assert d.level is Level.SCALE_IN and d.drop == {2, 3} and d.isolate == {1}
    assert s.degraded_since == 10.2 and 1 in s.counters.isolated and not s.incident


def test_a_preempted_node_goes_to_a_spare_node_with_fewer_warm_spares_than_its_ranks():
    """Two nodes of 2 ranks and a spare node with one warm spare: node 1 preempted. A planned
    drain waits for warm spares; a preemption whose grace runs out moves the node's ranks there
    all the same (the one without a warm spare started cold) - never a smaller world, and never
    nothing until the host is gone, with scale-in off too."""
    s = mc.JobState(phase=Phase.RUNNING, gen=3)
    rs = tuple(mc.RankSeen(rank=r, wid=100 + r, node=r // 2, joining=3, entered=3)
               for r in range(4))
    see = lambda t, x: mc.Seen(now=t, ranks=x, total_nodes=3, slots=2,  # noqa: E731
                               slowest_step_s=0.1, ready_spares={2: 1})
    asked = mc.Drain(see(10.0, rs), (), 1, "preempted (SIGTERM)", pressed=True)
    (refused,) = mc.step(s, dataclasses.replace(asked, pressed=False), P)[1]
    assert isinstance(refused, mc.DrainRefused) and "no spare node has 2 warm" in refused.why
    s, cmds = mc.step(s, asked, pol(enabled=False))
    assert kinds(cmds) == ["Regroup"] and s.regroup and not s.incident
    left = tuple(dataclasses.replace(r, left=3) for r in rs)
    s, cmds = mc.step(s, mc.Tick(see(10.2, left)), pol(enabled=False))
    assert kinds(cmds) == ["Decide", "CarryOut"]
    d, placement = cmds[1].decision, cmds[1].placement
    assert d.level is Level.REPLACE_NODE and d.replace == {2, 3} and d.isolate == {1}
    assert placement == {2: 2, 3: 2} and s.degraded_since is None


def test_a_preempted_node_holding_more_ranks_than_a_node_has_places_spreads_over_spare_nodes():
    """Node 1 holds 3 ranks of slots=2 (one moved there when no spare node was left), two spare
    nodes came since: preempted, its ranks move to both spare nodes - none is crowded onto one."""
    s = mc.JobState(phase=Phase.RUNNING, gen=3)
    node = {0: 0, 1: 0, 2: 1, 3: 1, 4: 1}
    rs = tuple(mc.RankSeen(rank=r, wid=100 + r, node=n, joining=3, entered=3)
               for r, n in node.items())
    see = lambda t, x: mc.Seen(now=t, ranks=x, total_nodes=4, slots=2,  # noqa: E731
                               slowest_step_s=0.1, ready_spares={2: 1, 3: 1})
    s, cmds = mc.step(s, mc.Drain(see(10.0, rs), (), 1, "preempted (SIGTERM)", pressed=True),
                      pol(enabled=False))
    assert kinds(cmds) == ["Regroup"]
    left = tuple(dataclasses.replace(r, left=3) for r in rs)
    s, cmds = mc.step(s, mc.Tick(see(10.2, left)), pol(enabled=False))
    d, placement = cmds[1].decision, cmds[1].placement
    assert d.level is Level.REPLACE_NODE and d.replace == {2, 3, 4}
    assert placement == {2: 2, 3: 2, 4: 3}


def test_a_sharded_job_leaves_and_comes_back_by_whole_replica_groups():
    """HSDP, 3 replica groups of 2 shards, scale_in.multiple_of left at 1: a lost rank takes its
    whole replica group with it, and the world grows back by whole groups only."""
    groups = {r: (r - r % 2, r - r % 2 + 1) for r in range(6)}
    view = dataclasses.replace(ONE_HOST, world=6, node_of={r: 0 for r in range(6)},
                               replica_groups=groups)
    d = decide([CRASH1], {1}, view=view, policy=pol(when="no_warm_spare"))
    assert d.level is Level.SCALE_IN and d.drop == {0, 1}
    assert elastic.grow(4, 6, [0], pol(), unit=2) == {}  # one spare: half a group, not enough
    assert elastic.grow(4, 6, [0, 0, 0], pol(), unit=2) == {4: 0, 5: 0}


# == a mesh sharded along the dimension that changes (plain FSDP, FSDP x TP) ===================
TWO_D = dataclasses.replace(ONE_HOST, regrid_unit=2)  # (dp_shard, tp) = (2, 2)


def test_a_mesh_sharded_along_its_first_dimension_shrinks_by_a_block_all_in_new_processes():
    d = decide([Fault("crash", rank=2, code=-9)], {2}, view=TWO_D, policy=pol(when="no_warm_spare"))
    # the lost rank's tensor-parallel peer leaves with it; the others' processes hold a model
    # sharded for 4 ranks: every rank that stays gets a new one (numbered as before the shrink)
    assert d.level is Level.SCALE_IN and d.drop == {2, 3} and d.replace == {0, 1}
    fsdp = dataclasses.replace(ONE_HOST, regrid_unit=1)
    d = decide([CRASH1], {1}, view=fsdp, policy=pol(when="no_warm_spare"))
    assert d.drop == {1} and d.replace == {0, 2, 3}  # an uneven world is fine for FSDP2
    # a block of one rank's world left: below the minimum, a new process for the lost rank
    one = dataclasses.replace(TWO_D, world=2, node_of={0: 0, 1: 0})
    d = decide([CRASH1], {1}, view=one, policy=pol(when="no_warm_spare"))
    assert d.level is Level.REPLACE_RANK and d.replace == {1}
    assert ladder.restarted(ONE_HOST, {0, 1}) == set()  # DDP, HSDP: the survivors go on live


def test_such_a_mesh_grows_back_by_whole_blocks_every_rank_in_a_new_process():
    p = pol(grow_after_s=1.0)
    s = mc.JobState(phase=Phase.RUNNING, gen=1, degraded_since=0.0)
    rs = rank_seen(2, 1)

    def see(t, ranks, ready):
        return mc.Seen(now=t, ranks=ranks, total_nodes=1, slots=4, target_world=4,
                       ready_spares=ready, slowest_step_s=0.1, regrid_unit=2)

    assert mc.step(s, mc.Tick(see(5.0, rs, {0: 1})), p)[1] == []  # one spare: half a block
    s, cmds = mc.step(s, mc.Tick(see(5.0, rs, {0: 2})), p)
    assert cmds == [mc.Regroup(1)]
    left = tuple(dataclasses.replace(r, left=1) for r in rs)
    s, cmds = mc.step(s, mc.Tick(see(5.2, left, {0: 2})), p)
    (_, carry) = cmds
    assert carry.decision.level is Level.SCALE_OUT and carry.placement == {2: 0, 3: 0}
    assert carry.decision.replace == {0, 1}  # the ranks that stay start again too


def test_a_mesh_of_fixed_size_with_nothing_replicated_does_not_shrink_and_says_why():
    fixed = dataclasses.replace(ONE_HOST, regrid_unit=-1)
    d = decide([CRASH1], {1}, view=fixed, policy=pol(when="no_warm_spare"))
    assert d.level is Level.REPLACE_RANK  # a new process for the rank, its shard from memory
    assert "its size is fixed" in ladder.shrink({1}, set(), fixed, pol())[1]

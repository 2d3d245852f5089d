"""The controller's state machine on a fake clock: every phase, deadline and decision, with no
process, no socket and no sleep (the clock is the ``now`` of each observation)."""

from __future__ import annotations

import dataclasses

from nonstop.controller import machine as mc
from nonstop.controller.phase import Phase
from nonstop.decide.faults import Fault
from nonstop.decide.ladder import Counters, Level
from nonstop.policy import Policy

P = Policy()
T = P.timeouts


def ranks(gen, *changes, n=4, slots=2):
    """``n`` ranks in generation ``gen`` (joined and entered), ``slots`` per node; ``changes``:
    dicts of rank -> the fields that differ."""
    out = []
    for r in range(n):
        kw = dict(rank=r, wid=100 + r, node=r // slots, joining=gen, entered=gen)
        for ch in changes:
            kw.update(ch.get(r, {}))
        out.append(mc.RankSeen(**kw))
    return tuple(out)


def seen(now, rs, nodes=3, slots=2, **kw):
    return mc.Seen(now=now, ranks=rs, total_nodes=nodes, slots=slots, **kw)


def running(gen=0, now=10.0):
    """A job that trains in generation ``gen``."""
    s, cmds = mc.step(mc.JobState(), mc.Start(seen(now, ranks(-1))), P)
    assert cmds == [mc.Publish(0, initial=True, level="start")]
    assert s.phase is Phase.RENDEZVOUS and s.deadline == now + T.rendezvous_s
    s = dataclasses.replace(s, gen=gen)
    s, cmds = mc.step(s, mc.Entered(seen=seen(now + 1, ranks(gen))), P)
    assert cmds == [mc.Formed(gen)] and s.phase is Phase.RUNNING
    return s


def kinds(cmds):
    return [type(c).__name__ for c in cmds]


def crash(s, now, rank=1):
    """Rank ``rank`` dies: the fault, then the survivors leave, the memory is probed, the
    decision. Returns the state and the commands of each of those steps."""
    rs = ranks(s.gen, {rank: {"dead": True}})
    s, c1 = mc.step(s, mc.Faulted(seen(now, rs), Fault("crash", rank=rank, code=-9)), P)
    left = ranks(s.gen, {rank: {"dead": True}},
                 {r: {"left": s.gen} for r in range(4) if r != rank})
    s, c2 = mc.step(s, mc.Tick(seen(now + 0.01, left)), P)
    s, c3 = mc.step(s, mc.Tick(seen(now + 0.02, left)), P)
    return s, c1, c2, c3


def test_a_generation_forms_only_once_every_rank_entered():
    s, _ = mc.step(mc.JobState(), mc.Start(seen(0.0, ranks(-1))), P)
    s, cmds = mc.step(s, mc.Entered(seen=seen(1.0, ranks(0, {3: {"entered": -1}}))), P)
    assert cmds == [] and s.phase is Phase.RENDEZVOUS
    s, cmds = mc.step(s, mc.Entered(seen=seen(1.1, ranks(0))), P)
    assert cmds == [mc.Formed(0)] and s.phase is Phase.RUNNING and s.deadline == float("inf")


def test_a_crash_aborts_then_the_memory_is_asked_then_the_rank_is_replaced_in_place():
    s = running()
    slow = 0.4
    rs = ranks(0, {1: {"dead": True}})
    s, cmds = mc.step(s, mc.Faulted(seen(20.0, rs, slowest_step_s=slow),
                                    Fault("crash", rank=1, code=-9)), P)
    assert kinds(cmds) == ["Raise", "AbortGeneration"] and cmds[1] == mc.AbortGeneration(0, managed=True)
    assert s.phase is Phase.TEARING_DOWN and s.incident
    assert s.deadline == 20.0 + T.teardown_s + 2 * slow  # a survivor may be mid-step
    # a survivor still in the generation: nothing yet
    s2, cmds = mc.step(s, mc.Tick(seen(20.1, rs)), P)
    assert cmds == [] and s2 == s
    left = ranks(0, {1: {"dead": True}, 0: {"left": 0}, 2: {"left": 0}, 3: {"left": 0}})
    s, cmds = mc.step(s, mc.Tick(seen(20.2, left)), P)
    assert cmds == [mc.Probe((0,))] and s.phase is Phase.TEARING_DOWN
    s, cmds = mc.step(s, mc.Tick(seen(20.21, left)), P)
    assert kinds(cmds) == ["Decide", "CarryOut"]
    decide, carry = cmds
    assert decide.decision.level is Level.REPLACE_RANK and decide.gen == 0
    assert carry.placement == {1: 0} and carry.gen == 1
    assert s.phase is Phase.RENDEZVOUS and s.gen == 1 and s.round == ()
    assert s.deadline == 20.21 + T.rendezvous_s and s.attempt
    assert s.level == "rank replacement"
    assert s.level_deadline == 20.21 + P.levels.rank_replacement.deadline_s
    assert s.counters.used(Level.REPLACE_RANK) == 1


def test_a_hang_gives_the_survivors_only_the_base_teardown_time():
    s = running()
    s, _ = mc.step(s, mc.Faulted(seen(5.0, ranks(0), slowest_step_s=3.0),
                                 Fault("hang", message="no step")), P)
    assert s.deadline == 5.0 + T.teardown_s


def test_a_survivor_that_does_not_leave_in_time_is_killed_with_its_stacks():
    s = running()
    rs = ranks(0, {1: {"dead": True}}, {0: {"left": 0}})
    s, _ = mc.step(s, mc.Faulted(seen(5.0, rs), Fault("crash", rank=1, code=-9)), P)
    s, cmds = mc.step(s, mc.Tick(seen(s.deadline - 0.001, rs)), P)
    assert cmds == []
    allowance = round(s.deadline - s.t_abort, 3)
    s, cmds = mc.step(s, mc.Tick(seen(s.deadline + 0.001, rs)), P)
    missed, *kills = cmds  # the deadline, as an event, then the kills
    assert missed == mc.Missed("teardown", allowance, 0, (2, 3), "killed")
    assert [(c.wid, c.dump) for c in kills] == [(102, True), (103, True)]
    assert all(c.fault.kind == "teardown_timeout" for c in kills)
    assert [f.kind for f in s.round] == ["crash"] + ["teardown_timeout"] * 2


def test_when_no_survivor_has_left_by_the_deadline_they_get_one_longer_wait_before_the_kill():
    """Killed, they would take the only live state with them: a late abort (a loaded
    machine, a controller that just took office) is waited for once more, then not again."""
    s = running()
    rs = ranks(0, {1: {"dead": True}})
    s, _ = mc.step(s, mc.Faulted(seen(5.0, rs), Fault("crash", rank=1, code=-9)), P)
    first = s.deadline
    s, cmds = mc.step(s, mc.Tick(seen(first + 0.001, rs)), P)
    [missed] = cmds
    assert missed.what == "teardown" and missed.ranks == (0, 2, 3) and missed.detail != "killed"
    assert s.patient and s.deadline == first + 0.001 + T.teardown_s * mc.TEARDOWN_PATIENCE
    # the ranks leave within it: no kill, the decision as usual
    out = ranks(0, {1: {"dead": True}}, {r: {"left": 0} for r in (0, 2, 3)})
    s2, cmds = mc.step(s, mc.Tick(seen(first + 1.0, out)), P)
    assert cmds == [mc.Probe((0,))]
    # still in it at the second deadline: killed
    s, cmds = mc.step(s, mc.Tick(seen(s.deadline + 0.001, rs)), P)
    missed, *kills = cmds
    assert missed.detail == "killed" and [c.wid for c in kills] == [100, 102, 103]
    # the next teardown is patient again
    s = running(gen=1)
    s, _ = mc.step(s, mc.Faulted(seen(50.0, ranks(1, {1: {"dead": True}})),
                                 Fault("crash", rank=1, code=-9)), P)
    assert not s.patient


def test_a_node_whose_ranks_and_memory_died_is_replaced_on_a_spare_node():
    s = running()
    dead = {0: {"dead": True}, 1: {"dead": True}}
    rs = ranks(0, dead)
    s, _ = mc.step(s, mc.Faulted(seen(5.0, rs), Fault("crash", rank=0, code=-9)), P)
    left = ranks(0, dead, {2: {"left": 0}, 3: {"left": 0}})
    s, cmds = mc.step(s, mc.Tick(seen(5.1, left)), P)
    assert cmds == [mc.Probe((0,))]
    s, cmds = mc.step(s, mc.Tick(seen(5.2, left, lost_memory=frozenset({0}))), P)
    decide, carry = cmds
    assert decide.decision.level is Level.REPLACE_NODE and decide.decision.isolate == {0}
    assert carry.placement == {0: 2, 1: 2}  # node 2: the spare node
    assert 0 in s.counters.isolated and s.faulty_nodes == {0}


def test_a_node_with_a_rank_still_alive_is_not_lost_with_its_memory():
    # node 0's memory died, then rank 0 (and only it): rank 1, on node 0 too, still holds the
    # live state - the node is not lost, rank 0 is replaced there (no node replacement, and
    # without a spare node no job restart that would throw rank 1's state away)
    s = running()
    dead = {0: {"dead": True}}
    s, _ = mc.step(s, mc.Faulted(seen(5.0, ranks(0, dead), nodes=2),
                                 Fault("crash", rank=0, code=-9)), P)
    left = ranks(0, dead, {1: {"left": 0}, 2: {"left": 0}, 3: {"left": 0}})
    s, cmds = mc.step(s, mc.Tick(seen(5.1, left, nodes=2)), P)
    assert cmds == [mc.Probe((0,))]
    s, (decide, carry) = mc.step(s, mc.Tick(seen(5.2, left, nodes=2,
                                                 lost_memory=frozenset({0}))), P)
    assert decide.decision.level is Level.REPLACE_RANK and decide.decision.replace == {0}
    assert not decide.decision.isolate and carry.placement == {0: 0}
    assert 0 not in s.counters.isolated and s.faulty_nodes == frozenset()


def test_without_the_memory_lost_the_same_deaths_are_rank_replacements():
    s = running()
    dead = {0: {"dead": True}, 1: {"dead": True}}
    s, _ = mc.step(s, mc.Faulted(seen(5.0, ranks(0, dead)),
                                 Fault("crash", rank=0, code=-9)), P)
    left = ranks(0, dead, {2: {"left": 0}, 3: {"left": 0}})
    s, _ = mc.step(s, mc.Tick(seen(5.1, left)), P)
    s, (decide, carry) = mc.step(s, mc.Tick(seen(5.2, left)), P)
    assert decide.decision.level is Level.REPLACE_RANK and carry.placement == {0: 0, 1: 0}


def test_a_rank_that_does_not_join_in_time_escalates_the_level():
    s, *_ = crash(running(), 5.0)
    assert s.phase is Phase.RENDEZVOUS and s.gen == 1
    slow = ranks(1, {1: {"joining": 0, "entered": -1}})
    s2, cmds = mc.step(s, mc.Tick(seen(s.deadline - 0.01, slow)), P)
    assert cmds == []
    s, cmds = mc.step(s, mc.Tick(seen(s.deadline + 0.01, slow)), P)
    assert kinds(cmds) == ["Missed", "Kill", "Interrupt", "Raise", "AbortGeneration"]  # the attempt ends
    assert cmds[0].what == "rendezvous" and cmds[0].limit_s == T.rendezvous_s
    assert cmds[0].ranks == (1,) and cmds[0].gen == 1
    assert cmds[1].wid == 101 and cmds[3].fault.kind == "rendezvous_timeout"
    dead = ranks(1, {1: {"dead": True, "joining": 0}}, {r: {"left": 1} for r in (0, 2, 3)})
    s, _ = mc.step(s, mc.Tick(seen(s.deadline, dead)), P)
    s, cmds = mc.step(s, mc.Tick(seen(s.deadline, dead)), P)
    assert cmds[0].escalated_from == "rank replacement"
    assert cmds[0].decision.level is not Level.REPLACE_RANK


def test_a_warm_process_gets_join_s_and_a_stopped_one_is_a_hang():
    s, *_ = crash(running(), 5.0)
    t0 = s.t_gen
    # rank 2 was running when the generation was published: it must start joining quickly
    late = ranks(1, {r: {"joining": 0, "entered": 0, "warm": True} for r in (0, 2, 3)})
    s2, cmds = mc.step(s, mc.Tick(seen(t0 + T.join_s - 0.01, late)), P)
    assert cmds == []
    s2, cmds = mc.step(s, mc.Tick(seen(t0 + T.join_s + 0.01, late)), P)
    assert [c.wid for c in cmds if isinstance(c, mc.Kill)] == [100, 102, 103]
    # a rank that joined and is stopped by the kernel holds the others in the group's set-up
    frozen = ranks(1, {2: {"entered": 0, "stopped": True}})
    s3, cmds = mc.step(s, mc.Tick(seen(t0 + 0.1, frozen)), P)
    assert kinds(cmds) == ["Kill", "Interrupt", "Raise", "AbortGeneration"]
    assert cmds[1].phase == "rendezvous" and cmds[2].fault.kind == "hang"
    assert "frozen" in cmds[2].fault.message
    stuck = ranks(1, {2: {"entered": 0, "own_code_s": T.join_s + 1, "loc": "x.py:3"}})
    _, cmds = mc.step(s, mc.Tick(seen(t0 + T.join_s + 0.1, stuck)), P)
    assert "x.py:3" in cmds[0].why and f"stuck for {T.join_s + 0.1:.1f} s" in cmds[0].why


def test_time_in_its_own_code_before_the_generation_is_not_time_stuck_forming_it():
    """A survivor that waited in the old generation's collective (a paused host's ranks held
    it, while the controller taking over was away) comes to join the new generation from that
    place of its code: its time there before the generation was published is not held against
    it. Only join_s after the publication is it stuck."""
    s, *_ = crash(running(), 5.0)
    t0 = s.t_gen
    waited = ranks(1, {r: {"entered": 0, "own_code_s": 5.8 + T.join_s, "loc": "train.py:36"}
                       for r in (0, 2, 3)})
    _, cmds = mc.step(s, mc.Tick(seen(t0 + 0.5, waited)), P)
    assert cmds == []
    _, cmds = mc.step(s, mc.Tick(seen(t0 + T.join_s - 0.01, waited)), P)
    assert cmds == []


def test_the_time_the_controller_could_not_hear_is_not_counted_against_the_ranks():
    """Every host silent at once and etcd too: the controller judged nothing (Cluster.deaf).
    Heard again after 3 s, the survivors' teardown deadline, the generation's join_s and the
    level's deadline have moved on by those 3 s: a survivor is killed only once it overstays
    the teardown by the time the controller could hear it. What began in the middle of those
    3 s moves on to the moment it heard again, not past it."""
    rs = ranks(0, {1: {"dead": True}}, {0: {"left": 0}})
    s, _ = mc.step(running(), mc.Faulted(seen(20.0, rs), Fault("crash", rank=1, code=-9)), P)
    due = s.deadline
    s2, cmds = mc.step(s, mc.Heard(seen(23.5, rs), 3.0), P)  # unheard from 20.5 to 23.5
    assert cmds == [] and s2.deadline == due + 3.0 and s2.t_abort == s.t_abort + 3.0
    _, cmds = mc.step(s2, mc.Tick(seen(due + 2.9, rs)), P)
    assert cmds == []
    _, cmds = mc.step(s2, mc.Tick(seen(due + 3.01, rs)), P)
    assert [c.wid for c in cmds if isinstance(c, mc.Kill)] == [102, 103]
    s3, _ = mc.step(s, mc.Heard(seen(20.1, rs), 3.0), P)  # the abort came 0.1 s before it heard
    assert s3.deadline == due + 0.1 and s3.t_abort == s.t_abort + 0.1
    s, *_ = crash(running(), 5.0)  # a generation forming, its level under way
    s2, _ = mc.step(s, mc.Heard(seen(s.t_gen + 4.0, ranks(1)), 3.0), P)
    assert s2.t_gen == s.t_gen + 3.0 and s2.level_deadline == s.level_deadline + 3.0
    assert s2.deadline == s.deadline + 3.0
    late = ranks(1, {2: {"joining": 0, "entered": 0, "warm": True}})
    _, cmds = mc.step(s2, mc.Tick(seen(s.t_gen + T.join_s + 0.5, late)), P)
    assert cmds == []  # (it would be killed had the controller's deafness counted)
    _, cmds = mc.step(s, mc.Tick(seen(s.t_gen + T.join_s + 0.5, late)), P)
    assert [c.wid for c in cmds if isinstance(c, mc.Kill)] == [102]
    steady = running()  # nothing to move on: no deadline
    s2, _ = mc.step(steady, mc.Heard(seen(30.0, ranks(0)), 3.0), P)
    assert s2.deadline == float("inf") and s2.level_deadline is None


def test_a_fault_in_a_recovery_interrupts_that_attempt_in_its_phase():
    s, *_ = crash(running(), 5.0)
    not_joined = ranks(1, {1: {"joining": 0, "entered": -1, "dead": True}})
    _, cmds = mc.step(s, mc.Faulted(seen(5.5, not_joined), Fault("crash", rank=1)), P)
    assert cmds[0] == mc.Interrupt("replace")
    s2, _ = mc.step(s, mc.Entered(seen=seen(5.5, ranks(1))), P)
    _, cmds = mc.step(s2, mc.Faulted(seen(5.6, ranks(1)), Fault("crash", rank=3)), P)
    assert cmds[0] == mc.Interrupt("first_step")
    # once recovered, a fault opens a new incident: no interruption
    s3, _ = mc.step(s2, mc.Recovered(seen(5.7, ranks(1))), P)
    assert not s3.incident and s3.level_deadline is None
    _, cmds = mc.step(s3, mc.Faulted(seen(5.8, ranks(1)), Fault("crash", rank=3)), P)
    assert kinds(cmds) == ["Raise", "AbortGeneration"]


def test_a_level_that_does_not_recover_within_its_deadline_is_a_fault():
    s, *_ = crash(running(), 5.0)
    s, _ = mc.step(s, mc.Entered(seen=seen(5.5, ranks(1))), P)
    s2, cmds = mc.step(s, mc.Tick(seen(s.level_deadline - 0.01, ranks(1))), P)
    assert cmds == []
    s, cmds = mc.step(s, mc.Tick(seen(s.level_deadline + 0.01, ranks(1))), P)
    assert kinds(cmds) == ["Missed", "Interrupt", "Raise", "AbortGeneration"]
    assert cmds[0].what == "recovery_level" and "rank replacement" in cmds[0].detail
    assert cmds[0].limit_s == P.levels.rank_replacement.deadline_s
    assert cmds[2].fault.kind == "deadline" and "rank replacement" in cmds[2].fault.message
    assert s.level_deadline is None


def test_non_finite_gradients_retry_in_place_or_fall_back():
    s = running()
    one = ranks(0, {0: {"retry_step": 7, "retry_loss": "nan"}})
    s, cmds = mc.step(s, mc.RetryAsked(seen=seen(3.0, one)), P)
    assert cmds == [mc.RetryOpened(7)] and s.incident
    assert s.retry_deadline == 3.0 + P.levels.step_retry.deadline_s
    every = ranks(0, {r: {"retry_step": 7, "retry_loss": 1.0} for r in range(4)})
    s2, cmds = mc.step(s, mc.RetryAsked(seen=seen(3.1, every)), P)
    assert kinds(cmds) == ["Decide", "RedoStep"] and cmds[1].step == 7
    assert s2.retry_deadline is None and s2.phase is Phase.RUNNING
    assert s2.counters.nan_in_a_row == 1
    split = ranks(0, {r: {"retry_step": 7 + (r == 3)} for r in range(4)})
    _, cmds = mc.step(s, mc.RetryAsked(seen=seen(3.1, split)), P)
    assert cmds[0].fault.kind == "nan" and "different steps" in cmds[0].fault.message
    # not every rank said so in time: the coarse way
    _, cmds = mc.step(s, mc.Tick(seen(s.retry_deadline + 0.01, one)), P)
    assert kinds(cmds) == ["Missed", "Raise", "AbortGeneration"] and cmds[1].fault.kind == "nan"
    assert cmds[0].what == "step_retry" and cmds[0].limit_s == P.levels.step_retry.deadline_s


def test_a_plain_script_is_ended_whole():
    s = running()
    rs = ranks(0, {0: {"dead": True}})
    s, cmds = mc.step(s, mc.Faulted(seen(2.0, rs, managed=False), Fault("crash", rank=0)), P)
    assert cmds[1] == mc.AbortGeneration(0, managed=False)
    assert s.deadline == 2.0 + T.terminate_grace_s


def test_a_budget_spent_gives_up():
    s = dataclasses.replace(running(), counters=Counters(hangs_in_a_row=P.rules.hang_restarts))
    s, _ = mc.step(s, mc.Faulted(seen(2.0, ranks(0)), Fault("hang", message="no step")), P)
    left = ranks(0, {r: {"left": 0} for r in range(4)})
    s, cmds = mc.step(s, mc.Tick(seen(2.1, left)), P)
    assert kinds(cmds) == ["Decide", "Fail"] and cmds[1].decision.level is Level.FAIL
    assert s.gen == 0  # nothing published


def test_the_end_waits_for_the_ranks_and_the_last_checkpoint_then_has_a_deadline():
    s = running()
    s, cmds = mc.step(s, mc.Completed(seen(50.0, ranks(0)), finish_s=5.0), P)
    assert cmds == [mc.Finish()] and s.phase is Phase.FINISHING
    _, cmds = mc.step(s, mc.Faulted(seen(50.1, ranks(0)), Fault("crash", rank=1)), P)
    assert kinds(cmds) == ["Ignore"]
    gone = ranks(0, {r: {"dead": True} for r in range(4)})
    _, cmds = mc.step(s, mc.Settled(seen(51.0, gone), settled=False), P)
    assert cmds == []
    _, cmds = mc.step(s, mc.Settled(seen(51.0, gone), settled=True), P)
    assert cmds == [mc.JobOver()]
    s, cmds = mc.step(s, mc.Settled(seen(55.1, ranks(0, {0: {"dead": True}})), False), P)
    assert cmds == [mc.Missed("finish", 5.0, 0, (1, 2, 3), cmds[0].detail),
                    mc.Overdue((101, 102, 103))]
    _, cmds = mc.step(s, mc.Settled(seen(56.0, ranks(0)), False), P)
    assert cmds == []  # once
    s, _ = mc.step(s, mc.Over(), P)
    assert s.phase is Phase.OVER


def test_recovery_with_steps_seen_starts_the_in_a_row_counters_over():
    s = dataclasses.replace(running(), incident=True, counters=Counters(hangs_in_a_row=2))
    s2, _ = mc.step(s, mc.Recovered(seen(1.0, ranks(0)), progressed=True), P)
    assert s2.counters.hangs_in_a_row == 0
    s3, _ = mc.step(s, mc.Recovered(seen(1.0, ranks(0)), progressed=False), P)
    assert s3.counters.hangs_in_a_row == 2


def test_an_isolated_node_is_never_a_place_for_ranks():
    s = running()
    s, cmds = mc.step(s, mc.Isolate(seen(1.0, ranks(0)), node=2), P)
    assert cmds == [] and s.counters.isolated == {2}
    assert s.usable_nodes(3) == [0, 1]
    # node 0's memory and ranks die: no spare node is left, the ranks stay where they can
    dead = {0: {"dead": True}, 1: {"dead": True}}
    s, _ = mc.step(s, mc.Faulted(seen(5.0, ranks(0, dead)), Fault("crash", rank=0)), P)
    left = ranks(0, dead, {2: {"left": 0}, 3: {"left": 0}})
    s, _ = mc.step(s, mc.Tick(seen(5.1, left)), P)
    s, cmds = mc.step(s, mc.Tick(seen(5.2, left, lost_memory=frozenset({0}))), P)
    placed = [c for c in cmds if isinstance(c, mc.CarryOut)]
    assert all(n != 2 for c in placed for n in c.placement.values())


def test_placement_for_each_level():
    # ranks 0-3 on nodes 0-1, node 2 a spare node
    s = seen(0.0, ranks(0))
    rank = ladder_decision(Level.REPLACE_RANK, replace={1, 3})
    assert mc.place(rank, s, set()) == {1: 0, 3: 1}  # where they were
    # node 0 given up: its ranks go to the spare node together; rank 3 (died on a healthy node
    # meanwhile) stays on its node
    node = ladder_decision(Level.REPLACE_NODE, replace={0, 1, 3}, isolate={0})
    assert mc.place(node, s, {0}) == {0: 2, 1: 2, 3: 1}
    # a job restart fills the healthy nodes in order
    job = ladder_decision(Level.JOB_RESTART, replace={0, 1, 2, 3})
    assert mc.place(job, s, {1}) == {0: 0, 1: 0, 2: 2, 3: 2}


def test_the_view_counts_spare_nodes_and_capacity_without_isolated_nodes():
    v = mc.view({2}, seen(0.0, ranks(0), nodes=4))
    assert v.world == 4 and v.spare_nodes == 1 and v.capacity == 6 and v.slots == 2
    assert mc.spare_nodes(v.node_of, 4, {2}) == [3]


def ladder_decision(level, replace=(), isolate=()):
    from nonstop.decide.ladder import Decision

    return Decision(level, replace=frozenset(replace), isolate=frozenset(isolate))


def test_with_no_spare_node_a_lost_nodes_rank_goes_where_a_node_has_a_place_left():
    # after a scale-in and a scale-out the ranks need not fill their nodes: here ranks 0, 1 on
    # node 0, rank 2 on node 1 (one place left, a warm spare there), rank 3 alone on node 2
    rs = ranks(0, {2: {"node": 1}, 3: {"node": 2}})
    s = seen(0.0, rs, nodes=3, ready_spares={1: 1})
    v = mc.view(set(), s)
    assert v.spare_nodes == 0 and v.free_slots == {1: 1, 2: 1}
    from nonstop.decide import ladder
    lost = Fault("node_lost", node=2, message="node 2 is gone")
    d = ladder.decide([lost], {3}, v, P, Counters(), 10.0)
    assert d.level is Level.REPLACE_NODE and d.isolate == {2}  # not a scale-in
    assert mc.place(d, s, {2}) == {3: 1}  # into node 1's free place, where a spare is warm
    # more ranks to move than places left: no node replacement
    rs2 = ranks(0, {2: {"node": 1}, 3: {"node": 1}})
    v2 = mc.view(set(), seen(0.0, rs2, nodes=2))
    d2 = ladder.decide([Fault("node_lost", node=1)], {2, 3}, v2, P, Counters(), 10.0)
    assert d2.level is not Level.REPLACE_NODE


def test_a_rank_still_to_leave_is_told_alike_from_its_view_and_its_record():
    from nonstop.controller.machine import still_to_leave
    from nonstop.controller.workers import Worker

    gen = 4
    cases = [dict(), dict(dead=True), dict(left=4), dict(done=4), dict(retry_step=9),
             dict(joining=3), dict(left=3, joining=4)]
    for fields in cases:
        w = Worker(wid=1, spare=False, rank=0)
        w.joining = 4
        for k, v in fields.items():
            setattr(w, k, v)
        expect = not (w.dead or w.left >= gen or w.done >= gen or w.retry_step is not None
                      or w.joining < gen)
        assert still_to_leave(w, gen, managed=True) is expect, fields
    w = Worker(wid=1, spare=False, rank=0)  # a plain script's ranks never say they joined
    assert still_to_leave(w, gen, managed=False) and not still_to_leave(w, gen, managed=True)


def test_idle_says_when_a_tick_cannot_act_whatever_the_ranks_are():
    s = running(gen=0, now=10.0)
    assert mc.idle(s, 11.0, P)  # training, nothing due: the controller builds no view
    retry = dataclasses.replace(s, retry_deadline=12.0)
    assert mc.idle(retry, 11.0, P) and not mc.idle(retry, 12.5, P)  # a step retry overdue
    level = dataclasses.replace(s, incident=True, level="rank_replace", level_deadline=20.0)
    assert mc.idle(level, 19.0, P) and not mc.idle(level, 21.0, P)  # a recovery level overdue
    grown = dataclasses.replace(s, degraded_since=0.0)  # degraded long enough to grow back
    assert not mc.idle(grown, 10.0 + P.levels.scale_in.grow_after_s, P)
    for phase in (Phase.RENDEZVOUS, Phase.TEARING_DOWN, Phase.FINISHING):
        assert not mc.idle(dataclasses.replace(s, phase=phase), 11.0, P)
    # and where idle says so, a tick indeed does nothing
    for st, now in ((s, 11.0), (retry, 11.0), (level, 19.0)):
        assert mc.step(st, mc.Tick(seen(now, ranks(0))), P) == (st, [])


def test_the_executor_has_a_case_for_every_command_and_calls_each_handler_once():
    """controller.Controller._carry_out dispatches with a match over the command types: each type
    of commands.Command has its case, and each case calls the handler named for it."""
    import ast
    import typing
    from pathlib import Path

    from nonstop.controller import commands, controller

    types = {t.__name__ for t in typing.get_args(commands.Command)}
    assert len(types) >= 19
    tree = ast.parse(Path(controller.__file__).read_text())
    (fn,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_carry_out"]
    (match,) = [n for n in ast.walk(fn) if isinstance(n, ast.Match)]
    cases = {}
    for case in match.cases:
        if isinstance(case.pattern, ast.MatchClass):
            called = [c.func.attr for c in ast.walk(case) if isinstance(c, ast.Call)
                      and isinstance(c.func, ast.Attribute)]
            cases[case.pattern.cls.attr] = called
    assert set(cases) == types
    assert all(called == [f"_do_{name}"] for name, called in cases.items()), cases


def test_a_ranks_view_keeps_the_field_order_the_controller_makes_it_by():
    """``WorkerTable.ranks_seen`` makes each rank's view by position (16,384 of them after a
    teardown): a field moved or added in between would shift every value into another's."""
    assert [f.name for f in dataclasses.fields(mc.RankSeen)] == [
        "rank", "wid", "node", "dead", "joining", "entered", "left", "done", "retry_step",
        "retry_loss", "warm", "stopped", "own_code_s", "loc"]
    import inspect

    from nonstop.controller.workers import WorkerTable
    src = inspect.getsource(WorkerTable.ranks_seen)
    assert ("RankSeen(rank, wid, w.node, w.dead, w.joining, w.entered, w.left, w.done,\n"
            "                         w.retry_step, w.retry_loss, warm, st,") in src


def test_a_corruption_the_replay_pinned_on_a_rank_counts_against_its_node_and_isolates_it_by_the_rules():
    s = running()
    named = Fault("sdc", rank=3, message="its first pass parted first")
    # counted against node 1 (rank 3's), no recovery: its rank holds the state its twins agree on
    s1, cmds = mc.step(s, mc.Attributed(named, seen=seen(30.0, ranks(0))), P)
    assert cmds == [] and s1.phase is Phase.RUNNING and not s1.incident
    assert s1.counters.recent == [(30.0, "SDC", 3, 1)] and s1.counters.last_fault_t == 30.0
    # the rules' count reached (here the first time): a fault, and the ladder moves the node
    once = P.model_copy(update={"rules": P.rules.model_copy(update={
        "isolate": P.rules.isolate.model_copy(update={"times": 2})})})
    s2, cmds = mc.step(s1, mc.Attributed(named, seen=seen(31.0, ranks(0))), once)
    assert kinds(cmds) == ["Raise", "AbortGeneration"] and s2.incident
    left = ranks(0, {r: {"left": 0} for r in range(4)})
    cmds = []
    for t in (31.1, 31.2, 31.3):  # (rank 3 gets a new process: its memory asked first)
        s2, more = mc.step(s2, mc.Tick(seen(t, left)), once)
        cmds += more
    (d,) = [c for c in cmds if isinstance(c, mc.Decide)]
    assert d.decision.level is Level.REPLACE_NODE and d.decision.isolate == {1}
    # a job ending hears of it and does nothing
    ending = dataclasses.replace(s, phase=Phase.FINISHING)
    assert kinds(mc.step(ending, mc.Attributed(named, seen=seen(32.0, ranks(0))), P)[1]) == ["Ignore"]


NO_SCALE_IN = P.with_overrides(**{"recover.levels.scale_in.enabled": False})


def lost_with_no_room(hosts_join: bool, policy=NO_SCALE_IN):
    """Node 2 isolated, then node 0's ranks and memory die: node 1 alone cannot hold 4 ranks,
    and the world may not shrink."""
    P = policy  # noqa: N806 - the machine's steps below under this policy
    s = running()
    s, _ = mc.step(s, mc.Isolate(seen(1.0, ranks(0)), node=2), P)
    dead = {0: {"dead": True}, 1: {"dead": True}}
    s, _ = mc.step(s, mc.Faulted(seen(5.0, ranks(0, dead), hosts_join=hosts_join),
                                 Fault("crash", rank=0, code=-9)), P)
    left = ranks(0, dead, {2: {"left": 0}, 3: {"left": 0}})
    s, _ = mc.step(s, mc.Tick(seen(5.1, left, hosts_join=hosts_join)), P)
    s, cmds = mc.step(s, mc.Tick(seen(5.2, left, lost_memory=frozenset({0}),
                                      hosts_join=hosts_join)), P)
    return s, cmds, left


def test_with_too_few_healthy_hosts_the_job_waits_for_one_to_join_then_recovers():
    s, cmds, left = lost_with_no_room(hosts_join=True)
    assert kinds(cmds) == ["WaitForHosts"] and s.phase is Phase.WAITING_FOR_HOSTS
    assert cmds[0].decision.wanting == 2 and cmds[0].limit_s == NO_SCALE_IN.hosts.capacity_wait_s
    assert s.counters.spent == {}  # nothing charged while it waits
    lost = frozenset({0})
    s, cmds = mc.step(s, mc.Tick(seen(60.0, left, lost_memory=lost, hosts_join=True)), NO_SCALE_IN)
    assert cmds == [] and s.phase is Phase.WAITING_FOR_HOSTS
    # a host joins: node 3, a spare node; the same faults decided again, the ranks go there
    s, cmds = mc.step(s, mc.Tick(seen(61.0, left, nodes=4, lost_memory=lost, hosts_join=True)), NO_SCALE_IN)
    decide, carry = cmds
    assert decide.decision.level is Level.REPLACE_NODE and decide.decision.isolate == {0}
    assert carry.placement == {0: 3, 1: 3} and s.phase is Phase.RENDEZVOUS
    assert s.t_wait is None and s.counters.used(Level.REPLACE_NODE) == 1


def test_with_too_few_healthy_hosts_and_none_joining_the_job_fails_after_the_wait():
    s, cmds, left = lost_with_no_room(hosts_join=True)
    lost = frozenset({0})
    limit = NO_SCALE_IN.hosts.capacity_wait_s
    s, cmds = mc.step(s, mc.Tick(seen(5.2 + limit - 1, left, lost_memory=lost, hosts_join=True)), NO_SCALE_IN)
    assert cmds == []
    s, cmds = mc.step(s, mc.Tick(seen(5.2 + limit + 1, left, lost_memory=lost, hosts_join=True)), NO_SCALE_IN)
    assert kinds(cmds) == ["Decide", "Fail"]
    assert "capacity_wait_s" in cmds[1].decision.diagnosis
    # on one host no host can join: it fails at once, as with the wait set to 0
    _, cmds, _ = lost_with_no_room(hosts_join=False)
    assert kinds(cmds) == ["Decide", "Fail"] and "cannot hold 4 ranks" in cmds[1].decision.diagnosis


def test_a_fault_while_waiting_for_hosts_joins_the_round_decided_once_one_joins():
    s, _, left = lost_with_no_room(hosts_join=True)
    lost = frozenset({0})
    s, cmds = mc.step(s, mc.Faulted(seen(8.0, left, lost_memory=lost, hosts_join=True),
                                    Fault("crash", rank=2, code=-9)), NO_SCALE_IN)
    assert kinds(cmds) == ["Raise"] and s.phase is Phase.WAITING_FOR_HOSTS
    both = ranks(0, {0: {"dead": True}, 1: {"dead": True}, 2: {"dead": True}}, {3: {"left": 0}})
    s, cmds = mc.step(s, mc.Tick(seen(9.0, both, nodes=4, lost_memory=lost, hosts_join=True)), NO_SCALE_IN)
    decide, carry = cmds
    assert 2 in decide.decision.replace and carry.placement[2] == 1  # in its own place

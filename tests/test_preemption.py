"""What becomes of a host a scheduler told to stop, when it is looked at (pure)."""

from nonstop.decide.preemption import Preempt, choose


def _choose(node=1, **kw):
    args = dict(isolated=set(), busy_nodes={0, 1}, job_busy=False, ranks_here=2,
                spare_nodes=[2], ready={2: 2}, late=False)
    args.update(kw)
    return choose(node, **args)


def test_a_host_with_ranks_is_drained_when_the_job_is_quiet_and_a_spare_host_is_warm():
    assert _choose() is Preempt.DRAIN
    assert _choose(spare_nodes=[]) is Preempt.DRAIN  # no spare node: the world shrinks now


def test_a_host_given_up_already_is_forgotten_and_one_with_no_rank_let_go():
    assert _choose(isolated={1}) is Preempt.FORGET
    assert _choose(node=3) is Preempt.RELEASE  # a spare host: released at once


def test_a_busy_job_is_not_drained_until_it_is_quiet():
    assert _choose(job_busy=True) is Preempt.LATER
    assert _choose(job_busy=True, late=True) is Preempt.LATER  # late or not


def test_a_spare_host_warming_up_is_waited_for_half_the_grace_then_not():
    assert _choose(ready={2: 1}) is Preempt.LATER  # 2 ranks, 1 warm spare there
    assert _choose(ready={}) is Preempt.LATER
    assert _choose(ready={2: 1}, late=True) is Preempt.DRAIN  # cold there, all the same
    assert _choose(ready={2: 1, 4: 2}, spare_nodes=[2, 4]) is Preempt.DRAIN  # one is warm enough

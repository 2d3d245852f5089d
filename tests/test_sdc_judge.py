"""Silent corruption or divergence (decide/sdc.py), on the digests alone: no process, no clock.
One replica that differs, once, is a corruption (its rank repaired, the job rolled back); replicas
that split into groups, or differ again after the rollback, diverge: the job stops with a
diagnosis, and no rank or node is blamed."""

from __future__ import annotations

import pytest

from nonstop.decide.sdc import CORRUPTION, DIVERGENCE, Judge, groups, suspects_of


def test_groups_are_the_ranks_that_agree_largest_first():
    assert groups({0: 7, 1: 9, 2: 7, 3: 5}) == ((0, 2), (1,), (3,))
    assert groups({0: 1, 1: 2}) == ((0,), (1,))
    assert suspects_of({0: 7, 1: 9, 2: 7}) == (1,)
    assert suspects_of({0: 1, 1: 2}) == (0, 1)  # two replicas: which one is right?
    assert suspects_of({0: 1, 1: 1, 2: 2, 3: 2}) == (0, 1, 2, 3)


def test_one_replica_that_differs_once_is_a_corruption_of_that_rank():
    j = Judge()
    v = j.judge(40, {0: 11, 1: 12, 2: 11}, redo_gen=3)
    assert v.kind == CORRUPTION and v.suspects == (1,) and v.step == 40
    assert "rank 1" in v.diagnosis
    # the steps redone after the rollback agree: the next one, much later, is a corruption too
    j.agreed(3)
    v = j.judge(90, {0: 21, 1: 21, 2: 23}, redo_gen=5)
    assert v.kind == CORRUPTION and v.suspects == (2,)


@pytest.mark.parametrize("digests", [{0: 1, 1: 2}, {0: 1, 1: 2, 2: 3}])
def test_with_no_majority_each_replica_is_suspect_the_first_time(digests):
    v = Judge().judge(10, digests)
    assert v.kind == CORRUPTION and v.suspects == tuple(sorted(digests))


@pytest.mark.parametrize("digests", [{0: 1, 1: 1, 2: 2, 3: 2},  # 2-2
                                     {0: 1, 1: 1, 2: 1, 3: 2, 4: 2},  # 3-2: two of one mind
                                     {0: 1, 1: 1, 2: 2, 3: 2, 4: 3}])
def test_replicas_split_into_groups_diverge_at_once(digests):
    v = Judge().judge(20, digests, node_of={0: 0, 1: 0, 2: 1, 3: 1, 4: 1})
    assert v.kind == DIVERGENCE and v.suspects == ()
    assert "diverge" in v.diagnosis and "split into groups" in v.diagnosis
    assert "agree with each other" in v.diagnosis and "(node" in v.diagnosis
    if digests == {0: 1, 1: 1, 2: 2, 3: 2}:
        assert "ranks 0, 1 (node 0) agree with each other; ranks 2, 3 (node 1)" in v.diagnosis
    assert "different code, arguments or data" in v.diagnosis and "isolated" in v.diagnosis


def test_the_same_digests_again_where_the_rollback_led_back_is_a_divergence():
    j = Judge()
    # ranks 1 and 2 have a learning rate of their own: rank 0 looks like the odd one...
    assert j.judge(7, {0: 5, 1: 6, 2: 6}, redo_gen=1).kind == CORRUPTION
    # ...its rank is replaced, every rank goes back and redoes step 7: the very same digests
    v = j.judge(7, {0: 5, 1: 6, 2: 6}, redo_gen=2)
    assert v.kind == DIVERGENCE and "very parameters it had before" in v.diagnosis
    # (and so even when a comparison agreed in between: a replay is no chance)
    j = Judge()
    j.judge(7, {0: 5, 1: 6, 2: 6}, redo_gen=1)
    j.agreed(1)
    assert j.judge(7, {0: 5, 1: 6, 2: 6}).kind == DIVERGENCE


def test_differing_again_before_any_comparison_agreed_is_a_divergence():
    j = Judge()
    assert j.judge(10, {0: 1, 1: 2, 2: 3}, redo_gen=1).kind == CORRUPTION  # all suspect
    # each rank its own randomness: other digests each time, never agreeing
    v = j.judge(10, {0: 4, 1: 5, 2: 6}, redo_gen=2)
    assert v.kind == DIVERGENCE and "with no comparison agreeing between" in v.diagnosis
    # another rank at odds than the one that differed: as much a divergence
    j = Judge()
    j.judge(10, {0: 1, 1: 2, 2: 1}, redo_gen=1)
    assert j.judge(15, {0: 3, 1: 3, 2: 4}, redo_gen=2).kind == DIVERGENCE


def test_a_comparison_of_the_generation_that_found_it_does_not_close_a_corruption():
    j = Judge()
    j.judge(10, {0: 1, 1: 2, 2: 1}, redo_gen=4)
    j.agreed(3)  # the checks before the mismatch, reported as the ranks left
    assert j.pending is not None
    j.agreed(4)
    assert j.pending is None


def test_the_same_rank_again_with_other_values_is_its_failing_device():
    j = Judge()
    j.judge(10, {0: 1, 1: 2, 2: 1}, redo_gen=1)
    v = j.judge(10, {0: 1, 1: 9, 2: 1}, redo_gen=2)  # rank 1 again, another wrong value
    assert v.kind == CORRUPTION and v.suspects == (1,)


def test_agreeing_digests_are_nothing_to_judge():
    with pytest.raises(ValueError):
        Judge().judge(5, {0: 1, 1: 1})

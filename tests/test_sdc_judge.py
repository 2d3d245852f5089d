"""Silent corruption or divergence (decide/sdc.py), on the digests alone: no process, no clock.
One replica that differs, once, is a corruption (its rank repaired, the job rolled back); replicas
that split into groups, or differ again after the rollback, diverge: the job stops with a
diagnosis, and no rank or node is blamed. Which rank a corruption came from is what a replay of
the steps says: the rank whose two passes part first."""

from __future__ import annotations

import pytest

from nonstop.decide.sdc import (CORRUPTION, DIVERGENCE, PERSISTENT, POINTS, TRANSIENT,
                                UNATTRIBUTED, Judge, attribute, groups, suspects_of)


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


# -- sharded and pipelined jobs: each twin group on its own --------------------------------------
HSDP_3x2 = {0: 0, 1: 1, 2: 0, 3: 1, 4: 0, 5: 1}  # rank -> its shard (or stage): 3 replica groups
HSDP_2x2 = {0: 0, 1: 1, 2: 0, 3: 1}


def test_each_twin_group_is_judged_on_its_own():
    # HSDP 3 x 2, a bit flipped in rank 1: shard 0's twins agree, shard 1's are 2 to 1
    digests = {0: 10, 1: 21, 2: 10, 3: 20, 4: 10, 5: 20}
    assert suspects_of(digests, HSDP_3x2) == (1,)
    v = Judge().judge(32, digests, twins=HSDP_3x2, redo_gen=1)
    assert v.kind == CORRUPTION and v.suspects == (1,), v.diagnosis
    assert v.groups == ((3, 5), (1,)) and "rank 1" in v.diagnosis
    # judged as one population, the agreeing twin groups looked like camps: a divergence
    assert Judge().judge(32, digests).kind == DIVERGENCE


def test_two_replicas_of_a_part_are_both_suspect_and_no_other_rank():
    # HSDP 2 x 2 (or a pipeline of 2 data-parallel groups x 2 stages): [A, B, A, C]
    digests = {0: 10, 1: 21, 2: 10, 3: 20}
    assert suspects_of(digests, HSDP_2x2) == (1, 3)
    assert suspects_of(digests) == (0, 1, 2, 3)  # (the whole world: every rank)
    v = Judge().judge(32, digests, twins=HSDP_2x2, redo_gen=1)
    assert v.kind == CORRUPTION and v.suspects == (1, 3)
    assert "differ from the other replica" in v.diagnosis


def test_a_twin_group_that_splits_into_camps_diverges():
    # 4 replica groups x 2 shards: shard 1's twins split 2 to 2 (two replica groups with a
    # learning rate of their own), shard 0's too
    twins = {r: r % 2 for r in range(8)}
    digests = {0: 1, 2: 1, 4: 2, 6: 2, 1: 3, 3: 3, 5: 4, 7: 4}
    v = Judge().judge(20, digests, twins=twins)
    assert v.kind == DIVERGENCE and v.suspects == ()
    assert "split into groups" in v.diagnosis and "holding the same part" in v.diagnosis
    # one twin group split, the other agreeing: as much a divergence
    digests = {0: 1, 2: 1, 4: 1, 6: 1, 1: 3, 3: 3, 5: 4, 7: 4}
    assert Judge().judge(20, digests, twins=twins).kind == DIVERGENCE


def test_twins_that_come_out_the_same_again_after_the_rollback_diverge():
    j = Judge()
    digests = {0: 10, 1: 21, 2: 10, 3: 20, 4: 10, 5: 20}
    assert j.judge(32, digests, twins=HSDP_3x2, redo_gen=1).kind == CORRUPTION
    # redone, step 32 comes out with the very same digests (another part's too: only the
    # group at odds is compared with what it held before)
    again = {**digests, 0: 11, 2: 11, 4: 11}
    v = j.judge(32, again, twins=HSDP_3x2, redo_gen=2)
    assert v.kind == DIVERGENCE and "very parameters it had before" in v.diagnosis


def test_the_same_twin_again_with_other_values_is_its_failing_device_another_one_diverges():
    j = Judge()
    j.judge(32, {0: 10, 1: 21, 2: 10, 3: 20, 4: 10, 5: 20}, twins=HSDP_3x2, redo_gen=1)
    v = j.judge(32, {0: 10, 1: 22, 2: 10, 3: 20, 4: 10, 5: 20}, twins=HSDP_3x2, redo_gen=2)
    assert v.kind == CORRUPTION and v.suspects == (1,)
    v = j.judge(40, {0: 30, 1: 40, 2: 31, 3: 40, 4: 30, 5: 40}, twins=HSDP_3x2, redo_gen=3)
    assert v.kind == DIVERGENCE  # rank 2 now, before any comparison agreed


def test_twin_groups_that_all_agree_are_nothing_to_judge():
    with pytest.raises(ValueError):
        Judge().judge(5, {0: 1, 1: 2, 2: 1, 3: 2}, twins=HSDP_2x2)


# -- the replay: which rank's passes part first ---------------------------------------------------
OUTPUT, END = POINTS.index("output"), POINTS.index("end")


def test_the_rank_whose_passes_part_first_is_named_though_its_peer_was_carried_off_too():
    # DDP, two replicas, a bit of rank 1 flipped at the start of step 12 and found at 18: the
    # all-reduce carried it into rank 0's parameters at step 12's update, so both ranks'
    # digests at 18 differ from the replay's (neither is "the one that agrees"), but rank 0's
    # forward outputs part only at step 13, rank 1's at step 12
    parted = {0: (13, OUTPUT), 1: (12, OUTPUT)}
    a = attribute(18, [0, 1], parted, agreed=True)
    assert a.verdict == TRANSIENT and a.rank == 1 and a.at == (12, "output")
    assert "before rank 0's" in a.why and "did not recur" in a.why
    a = attribute(18, [0, 1], parted, agreed=False)
    assert a.verdict == PERSISTENT and a.rank == 1 and "recurs" in a.why
    # a flip too small to reach the forward outputs, and to reach rank 0 at all: only rank 1's
    # parameters at the comparison differ
    a = attribute(18, [0, 1], {0: None, 1: (17, END)}, agreed=True)
    assert a.rank == 1 and a.at == (17, "end")


def test_no_rank_is_named_on_a_tie_or_without_every_first_pass():
    tie = attribute(18, [0, 1], {0: (12, OUTPUT), 1: (12, OUTPUT)}, agreed=True)
    assert tie.verdict == UNATTRIBUTED and tie.rank is None and "same point" in tie.why
    # rank 1 a new process since: it has no first pass to compare
    lost = attribute(18, [0, 1], {0: (13, OUTPUT)}, agreed=True)
    assert lost.verdict == UNATTRIBUTED and "no record" in lost.why
    # the replay came out the same as the first pass on every rank, and differs again: not the
    # replay's to judge (a divergence)
    assert attribute(18, [0, 1], {0: None, 1: None}, agreed=False) is None
    assert attribute(18, [0, 1], {0: None, 1: None}, agreed=True).verdict == UNATTRIBUTED


def test_a_rank_the_replay_found_faulty_again_is_a_corruption_though_two_replicas_differ_again():
    j = Judge()
    assert j.judge(18, {0: 1, 1: 2}, redo_gen=1).suspects == (0, 1)
    assert j.candidates(18) == (0, 1) and j.original(18) == {0: 1, 1: 2}
    assert j.candidates(19) == ()
    # the replay: rank 1's passes part first, and the twins differ again
    v = j.judge(18, {0: 3, 1: 4}, redo_gen=2, named=1)
    assert v.kind == CORRUPTION and v.suspects == (1,) and "differs again" in v.diagnosis
    assert j.candidates(18) == (0, 1)  # (the first pass's)
    # without the replay's word: differing again before any comparison agreed diverges
    j = Judge()
    j.judge(18, {0: 1, 1: 2}, redo_gen=1)
    assert j.judge(18, {0: 3, 1: 4}, redo_gen=2).kind == DIVERGENCE
    # camps are camps, whatever a replay says
    assert Judge().judge(20, {0: 1, 1: 1, 2: 2, 3: 2}, named=2).kind == DIVERGENCE

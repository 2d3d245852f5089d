"""What a controller taking office makes of the journal and of what the hosts report (pure)."""

from nonstop.decide.takeover import Seen, adopt, faults


def _rank(wid, rank, gen, node=0, alive=True):
    return Seen(wid=wid, node=node, alive=alive, spare=False, rank=rank, gen=gen, seq=gen + 1)


def test_a_job_that_trains_is_taken_over_as_it_is():
    seen = [_rank(0, 0, 3), _rank(1, 1, 3, node=1), Seen(7, 1, True, True)]
    a = adopt({"gen": 3, "plan": {"0": 0, "1": 1}}, seen, world=2)
    assert a.steady and a.gen == 3 and a.plan == {0: 0, 1: 1}
    assert a.missing == [] and a.orphans == [] and a.spares == [7]


def test_the_hosts_win_over_a_journal_one_generation_behind():
    # the controller sent generation 4's assignments and died before journaling them
    seen = [_rank(0, 0, 4), _rank(5, 1, 4, node=1), _rank(1, 1, 3, node=1, alive=False)]
    a = adopt({"gen": 3, "plan": {"0": 0, "1": 1}}, seen, world=2)
    assert a.gen == 4 and a.plan == {0: 0, 1: 5} and a.steady


def test_a_rank_without_a_live_process_is_missing():
    seen = [_rank(0, 0, 2), _rank(1, 1, 2, alive=False)]
    a = adopt({"gen": 2, "plan": {"0": 0, "1": 1}}, seen, world=2)
    assert not a.steady and a.missing == [1] and a.plan == {0: 0, 1: 1}
    # its host gone too: the journal still names the process, to be replaced
    a = adopt({"gen": 2, "plan": {"0": 0, "1": 1}}, [_rank(0, 0, 2)], world=2)
    assert a.missing == [1] and a.plan[1] == 1


def test_a_generation_caught_forming_keeps_every_live_process():
    # generation 5 went out to rank 1's replacement only, then the controller died: rank 1's old
    # process was replaced (an orphan, ended); rank 0's process never heard of 5 but holds the
    # rank: kept, and the generation is formed again (not steady, nothing missing)
    seen = [_rank(0, 0, 4), _rank(1, 1, 4), _rank(9, 1, 5)]
    a = adopt({"gen": 4, "plan": {"0": 0, "1": 1}}, seen, world=2)
    assert a.gen == 5 and a.plan == {0: 0, 1: 9} and a.missing == []
    assert a.orphans == [1] and not a.steady


def test_two_processes_claiming_one_rank_keep_the_older_and_end_the_other():
    seen = [_rank(3, 0, 1), _rank(4, 0, 1), _rank(5, 1, 1)]
    a = adopt(None, seen, world=2)
    assert a.plan == {0: 3, 1: 5} and a.orphans == [4] and a.steady


def test_nothing_known_at_all():
    a = adopt(None, [], world=3)
    assert a.gen == 0 and a.missing == [0, 1, 2] and not a.steady
    assert set(a.plan) == {0, 1, 2} and all(w < 0 for w in a.plan.values())


def test_what_the_new_controller_recovers_from():
    steady = adopt({"gen": 3, "plan": {"0": 0, "1": 1}}, [_rank(0, 0, 3), _rank(1, 1, 3, node=1)],
                   world=2)
    assert faults(steady, set(), {0: 0, 1: 1}) == []  # trains on untouched
    assert faults(steady, {2}, {0: 0, 1: 1}) == []  # a lost host that held no rank
    (lost,) = faults(steady, {1}, {0: 0, 1: 1})
    assert lost.kind == "node_lost" and lost.node == 1
    missing = adopt({"gen": 2, "plan": {"0": 0, "1": 1}}, [_rank(0, 0, 2)], world=2)
    (crash,) = faults(missing, set(), {0: 0, 1: 1})
    assert crash.kind == "crash" and crash.rank == 1 and crash.node == 1
    forming = adopt({"gen": 4, "plan": {"0": 0, "1": 1}},
                    [_rank(0, 0, 4), _rank(1, 1, 4), _rank(9, 1, 5)], world=2)
    assert [f.kind for f in faults(forming, set(), {0: 0, 1: 0})] == ["takeover"]
    # a lost host is the cause: no second fault for the generation it interrupted
    assert [f.kind for f in faults(forming, {0}, {0: 0, 1: 0})] == ["node_lost"]

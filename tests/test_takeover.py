"""What a controller taking office makes of the journal and of what the hosts report (pure)."""

import json

import pytest

from nonstop.decide.takeover import Seen, adopt, faults, newest_step, resume
from nonstop.protocol.hosts import JournalRecord, LastWord, NodeHost


def J(gen: int) -> JournalRecord:
    """A journal of a 2-rank job at ``gen``: rank r held by process r."""
    return JournalRecord(gen=gen, plan={0: 0, 1: 1})


def _rank(wid, rank, gen, node=0, alive=True, code=None, done=None):
    return Seen(wid=wid, node=node, alive=alive, spare=False, rank=rank, gen=gen, seq=gen + 1,
                code=code, done=gen if done is None and code == 0 else done)


def test_a_job_that_trains_is_taken_over_as_it_is():
    seen = [_rank(0, 0, 3), _rank(1, 1, 3, node=1), Seen(7, 1, True, True)]
    a = adopt(J(3), seen, world=2)
    assert a.steady and a.gen == 3 and a.plan == {0: 0, 1: 1}
    assert a.missing == [] and a.orphans == [] and a.spares == [7]


def test_the_hosts_win_over_a_journal_one_generation_behind():
    # the controller sent generation 4's assignments and died before journaling them
    seen = [_rank(0, 0, 4), _rank(5, 1, 4, node=1), _rank(1, 1, 3, node=1, alive=False)]
    a = adopt(J(3), seen, world=2)
    assert a.gen == 4 and a.plan == {0: 0, 1: 5} and a.steady


def test_a_rank_without_a_live_process_is_missing():
    seen = [_rank(0, 0, 2), _rank(1, 1, 2, alive=False)]
    a = adopt(J(2), seen, world=2)
    assert not a.steady and a.missing == [1] and a.plan == {0: 0, 1: 1}
    # its host gone too: the journal still names the process, to be replaced
    a = adopt(J(2), [_rank(0, 0, 2)], world=2)
    assert a.missing == [1] and a.plan[1] == 1


def test_ranks_that_ran_to_the_end_are_not_missing():
    # the controller died as training ended: every rank's process exited 0 in the newest
    # generation, before a successor took office - the job is over, nothing to recover
    over = adopt(J(2), [_rank(0, 0, 2, alive=False, code=0),
                        _rank(1, 1, 2, node=1, alive=False, code=0)], world=2)
    assert over.over and over.steady and over.finished == [0, 1] and over.missing == []
    assert faults(over, set(), {0: 0, 1: 1}) == []
    # one still finishing: it holds its rank, the other ran to the end; the job is not over
    part = adopt(J(2), [_rank(0, 0, 2), _rank(1, 1, 2, alive=False, code=0)], world=2)
    assert part.finished == [1] and not part.over and part.steady and part.missing == []
    assert faults(part, set(), {0: 0, 1: 1}) == []
    # exited with an error, or killed: missing (a crash to recover from), not finished
    for code in (1, -9, None):
        bad = adopt(J(2), [_rank(0, 0, 2), _rank(1, 1, 2, alive=False, code=code)], world=2)
        assert bad.missing == [1] and bad.finished == [] and not bad.over
    # a process that ended 0 in an older generation was replaced since: the newer one holds it
    old = adopt(J(3), [_rank(0, 0, 3), _rank(1, 1, 2, alive=False, code=0), _rank(4, 1, 3)],
                world=2)
    assert old.plan == {0: 0, 1: 4} and old.finished == [] and old.orphans == []
    # a wrapped rank that exited 0 without saying it was done (sys.exit(0) mid-training), or
    # done in an older generation: missing; a plain script's ranks say nothing: exit 0 is done
    for done in (-1, 1):
        early = adopt(J(2), [_rank(0, 0, 2), _rank(1, 1, 2, alive=False, code=0, done=done)],
                      world=2)
        assert early.missing == [1] and early.finished == []
    plain = adopt(J(2), [_rank(0, 0, 2), _rank(1, 1, 2, alive=False, code=0, done=-1)],
                  world=2, managed=False)
    assert plain.finished == [1] and plain.missing == []


def test_a_generation_caught_forming_keeps_every_live_process():
    # generation 5 went out to rank 1's replacement only, then the controller died: rank 1's old
    # process was replaced (an orphan, ended); rank 0's process never heard of 5 but holds the
    # rank: kept, and the generation is formed again (not steady, nothing missing)
    seen = [_rank(0, 0, 4), _rank(1, 1, 4), _rank(9, 1, 5)]
    a = adopt(J(4), seen, world=2)
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
    steady = adopt(J(3), [_rank(0, 0, 3), _rank(1, 1, 3, node=1)],
                   world=2)
    assert faults(steady, set(), {0: 0, 1: 1}) == []  # trains on untouched
    assert faults(steady, {2}, {0: 0, 1: 1}) == []  # a lost host that held no rank
    (lost,) = faults(steady, {1}, {0: 0, 1: 1})
    assert lost.kind == "node_lost" and lost.node == 1
    missing = adopt(J(2), [_rank(0, 0, 2)], world=2)
    (crash,) = faults(missing, set(), {0: 0, 1: 1})
    assert crash.kind == "crash" and crash.rank == 1 and crash.node == 1
    forming = adopt(J(4),
                    [_rank(0, 0, 4), _rank(1, 1, 4), _rank(9, 1, 5)], world=2)
    assert [f.kind for f in faults(forming, set(), {0: 0, 1: 0})] == ["takeover"]
    # a lost host is the cause: no second fault for the generation it interrupted
    assert [f.kind for f in faults(forming, {0}, {0: 0, 1: 0})] == ["node_lost"]


def test_the_journal_round_trips_and_a_malformed_one_is_refused():
    rec = JournalRecord(epoch=7, gen=3, plan={0: 4, 1: 5},
                        nodes={0: NodeHost("h0", "i0", "10.0.0.1", 4000),
                               1: NodeHost("h1", "i1", "10.0.0.2", 4001)},
                        isolated=(2,), replacements=(0, 1), max_step=120, node_of={0: 0, 1: 1},
                        claimed={"0": 1}, next_wid=6, worlds={0: 2, 3: 2}, trained_world=2,
                        counters={"restarts": 1}, incidents=2,
                        job={"t_start": 1.0, "t": 2.0, "time_s": {"productive": 1.0}})
    assert JournalRecord.loads(rec.dumps()) == rec
    good = json.loads(rec.dumps())
    for broken in ({**good, "gen": "3"}, {**good, "plan": {"x": 1}}, {**good, "extra": 1},
                   {k: v for k, v in good.items() if k != "nodes"},
                   {**good, "nodes": {"0": {"host": "h0"}}}, {**good, "isolated": [True]},
                   {**good, "job": {"t": 1.0}}, {**good, "claimed": []}):
        with pytest.raises(ValueError):
            JournalRecord.loads(json.dumps(broken))
    with pytest.raises(ValueError):
        JournalRecord.loads("{not json")


def test_an_incident_found_at_a_takeover_counts_from_the_newest_step_any_rank_reached():
    """The journal is written at generations: a job whose every rank went with its controller
    (restarted from a snapshot of step 10 at step ~102) lost ~92 steps, not none. The
    predecessor's last status record (twice a second) says where the ranks had come to."""
    journal = JournalRecord(gen=0, plan={0: 0, 1: 1}, max_step=4)
    last = LastWord.loads(json.dumps({"t": 1000.5, "gen": 0, "step": 102, "phase": "running",
                                      "ranks": []}))
    assert last == LastWord(t=1000.5, step=102)
    assert newest_step(journal, last) == 102
    assert newest_step(journal, None) == 4  # no status in etcd: the journal's
    assert newest_step(None, last) == 102
    assert newest_step(JournalRecord(max_step=150), LastWord(t=1.0, step=120)) == 150
    for bad in ('{"t": 1.0}', '{"step": 3}', '{"t": "x", "step": 3}', '{"t": 1.0, "step": true}',
                '{"t": 1.0, "step": -1}', "[]", "not json"):
        with pytest.raises(ValueError):
            LastWord.loads(bad)


def test_what_a_takeover_goes_on_from():
    """The newest step, the faults with when they began (the predecessor's last word, if it is
    recent and not from another clock's future) and the isolated hosts still up to let go."""
    missing = adopt(J(2), [_rank(0, 0, 2)], world=2)
    last = LastWord(t=995.0, step=40)
    up = {3}.__contains__
    then = resume(missing, J(2), last, {2}, {0: 0, 1: 1}, {2, 3}, up, now=1000.0)
    assert then.max_step == 40 and then.t_fault == 995.0
    assert [(f.kind, f.rank) for f in then.faults] == [("crash", 1)]
    assert then.release == (3,)  # host 2 lost: nothing to let go
    assert resume(missing, J(2), LastWord(t=900.0, step=40), set(), {0: 0, 1: 1}, set(), up,
                  now=1000.0).t_fault is None  # over a minute old: bounds nothing
    assert resume(missing, J(2), LastWord(t=1001.0, step=40), set(), {0: 0, 1: 1}, set(), up,
                  now=1000.0).t_fault is None  # ahead of this clock: bounds nothing
    steady = adopt(J(3), [_rank(0, 0, 3), _rank(1, 1, 3, node=1)], world=2)
    calm = resume(steady, J(3), None, set(), {0: 0, 1: 1}, set(), up, now=1000.0)
    assert calm.faults == () and calm.t_fault is None and calm.max_step == 0

"""Fault spec parsing: good specs parse, bad ones are one clear UsageError."""

import pytest

from nonstop import inject
from nonstop.errors import UsageError


def test_parse_several_specs_joined_and_repeated():
    faults = inject.parse(["crash:rank=2,step=50;hang:rank=1,step=80", "exception:rank=0,step=3,at=optimizer,times=2"])
    assert [f.kind for f in faults] == ["crash", "hang", "exception"]
    assert faults[0].rank == 2 and faults[0].step == 50 and faults[0].times == 1
    assert faults[2].at == "optimizer" and faults[2].times == 2


def test_round_trip_through_environment():
    faults = inject.parse("exit:rank=1,step=4,code=3")
    assert inject.from_env(inject.to_env(faults)) == faults


@pytest.mark.parametrize("spec, words", [
    ("explode:rank=1,step=2", "unknown fault 'explode'"),
    ("crash", "needs rank= and step="),
    ("crash:rank=1", "missing step="),
    ("crash:rank=x,step=1", "not an integer"),
    ("crash:rank=-1,step=1", "must be >= 0"),
    ("crash:rank=1,step=1,colour=red", "unknown key 'colour'"),
    ("crash:rank=1,rank=2,step=1", "given twice"),
    ("crash:rank=1,step=1,at=middle", "at='middle'"),
    ("crash:rank 1", "expected key=value"),
    ("crash:rank=1,step=2,times=0", "times must be >= 1"),
])
def test_bad_specs_are_clear_errors(spec, words):
    with pytest.raises(UsageError, match=words.replace("(", r"\(")):
        inject.parse(spec)


def test_a_slowdown_for_some_steps_only():
    (f,) = inject.parse("slow:rank=all,step=5,ms=300,steps=2")
    assert f.steps == 2 and inject.from_env(inject.to_env([f])) == [f]
    assert f.describe() == "slow:rank=all,step=5,ms=300,steps=2"
    inj = inject.Injector([f], lambda i, f: True, lambda f, step, index=None: None)
    assert [inj.forward(1, step)[0] for step in range(4, 9)] == [0, 0.3, 0.3, 0, 0]
    (always,) = inject.parse("slow:rank=1,step=5,ms=300")  # without steps: to the end
    inj = inject.Injector([always], lambda i, f: True, lambda f, step, index=None: None)
    assert inj.forward(1, 500)[0] == 0.3
    with pytest.raises(UsageError, match="steps must be >= 1"):
        inject.parse("slow:rank=1,step=5,ms=300,steps=0")
    with pytest.raises(UsageError, match="unknown key 'steps'"):
        inject.parse("crash:rank=1,step=5,steps=2")


def test_rank_outside_world_is_refused():
    with pytest.raises(UsageError, match="rank 4 does not exist"):
        inject.check_world(inject.parse("crash:rank=4,step=1"), 4)


def test_injector_fires_only_when_claimed():
    fired, claims = [], {}

    def claim(i, f):
        claims[i] = claims.get(i, 0) + 1
        return claims[i] <= f.times

    faults = inject.parse("exception:rank=1,step=3")
    inj = inject.Injector(faults, claim, lambda f, step, index=None: fired.append((f.kind, step)))
    inj.check("start", rank=0, step=3)  # other rank: nothing
    inj.check("start", rank=1, step=2)  # other step: nothing
    with pytest.raises(inject.InjectedError):
        inj.check("start", rank=1, step=3)
    inj.check("start", rank=1, step=3)  # replayed step: already fired once
    assert fired == [("exception", 3)]


def test_a_snapshots_fault_fires_at_the_first_snapshot_of_its_step_or_later():
    claims: dict[int, int] = {}

    def claim(i, f):
        claims[i] = claims.get(i, 0) + 1
        return claims[i] <= f.times

    fired = []
    inj = inject.Injector(inject.parse("corrupt:rank=0,step=5"), claim,
                          lambda f, step, index=None: fired.append(step))
    assert not inj.claim_kind("corrupt", 0, 4)  # before its step
    assert inj.claim_kind("corrupt", 0, 7)  # no snapshot at 5 or 6: the one at 7
    assert not inj.claim_kind("corrupt", 0, 8) and not inj.claim_kind("corrupt", 0, 9)
    assert fired == [7] and claims == {0: 2}  # spent: not asked again after its first refusal


def test_recovery_points_are_keyed_by_generation():
    (f,) = inject.parse("crash:rank=1,at=rendezvous,gen=3")
    assert f.at == "rendezvous" and f.gen == 3 and f.describe() == "crash:rank=1,at=rendezvous,gen=3"
    assert f.fires_in(3) and not f.fires_in(2) and not f.fires_in(4)
    (first,) = inject.parse("stop:rank=0,at=assigned")  # no gen: the first recovery
    assert not first.fires_in(0) and first.fires_in(1) and first.fires_in(5)
    (leaving,) = inject.parse("exit:rank=0,at=teardown")  # leaving any generation, gen 0 too
    assert leaving.fires_in(0)
    (promoted,) = inject.parse("crash:rank=2,at=promoted")  # a warm spare taking rank 2
    assert promoted.describe() == "crash:rank=2,at=promoted" and promoted.fires_in(1)
    assert inject.from_env(inject.to_env([f])) == [f]


@pytest.mark.parametrize("spec, words", [
    ("crash:rank=1,at=restore,step=4", "keyed by gen=, not step="),
    ("crash:rank=1,step=4,gen=2", "gen= is only for faults inside a recovery"),
    ("nan:rank=1,at=first_step", "at=first_step is for crash, exit"),
    ("crash:rank=1,at=restore,gen=-1", "gen must be >= 0"),
])
def test_bad_recovery_points_are_clear_errors(spec, words):
    with pytest.raises(UsageError, match=words):
        inject.parse(spec)


def test_injector_fires_a_recovery_point_once_in_its_generation(monkeypatch):
    fired, claims = [], {}

    def claim(i, f):
        claims[i] = claims.get(i, 0) + 1
        return claims[i] <= f.times

    monkeypatch.setattr(inject, "fire", lambda f: fired.append(f.describe()))
    inj = inject.Injector(inject.parse("crash:rank=1,at=restore,gen=2"), claim, lambda f, s, index=None: None)
    inj.in_recovery("restore", 1, 1)  # another generation
    inj.in_recovery("rendezvous", 1, 2)  # another point
    inj.in_recovery("restore", 0, 2)  # another rank
    assert fired == []
    inj.in_recovery("restore", 1, 2)
    inj.in_recovery("restore", 1, 2)
    assert fired == ["crash:rank=1,at=restore,gen=2"]
    assert inj.has_point("restore") and not inj.has_point("teardown")

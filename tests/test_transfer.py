"""Agreeing on one step, and moving state bit for bit (pure parts, no process group)."""

import pytest
import torch

from nonstop.runtime.transfer import NoConsistentState, pack, plan_sync, unpack


def test_newest_clean_step_wins_and_lowest_rank_sends():
    plan = plan_sync([(1, 30, 0), (1, 31, 0), (1, 31, 0), (0, 0, 0)])
    assert plan.step == 31 and plan.source == 1 and plan.receivers == (0, 3)


def test_dirty_rank_receives_even_at_the_newest_step():
    plan = plan_sync([(1, 30, 1), (1, 30, 0)])
    assert plan.step == 30 and plan.source == 1 and plan.receivers == (0,)


def test_everyone_in_agreement_moves_nothing():
    plan = plan_sync([(1, 7, 0)] * 4)
    assert plan.step == 7 and plan.receivers == ()


def test_nobody_with_state_starts_from_zero():
    plan = plan_sync([(0, 0, 0)] * 3)
    assert plan.step == 0 and plan.source is None


def test_only_dirty_state_is_not_consistent():
    with pytest.raises(NoConsistentState):
        plan_sync([(1, 5, 1), (0, 0, 0)])


def test_pack_unpack_is_bitwise_and_keeps_structure():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    sd = {"model": model.state_dict(), "optimizer": opt.state_dict(), "extra": {"epoch": 3},
          "flags": torch.tensor([True, False]), "half": torch.randn(3).half(), "empty": torch.empty(0)}
    meta, buf = pack(sd)
    out = unpack(meta, buf)
    assert out["extra"] == {"epoch": 3}
    assert getattr(out["model"], "_metadata", None) == getattr(sd["model"], "_metadata", None)
    for k, v in sd["model"].items():
        assert torch.equal(v, out["model"][k]) and v.dtype == out["model"][k].dtype
    for k in ("flags", "half", "empty"):
        assert torch.equal(sd[k], out[k]) and sd[k].dtype == out[k].dtype
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    fresh_opt = torch.optim.Adam(fresh.parameters())
    fresh.load_state_dict(out["model"])
    fresh_opt.load_state_dict(out["optimizer"])
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]

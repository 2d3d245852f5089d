"""Moving state bit for bit: a state dict as (structure, one flat buffer) and back; the group
that carries it between ranks."""

import torch

from nonstop.state.packing import layout, pack, unpack, unpack_with_info


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


def test_layout_plans_without_copying_and_info_rides_along():
    sd = {"w": torch.randn(5, 3), "b": torch.arange(7, dtype=torch.int16), "n": {"x": 1}}
    lay = layout(sd, {"step": 9})
    assert [s[3] for s in lay.specs] == [60, 14]
    assert all(off % 16 == 0 for _, _, off, _ in lay.specs) and lay.nbytes >= 74
    assert lay.tensors[0] is sd["w"]  # a reference, not a copy
    meta, buf = pack(sd, {"step": 9})
    out, info = unpack_with_info(meta, buf)
    assert info == {"step": 9} and torch.equal(out["w"], sd["w"]) and out["n"] == {"x": 1}


def test_a_plain_nccl_backend_gets_gloo_beside_it_for_cpu_tensors():
    from nonstop.runtime.pg import with_cpu_backend

    assert with_cpu_backend("nccl") == with_cpu_backend(" NCCL ") == "cpu:gloo,cuda:nccl"
    assert with_cpu_backend("gloo") == "gloo"
    assert with_cpu_backend("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"

"""DTensor state kept as local shards: ``State.state_dict`` gives plain local tensors and their
paths, ``State.load_state_dict`` puts them back where they belong (in place for a sharded
module, as DTensors like the parameter's for its optimizer), and refuses a copy that is not this
rank's shard. One rank, an FSDP2 model, in this process."""

from __future__ import annotations

import pytest
import torch

from nonstop.errors import ScriptSetupError
from nonstop.runtime.registered import State
from nonstop.state import packing, shards


@pytest.fixture
def world_of_one():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sharded_state():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt, State(model=model, optimizer=opt)


def _train(model, opt, steps=2):
    for i in range(steps):
        loss = model(torch.full((2, 4), float(i + 1))).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_sharded_state_travels_as_local_tensors_and_comes_back_bitwise(world_of_one):
    model, opt, state = _sharded_state()
    _train(model, opt)
    sd = state.state_dict()
    shapes = {"0.weight": [8, 4], "0.bias": [8], "2.weight": [1, 8], "2.bias": [1]}
    assert sd[shards.KEY] == {  # each: path, the whole tensor's shape, the shard's offset in it
        "model": [[[k], v, [0] * len(v)] for k, v in shapes.items()],
        "optimizer": [[["state", i, k], v, [0] * len(v)] for i, v in enumerate(shapes.values())
                      for k in ("exp_avg", "exp_avg_sq")]}
    assert shards.layout(sd)["optimizer.state.3.exp_avg_sq"] == ([1], [0])
    meta, buf = packing.pack(sd)  # what a snapshot, a peer or a checkpoint carries
    before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    moments = [opt.state[p]["exp_avg"].to_local().clone() for p in model.parameters()]
    _train(model, opt)  # move away from it
    assert not torch.equal(model.state_dict()["0.weight"].full_tensor(), before["0.weight"])
    state.load_state_dict(packing.unpack(meta, buf))
    after = model.state_dict()
    assert all(torch.equal(after[k].full_tensor(), v) for k, v in before.items())
    assert all(shards.is_dtensor(p) for p in model.parameters())  # the module's own, in place
    for p, m in zip(model.parameters(), moments):
        assert shards.is_dtensor(opt.state[p]["exp_avg"])
        assert torch.equal(opt.state[p]["exp_avg"].to_local(), m)
    _train(model, opt, steps=1)  # and it trains on


def test_a_restore_to_the_device_copies_each_shard_into_its_local_tensor(world_of_one):
    """The device path (pinned bounce buffers, run here on the host): a sharded module's and its
    optimizer's shards go into the DTensors' local tensors, never through the DTensors (an op on
    one is a collective of its mesh: on a GPU it waited for peers that were not in it)."""
    from nonstop.state import staging

    model, opt, state = _sharded_state()
    _train(model, opt)
    saved = packing.unpack(*packing.pack(state.state_dict()))
    before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    _train(model, opt)
    moved = staging.to_device(state, saved, device_type="cpu")
    live = model.state_dict()
    for key in before:
        assert not shards.is_dtensor(moved["model"][key])
        assert moved["model"][key].data_ptr() == live[key].to_local().data_ptr()
        assert torch.equal(live[key].to_local(), before[key])  # copied in by the mapping
    for pid, entry in moved["optimizer"]["state"].items():
        assert not shards.is_dtensor(entry["exp_avg"])
    state.load_state_dict(moved)
    assert all(torch.equal(v.to_local(), before[k]) for k, v in model.state_dict().items())
    assert all(shards.is_dtensor(opt.state[p]["exp_avg"]) for p in model.parameters())
    _train(model, opt, steps=1)


def test_a_shard_of_another_shape_is_refused_naming_the_tensor(world_of_one):
    model, opt, state = _sharded_state()
    _train(model, opt)
    sd = state.state_dict()
    sd["model"]["2.weight"] = torch.zeros(3, 8)
    with pytest.raises(shards.ShardMismatch, match=r"model.2.weight: the kept copy is .*\(3, 8\)"):
        state.load_state_dict(sd)
    sd = state.state_dict()
    sd["optimizer"]["state"][0]["exp_avg"] = torch.zeros(5)
    with pytest.raises(shards.ShardMismatch, match=r"optimizer.state.0.exp_avg: the kept shard"):
        state.load_state_dict(sd)


def test_a_shard_sent_to_a_model_that_is_not_sharded_says_how_to_shard_it(world_of_one):
    model, opt, state = _sharded_state()
    _train(model, opt)
    sd = state.state_dict()
    plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    popt = torch.optim.AdamW(plain.parameters())
    with pytest.raises(ScriptSetupError, match="nonstop.Mesh"):
        State(model=plain, optimizer=popt).load_state_dict(sd)
    assert shards.unmanaged_mesh(state) is not None
    assert shards.unmanaged_mesh(State(model=plain)) is None


@pytest.mark.parametrize("torch_has_reset", [True, False], ids=["reset_iter_state", "older-torch"])
def test_a_module_left_in_the_middle_of_a_step_is_set_back_to_rest(world_of_one, monkeypatch,
                                                                   torch_has_reset):
    """A backward whose gradient reduction fails (a peer left) leaves FSDP2's root gathered, in
    its backward state, with the step's gradient still on the gathered parameters: ``settle``
    drops it and reshards, so the next step's gradients are those of a fresh process - with
    FSDP2's own ``reset_iter_state``, or without it (a torch before 2.12: nonstop's own)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    if not torch_has_reset:
        monkeypatch.delattr(FSDPModule, "reset_iter_state")

    model, opt, state = _sharded_state()
    _train(model, opt)
    fresh_model, fresh_opt, fresh = _sharded_state()
    fresh.load_state_dict(state.state_dict())
    x = torch.ones(2, 4)
    reduce = FSDPParamGroup.post_backward

    def peer_left(self, *args, **kwargs):
        raise RuntimeError("a peer left")

    monkeypatch.setattr(FSDPParamGroup, "post_backward", peer_left)
    loss = model(x).pow(2).mean()
    with pytest.raises(RuntimeError, match="a peer left"):
        loss.backward()
    del loss
    monkeypatch.setattr(FSDPParamGroup, "post_backward", reduce)
    states = [m._get_fsdp_state() for m in model.modules() if hasattr(m, "_get_fsdp_state")]
    if not torch_has_reset:  # and its states' one parameter group each, as before 2.12
        monkeypatch.setattr(type(states[0]), "_fsdp_param_group",
                            property(lambda st: st.__dict__.get("_one_group")))
        for st in states:
            (st._one_group,) = st.__dict__.pop("_fsdp_param_groups")
    assert shards.settle(state) == 1
    if not torch_has_reset:
        for st in states:
            st._fsdp_param_groups = [st.__dict__.pop("_one_group")]
    assert all(not g.is_unsharded for m in model.modules() if hasattr(m, "_get_fsdp_state")
               for g in m._get_fsdp_state()._fsdp_param_groups)
    for m, o in ((model, opt), (fresh_model, fresh_opt)):
        o.zero_grad()
        m(x).pow(2).mean().backward()
    assert all(torch.equal(a.grad.to_local(), b.grad.to_local())
               for a, b in zip(model.parameters(), fresh_model.parameters()))


@pytest.mark.parametrize("kept", [True, False])
def test_a_failed_commit_takes_the_step_on_this_ranks_verdict_only_with_the_state_kept(
        world_of_one, monkeypatch, kept):
    """The commit (the verdict's all-reduce, the step's last collective) fails on this rank: with
    the state before the step kept, the rank takes the step on its own verdict; without a copy,
    the failure is raised and nothing is updated. An error that is no collective's is raised
    as it is, nothing kept."""
    import torch.distributed as dist

    model, opt, state = _sharded_state()
    _train(model, opt)
    state.check_finite = True
    state.twins = (0,)  # a shard with a twin (HSDP): what the kept copy is for
    seen: list[dict] = []

    def keep():
        seen.append({k: v.to_local().clone() for k, v in model.state_dict().items()})
        return kept

    state._keep_before_step = keep
    before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    real = dist.all_reduce

    def commit_fails(tensor, *args, **kwargs):
        if tensor.numel() == 1 and tensor.device.type == "cpu":
            raise RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer")
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", commit_fails)
    if kept:
        _train(model, opt, steps=1)
        after = model.state_dict()
        assert any(not torch.equal(after[k].to_local(), v) for k, v in before.items())
    else:
        with pytest.raises(RuntimeError, match="Connection closed"):
            _train(model, opt, steps=1)
        assert all(torch.equal(v.to_local(), before[k]) for k, v in model.state_dict().items())
    assert len(seen) == 1 and all(torch.equal(seen[0][k], v) for k, v in before.items())

    monkeypatch.setattr(dist, "all_reduce", commit_fails)
    before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    opt.zero_grad()  # this rank's own gradients are not finite as the commit fails
    model(torch.full((2, 4), float("nan"))).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match="Connection closed"):  # the peer's failure, not a NaN
        opt.step()
    assert all(torch.equal(v.to_local(), before[k]) for k, v in model.state_dict().items())
    assert len(seen) == 1  # nothing kept for it

    def not_a_collective(tensor, *args, **kwargs):
        raise ValueError("the user's own bug")

    monkeypatch.setattr(dist, "all_reduce", not_a_collective)
    with pytest.raises(ValueError):
        _train(model, opt, steps=1)
    assert len(seen) == 1


def test_with_no_twin_a_failed_commit_keeps_nothing_and_takes_no_step(world_of_one, monkeypatch):
    """Plain FSDP2: no rank holds another's shard, so a restore goes back to a snapshot every
    shard has, and a state kept before the step would serve nothing: the failure is raised,
    nothing kept, the step not taken. With no NaN check, no commit is made at all."""
    import torch.distributed as dist

    model, opt, state = _sharded_state()
    _train(model, opt)
    assert state.twins is None
    kept: list[int] = []
    state._keep_before_step = lambda: kept.append(1) or True
    state.check_finite = True
    before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    calls: list[int] = []

    def commit_fails(tensor, *args, **kwargs):
        calls.append(1)
        raise RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer")

    monkeypatch.setattr(dist, "all_reduce", commit_fails)
    with pytest.raises(RuntimeError, match="Connection closed"):
        _train(model, opt, steps=1)
    assert all(torch.equal(v.to_local(), before[k]) for k, v in model.state_dict().items())
    assert kept == [] and calls == [1]
    state.check_finite = False
    _train(model, opt, steps=1)
    assert calls == [1] and kept == []


def test_a_shards_offset_is_computed_once_per_mesh(world_of_one, monkeypatch):
    import weakref

    from nonstop import torch_internals

    monkeypatch.setattr(shards, "_OFFSETS", weakref.WeakKeyDictionary())  # (the tests' before)

    calls = []
    name = "dtensor.compute_local_shape_and_global_offset"
    real = torch_internals.get(name)
    monkeypatch.setitem(torch_internals._resolved, name,  # what the door hands out
                        lambda *a: calls.append(a[0]) or real(*a))
    model, opt, state = _sharded_state()
    _train(model, opt)
    first = state.state_dict()[shards.KEY]
    assert len(calls) == 4  # one per (shape, placements): 4 parameters, their moments alike
    assert state.state_dict()[shards.KEY] == first and len(calls) == 4  # the next: none
    # a new generation's mesh of the same layout, this rank at the same place: the same offsets
    model, opt, state = _sharded_state()
    _train(model, opt)
    assert state.state_dict()[shards.KEY] == first and len(calls) == 4
    # ...at another place in it (its coordinate): computed for that place
    monkeypatch.setattr(type(model[0].weight.device_mesh), "get_coordinate", lambda self: [7])
    assert state.state_dict()[shards.KEY] == first and len(calls) == 8


def test_a_new_shard_is_cut_from_the_old_shards_that_overlap_it_and_refused_if_not_covered():
    """The arithmetic of resharding a running job (``regrid.cut``): rows 0..9 of a 10 x 2 tensor
    were sharded over 3 old ranks (4, 4, 2 rows, FSDP2's chunks), one of them also held by a
    twin; a new rank of 2 holds rows 5..9."""
    from nonstop.state import regrid, shards

    whole = torch.arange(20, dtype=torch.float32).view(10, 2)
    old = [([0, 0], whole[0:4]), ([4, 0], whole[4:8]), ([4, 0], whole[4:8].clone()),
           ([8, 0], whole[8:10])]
    got = regrid.cut("w", (5, 2), (5, 0), old)
    assert torch.equal(got, whole[5:10])
    # column shards too (tensor parallel): the right half of rows 2..5
    cols = [([0, 0], whole[:, :1]), ([0, 1], whole[:, 1:])]
    assert torch.equal(regrid.cut("w", (4, 1), (2, 1), cols), whole[2:6, 1:])
    with pytest.raises(shards.ShardMismatch, match="cover 6 of the 10"):
        regrid.cut("w", (5, 2), (5, 0), old[:2])  # rows 8..9 in no old shard
    with pytest.raises(shards.ShardMismatch, match="in no old shard"):
        regrid.cut("w", (5, 2), (5, 0), [])

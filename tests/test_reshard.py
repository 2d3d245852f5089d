"""Sharded state over another world size: where every old shard comes from (pure), and how the
shards are merged."""

from __future__ import annotations

import pytest

from nonstop.protocol.keeper_messages import HolderEntry
from nonstop.state import reshard
from nonstop.state.plan import NoConsistentState
from nonstop.state.shm import SlotInfo


W = {0: 4, 1: 3}  # generation -> world size


def inv(live=None, memory=None, disk=None, gen=0):
    """An inventory; ``memory``: holder -> steps of snapshots taken in generation ``gen``."""
    def entry(steps):
        slots = [SlotInfo(seq=i, step=s, meta_len=0, data_len=0, checksum=0, written_at=0.0,
                          rank=0, gen=gen) for i, s in enumerate(steps)]
        return HolderEntry(slots=[*slots, None], replicated_step=None, repl_s=None,
                           repl_error=None, buddies=[])

    return reshard.inventory_of(live, {k: entry(v) for k, v in (memory or {}).items()},
                                disk or {})


def test_live_shards_first_the_lost_one_from_memory_then_its_replica():
    # 3 ranks left of 4: old ranks 0, 2, 3 live at step 20; old rank 1's snapshot of step 20 is
    # in the memory of new rank 0's node, and its replica on new rank 2's
    invs = [inv((0, 20, 4), {"r0": [20, 19], "r1": [20, 19]}), inv((2, 20, 4), {"r2": [20]}),
            inv((3, 20, 4), {"rep1": [20, 19]})]
    step, world, sources = reshard.plan(invs, W, set(), prefer=4)
    assert (step, world) == (20, 4)
    assert [(s.shard, s.kind, s.holder) for s in sources] == [
        (0, "live", 0), (1, "memory", 0), (2, "live", 1), (3, "live", 2)]
    step, world, sources = reshard.plan(invs, W, {(1, "memory", 20)})  # that copy failed
    assert (sources[1].kind, sources[1].holder) == ("buddy", 2)


def test_a_shard_held_only_at_an_older_step_rolls_everyone_back():
    invs = [inv((0, 20, 4), {"r0": [18, 16]}), inv((2, 20, 4), {"r2": [18], "rep1": [18]}),
            inv(None, {"r3": [18, 20]})]
    step, world, sources = reshard.plan(invs, W, set())
    assert (step, world) == (18, 4)
    assert [s.kind for s in sources] == ["memory", "buddy", "memory", "memory"]


def test_each_snapshot_counts_for_the_world_size_of_its_generation():
    # step 30: shards 0-2 of the 3-rank world (generation 1) were snapshotted, right after a
    # reshard; slot r3 still holds step 30 of the 4-rank world: that is no shard of world 3
    invs = [inv(None, {"r0": [30], "r1": [30], "r2": [30]}, gen=1),
            inv(None, {"r3": [30, 28]}, gen=0)]
    step, world, sources = reshard.plan(invs, W, set(), prefer=4)
    assert (step, world) == (30, 3) and len(sources) == 3
    old = [inv(None, {"r0": [30]}, gen=7)]  # a generation no longer known: its size neither
    with pytest.raises(NoConsistentState):
        reshard.plan(old, W, set())


def test_disk_parts_of_the_old_world_and_nothing_at_all():
    invs = [inv(disk={2: {0: [100], 1: [100]}}), inv(disk={2: {0: [100], 1: [100]}})]
    step, world, sources = reshard.plan(invs, W, set())
    assert (step, world) == (100, 2) and [s.kind for s in sources] == ["disk", "disk"]
    with pytest.raises(NoConsistentState):
        reshard.plan([inv(disk={3: {0: [100], 1: [100]}})], W, set())  # part 2 is nowhere


def test_merge_takes_each_parameters_optimizer_state_from_the_shard_that_held_it():
    opt = lambda state: {"state": state, "param_groups": [{"params": [0, 1, 2], "lr": 0.1}]}  # noqa: E731
    a = {"model": {"w": 1}, "optimizer": opt({0: {"m": "a0"}}), "sampler": {"position": 5}}
    b = {"model": {"w": 1}, "optimizer": opt({1: {"m": "b1"}, 2: {"m": "b2"}}),
         "sampler": {"position": 5}}
    merged = reshard.merge([a, b])
    assert merged["optimizer"]["state"] == {0: {"m": "a0"}, 1: {"m": "b1"}, 2: {"m": "b2"}}
    assert merged["optimizer"]["param_groups"] == a["optimizer"]["param_groups"]
    assert merged["model"] is a["model"] and merged["sampler"] == {"position": 5}


def test_after_a_merge_each_rank_keeps_the_state_of_its_own_parameters_only():
    import torch

    import nonstop

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters())
    state = nonstop.State(model=model, optimizer=opt, sharded=True)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()  # state for weight and bias
    assert len(opt.state) == 2
    state.prune_unowned()
    model.bias.grad = None  # another rank owns the bias now
    opt.step()
    assert set(opt.state) == {model.weight}

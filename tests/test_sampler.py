"""The sampler's stream: each step's global batch does not depend on the world size, and across
any sequence of world sizes every sample of an epoch is seen exactly once, in the same order."""

from __future__ import annotations

import random
import types

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import nonstop
from nonstop.runtime.sampler import GlobalBatchSampler


def test_every_world_splits_the_same_global_batch():
    s = GlobalBatchSampler(50, 12, seed=3)
    for step in range(12):
        whole = s.global_indices(step)
        assert len(whole) == 12
        for world in range(1, 16):
            shares = [s.share(step, r, world) for r in range(world)]
            assert sum(shares, []) == whole
            sizes = [len(x) for x in shares]
            assert max(sizes) - min(sizes) <= 1  # a world larger than the batch: some get none


def test_any_sequence_of_world_sizes_sees_each_sample_of_an_epoch_once_in_order():
    size, batch = 96, 8  # 12 steps an epoch
    s = GlobalBatchSampler(size, batch, seed=7)
    rng = random.Random(1)
    worlds = [4] * 5 + [rng.choice([1, 2, 3, 4, 5, 6, 8]) for _ in range(31)]  # 3 epochs
    seen: list[int] = []
    for step, world in enumerate(worlds):
        for rank in range(world):
            seen += s.share(step, rank, world)
    for epoch in range(3):
        got = seen[epoch * size:(epoch + 1) * size]
        assert sorted(got) == list(range(size))  # each sample exactly once
        assert got == s.order(epoch)  # in the same global order as any other run
    assert s.order(0) != s.order(1)  # shuffled anew each epoch, deterministically
    assert GlobalBatchSampler(size, batch, seed=7).order(1) == s.order(1)


def test_a_batch_may_end_an_epoch_and_begin_the_next():
    s = GlobalBatchSampler(10, 4, shuffle=False)
    stream = sum((s.global_indices(step) for step in range(5)), [])
    assert stream == list(range(10)) + list(range(10))
    assert s.global_indices(2) == [8, 9, 0, 1] and s.epoch(2) == 0 and s.epoch(3) == 1


def test_its_state_is_registered_and_a_changed_stream_is_refused():
    s = GlobalBatchSampler(100, 10, seed=1)
    s.share(4, 0, 2)
    state = nonstop.State(sampler=s)
    sd = state.state_dict()
    again = GlobalBatchSampler(100, 10, seed=1)
    nonstop.State(sampler=again).load_state_dict(sd)
    assert again.position == 5 and again.state_dict()["samples_consumed"] == 50
    with pytest.raises(ValueError, match="another sample stream"):
        GlobalBatchSampler(100, 20, seed=1).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="positive int"):
        GlobalBatchSampler(0, 10)


class _Ids(Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.tensor(i)


def test_a_plain_dataloader_reads_this_ranks_shares_from_the_step_it_resumes_at():
    s = GlobalBatchSampler(40, 8, seed=2)
    ctx = types.SimpleNamespace(rank=1, world_size=3, step=6)
    loader = DataLoader(_Ids(), batch_sampler=s.for_rank(ctx))
    got = [b.tolist() for _, b in zip(range(4), loader)]
    assert got == [s.share(step, 1, 3) for step in range(6, 10)]


@pytest.mark.filterwarnings("ignore:.set_vital. is deprecated")
def test_a_stateful_dataloader_resumes_at_the_same_share():
    """torchdata's StatefulDataLoader over the sampler's shares: its state, saved after three
    batches and loaded into a new loader, goes on with the fourth share."""
    pytest.importorskip("torchdata.stateful_dataloader")
    import torch
    from torch.utils.data import TensorDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    class Ctx:
        rank, world_size, step = 1, 3, 5

    data = TensorDataset(torch.arange(100))
    sampler = GlobalBatchSampler(100, 12, seed=0)
    loader = StatefulDataLoader(data, batch_sampler=sampler.for_rank(Ctx))
    it = iter(loader)
    got = [next(it)[0].tolist() for _ in range(3)]
    assert got == [sampler.share(s, 1, 3) for s in (5, 6, 7)]
    again = StatefulDataLoader(data, batch_sampler=sampler.for_rank(Ctx))
    again.load_state_dict(loader.state_dict())
    assert next(iter(again))[0].tolist() == sampler.share(8, 1, 3)

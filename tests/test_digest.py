"""The replicas' digests (pure parts): any flipped bit changes a digest, equal weights give equal
digests whatever their history, the odd ranks are found, state newer than a corruption is not
offered for a restore, two passes over the same steps part where they first differ."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from conftest import ROOT, rank_processes

from nonstop.protocol.rank_policy import RankSdc
from nonstop.runtime.registered import State
from nonstop.state.digest import (END, OUTPUT, Digests, StepTrace, alike, digest, odd_ones,
                                  parted, word)
from nonstop.state.restore import Where, _offer


def test_every_single_bit_flip_changes_the_digest():
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        m = torch.nn.Linear(3, 2).to(dtype)
        base = digest([m])
        words = {2: torch.int16, 4: torch.int32, 8: torch.int64}[m.weight.element_size()]
        flat = m.weight.detach().view(words).view(-1)
        for bit in range(8 * m.weight.element_size()):
            with torch.no_grad():
                flat[1] ^= 1 << bit if bit < 8 * m.weight.element_size() - 1 else -(1 << bit)
            assert digest([m]) != base, (dtype, bit)
            with torch.no_grad():
                flat[1] ^= 1 << bit if bit < 8 * m.weight.element_size() - 1 else -(1 << bit)
            assert digest([m]) == base


def test_equal_weights_equal_digests_and_the_tensors_order_matters():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    b.load_state_dict(a.state_dict())
    assert digest([a]) == digest([b]) != digest([torch.nn.Linear(4, 4)])
    c, d = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    assert digest([c, d]) != digest([d, c])  # the same tensors, swapped: another digest
    assert -2**63 <= digest([c, d]) < 2**63  # one signed 64-bit integer, as gathered


def test_odd_ones():
    assert odd_ones([5, 5, 5]) == [] and odd_ones([5]) == []
    assert odd_ones([5, 6, 5, 5]) == [1]
    assert odd_ones([5, 6, 7, 5, 5]) == [1, 2]
    assert odd_ones([5, 6]) == [0, 1]  # no majority: every rank is suspect
    assert odd_ones([5, 5, 6, 6]) == [0, 1, 2, 3]


def test_the_injected_flip_changes_one_bit_of_one_parameter():
    m = torch.nn.Linear(8, 8)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    where = State(model=m).flip_bit(seed=3)
    changed = [n for n, p in m.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == 1 and where.startswith(f"0.{changed[0]}[")
    diff = (m.state_dict()[changed[0]] != before[changed[0]]).sum().item()
    assert diff == 1


def test_checks_are_spaced_to_their_share_of_step_time():
    d = Digests(RankSdc(enabled=True, action="replace", max_overhead_pct=1.0, replay_every=0))
    assert d.interval(0.1) == 1  # nothing measured yet
    d._costs.append(0.002)
    assert d.interval(0.1) == 2 and d.interval(0.4) == 1 and d.interval(0.01) == 20


def test_a_steps_trace_holds_each_forward_and_two_passes_part_where_they_first_differ():
    m = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    first = StepTrace()
    for step in (10, 11, 12):
        first.begin(step)
        first.output(step, m(x).detach())
        first.output(step, m(x * step).detach())  # a second forward (a micro-batch)
    first.note(12, END, digest([m]))
    assert isinstance(first.value(11, OUTPUT), tuple) and len(first.value(11, OUTPUT)) == 2
    # the replay: the same until step 11's second forward, where this rank's weight changed
    second = StepTrace()
    for step in (10, 11, 12):
        second.begin(step)
        second.begin(step)  # (a step begun again counts its outputs afresh)
        if step == 10:  # a forward before the step's own (a pipeline stage's shape inference)
            second.output(step, torch.empty(4, 2).fill_(7.0))
        second.output(step, m(x).detach())
        if step == 11:
            with torch.no_grad():
                m.weight[0, 0] += 1.0
        second.output(step, m(x * step).detach())
    second.note(12, END, digest([m]))
    assert parted(first.points(), second.points()) == (4, (11, OUTPUT))
    assert parted(first.points(), first.points()) == (4, None)
    assert alike((1, 2, 3), (2, 3)) and not alike((1, 2, 3), (1, 2))
    assert word((5, 2, 3), (2, 3)) == word((2, 3))
    second.keep_from(12)
    assert set(second.points()) == {(12, OUTPUT), (12, END)}
    second.redo_from(12)
    assert second.points() == {}


def test_no_state_newer_than_the_corruption_is_offered():
    state = types.SimpleNamespace(step=30, dirty=False)
    offer, _ = _offer(state, 0, True, Where())
    assert offer.live == 30
    offer, _ = _offer(state, 0, True, Where(not_after=29))
    assert offer.live is None


def test_sharded_parameters_are_digested_by_their_own_part_and_not_compared():
    """FSDP2's parameters are DTensors, each rank holding its own part: the digest reads that
    part (a DTensor has no memory of its own to read), and the check across ranks is not made
    (no other rank holds that part) - it says why instead of failing every rank as corrupt."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from nonstop.state.digest import SHARDED, sharded

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
        model.load_state_dict(plain.state_dict())
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        assert sharded([model]) and not sharded([plain])
        # one rank holds every part: its parts' digest is the unsharded model's
        assert digest([model]) == digest([plain])
        checks = Digests(RankSdc(enabled=True, action="replace", max_overhead_pct=0.5, replay_every=0))
        assert checks.check([model], step=3, world=2) == 0.0  # (no collective was made)
        assert checks.stats().uncompared == SHARDED and checks.stats().checks == 0
    finally:
        dist.destroy_process_group()


def test_sharded_parameters_with_twins_are_compared_among_twins_only():
    from nonstop.state.digest import _odd_twins

    # shard 0 on ranks 0 and 2, shard 1 on ranks 1 and 3: different shards differ, as they must
    assert _odd_twins([10, 20, 10, 20], (0, 1, 0, 1)) == []
    # rank 3's shard differs from its twin's: with two of them, which one is right cannot be told
    assert _odd_twins([10, 20, 10, 21], (0, 1, 0, 1)) == [1, 3]
    # three replica groups: the odd one is found
    assert _odd_twins([10, 20, 10, 20, 10, 99], (0, 1, 0, 1, 0, 1)) == [5]


def test_a_checks_cost_is_its_own_not_the_wait_for_a_late_peer():
    """The cost that spaces snapshots out (and with them the checks) is the digest and the
    all-gather as the last rank to reach it saw it; the early ranks' wait for a peer still in
    its step is no cost of the check (it would wait as long at the next collective)."""
    from nonstop.state.digest import check_cost

    # rank 0 waited 0.3 s for rank 1 in the last gather; rank 1, the last, 2 ms
    assert check_cost([0.001, 0.002], [0.3, 0.002]) == pytest.approx(0.004)
    # a rank that made no gather yet (a generation's first check): not counted
    assert check_cost([0.001, 0.002], [None, 0.002]) is None


@pytest.mark.integration
def test_a_late_rank_does_not_make_the_check_look_expensive(tmp_path):
    """Two ranks over real gloo, rank 1 reaching each check 0.3 s after rank 0: rank 0 waits
    that long in every gather, yet neither counts the wait as the check's cost (counted, a
    pipeline's snapshots and checks were spaced out several times further than an HSDP job's).
    The gather prints no FutureWarning (torch 2.13 renamed it), and a flipped bit is still
    found."""
    seen = [json.loads(out.strip().splitlines()[-1]) for out, _ in rank_processes(
        lambda r: [sys.executable, str(ROOT / "tests" / "scripts" / "digest_ranks.py"), str(r),
                   str(tmp_path / "store")], timeout=120)]
    assert seen[0]["waited_s"] >= 0.25  # rank 0 did wait for rank 1 ...
    for s in seen:
        assert s["checks"] == 7 and s["cost_s"] < 0.1, s  # ... but the checks cost ms
        assert s["found"] == [0, 1]
        assert not [w for w in s["warnings"] if w.startswith("FutureWarning")], s["warnings"]

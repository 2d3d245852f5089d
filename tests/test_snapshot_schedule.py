"""Which steps are snapshotted (and so compared across replicas, and sent to disk) must be the
same on every rank whatever happens to one rank's memory: a rank that thinks a snapshot is due
alone waits in the comparison while the others step on (a hang)."""

from __future__ import annotations

import dataclasses

from nonstop.protocol.rank_policy import RankCheckpoint, RankSdc, RankSnapshot, RankState
from nonstop.state.snapshot import Snapshots


class _State:
    sharded = False
    twins = None
    meshed = False

    def modules(self):
        return []

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {}


class _Gone:
    """A node memory whose keeper died: every request fails."""

    def alloc(self, holder, size):
        raise ConnectionRefusedError("the keeper is gone")

    def reset(self):
        pass


CFG = RankState(RankSnapshot(enabled=True, every_steps=5, max_overhead_pct=5.0),
                RankCheckpoint(dir="/nonexistent/ckpt", every_steps=3, at_end=True))
AUTO = RankState(RankSnapshot(enabled=True, every_steps="auto", max_overhead_pct=1.0),
                 RankCheckpoint(dir=None, every_steps=100, at_end=False))


def _due_steps(memory):
    snaps, state, due = Snapshots(CFG, memory), _State(), []
    for step in range(1, 21):
        state.step = step
        before = snaps.taken, snaps.last_persist
        snaps.after_step(state, rank=1, world=2, gen=0, step_s=0.01, first=False, injector=None)
        if (snaps.taken, snaps.last_persist) != before or snaps.anchor == step:
            due.append(step)
    return due


def test_a_rank_without_memory_or_whose_memory_fails_snapshots_at_the_same_steps():
    # a checkpoint every 3 steps (each a snapshot: the next one counts 5 on from there)
    expected = [3, 6, 9, 12, 15, 18]
    assert _due_steps(None) == expected
    assert _due_steps(_Gone()) == expected


def test_one_share_of_the_steps_covers_the_copy_its_replication_and_the_digest():
    snaps = Snapshots(AUTO, None)
    step_s = 0.025  # 1% of it: 0.25 ms a step
    assert snaps._interval(0.001, step_s, 0.0) == 4  # a 1 ms snapshot: every 4 steps
    assert snaps._interval(0.001, step_s, 0.0005) == 6  # ...and its replication
    snaps = Snapshots(AUTO, None, sdc=RankSdc(enabled=True, action="replace",
                                              max_overhead_pct=0.5, replay_every=0))
    # the digest joins the same share (it had one of its own: 1% and 0.5% beside each other)
    assert snaps._interval(0.001, step_s, 0.0005, 0.0005) == 8
    # ...and stays within its own share too
    assert snaps._interval(0.0001, step_s, 0.0, 0.001) == 8


# == where the next snapshot is counted from, and when one is taken at once =======================
FIXED = RankState(RankSnapshot(enabled=True, every_steps=5, max_overhead_pct=5.0),
                  RankCheckpoint(dir=None, every_steps=100, at_end=False))


class _Taking(Snapshots):
    """Snapshots whose ``take`` only notes the step (no memory, no digest)."""

    def __init__(self, cfg=FIXED, memory=None, sdc=None):
        super().__init__(cfg, memory, sdc)
        self.took = []

    def take(self, state, rank, world, gen, injector=None, final=False):
        self.took.append(state.step)
        self.last_step = state.step
        return 0.0


def _run(snaps, start, stop):
    state = _State()
    for step in range(start + 1, stop + 1):
        state.step = step
        snaps.after_step(state, rank=0, world=1, gen=0, step_s=0.01, first=False, injector=None)
    return snaps.took


def _entered(snaps, step, **agreed):
    snaps.adopt([{"every": 5, **agreed}] * 3, step, from_disk=False)
    return snaps


def test_the_next_snapshot_is_counted_from_the_newest_one_held_not_from_the_entry():
    # entered at step 15, the newest snapshot every rank can be restored from is step 12: due at
    # 17 (counted from each entry, a job failing every few steps never took another one)
    assert _run(_entered(_Taking(), 15, held=12), 15, 30) == [17, 22, 27]
    # nothing held (the memory was lost, and a new one is empty): the first step takes one
    assert _run(_entered(_Taking(), 15, held=None), 15, 27) == [16, 21, 26]
    # ...except at step 0, which a job restart always reaches
    assert _run(_entered(_Taking(), 0, held=None), 0, 11) == [5, 10]
    # a restore that says nothing of it (a reshard, which snapshots at once): from the entry
    assert _run(_entered(_Taking(), 15), 15, 26) == [20, 25]


def test_the_step_where_a_mismatch_was_found_is_compared_again_when_redone():
    # rolled back to 12 for a mismatch found at 14: 14 is compared (and snapshotted) again
    assert _run(_entered(_Taking(), 12, held=12, recheck=14), 12, 25) == [14, 19, 24]
    # a recheck at or before the entry means nothing (the job is past it)
    assert _run(_entered(_Taking(), 12, held=12, recheck=12), 12, 18) == [17]


class _Memory:
    """A node memory that holds what it is told to (``held``), as the keeper lists it."""

    def __init__(self):
        self.held = None

    def steps(self, holder, listing=None):
        return list(self.held) if self.held is not None else []

    def reset(self):
        pass


def test_a_memory_that_lost_the_newest_snapshot_gets_one_at_the_next_agreement():
    memory = _Memory()
    snaps = _Taking(dataclasses.replace(
        FIXED, snapshot=dataclasses.replace(FIXED.snapshot, every_steps=8)), memory)
    snaps.adopt([{"every": 8, "held": None}], 0, from_disk=False)
    state = _State()
    for step in range(1, 31):
        state.step = step
        memory.held = [] if step > 17 else snaps.took[-1:]  # the keeper died after step 17
        snaps.after_step(state, rank=0, world=1, gen=0, step_s=0.01, first=False, injector=None)
    # 8, 16 as due; at step 20 (an agreement: every 20th step) the memory no longer holds 16:
    # one now, rather than at 24; then counted from there
    assert snaps.took == [8, 16, 20, 28]


def test_the_interval_is_agreed_from_steady_costs_only():
    snaps = Snapshots(AUTO, None)
    snaps._first_cost = 0.5  # a promoted spare's first snapshot, into new memory
    assert snaps.cost_s == 0.5 and snaps.schedule()["cost_s"] is None
    snaps._costs.append(0.002)
    assert snaps.schedule()["cost_s"] == 0.002


def test_the_replicas_are_compared_between_snapshots_at_their_own_interval():
    """A corruption is found at the next comparison, not at the next snapshot: the comparisons
    (a digest and an all-gather of three words) have an interval of their own, kept under
    ``detect.sdc.max_overhead_pct`` of the agreed step time, and every snapshot is compared
    besides. Before the costs are agreed, only the snapshots are."""
    sdc = RankSdc(enabled=True, action="replace", max_overhead_pct=0.5, replay_every=0)
    snaps = _Taking(dataclasses.replace(
        FIXED, snapshot=dataclasses.replace(FIXED.snapshot, every_steps=10)), sdc=sdc)
    compared = []
    snaps.digests.check = lambda modules, step, *_, **__: compared.append(step) or 0.0
    snaps.digests._costs.append(0.0001)  # 0.1 ms a check, 10 ms steps: 0.5% is every 2 steps
    assert _run(snaps, 0, 30) == [10, 20, 30]
    assert compared == [10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30]
    # a new generation: the interval from what every rank brought (the same on each)
    snaps.adopt([{"every": 10, "step_s": 0.01, "sdc_s": 0.0002}] * 2, 30, from_disk=False)
    assert snaps.check_every == 4
    snaps.adopt([{"every": 10}, {}], 30, from_disk=False)  # no costs known yet: snapshots only
    assert snaps.check_every is None

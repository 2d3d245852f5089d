"""Which steps are snapshotted (and so compared across replicas, and sent to disk) must be the
same on every rank whatever happens to one rank's memory: a rank that thinks a snapshot is due
alone waits in the comparison while the others step on (a hang)."""

from __future__ import annotations

from nonstop.state.snapshot import Snapshots


class _State:
    sharded = False

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


CFG = {"snapshot": {"enabled": True, "every_steps": 5, "max_overhead_pct": 5.0},
       "checkpoint": {"dir": "/nonexistent/ckpt", "every_steps": 3, "at_end": True}}


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
    cfg = {"snapshot": {"enabled": True, "every_steps": "auto", "max_overhead_pct": 1.0},
           "checkpoint": {"dir": None, "every_steps": 100, "at_end": False}}
    snaps = Snapshots(cfg, None)
    step_s = 0.025  # 1% of it: 0.25 ms a step
    assert snaps._interval(0.001, step_s, 0.0) == 4  # a 1 ms snapshot: every 4 steps
    assert snaps._interval(0.001, step_s, 0.0005) == 6  # ...and its replication
    snaps = Snapshots(cfg, None, sdc={"enabled": True, "action": "replace",
                                      "max_overhead_pct": 0.5})
    # the digest joins the same share (it had one of its own: 1% and 0.5% beside each other)
    assert snaps._interval(0.001, step_s, 0.0005, 0.0005) == 8
    # ...and stays within its own share too
    assert snaps._interval(0.0001, step_s, 0.0, 0.001) == 8

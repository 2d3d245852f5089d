"""Choosing the step every rank resumes from and each rank's source: pure logic, no processes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nonstop.state.plan import NoConsistentState, Offer, plan
from nonstop.state.restore import _without


def sources(p):
    return [(a.source, a.holder) for a in p.actions]


# -- replicated state (data parallel): any clean copy will do ------------------------------------
def test_newest_clean_step_wins_and_the_lowest_rank_sends():
    p = plan([Offer(live=30), Offer(live=31), Offer(live=31), Offer()], sharded=False)
    assert p.step == 31
    assert sources(p) == [("live", 1), ("live", None), ("live", None), ("live", 1)]


def test_a_dirty_rank_offers_no_live_state_and_receives():
    p = plan([Offer(live=None, memory=(29,)), Offer(live=30)], sharded=False)
    assert p.step == 30 and sources(p) == [("live", 1), ("live", None)]


def test_own_memory_is_cheaper_than_a_peer():
    p = plan([Offer(live=12), Offer(memory=(12, 11))], sharded=False)
    assert sources(p) == [("live", None), ("memory", None)]


def test_nobody_with_state_starts_fresh_from_step_0():
    p = plan([Offer(), Offer()], sharded=False)
    assert p.fresh and p.step == 0 and p.sources() == {"live": 2}


def test_everyone_restarted_resumes_from_memory_else_disk():
    p = plan([Offer(live=0, memory=(40, 39), disk=(30,)), Offer(live=0, memory=(40, 39), disk=(30,))],
             sharded=False)
    assert p.step == 40 and p.sources() == {"memory": 2}
    p = plan([Offer(live=0, disk=(30, 20)), Offer(live=0, disk=(30, 20))], sharded=False)
    assert p.step == 30 and p.sources() == {"disk": 2}


# -- sharded state: every rank needs its own shard -----------------------------------------------
def test_sharded_rolls_back_to_the_newest_step_every_shard_has():
    # rank 2 died; its shard exists only as a replica of step 14 on rank 0's node
    offers = [Offer(live=15, memory=(15, 14), replicas={2: (14, 13)}), Offer(live=15, memory=(15, 14)),
              Offer()]
    p = plan(offers, sharded=True)
    assert p.step == 14
    assert sources(p) == [("memory", None), ("memory", None), ("buddy", 0)]


def test_sharded_prefers_a_replica_on_its_own_node_to_one_sent_over_the_network():
    offers = [Offer(live=9, replicas={1: (9,)}), Offer(replicas={1: (9,)})]
    assert sources(plan(offers, sharded=True)) == [("live", None), ("buddy", None)]


def test_a_lost_shard_comes_from_its_own_snapshot_read_by_a_rank_still_on_its_old_node():
    """FSDP x tensor parallel on two nodes: rank 3 dies, and its warm spare runs on node 0. Its
    own snapshot is in node 1's memory, which rank 2 (still on node 1) reads and sends - before
    a buddy's replica, which lags behind it."""
    offers = [Offer(live=4, memory=(4, 3)), Offer(live=4, memory=(4, 3)),
              Offer(live=4, memory=(4, 3), neighbours={3: (4, 3)}, replicas={0: (3,)}),
              Offer()]
    p = plan(offers, sharded=True)
    assert p.step == 4
    assert sources(p) == [("live", None)] * 3 + [("node", 2)]
    # without it, the job could only go back to the buddy's older replica, or nowhere
    offers[2] = Offer(live=4, memory=(4, 3))
    with pytest.raises(NoConsistentState):
        plan(offers, sharded=True)


def test_sharded_never_takes_a_peers_copy():
    with pytest.raises(NoConsistentState):
        plan([Offer(live=9, memory=(9,)), Offer()], sharded=True)


def test_sharded_falls_back_to_disk_when_memory_has_no_common_step():
    offers = [Offer(live=15, memory=(15, 14), disk=(10,)), Offer(memory=(12,), disk=(10,))]
    p = plan(offers, sharded=True)
    assert p.step == 10 and p.sources() == {"disk": 2}


# -- a source that failed is excluded and the plan made again -------------------------------------
def test_a_corrupt_memory_snapshot_is_excluded_and_the_buddy_used():
    offers = [Offer(live=21, memory=(21, 20), replicas={1: (21, 20)}), Offer(memory=(21, 20))]
    p = plan(offers, sharded=True)
    assert sources(p)[1] == ("memory", None) and p.step == 21
    offers = _without(offers, [{"rank": 1, "source": "memory", "offered_by": 1, "step": 21}])
    p = plan(offers, sharded=True)
    assert p.step == 21 and sources(p)[1] == ("buddy", 0)
    offers = _without(offers, [{"rank": 1, "source": "buddy", "offered_by": 0, "step": 21}])
    p = plan(offers, sharded=True)
    assert p.step == 20 and sources(p) == [("memory", None), ("memory", None)]


def test_a_corrupt_checkpoint_step_is_excluded_for_everyone():
    offers = [Offer(live=0, disk=(40, 30)), Offer(live=0, disk=(40, 30))]
    offers = _without(offers, [{"rank": 0, "source": "disk", "offered_by": 0, "step": 40}])
    p = plan(offers, sharded=False)
    assert p.step == 30 and p.sources() == {"disk": 2}


def test_offers_survive_the_wire():
    o = Offer(live=3, memory=(3, 2), replicas={5: (2,)}, disk=(1,))
    assert Offer.from_wire(o.to_wire()) == o


steps = st.frozensets(st.integers(0, 6), max_size=3)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.none() | st.integers(0, 6), steps, steps), min_size=1, max_size=5),
       st.booleans())
def test_every_plan_is_reachable_by_every_rank(rows, sharded):
    offers = [Offer(live=live, memory=tuple(sorted(mem)), disk=tuple(sorted(disk)))
              for live, mem, disk in rows]
    try:
        p = plan(offers, sharded)
    except NoConsistentState:
        # then truly no step is held for every rank
        for step in range(7):
            assert not all((o.live == step or step in o.memory or step in o.disk) or
                           (not sharded and any(x.live == step or step in x.memory for x in offers))
                           for o in offers)
        return
    assert len(p.actions) == len(offers)
    for a in p.actions:
        me = offers[a.rank]
        if a.source == "live" and a.holder is None:
            assert me.live == p.step or p.fresh
        elif a.source == "live":
            assert not sharded
            peer = offers[a.holder]
            assert peer.live == p.step or p.step in peer.memory
        elif a.source == "memory":
            assert p.step in me.memory
        elif a.source == "disk":
            assert p.step in me.disk
    # and it is the newest such step
    newer = [s for s in range(p.step + 1, 7)
             if all((o.live == s or s in o.memory or s in o.disk) for o in offers)]
    assert not newer


def test_held_is_the_newest_step_every_rank_reaches_from_snapshots_alone():
    from nonstop.state.restore import _agreeing, held

    # replicated: a peer's snapshot will do for a rank with none (a new process)
    offers = [Offer(live=20, memory=(15, 10)), Offer(live=20, memory=(15,)), Offer()]
    assert held(offers, sharded=False, cap=20) == 15
    assert held(offers, sharded=False, cap=12) == 12  # never past the step resumed from
    # sharded: the newest step every shard has
    assert held([Offer(memory=(15, 10)), Offer(memory=(10,))], sharded=True, cap=20) == 10
    # live state and disk are not snapshots in memory: nothing held
    assert held([Offer(live=20, disk=(10,)), Offer(live=20)], sharded=False, cap=20) is None
    assert held([Offer(memory=(15,)), Offer(memory=(10,))], sharded=True, cap=20) is None
    # live states that differ at one step: every one of them withdrawn (the odd one's gradients
    # went into the others' updates), and each finding says the step and what each rank held
    out, found = _agreeing([Offer(live=20, memory=(15,)), Offer(live=20), Offer(live=20)],
                           [7, 8, 7])
    assert [o.live for o in out] == [None, None, None]
    assert found == [{"rank": 1, "step": 20, "digests": {"0": 7, "1": 8, "2": 7}}]


def test_a_copy_kept_in_a_process_is_a_source_of_its_step_for_every_rank():
    # the node's memory died with the snapshots of 10: ranks 0 and 1 kept the certified step 12
    # in their processes (the new memory is empty), rank 2 is a new process: it gets 12 from a
    # peer; live state newer than the corruption is not offered
    offers = [Offer(kept=12), Offer(kept=12), Offer()]
    p = plan(offers, sharded=False)
    assert p.step == 12 and [(a.source, a.holder) for a in p.actions] == [
        ("kept", None), ("kept", None), ("live", 0)]
    from nonstop.state.restore import _without, held

    assert held(offers, sharded=False, cap=20) == 12
    # sharded: only a rank's own copy will do
    assert plan([Offer(kept=12), Offer(memory=(12,))], sharded=True).step == 12
    with pytest.raises(NoConsistentState):
        plan([Offer(kept=12), Offer()], sharded=True)
    # a kept copy that failed is not offered again
    out = _without(offers, [{"rank": 2, "source": "live", "offered_by": 0, "step": 12}])
    assert out[0].kept is None and out[1].kept == 12
    assert Offer.from_wire(Offer(live=3, kept=2).to_wire()) == Offer(live=3, kept=2)


# -- sharded state with twins (HSDP): a shard's twin in another replica group is its copy ------
def test_a_lost_shard_comes_live_from_its_twin_not_from_an_older_snapshot():
    # 2 replica groups x 2 shards: rank r holds shard r % 2. Rank 1 is new: its own snapshot is
    # of step 5, its twin (rank 3) is live at step 9.
    twins = (0, 1, 0, 1)
    offers = [Offer(live=9), Offer(memory=(5,)), Offer(live=9), Offer(live=9)]
    p = plan(offers, sharded=True, twins=twins)
    assert p.step == 9 and sources(p) == [("live", None), ("live", 3), ("live", None),
                                          ("live", None)]
    # without twins (plain FSDP) the same offers roll every rank back to the snapshot... which
    # only rank 1 has: nothing common
    with pytest.raises(NoConsistentState, match="each shard exists only once"):
        plan(offers, sharded=True)


def test_a_twin_is_never_taken_from_another_shard_position():
    # rank 1's only live peers hold shard 0: it must roll back with everyone to its snapshot
    twins = (0, 1, 0, 1)
    offers = [Offer(live=9, memory=(5,)), Offer(memory=(5,)), Offer(live=9, memory=(5,)),
              Offer(memory=(5,))]
    p = plan(offers, sharded=True, twins=twins)
    assert p.step == 5 and sources(p) == [("memory", None)] * 4


def test_twins_must_name_every_rank():
    with pytest.raises(ValueError, match="2 ranks, not of 3"):
        plan([Offer(live=1)] * 3, sharded=True, twins=(0, 1))


def test_a_sharded_restore_lists_only_the_snapshots_of_its_own_world_size():
    """A node memory's listing, as a sharded restore sees it: a snapshot counts for the world
    size of the generation it was taken in, and one of another size is left out (only a
    reshard reads it); one of a generation too old to be known stays (its check decides)."""
    from nonstop.protocol.keeper_messages import HolderEntry
    from nonstop.state.restore import _of_world
    from nonstop.state.shm import SlotInfo

    def slot(step, gen):
        return SlotInfo(seq=step, step=step, meta_len=1, data_len=1, checksum=0, written_at=0.0,
                        rank=0, gen=gen)

    listing = {"r0": HolderEntry(slots=[slot(10, 0), slot(12, 1)], replicated_step=None,
                                 repl_s=None, repl_error=None, buddies=[]),
               "r1": HolderEntry(slots=[slot(5, 7), None], replicated_step=None, repl_s=None,
                                 repl_error=None, buddies=[])}
    mine = _of_world(listing, {0: 4, 1: 2}, 2)
    assert [s.step if s else None for s in mine["r0"].slots] == [None, 12]
    assert [s.step if s else None for s in mine["r1"].slots] == [5, None]  # gen 7: unknown
    assert [s.step for s in listing["r0"].slots] == [10, 12]  # the listing itself unchanged


# -- departure snapshots: a step kept in node memory as a rank left a failed generation ---------
def test_a_lost_twins_departure_snapshot_is_the_step_and_a_corruption_never_goes_back_to_it():
    """(dp, pp) = (2, 2): stage 0 is held by ranks 0 and 2. Rank 0 was lost, then rank 2 during
    the recovery; both are new processes. Rank 2 had kept step 8 in its node's memory as it left
    (a departure snapshot): the plan resumes at 8, rank 2 from its memory, rank 0 from rank 2's
    copy. Whatever a corruption rolls back to, and what the next snapshot is counted from
    (``held``), is a periodic snapshot: step 5."""
    from nonstop.state.restore import checked, held

    twins = (0, 1, 0, 1)
    offers = [Offer(memory=(5,)), Offer(live=8, memory=(5,)),
              Offer(memory=(8, 5), unchecked={2: (8,)}), Offer(live=8, memory=(5,))]
    p = plan(offers, sharded=True, twins=twins)
    assert p.step == 8 and sources(p) == [("live", 2), ("live", None), ("memory", None),
                                          ("live", None)]
    assert held(offers, sharded=True, cap=8, twins=twins) == 5
    assert [o.memory for o in checked(offers)] == [(5,), (5,), (5,), (5,)]
    # a neighbour's or a replica's departure snapshot, by the rank whose state it is
    near = Offer(neighbours={2: (8, 5), 3: (8,)}, replicas={2: (8,)}, unchecked={2: (8,)})
    assert near.checked(0) == Offer(neighbours={2: (5,), 3: (8,)}, replicas={2: ()})
    assert Offer.from_wire(offers[2].to_wire()) == offers[2]


def test_a_node_memorys_departure_snapshots_are_named_and_left_out_after_a_corruption():
    from nonstop.protocol.keeper_messages import HolderEntry
    from nonstop.state.restore import _departures, without_departures
    from nonstop.state.shm import SlotInfo

    def slot(step, departure=False):
        return SlotInfo(seq=step, step=step, meta_len=1, data_len=1, checksum=0, written_at=0.0,
                        rank=0, gen=0, departure=departure)

    def entry(*slots):
        return HolderEntry(slots=list(slots), replicated_step=None, repl_s=None, repl_error=None,
                           buddies=[])

    listing = {"r0": entry(slot(10), slot(12, True)), "rep3": entry(slot(12, True), None),
               "r1": entry(slot(10), slot(5))}
    assert _departures(listing) == {0: (12,), 3: (12,)}
    kept = without_departures(listing)
    assert [s.step if s else None for s in kept["r0"].slots] == [10, None]
    assert [s.step if s else None for s in kept["rep3"].slots] == [None, None]
    assert kept["r1"] == listing["r1"]


def test_a_rank_whose_copy_arrived_holds_the_plans_step_in_the_next_attempt():
    """A plan's attempt failed for one rank (its copy was bad): every other rank that received
    or read its state holds the plan's step from then on - offered as it was before, a rank
    brought to step 9 and given an older plan's "live" would keep step 9's tensors."""
    from nonstop.state.restore import _holding

    offers = [Offer(live=9), Offer(live=7), Offer(memory=(9,)), Offer(memory=(9,))]
    p = plan(offers, sharded=False)
    assert p.step == 9 and sources(p) == [("live", None), ("live", 0), ("memory", None),
                                          ("memory", None)]
    failed = [{"rank": 3, "source": "memory", "offered_by": 3, "step": 9, "why": "checksum"}]
    after = _holding(_without(offers, failed), p, failed)
    assert [o.live for o in after] == [9, 9, 9, None] and after[3].memory == ()


def test_the_route_of_a_restore_by_layout_and_world_size():
    """Which way a rank's state comes back (``state.plan.route``, pure): at this world size for
    replicated state and for a mesh whose twins hold each part whole; merged from every old shard
    for ZeRO-1 last trained at another size (a new job: its checkpoint's size); regridded for a
    mesh sharded along the dimension that changed."""
    from nonstop.state.plan import Route, route

    asked = []

    def disk(size):
        return lambda: asked.append(size) or size

    def way(sharded, meshed, twins, reshard_from=0, initial=False, on_disk=0):
        return route(world=4, sharded=sharded, meshed=meshed, twins=twins,
                     reshard_from=reshard_from, initial=initial, disk_world=disk(on_disk))

    assert way(False, False, False, reshard_from=2) == Route()  # DDP: any peer's copy
    assert way(True, True, True, reshard_from=2) == Route()  # HSDP: a twin holds the part
    zero = way(True, False, False, reshard_from=2)
    assert zero == Route(old_world=2) and zero.resharded(4)
    assert not way(True, False, False, reshard_from=4).resharded(4)  # the same size: a restore
    fsdp = way(True, True, False, reshard_from=8)
    assert fsdp == Route(old_world=8, regrid=True) and fsdp.resharded(4)
    assert asked == []  # the disk is read only for a new ZeRO-1 job
    assert way(True, False, False, initial=True, on_disk=2) == Route(old_world=2)
    assert way(True, False, False, initial=True, on_disk=0) == Route()
    assert way(True, True, False, initial=True, on_disk=2) == Route(regrid=True)  # DCP's own
    assert asked == [2, 0]

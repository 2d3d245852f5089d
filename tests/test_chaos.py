"""The chaos soak: a seeded schedule of faults of every kind thrown at one job (real processes);
it completes with the fault-free weights, every incident closed, nothing left running."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from nonstop_bench.chaos import (FIRST, GAP, KINDS, ONCE, SNAPSHOT_EVERY, needed, passed, policy,
                                  schedule, steps_lost_bound)


def test_the_same_seed_gives_the_same_schedule_and_every_kind_comes_before_a_repeat():
    n = len(KINDS)
    a, b, c = schedule(7, n, 3, needed(n)), schedule(7, n, 3, needed(n)), schedule(8, n, 3, needed(n))
    assert a == b and a != c
    assert sorted(f["kind"] for f in a) == sorted(KINDS)  # as many faults as kinds: each once
    steps = [f["step"] for f in a]
    assert steps == sorted(steps) and steps[0] >= FIRST
    assert all(y - x >= GAP for x, y in zip(steps, steps[1:]))
    many = schedule(1, 30, 4, needed(30))
    assert all(sum(f["kind"] == k for f in many) <= 1 for k in ONCE)
    for f in many:  # two ranks at once are two distinct ranks
        if f["kind"] == "crash_two":
            r1, r2 = (int(p.split("rank=")[1].split(",")[0]) for p in f["spec"].split(";"))
            assert r1 != r2


def _left(t, step, certified, certified_t):
    return {"type": "rank_left", "t": t, "step": step,
            "sdc": {"certified": certified, "certified_t": certified_t}}


def test_steps_lost_are_held_to_none_but_for_a_corruption_the_steps_since_its_certified_snapshot():
    inc = lambda i, t, before, lost, gens: {  # noqa: E731
        "type": "incident", "id": i, "t_fault": t, "step_before": before, "steps_lost": lost,
        "gen_from": gens[0], "gen_to": gens[1], "faults": ["..."]}
    events = [
        _left(1.0, 10, 10, 0.9), inc(1, 1.0, 12, 0, (0, 1)),  # a crash: none lost
        _left(2.0, 30, 30, 1.9),
        {"type": "fault", "kind": "sdc", "incident": 2, "t": 2.0},
        inc(2, 2.0, 40, 10, (1, 2)),  # found at a check: back to 30, the newest certified
        {"type": "restore", "gen": 4, "step": 30,
         "skipped": [{"rank": 1, "cause": "sdc", "why": "its parameters differ from its replicas'"}]},
        inc(3, 3.0, 45, 15, (3, 4)),  # found at a restore: 15 since 30
        {"type": "node_memory_lost", "t": 3.5},  # the memory, and the snapshot of 30, gone
        {"type": "fault", "kind": "sdc", "incident": 4, "t": 4.0},
        inc(4, 3.4, 50, 50, (4, 5)),  # nothing certified left: all of it may go (timed from
        # an injection before the memory died; found after it)
        inc(5, 5.0, 60, 2, (5, 6)),  # a fault that is no corruption lost 2: broken
    ]
    bound = steps_lost_bound(events)
    rows = {r["id"]: r for r in bound["incidents"]}
    assert [rows[i]["corruption"] for i in range(1, 6)] == [False, True, True, True, False]
    assert (rows[2]["bound"], rows[3]["bound"], rows[4]["bound"]) == (10, 15, 50)
    assert rows[2]["certified"] == 30 and rows[4]["certified"] is None
    assert not bound["held"] and [b["id"] for b in bound["broken"]] == [5]
    assert steps_lost_bound(events[:-1])["held"]


def test_faults_that_took_every_process_holding_the_state_may_lose_the_steps_since_a_snapshot():
    gen = lambda g, ranks: {"type": "generation", "gen": g, "ranks": ranks}  # noqa: E731
    inc = lambda i, levels, gens: {  # noqa: E731
        "type": "incident", "id": i, "t_fault": 2.0, "step_before": 15, "steps_lost": 3,
        "levels": levels, "gen_from": gens[0], "gen_to": gens[1]}
    events = [_left(1.0, 12, 12, 0.9), gen(0, {"0": 1, "1": 2, "2": 3}),
              # rank 0 crashed, rank 1 in the teardown, rank 2 in the restore: no live state
              gen(3, {"0": 6, "1": 5, "2": 7}), inc(1, ["rank replacement"] * 3, (0, 3)),
              # rank 1 survived: its live state was there to resume from
              gen(4, {"0": 8, "1": 5, "2": 9}), inc(2, ["rank replacement"], (3, 4)),
              # a job restart threw the live state away
              gen(5, {"0": 10, "1": 11, "2": 12}), inc(3, ["job restart"], (4, 5))]
    rows = {r["id"]: r for r in steps_lost_bound(events)["incidents"]}
    assert rows[1]["every_process_lost"] and rows[1]["bound"] == 3
    assert not rows[2]["every_process_lost"] and rows[2]["bound"] == 0
    assert not rows[3]["every_process_lost"] and rows[3]["bound"] == 0


def test_the_soak_snapshots_often_enough_for_every_snapshot_fault_to_fire_and_fails_otherwise():
    from nonstop.policy import load_text

    assert SNAPSHOT_EVERY < GAP
    assert load_text(policy(), "soak").state.snapshot.every_steps == SNAPSHOT_EVERY
    assert load_text(policy("auto"), "soak").state.snapshot.every_steps == "auto"
    ok = {"completed": True, "params_match_reference": True, "orphans": 0, "unfired": [],
          "steps_lost_bound": {"held": True}}
    assert passed(ok)
    assert not passed({**ok, "unfired": ["corrupt_snapshot"]})
    assert not passed({**ok, "steps_lost_bound": {"held": False}})


@pytest.mark.integration
def test_a_ten_fault_schedule_leaves_the_weights_and_nothing_behind(tmp_path):
    out = subprocess.run([sys.executable, "-m", "nonstop", "chaos", "--faults", "10", "--seed", "1",
                          "--json", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=900)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0, out.stderr[-4000:]
    assert result["completed"] and result["params_match_reference"], result
    assert result["orphans"] == 0 and result["faults"] == 10
    assert result["incidents"] >= 5 and result["incidents_closed"] == result["incidents"], result
    assert not result["unfired"] and all(k["fired"] == k["scheduled"]
                                         for k in result["by_kind"].values()), result["by_kind"]
    assert result["steps_lost_bound"]["held"], result["steps_lost_bound"]
    assert "steps lost" in out.stderr

"""The chaos soak: a seeded schedule of faults of every kind thrown at one job (real processes);
it completes with the fault-free weights, every incident closed, nothing left running."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from nonstop.bench.chaos import FIRST, GAP, KINDS, ONCE, needed, schedule


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
    assert sum(k["fired"] for k in result["by_kind"].values()) >= 8, result["by_kind"]

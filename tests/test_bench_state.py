"""``nonstop bench state``: its job restart measurement at a tiny size (the full-size numbers,
against torchrun, are the benchmark's, in docs/benchmarks.md), and its input checks."""

from __future__ import annotations

import pytest

import json
import subprocess

from conftest import nonstop_cmd
from test_cli import assert_one_line_error

TINY = ["--hidden", "64", "--layers", "2", "--steps", "30", "--kill-step", "15", "--repeat", "1",
        "--ranks", "2", "--phases", "restart", "--systems", "nonstop"]


@pytest.mark.integration
def test_bench_state_job_restart_loses_nothing(tmp_path):
    proc = subprocess.run(nonstop_cmd("bench", "state", "--json", "--out", str(tmp_path), *TINY),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["scenario"] == "state" and res["ranks"] == 2
    assert res["params"] == 32 * 64 + 64 + 2 * (64 * 64 + 64) + 64 + 1
    assert res["snapshot"] == {} and res["restore"] == {}  # not asked for
    (ns,) = res["job_restart"]  # torchrun's side is bench crash's, tested with it
    assert ns["system"] == "nonstop"
    assert ns["lost_steps"]["max"] == 0 and ns["params_match_reference"], ns
    assert ns["runs"][0]["levels"] == ["job restart"]
    assert ns["runs"][0]["restore_sources"] == [{"0": "memory", "1": "memory"}]
    assert ns["mttr_s"]["median"] > 0
    assert res["targets"]["zero_lost_from_memory"] is True


@pytest.mark.integration
def test_bench_state_bad_input():
    proc = subprocess.run(nonstop_cmd("bench", "state", "--ranks", "3"), capture_output=True,
                          text=True, timeout=60)
    assert_one_line_error(proc, "--ranks must be even")
    proc = subprocess.run(nonstop_cmd("bench", "state", "--phases", "snapshots"),
                          capture_output=True, text=True, timeout=60)
    assert_one_line_error(proc, "--phases takes snapshot, restore, restart")


def test_the_spare_pool_refill_is_timed_from_the_fault_to_a_new_spare_ready(tmp_path):
    import json

    from nonstop_bench.common import spare_refill_s

    evs = [{"t": 1.0, "type": "spawn", "wid": 3, "spare": True},   # the spare of the start
           {"t": 2.0, "type": "rank_ready", "wid": 3},
           {"t": 5.0, "type": "rank_inject", "wid": 1},              # the fault
           {"t": 5.1, "type": "spawn", "wid": 4, "spare": False},
           {"t": 5.2, "type": "spawn", "wid": 5, "spare": True},     # the pool's refill
           {"t": 5.3, "type": "rank_ready", "wid": 4},
           {"t": 5.9, "type": "rank_ready", "wid": 5}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evs))
    assert spare_refill_s(tmp_path, 5.0) == 0.9
    assert spare_refill_s(tmp_path, 6.0) is None  # no spare started after that

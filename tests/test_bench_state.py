"""``nonstop bench state`` at a tiny size: the JSON it prints, the restore sources it meant to use,
and a job restart that loses no step; its numbers are checked by the full-size run, not here."""

from __future__ import annotations

import json
import subprocess

from conftest import nonstop_cmd
from test_cli import assert_one_line_error

TINY = ["--hidden", "64", "--layers", "2", "--state-steps", "12", "--steps", "30",
        "--kill-step", "15", "--repeat", "1", "--ranks", "2"]


def test_bench_state_tiny(tmp_path):
    proc = subprocess.run(nonstop_cmd("bench", "state", "--json", "--out", str(tmp_path), *TINY),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["scenario"] == "state" and res["ranks"] == 2
    assert res["params"] == 32 * 64 + 64 + 2 * (64 * 64 + 64) + 64 + 1
    snap = res["snapshot"]
    assert snap["exit_code_without"] == 0 and snap["exit_code_with"] == 0
    for key in ("interval_steps", "overhead_pct", "self_reported_pct", "cost_s", "step_s_without",
                "step_s_with"):
        assert snap[key] is not None, key
    assert snap["interval_steps"] >= 1 and res["step_s"] == snap["step_s_without"] > 0
    for kind in ("memory", "buddy", "disk"):
        r = res["restore"][kind]
        assert r["exit_code"] == 0 and r["source_ok"], (kind, r)
        assert res["restore_sources"][kind] == kind
        assert res["restore_s"][kind] > 0 and res["restore_bytes"][kind] > 0
    assert res["restore"]["disk"]["checkpoint_step"] and not res["restore"]["disk"]["outlived_launcher"]
    assert res["memory_vs_disk"] > 0
    by = {r["system"]: r for r in res["job_restart"]}
    assert set(by) == {"nonstop", "torchrun"}
    ns, tr = by["nonstop"], by["torchrun"]
    assert ns["lost_steps"]["max"] == 0 and ns["params_match_reference"], ns
    assert ns["runs"][0]["levels"] == ["job restart"]
    assert ns["runs"][0]["restore_sources"] == [{"0": "memory", "1": "memory"}]
    assert ns["mttr_s"]["median"] > 0 and tr["mttr_s"]["median"] > 0
    assert tr["params_match_reference"] and tr["lost_steps"]["max"] == 15  # no checkpoint yet
    assert res["targets"]["zero_lost_from_memory"] is True
    assert set(res["targets"]) == {"overhead_le_5pct", "zero_lost_from_memory",
                                   "memory_10x_faster_than_disk"}
    assert res["date"]


def test_bench_state_bad_input():
    proc = subprocess.run(nonstop_cmd("bench", "state", "--ranks", "3"), capture_output=True,
                          text=True, timeout=60)
    assert_one_line_error(proc, "--ranks must be even")

"""``nonstop bench state``: its job restart measurement at a tiny size (the full-size numbers,
against torchrun, are the benchmark's, in docs/benchmarks.md), and its input checks."""

from __future__ import annotations

import json
import subprocess

from conftest import nonstop_cmd
from test_cli import assert_one_line_error

TINY = ["--hidden", "64", "--layers", "2", "--steps", "30", "--kill-step", "15", "--repeat", "1",
        "--ranks", "2", "--phases", "restart", "--systems", "nonstop"]


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


def test_bench_state_bad_input():
    proc = subprocess.run(nonstop_cmd("bench", "state", "--ranks", "3"), capture_output=True,
                          text=True, timeout=60)
    assert_one_line_error(proc, "--ranks must be even")
    proc = subprocess.run(nonstop_cmd("bench", "state", "--phases", "snapshots"),
                          capture_output=True, text=True, timeout=60)
    assert_one_line_error(proc, "--phases takes snapshot, restore, restart")

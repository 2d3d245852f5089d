"""``nonstop bench hosts``: one short run of its fastest case across test hosts (the full bench,
every case against torchrun, is the benchmark's, in docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import nonstop_cmd

from nonstop_bench import netns

pytestmark = pytest.mark.integration

ok, why = netns.available()
if not ok:
    pytest.skip(f"test hosts unavailable: {why}", allow_module_level=True)


def test_bench_hosts_rank_crash_smoke(tmp_path):
    proc = subprocess.run(
        nonstop_cmd("bench", "hosts", "--json", "--repeat", "1", "--cases", "rank_crash,startup",
                    "--systems", "nonstop", "--steps", "60", "--kill-step", "20",
                    "--hosts", "2", "--ranks-per-host", "1", "--spare-hosts", "0",
                    "--sleep-ms", "10", "--out", str(tmp_path)),
        capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["scenario"] == "hosts"
    assert (res["hosts"], res["ranks_per_host"], res["lease_ttl_s"]) == (2, 1, 2)
    r, start = res["results"]
    assert (r["case"], r["system"]) == ("rank_crash", "nonstop")
    assert set(r) >= {"mttr_s", "lost_steps", "max_step_gap_s", "split_brain",
                      "params_match_reference"}
    assert r["params_match_reference"] is True, proc.stderr[-3000:]
    assert r["split_brain"] is False
    assert r["lost_steps"]["max"] == 0
    assert r["mttr_s"]["median"] is not None and r["max_step_gap_s"] is not None
    (run,) = r["runs"]
    assert run["levels"] == ["rank replacement"] and run["victim_is_controller_host"] is False
    # start-up: every host at once, its phases in order, beside the same job on one host
    assert start["case"] == "startup" and start["params_match_reference"] is True
    for phases in (start["startup_s"], res["startup_one_host_s"]):
        order = [phases[p] for p in ("in_office", "spawned", "entered", "first_step")]
        assert None not in order and order == sorted(order) and order[0] > 0, phases
    across = start["startup_s"]
    assert across["registered"] > 0 and across["elected"] <= across["in_office"] + 0.5, across
    # the CPU the job had used at its first step: two hosts' processes against one host's (not
    # a fixed floor: zygotes forked from a template, and their ranks, are not the job's children)
    assert across["cpu_s"] > res["startup_one_host_s"]["cpu_s"] > 0, (across, res)
    assert res["targets"]["startup_across_hosts_minus_one_host_s"] == round(
        across["first_step"] - res["startup_one_host_s"]["first_step"], 3)

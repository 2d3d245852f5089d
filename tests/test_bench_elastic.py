"""``nonstop bench elastic`` at a tiny size (the full-size numbers, against torchrun, are the
benchmark's, in docs/benchmarks.md): its JSON, and its input checks."""

from __future__ import annotations

import json
import subprocess

from conftest import nonstop_cmd
from test_cli import assert_one_line_error


def test_bench_elastic_scale_in_reports(tmp_path):
    proc = subprocess.run(nonstop_cmd("bench", "elastic", "--json", "--out", str(tmp_path),
                                      "--ranks", "2", "--steps", "100", "--kill-step", "20",
                                      "--repeat", "1", "--grow-after", "0",
                                      "--systems", "nonstop-scale-in"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["scenario"] == "elastic" and res["ranks"] == 2
    (r,) = res["results"]
    assert r["system"] == "nonstop-scale-in" and r["lost_steps"]["max"] == 0
    assert 0 < r["mttr_s"]["median"] < 5
    assert r["samples_exactly_once"] and r["global_batch_constant"]
    assert 0 < r["final_params_max_rel_diff"] < 1e-5  # not bitwise (another world), close


def test_bench_elastic_bad_input():
    proc = subprocess.run(nonstop_cmd("bench", "elastic", "--systems", "slurm"),
                          capture_output=True, text=True, timeout=60)
    assert_one_line_error(proc, "unknown system(s) slurm")
    proc = subprocess.run(nonstop_cmd("bench", "elastic", "--hosts", "1"), capture_output=True,
                          text=True, timeout=60)
    assert_one_line_error(proc, "--hosts must be at least 2")

"""``nonstop bench elastic``: its input checks. Its runs take a minute and more, so they are the
benchmark's, recorded with their JSON in docs/benchmarks.md; the behaviour they measure is tested
in test_scale.py and test_hosts_elastic.py."""

from __future__ import annotations

import pytest

import subprocess

from conftest import nonstop_cmd
from test_cli import assert_one_line_error

pytestmark = pytest.mark.integration  # starts processes


def test_bench_elastic_bad_input():
    proc = subprocess.run(nonstop_cmd("bench", "elastic", "--systems", "slurm"),
                          capture_output=True, text=True, timeout=60)
    assert_one_line_error(proc, "unknown system(s) slurm")
    proc = subprocess.run(nonstop_cmd("bench", "elastic", "--hosts", "1"), capture_output=True,
                          text=True, timeout=60)
    assert_one_line_error(proc, "--hosts must be at least 2")
    proc = subprocess.run(nonstop_cmd("bench", "elastic", "--parallel", "ddp,tp"),
                          capture_output=True, text=True, timeout=60)
    assert_one_line_error(proc, "--parallel: unknown layout(s) tp")
    proc = subprocess.run(nonstop_cmd("bench", "elastic", "--hosts", "2", "--parallel", "pp"),
                          capture_output=True, text=True, timeout=60)
    assert_one_line_error(proc, "bench elastic --hosts runs the ddp layout")

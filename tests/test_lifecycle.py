"""The launcher's own life: signals end every process; nothing outlives a killed launcher."""

from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import TRAIN, assert_none_left, finish, start, wait_for_event

pytestmark = pytest.mark.integration


def test_sigterm_ends_every_process(tmp_path):
    t0 = time.time()
    proc = start(tmp_path / "run", "--nproc=2", "--spares=1", str(TRAIN), "--steps", "100000")
    wait_for_event(tmp_path / "run", lambda e: e["type"] == "rank_first_step")
    os.kill(proc.pid, signal.SIGTERM)
    run = finish(proc, tmp_path / "run", t0, timeout=60)
    assert run.code == 128 + signal.SIGTERM
    assert "interrupted by SIGTERM" in run.stderr
    assert run.of("interrupted") and run.of("run_end")


def test_nothing_outlives_a_killed_launcher(tmp_path):
    t0 = time.time()
    proc = start(tmp_path / "run", "--nproc=2", "--spares=1", str(TRAIN), "--steps", "100000")
    wait_for_event(tmp_path / "run", lambda e: e["type"] == "rank_first_step")
    wait_for_event(tmp_path / "run", lambda e: e["type"] == "rank_ready")
    os.kill(proc.pid, signal.SIGKILL)
    finish(proc, tmp_path / "run", t0, timeout=30)
    assert_none_left(timeout=10)  # ranks and spares die with their launcher


def test_fault_free_run_reports_its_progress(tmp_path):
    out = tmp_path / "final.pt"
    t0 = time.time()
    proc = start(tmp_path / "run", "--nproc=2", str(TRAIN), "--steps", "30", "--save", str(out))
    run = finish(proc, tmp_path / "run", t0)
    assert run.code == 0 and out.exists()
    s = run.summary
    assert s["incidents"] == 0 and s["steps"] == 30 and 0 < s["goodput"] <= 1
    firsts = run.of("rank_first_step")
    assert {e["rank"] for e in firsts} == {0, 1}
    assert [e["type"] for e in run.events][-1] == "run_end"

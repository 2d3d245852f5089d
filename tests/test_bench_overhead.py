"""``nonstop bench overhead``'s arithmetic (pure): the paired figure is the median of each turn's
runs against each other, so a machine drifting between turns does not move it."""

import os

import pytest

from nonstop_bench.overhead import _paired, _pct, mean_step, table


def _runs(*steps):
    return [{"step_s": s} for s in steps]


def test_the_paired_overhead_is_each_turns_ratio_then_their_median():
    # the machine slows by 10% from turn to turn: the medians of each system see 1.7%, the
    # turns each see 1% (and a failed run drops its turn only)
    plain = _runs(0.040, 0.044, 0.0484, None)
    nonstop = _runs(0.0404, 0.04444, 0.048884, 0.05)
    assert _pct(0.04444, 0.044) == 1.0
    assert _paired(nonstop, plain) == 1.0
    assert _paired(None, plain) is None and _paired(nonstop, _runs(None)) is None


def test_the_mean_step_skips_the_first_fifth():
    rows = [(s, 0.01 * s + (0.5 if s < 2 else 0.0), 0) for s in range(10)]
    assert abs(mean_step(rows) - 0.01) < 1e-9
    assert mean_step(rows[:5]) is None


def test_a_run_of_one_system_prints_its_column_and_dashes_for_the_others():
    """``--systems nonstop`` alone: no plain step to compare with, no KeyError at the table."""


    row = table([{"step_ms": 25.0, "nonstop_s": 0.0412, "overhead_pct": None,
                  "reproducible_overhead_pct": None}]).splitlines()[-1]
    assert row.startswith("| 25 ms | - | 0.0412 | -% |"), row


@pytest.mark.integration
def test_a_bench_ended_by_sigterm_ends_its_running_job():
    """SIGTERM to ``nonstop bench`` while its job runs: the bench exits 143 and takes the job
    (its launcher, and what the launcher started) with it - none is left running alone."""
    import signal
    import subprocess
    import time

    from conftest import kill_left, nonstop_cmd, processes_below, still_running

    proc = subprocess.Popen(nonstop_cmd("bench", "overhead", "--systems", "nonstop", "--ranks",
                                        "2", "--step-ms", "25", "--steps", "2000",
                                        "--repeat", "1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    below: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(below) < 2:  # the launcher and its keeper
            time.sleep(0.2)
            below = processes_below(proc.pid)
        assert len(below) >= 2, below
        time.sleep(2)  # its ranks starting
        below |= processes_below(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
        assert not still_running(below), "the bench's job still runs"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        kill_left(below)  # (only where the test failed: its job, ended by pid)

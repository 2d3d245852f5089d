"""Node health checks with real subprocesses; NVML skipped cleanly without a GPU."""

from __future__ import annotations

import os
import time

from nonstop.health import HealthMonitor
from nonstop.policy import HealthCheck


def poll_until(mon, n, timeout=10.0):
    results, deadline = [], time.time() + timeout
    while len(results) < n and time.time() < deadline:
        results += mon.poll(time.time())
        time.sleep(0.02)
    return results


def test_passing_failing_and_per_node_checks():
    checks = [HealthCheck(name="ok", command="true", every_s=60),
              HealthCheck(name="bad", command="echo disk full; exit 3", every_s=60),
              HealthCheck(name="node", command='test "$NONSTOP_NODE" != 1', every_s=60)]
    mon = HealthMonitor(checks, [0, 1], nvml="off")
    try:
        results = {(r.check, r.node): r for r in poll_until(mon, 6)}
    finally:
        mon.close()
    assert results[("ok", 0)].ok and results[("ok", 1)].ok
    bad = results[("bad", 0)]
    assert not bad.ok and bad.code == 3 and "disk full" in bad.detail
    assert results[("node", 0)].ok and not results[("node", 1)].ok


def test_timeout_kills_the_check(tmp_path):
    pid_file = tmp_path / "pid"
    mon = HealthMonitor([HealthCheck(name="slow", command=f"echo $$ > {pid_file}; exec sleep 30",
                                     timeout_s=0.3)], [0], nvml="off")
    try:
        t0 = time.time()
        assert mon.poll(t0) == []
        assert time.time() - t0 < 0.1  # never blocks
        (r,) = poll_until(mon, 1)
    finally:
        mon.close()
    assert not r.ok and r.code is None and "timed out" in r.detail
    assert not os.path.exists(f"/proc/{int(pid_file.read_text())}")


def test_cadence_missing_command_remove_node_and_close(tmp_path):
    mon = HealthMonitor([HealthCheck(name="c", command="true", every_s=0.3)], [0], nvml="off")
    try:
        first = poll_until(mon, 1)
        assert len(first) == 1
        assert mon.poll(time.time()) == []  # not due again yet
        time.sleep(0.4)
        assert len(poll_until(mon, 1)) == 1
    finally:
        mon.close()
    missing = HealthMonitor([HealthCheck(name="m", command="/no/such/command")], [0], nvml="off")
    try:
        (r,) = poll_until(missing, 1)
        assert not r.ok
    finally:
        missing.close()
    pid_file = tmp_path / "pid"
    running = HealthMonitor([HealthCheck(name="s", command=f"echo $$ > {pid_file}; exec sleep 30")],
                            [0, 1], nvml="off")
    running.poll(time.time())
    deadline = time.time() + 5
    while not pid_file.exists() and time.time() < deadline:
        time.sleep(0.02)
    running.remove_node(0)
    running.remove_node(1)
    assert running.poll(time.time()) == []
    running.close()


def test_nvml_is_skipped_cleanly_without_a_gpu():
    mon = HealthMonitor([], [0], nvml="auto")
    assert "skipped" in mon.nvml_status or "checked" in mon.nvml_status
    if "skipped" in mon.nvml_status:
        assert mon.poll(time.time()) == []
    assert "off" in HealthMonitor([], [0], nvml="off").nvml_status

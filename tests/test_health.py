"""Node health checks with real subprocesses (results, timeouts, cadence, ending them) and NVML:
skipped cleanly on this machine, and checked through a stand-in pynvml module."""

from __future__ import annotations

import os
import sys
import time
import types
from pathlib import Path

import pytest

from nonstop.agent.health import NVML_EVERY_S, HealthMonitor, HealthResult
from nonstop.policy import HealthCheck


def results_of(mon: HealthMonitor, now: float | None = None, n: int = 1,
               timeout: float = 5.0) -> list[HealthResult]:
    """Poll until n results came; ``now`` fixed (a fake clock) or, when None, the real time."""
    got: list[HealthResult] = []
    deadline = time.time() + timeout
    while len(got) < n:
        assert time.time() < deadline, f"only {got} after {timeout} s"
        got += mon.poll(time.time() if now is None else now)
        time.sleep(0.01)
    return got


def wait_for(path: Path, timeout: float = 5.0) -> str:
    deadline = time.time() + timeout
    while not (path.exists() and path.read_text().strip()):
        assert time.time() < deadline, f"{path} never written"
        time.sleep(0.01)
    return path.read_text().strip()


def alive(pid: int) -> bool:
    """A process that still runs (a zombie re-parented to init only waits for init to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def check(name: str, command: str, every_s: float = 60.0, timeout_s: float = 10.0) -> HealthCheck:
    return HealthCheck(name=name, command=command, every_s=every_s, timeout_s=timeout_s)


@pytest.mark.integration
def test_passing_failing_and_per_node_checks():
    checks = [check("ok", "true"),
              check("bad", "echo starting; echo disk full >&2; exit 3"),
              check("node", 'test "$NONSTOP_NODE" != 1'),
              check("who", 'echo "$NONSTOP_CHECK on $NONSTOP_NODE with $MARK"')]
    mon = HealthMonitor(checks, [0, 1], nvml="off", env={**os.environ, "MARK": "x"})
    try:
        got = {(r.check, r.node): r for r in results_of(mon, now=5.0, n=8)}
    finally:
        mon.close()
    assert got[("ok", 0)].ok and got[("ok", 1)].ok and got[("ok", 0)].code == 0
    bad = got[("bad", 1)]
    assert (bad.ok, bad.code, bad.detail, bad.t) == (False, 3, "exit 3: disk full", 5.0)
    assert got[("node", 0)].ok and not got[("node", 1)].ok and got[("node", 1)].code == 1
    assert got[("who", 1)].detail == "exit 0: who on 1 with x"


@pytest.mark.integration
def test_timeout_kills_and_reaps_the_check(tmp_path):
    pid_file = tmp_path / "pid"
    mon = HealthMonitor([check("slow", f"echo $$ > {pid_file}; exec sleep 30", timeout_s=0.3)],
                        [0], nvml="off")
    try:
        assert mon.poll(100.0) == []
        pid = int(wait_for(pid_file))
        assert mon.poll(100.25) == [] and alive(pid)  # not overdue yet
        (r,) = mon.poll(100.5)
        assert not os.path.exists(f"/proc/{pid}")  # killed and reaped, not even a zombie
        assert (r.ok, r.code, r.detail, r.seconds) == (False, None, "timed out after 0.3 s", 0.5)
    finally:
        mon.close()


@pytest.mark.integration
def test_what_a_finished_check_left_running_is_killed(tmp_path):
    pid_file = tmp_path / "pid"
    mon = HealthMonitor([check("bg", f"sleep 30 & echo $! > {pid_file}")], [0], nvml="off")
    try:
        (r,) = results_of(mon)
        assert r.ok
        pid = int(wait_for(pid_file))
        deadline = time.time() + 5
        while alive(pid) and time.time() < deadline:
            time.sleep(0.01)
        assert not alive(pid)
    finally:
        mon.close()


@pytest.mark.integration
def test_reruns_every_s_after_the_previous_run_finished(tmp_path):
    runs = tmp_path / "runs"
    mon = HealthMonitor([check("c", f"echo run >> {runs}", every_s=0.2)], [0], nvml="off")
    try:
        (r,) = results_of(mon, now=100.05)  # first poll: started at once
        assert r.ok and r.t == 100.05
        assert mon.poll(100.2) == []  # due at 100.25: 0.2 s after it finished, not after it started
        time.sleep(0.1)
        assert runs.read_text().count("run") == 1
        (r,) = results_of(mon, now=100.25)
        assert r.t == 100.25 and runs.read_text().count("run") == 2
    finally:
        mon.close()


@pytest.mark.integration
def test_one_run_at_a_time_and_poll_never_blocks(tmp_path):
    runs = tmp_path / "runs"
    mon = HealthMonitor([check("slow", f"echo run >> {runs}; sleep 5", every_s=0.01, timeout_s=60)],
                        [0], nvml="off")
    try:
        for i in range(10):
            t0 = time.monotonic()
            assert mon.poll(1.0 + i) == []
            assert time.monotonic() - t0 < 0.1
            time.sleep(0.02)
        assert runs.read_text().count("run") == 1
        t0 = time.monotonic()
    finally:
        mon.close()
    assert time.monotonic() - t0 < 1.0


@pytest.mark.integration
def test_remove_node_and_close_end_running_checks(tmp_path):
    cmd = f'echo $$ > {tmp_path}/"$NONSTOP_NODE"; exec sleep 30'
    mon = HealthMonitor([check("s", cmd, every_s=0.01, timeout_s=1000)], [0, 1], nvml="off")
    try:
        mon.poll(1.0)
        pid0, pid1 = (int(wait_for(tmp_path / str(n))) for n in (0, 1))
        mon.remove_node(1)
        assert not os.path.exists(f"/proc/{pid1}") and alive(pid0)
        (tmp_path / "1").unlink()
        assert mon.poll(2.0) == [] and mon.poll(100.0) == []
        time.sleep(0.1)
        assert not (tmp_path / "1").exists()  # never started again on the removed node
    finally:
        mon.close()
    assert not os.path.exists(f"/proc/{pid0}")
    assert mon.poll(200.0) == []  # closed: nothing starts


@pytest.mark.integration
def test_a_check_that_cannot_run_is_unhealthy_not_an_exception():
    mon = HealthMonitor([check("m", "/no/such/command")], [0], nvml="off")
    try:
        (r,) = results_of(mon)
    finally:
        mon.close()
    assert not r.ok and r.code == 127 and "not found" in r.detail
    # a NUL byte in the environment: Popen itself refuses
    mon = HealthMonitor([check("nul", "true")], [0], nvml="off", env={**os.environ, "BAD": "a\0b"})
    (r,) = mon.poll(1.0)
    mon.close()
    assert (r.ok, r.code) == (False, None) and r.detail.startswith("could not start")


def test_nvml_on_this_machine_and_off(monkeypatch):
    mon = HealthMonitor([], [0, 1], nvml="auto")
    if "skipped" in mon.nvml_status:  # a CPU machine (the usual test machine)
        assert mon.nvml_status.startswith("NVML: skipped (")
        assert mon.poll(1.0) == [] and mon.poll(1.0 + NVML_EVERY_S) == []
    else:
        assert "checked" in mon.nvml_status
    mon.close()
    monkeypatch.setitem(sys.modules, "pynvml", None)  # as if the package were not installed
    assert HealthMonitor([], [0]).nvml_status == "NVML: skipped (no pynvml module)"
    assert HealthMonitor([], [0], nvml="off").nvml_status == "NVML: skipped (off)"


def fake_pynvml(gpus: list[dict], init_error: int | None = None) -> types.ModuleType:
    """A stand-in for nvidia-ml-py: just the names health.py uses, each GPU a dict of answers."""
    nv = types.ModuleType("pynvml")

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(f"NVML error {value}")
            self.value = value

    nv.NVMLError = NVMLError
    for name, value in [("NotSupported", 3), ("NoPermission", 4), ("FunctionNotFound", 13),
                        ("GpuIsLost", 15)]:
        def new_error(self: NVMLError, v: int = value) -> None:
            NVMLError.__init__(self, v)
        setattr(nv, f"NVMLError_{name}", type(f"NVMLError_{name}", (NVMLError,),
                                               {"__init__": new_error}))
    nv.NVML_ERROR_DRIVER_NOT_LOADED, nv.NVML_ERROR_LIBRARY_NOT_FOUND = 9, 12
    nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC = 1, 0
    nv.calls = {"init": 0, "shutdown": 0, "ecc": 0}

    def init() -> None:
        nv.calls["init"] += 1
        if init_error is not None:
            raise NVMLError(init_error)

    def answer(key: str):
        def get(handle, *args):
            if key == "ecc":
                nv.calls["ecc"] += 1
                assert args == (1, 0)
            value = gpus[handle][key]
            if isinstance(value, str):  # the name of the error it raises
                raise getattr(nv, f"NVMLError_{value}")()
            return value
        return get

    nv.nvmlInit, nv.nvmlDeviceGetCount = init, lambda: len(gpus)
    nv.nvmlShutdown = lambda: nv.calls.__setitem__("shutdown", nv.calls["shutdown"] + 1)
    nv.nvmlDeviceGetHandleByIndex = lambda i: i
    nv.nvmlDeviceGetTotalEccErrors = answer("ecc")
    nv.nvmlDeviceGetRetiredPagesPendingStatus = answer("pending")
    nv.nvmlDeviceGetRemappedRows = answer("rows")
    return nv


def test_nvml_problems_are_reported_for_every_node(monkeypatch):
    healthy = {"ecc": 0, "pending": 0, "rows": (0, 0, 0, 0)}
    # "not supported" and the like (no ECC, row remapping only on newer GPUs) are fine
    ok = fake_pynvml([healthy, {"ecc": "NotSupported", "pending": "NoPermission",
                                "rows": "FunctionNotFound"}])
    monkeypatch.setitem(sys.modules, "pynvml", ok)
    mon = HealthMonitor([], [0, 1])
    assert mon.nvml_status == "NVML: 2 GPUs checked"
    assert mon.poll(1.0) == [] and ok.calls["ecc"] == 2
    mon.close()
    assert ok.calls["shutdown"] == 1

    nv = fake_pynvml([healthy,
                      {"ecc": 2, "pending": "NotSupported", "rows": "NotSupported"},
                      {"ecc": "NotSupported", "pending": 1, "rows": (0, 1, 1, 0)},
                      {"ecc": 0, "pending": 0, "rows": (0, 0, 0, 1)},
                      {"ecc": 0, "pending": 0, "rows": "NotSupported"}])
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    mon = HealthMonitor([], [0, 1, 2])
    mon.remove_node(2)
    results = mon.poll(10.0)
    assert [r.node for r in results] == [0, 1]
    assert {(r.check, r.ok, r.code) for r in results} == {("nvml", False, None)}
    assert results[0].detail == ("GPU 1: 2 uncorrected ECC error(s); GPU 2: retired pages pending; "
                                 "GPU 2: row remapping pending; GPU 3: row remapping failed")
    assert mon.poll(10.0 + NVML_EVERY_S - 1) == [] and nv.calls["ecc"] == 5  # not due yet
    assert len(mon.poll(10.0 + NVML_EVERY_S)) == 2 and nv.calls["ecc"] == 10
    mon.close()
    assert nv.calls == {"init": 1, "shutdown": 1, "ecc": 10}


def test_nvml_errors_other_than_not_supported_are_problems(monkeypatch):
    nv = fake_pynvml([{"ecc": 0, "pending": 0, "rows": (0, 0, 0, 0)}])
    nv.nvmlDeviceGetHandleByIndex = lambda i: (_ for _ in ()).throw(nv.NVMLError_GpuIsLost())
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    mon = HealthMonitor([], [0])
    (r,) = mon.poll(1.0)
    mon.close()
    assert r.detail == "GPU 0: NVML error 15"


@pytest.mark.parametrize("error, why", [(9, "no NVIDIA driver"), (12, "no NVIDIA driver"),
                                        (999, "init failed: NVML error 999")])
def test_nvml_init_failure_is_skipped_once(monkeypatch, error, why):
    nv = fake_pynvml([], init_error=error)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    mon = HealthMonitor([], [0])
    assert mon.nvml_status == f"NVML: skipped ({why})"
    assert mon.poll(1.0) == [] and mon.poll(1.0 + NVML_EVERY_S) == []
    mon.close()
    assert nv.calls["init"] == 1  # never tried again

"""Node health checks run by the agent: user commands per node (non-zero = unhealthy) and, where
NVML exists, GPU checks; never blocking the agent's loop, never failing on a CPU machine."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import tempfile
from typing import Any, Iterable, Mapping, Sequence

from .policy import HealthCheck

NVML_EVERY_S = 60.0


@dataclasses.dataclass(frozen=True)
class HealthResult:
    check: str
    node: int
    ok: bool
    code: int | None
    detail: str
    t: float
    seconds: float


@dataclasses.dataclass
class _Running:
    proc: subprocess.Popen
    out: Any
    started: float


class HealthMonitor:
    def __init__(self, checks: Sequence[HealthCheck], nodes: Iterable[int], nvml: str = "auto",
                 env: Mapping[str, str] | None = None):
        self.checks = list(checks)
        self.nodes = set(nodes)
        self.env = dict(env if env is not None else os.environ)
        self._next: dict[tuple[str, int], float] = {}  # due time; absent: due now
        self._running: dict[tuple[str, int], _Running] = {}
        self._dir = tempfile.mkdtemp(prefix="nonstop-health-") if self.checks else None
        self._nvml: Any = None
        self._nvml_next = 0.0
        self._nvml_status = "NVML: off" if nvml == "off" else self._init_nvml()

    @property
    def nvml_status(self) -> str:
        return self._nvml_status

    def _init_nvml(self) -> str:
        try:
            import pynvml  # type: ignore[import-not-found]
        except ImportError:
            return "NVML: skipped (no pynvml module)"
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
        except Exception as exc:  # noqa: BLE001 - no driver, no GPU: nothing to check
            return f"NVML: skipped ({type(exc).__name__})"
        self._nvml = pynvml
        return f"NVML: {count} GPU(s) checked (ECC, retired pages; XID events are not polled)"

    def poll(self, now: float) -> list[HealthResult]:
        out = self._collect(now)
        for check in self.checks:
            for node in sorted(self.nodes):
                key = (check.name, node)
                if key not in self._running and now >= self._next.get(key, 0.0):
                    self._start(check, node, now)
        if self._nvml is not None and now >= self._nvml_next:
            self._nvml_next = now + NVML_EVERY_S
            out += self._check_nvml(now)
        return out

    def _start(self, check: HealthCheck, node: int, now: float) -> None:
        out = open(os.path.join(self._dir, f"{check.name}-{node}.out"), "w+b")
        env = {**self.env, "NONSTOP_NODE": str(node), "NONSTOP_CHECK": check.name}
        try:
            proc = subprocess.Popen(["/bin/sh", "-c", check.command], stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)
        except OSError:
            out.close()
            self._next[(check.name, node)] = now + check.every_s
            return
        self._running[(check.name, node)] = _Running(proc, out, now)

    def _collect(self, now: float) -> list[HealthResult]:
        results = []
        by_name = {c.name: c for c in self.checks}
        for key, run in list(self._running.items()):
            name, node = key
            check = by_name[name]
            code = run.proc.poll()
            if code is None and now - run.started <= check.timeout_s:
                continue
            if code is None:
                _kill(run.proc)
                detail = f"timed out after {check.timeout_s:g} s"
            else:
                run.out.seek(0)
                lines = run.out.read().decode(errors="replace").strip().splitlines()
                detail = f"exit {code}" + (f": {lines[-1][:200]}" if lines else "")
            run.out.close()
            del self._running[key]
            self._next[key] = now + check.every_s
            results.append(HealthResult(name, node, code == 0, code, detail, now, now - run.started))
        return results

    def _check_nvml(self, now: float) -> list[HealthResult]:
        nv = self._nvml
        problems = []
        try:
            for i in range(nv.nvmlDeviceGetCount()):
                handle = nv.nvmlDeviceGetHandleByIndex(i)
                try:
                    ecc = nv.nvmlDeviceGetTotalEccErrors(handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                         nv.NVML_VOLATILE_ECC)
                    if ecc:
                        problems.append(f"GPU {i}: {ecc} uncorrected ECC error(s)")
                except nv.NVMLError:
                    pass  # not supported on this GPU
                try:
                    if nv.nvmlDeviceGetRetiredPagesPendingStatus(handle):
                        problems.append(f"GPU {i}: retired pages pending")
                except nv.NVMLError:
                    pass
        except Exception as exc:  # noqa: BLE001 - NVML went away: report once, stop checking
            self._nvml, self._nvml_status = None, f"NVML: stopped ({type(exc).__name__})"
            return []
        if not problems:
            return []
        return [HealthResult("nvml", node, False, None, "; ".join(problems), now, 0.0)
                for node in sorted(self.nodes)]

    def remove_node(self, node: int) -> None:
        self.nodes.discard(node)
        for key in [k for k in self._running if k[1] == node]:
            run = self._running.pop(key)
            _kill(run.proc)
            run.out.close()

    def close(self) -> None:
        for node in list(self.nodes):
            self.remove_node(node)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass

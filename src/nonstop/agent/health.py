"""Node health checks for the agent: the policy's shell commands on each node (non-zero exit =
unhealthy) and NVML GPU checks where a driver exists, polled from a loop they never block."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import IO, Any, Iterable, Mapping, Sequence

from ..policy import HealthCheck

# ECC counters and pending retirements change rarely; a GPU query costs milliseconds of the loop.
NVML_EVERY_S = 60.0
_TAIL_BYTES = 4096  # only the last line is kept: a chatty check must cost no memory
# A SIGKILLed check exits within a millisecond, unless stuck in the kernel (a hung NFS mount):
# that one is reaped by a later poll rather than stalling the loop.
_REAP_S = 0.2


@dataclass(frozen=True)
class HealthResult:
    check: str  # the check's name, or "nvml"
    node: int
    ok: bool
    code: int | None  # exit code; None on timeout / could not start / NVML
    detail: str  # one line: "exit 1: <last line of output>", "timed out after 10 s", ...
    t: float  # when it finished (the ``now`` of the poll that saw it)
    seconds: float  # how long it ran
    limit_s: float | None = None  # it ran out of its time (the check's timeout_s)


@dataclass
class _Run:
    proc: subprocess.Popen[bytes]
    out: IO[bytes]
    started: float


class HealthMonitor:
    """Runs every check on every node, each ``every_s`` after its previous run finished.

    NVML (``nvml="auto"``): each GPU of this machine, every NVML_EVERY_S, for volatile uncorrected
    ECC errors, retired pages pending and row remapping pending or failed; a problem is reported
    for every node (the nodes are on one machine). XID events are not polled: that needs an NVML
    event set kept registered, and a fatal XID shows anyway as a crashed or hung rank."""

    def __init__(self, checks: Sequence[HealthCheck], nodes: Iterable[int], nvml: str = "auto",
                 env: Mapping[str, str] | None = None) -> None:
        self._checks = list(checks)
        self._nodes = sorted(set(nodes))
        self._env = dict(os.environ if env is None else env)
        # keyed by (check index, node): names need not be unique
        self._next: dict[tuple[int, int], float] = {}  # when due again; absent: at the next poll
        self._running: dict[tuple[int, int], _Run] = {}
        self._dying: list[subprocess.Popen[bytes]] = []  # killed, not reaped yet
        self._closed = False
        self._nvml: Any = None  # the pynvml module once initialised
        self._nvml_due: float | None = None
        self._nvml_status = "NVML: skipped (off)" if nvml == "off" else self._init_nvml()

    @property
    def nvml_status(self) -> str:
        return self._nvml_status

    def _init_nvml(self) -> str:
        # Tried once: on a CPU machine this says why in one line, and never warns or raises.
        try:
            with warnings.catch_warnings():  # the old "pynvml" package warns on import
                warnings.simplefilter("ignore")
                import pynvml  # type: ignore[import-not-found,import-untyped,unused-ignore]
        except Exception:  # noqa: BLE001 - not installed, or a broken install
            return "NVML: skipped (no pynvml module)"
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001
            if getattr(exc, "value", None) in (getattr(pynvml, "NVML_ERROR_LIBRARY_NOT_FOUND", 12),
                                               getattr(pynvml, "NVML_ERROR_DRIVER_NOT_LOADED", 9)):
                return "NVML: skipped (no NVIDIA driver)"
            return f"NVML: skipped (init failed: {exc})"
        try:
            count = pynvml.nvmlDeviceGetCount()
        except Exception as exc:  # noqa: BLE001
            count, why = 0, f"no GPU count: {exc}"
        else:
            why = "no GPU"
        if count == 0:
            _shutdown(pynvml)
            return f"NVML: skipped ({why})"
        self._nvml = pynvml
        return f"NVML: {count} GPU{'s' if count != 1 else ''} checked"

    def poll(self, now: float) -> list[HealthResult]:
        """Collect finished checks, end overdue ones and start due ones; never waits on a check."""
        if self._closed:
            return []
        results = self._collect(now)
        self._dying = [p for p in self._dying if p.poll() is None]
        for i, check in enumerate(self._checks):
            for node in self._nodes:
                key = (i, node)
                if key not in self._running and now >= self._next.get(key, now):
                    results += self._start(key, check, now)
        if self._nvml is not None and now >= (self._nvml_due or now):
            results += self._check_nvml(now)
            self._nvml_due = now + NVML_EVERY_S
        return results

    def _start(self, key: tuple[int, int], check: HealthCheck, now: float) -> list[HealthResult]:
        env = {**self._env, "NONSTOP_NODE": str(key[1]), "NONSTOP_CHECK": check.name}
        out = None
        try:
            # An unnamed file (mode 0600, unlinked at once): output of any size never blocks the
            # check, as a full pipe would, and nothing is left to clean up.
            out = tempfile.TemporaryFile(prefix="nonstop-health-")
            proc = subprocess.Popen(check.command, shell=True, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
        except (OSError, ValueError, subprocess.SubprocessError) as exc:  # ValueError: NUL in env
            if out is not None:
                out.close()
            self._next[key] = now + check.every_s
            why = f"could not start: {exc}"
            return [HealthResult(check.name, key[1], False, None, why, now, 0.0)]
        self._running[key] = _Run(proc, out, now)
        return []

    def _collect(self, now: float) -> list[HealthResult]:
        results = []
        for key, run in list(self._running.items()):
            check = self._checks[key[0]]
            code: int | None = None
            limit: float | None = None
            if _exited(run.proc):
                _kill_group(run.proc)  # what it left in the background; the zombie holds the id
                code = run.proc.wait()
                detail = f"exit {code}" if code >= 0 else f"killed by signal {-code}"
            elif now - run.started >= check.timeout_s:
                self._end(run.proc)
                detail = f"timed out after {check.timeout_s:g} s"
                limit = check.timeout_s
            else:
                continue
            last = _last_line(run.out)
            run.out.close()
            del self._running[key]
            self._next[key] = now + check.every_s
            detail = f"{detail}: {last}" if last else detail
            results.append(HealthResult(check.name, key[1], code == 0, code, detail, now,
                                        now - run.started, limit))
        return results

    def _check_nvml(self, now: float) -> list[HealthResult]:
        nv, t0, problems = self._nvml, time.monotonic(), []

        def ask(what: str, fn: Any, *args: Any) -> Any:
            try:
                return fn(*args)
            except (nv.NVMLError_NotSupported, nv.NVMLError_NoPermission,
                    nv.NVMLError_FunctionNotFound):
                return None  # this GPU or driver cannot tell (no ECC, row remapping instead): fine
            except nv.NVMLError as exc:  # GPU lost, reset required, ...: unhealthy
                problems.append(f"{what}: {exc}")
                return None

        for i in range(ask("GPU count", nv.nvmlDeviceGetCount) or 0):
            handle = ask(f"GPU {i}", nv.nvmlDeviceGetHandleByIndex, i)
            if handle is None:
                continue
            ecc = ask(f"GPU {i} ECC", nv.nvmlDeviceGetTotalEccErrors, handle,
                      nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
            if ecc:
                problems.append(f"GPU {i}: {ecc} uncorrected ECC error(s)")
            if ask(f"GPU {i} retired pages", nv.nvmlDeviceGetRetiredPagesPendingStatus, handle):
                problems.append(f"GPU {i}: retired pages pending")
            rows = ask(f"GPU {i} remapped rows", nv.nvmlDeviceGetRemappedRows, handle)
            if rows and (rows[2] or rows[3]):  # (correctable, uncorrectable, pending, failed)
                problems.append(f"GPU {i}: row remapping {'failed' if rows[3] else 'pending'}")
        if not problems:
            return []
        seconds = time.monotonic() - t0
        return [HealthResult("nvml", node, False, None, "; ".join(problems), now, seconds)
                for node in self._nodes]

    def add_node(self, node: int) -> None:
        """A node that joined the job (a new host): checked from now on."""
        if node not in self._nodes:
            self._nodes = sorted(self._nodes + [node])

    def remove_node(self, node: int) -> None:
        """An isolated node: no more checks there; its running checks are ended."""
        self._nodes = [n for n in self._nodes if n != node]
        for key in [k for k in self._running if k[1] == node]:
            self._end(self._running.pop(key).proc)
        self._next = {k: t for k, t in self._next.items() if k[1] != node}

    def close(self) -> None:
        """End every running check (its whole process group) and reap it; poll then does nothing."""
        self._closed = True
        for run in self._running.values():
            self._end(run.proc)
            run.out.close()
        self._running.clear()
        for proc in self._dying:
            try:
                proc.wait(timeout=_REAP_S)
            except subprocess.TimeoutExpired:
                pass  # still stuck in the kernel: subprocess reaps it when it can
        self._dying.clear()
        if self._nvml is not None:
            _shutdown(self._nvml)
            self._nvml = None

    def _end(self, proc: subprocess.Popen[bytes]) -> None:
        _kill_group(proc)
        try:
            proc.wait(timeout=_REAP_S)
        except subprocess.TimeoutExpired:
            self._dying.append(proc)


def _exited(proc: subprocess.Popen[bytes]) -> bool:
    # WNOWAIT leaves the zombie in place, so its pid (the group's id) cannot be reused before the
    # group is killed.
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # already reaped
        return True


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    # The check leads its own session (start_new_session), so the group is exactly its processes.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def _last_line(out: IO[bytes]) -> str:
    size = out.seek(0, os.SEEK_END)
    out.seek(max(0, size - _TAIL_BYTES))
    lines = out.read().decode(errors="replace").strip().splitlines()
    return lines[-1].strip()[:200] if lines else ""


def _shutdown(nv: Any) -> None:
    try:
        nv.nvmlShutdown()
    except Exception:  # noqa: BLE001 - nothing to do about it while closing
        pass

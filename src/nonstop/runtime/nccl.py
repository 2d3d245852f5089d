"""The NCCL side of a generation's groups: the environment nonstop runs NCCL in, the device a rank
uses, and a bounded abort of every communicator of the process (the default group and the mesh's).

Measured on an H200 (torch 2.11, NCCL 2.28): a rank blocked in a collective on a frozen peer is
released 21 ms after ``ProcessGroupNCCL.abort()``; the abort call itself returns after ~0.5 s. An
abort while a communicator is still being created never returned (blocking or non-blocking
creation alike), so every abort has a deadline, past which the process is replaced.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any, Callable, Mapping

from ..torch_internals import get as torch_private

ABORT_S = 10.0  # an abort (or a creation it waits for) not done by then: the process is replaced

#: What nonstop sets for a rank whose script chose NCCL, unless the user set it: nonstop, not
#: PyTorch's watchdog, decides what a failed or slow collective means.
ENV_DEFAULTS: dict[str, str] = {
    # the watchdog neither aborts nor ends the process on an error or a timeout: nonstop aborts
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    # a CUDA error the watchdog meets does not terminate the process from its thread: the main
    # thread meets it too, and nonstop gives the rank a new process (pytorch#126544)
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
    # no flight-recorder dump on a timeout or an error: it would sit on the recovery path.
    # (PyTorch's heartbeat monitor stays on: the watchdog that signals a dump waits for it, up
    # to a minute, and destroying the group waits for the watchdog - measured on an H200)
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    # nor does the watchdog wait for one after a failed collective (it did, on an H200, though
    # no dump was asked for: 15 s by default, and a group's end waits for the watchdog)
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0",
    # NVLink SHARP's multicast buffers are not given back by an abort: a process that re-forms
    # its groups in place would run out of them
    "NCCL_NVLS_ENABLE": "0",
}
#: Several rank processes on one GPU (tests, a one-GPU check): each says it is its own host, so
#: NCCL lets them form a communicator (over its socket transport) instead of refusing the
#: duplicate device. Never for real training: it is slow.
ENV_SHARE_GPU = "NONSTOP_SHARE_GPU"


def uses_nccl(backend: str) -> bool:
    return "nccl" in backend.lower()


def environment(env: Mapping[str, str], pid: int, host: str) -> dict[str, str]:
    """The variables nonstop adds to a rank's environment before its first NCCL communicator:
    ``ENV_DEFAULTS`` where the user set nothing, and with ``NONSTOP_SHARE_GPU=1`` a host id of
    the process's own (pure: ``env`` is read, not changed)."""
    out = {k: v for k, v in ENV_DEFAULTS.items() if k not in env}
    if env.get(ENV_SHARE_GPU) == "1" and "NCCL_HOSTID" not in env:
        out["NCCL_HOSTID"] = f"{host}-nonstop-{pid}"
    return out


def prepare() -> dict[str, str]:
    """Apply ``environment`` to this process (NCCL reads it when its first communicator is
    created, PyTorch when a group is). Returns what was set."""
    added = environment(os.environ, os.getpid(), socket.gethostname())
    os.environ.update(added)
    return added


def device_index(local_rank: int, devices: int) -> int:
    """The GPU of a rank: its local rank on its node (several ranks on one GPU share it)."""
    if devices < 1:
        raise RuntimeError("the script chose NCCL, but no CUDA device is visible to this rank")
    return local_rank % devices


def device() -> Any:
    """Make this rank's GPU the current device, and return it (the group is bound to it: its
    communicators are created while the group forms, every peer just seen alive)."""
    import torch

    local = int(os.environ.get("LOCAL_RANK", "0"))
    index = device_index(local, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def connect(group: Any, gpu: Any) -> None:
    """Create ``group``'s NCCL communicator on ``gpu`` now rather than in the script's first
    collective."""
    import torch

    backend = group._get_backend(gpu)
    if hasattr(backend, "eager_connect_single_device"):
        backend.eager_connect_single_device(gpu)
    else:  # an older torch: a first collective creates it
        import torch.distributed as dist

        dist.all_reduce(torch.zeros(1, device=gpu), group=group)
        torch.cuda.synchronize(gpu)


def communicators() -> list[Any]:
    """The NCCL backends of every process group alive in this process (the default group and
    those the script made: a mesh's dimensions, its own sub-groups)."""
    import torch
    import torch.distributed as dist
    nccl_type = getattr(dist, "ProcessGroupNCCL", None)
    if nccl_type is None:
        return []
    for _ in range(10):  # read while the main thread may be making or ending a group
        try:
            groups = list(torch_private("c10d.world").pg_map)
            break
        except RuntimeError:
            time.sleep(0.001)
    else:
        return []
    out = []
    for pg in groups:
        try:
            backend = pg._get_backend(torch.device("cuda"))
        except (RuntimeError, AttributeError):
            continue
        if isinstance(backend, nccl_type) and all(b is not backend for b in out):
            out.append(backend)
    return out


#: How a process's communicators are aborted: ``threads`` (the default: each in a thread of its
#: own, all at once), ``grouped`` (one NCCL group call, pytorch#119797) or ``each`` (one after
#: the other). Measured on an H200 (torch 2.11, NCCL 2.28), an HSDP rank with three
#: communicators, a peer killed: grouped and one by one, the first abort had not returned after
#: 5 s (freeing its memory waits for the device, where another communicator's kernel still
#: waits for the dead peer); in threads, every abort returned within a second.
ENV_ABORT = "NONSTOP_NCCL_ABORT"
ABORT_MODES = ("grouped", "each", "threads")


def abort_mode(env: Mapping[str, str]) -> str:
    mode = env.get(ENV_ABORT, "threads").strip().lower() or "threads"
    return mode if mode in ABORT_MODES else "threads"


def abort_all(backends: list[Any], mode: str = "threads",
              note: Callable[[str], None] = lambda stage: None) -> None:
    """Abort ``backends``; by default each in a thread of its own, at once: one by one, or even
    in one NCCL group call, an abort can wait for another communicator's kernel that only that
    one's abort ends (pytorch#119797; ``ENV_ABORT``). ``note`` is told each stage as it begins
    (what an abort that never returns was doing)."""
    if not backends:
        return
    n = len(backends)
    if mode == "threads":
        done: list[int] = []
        errors: list[BaseException] = []

        def one(i: int, backend: Any) -> None:
            try:
                backend.abort()
            except Exception as exc:  # noqa: BLE001 - said by the caller, once all returned
                errors.append(exc)
            finally:
                done.append(i)
                note(f"{len(done)} of {n} communicators aborted (each in a thread; not yet: "
                     f"{sorted(set(range(n)) - set(done))})")

        note(f"0 of {n} communicators aborted (each in a thread)")
        threads = [threading.Thread(target=one, args=(i, b), name="nonstop-nccl-abort-one",
                                    daemon=True) for i, b in enumerate(backends)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return
    first = backends[0]
    grouped = mode == "grouped" and hasattr(first, "_group_start") and hasattr(first, "_group_end")
    if grouped:
        first._group_start()
    try:
        for i, backend in enumerate(backends):
            note(f"aborting communicator {i + 1} of {n}" + (" (in a group call)" if grouped else ""))
            backend.abort()
    finally:
        if grouped:
            note(f"ending the group call that aborts {n} communicators")
            first._group_end()


class CommAbort:
    """One abort of a process's NCCL communicators, in a thread of its own, with a deadline.

    Started once (every later ``start`` is the same abort); ``wait`` returns whether it ended
    by the deadline. ``escalate`` is called once, from whichever thread first finds it late:
    the process cannot be trusted to leave its generation and must be replaced."""

    def __init__(self, escalate: Callable[[str], None], deadline_s: float = ABORT_S,
                 abort: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self._escalate = escalate
        self.deadline_s = deadline_s
        self._abort = abort if abort is not None else lambda: abort_all(
            communicators(), abort_mode(os.environ), self._note)
        self._clock = clock
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._t0: float | None = None
        self.seconds: float | None = None  # how long the abort took, once it returned
        self.error: str | None = None  # what it raised, if anything
        self.escalated = False
        self.stage = "starting"  # what the abort was doing last (told when it is late)

    def _note(self, stage: str) -> None:
        self.stage = stage

    @property
    def started(self) -> bool:
        return self._t0 is not None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def start(self) -> None:
        with self._lock:
            if self._t0 is not None:
                return
            self._t0 = self._clock()
        threading.Thread(target=self._run, name="nonstop-nccl-abort", daemon=True).start()
        # late even if nobody waits for it (the main thread may be stuck in the same NCCL)
        timer = threading.Timer(self.deadline_s, self.wait)
        timer.daemon = True
        timer.start()

    def _run(self) -> None:
        try:
            self._abort()
        except Exception as exc:  # noqa: BLE001 - an abort that fails has still let go
            self.error = f"{type(exc).__name__}: {exc}"[:500]
        self.seconds = self._clock() - (self._t0 or 0.0)
        self._done.set()

    def age(self) -> float:
        """Seconds since the abort started (0 if it has not)."""
        return 0.0 if self._t0 is None else self._clock() - self._t0

    def wait(self, what: str = "the abort of this rank's NCCL communicators") -> bool:
        """Wait for the abort until its deadline; past it, escalate (once) and return False."""
        if self._t0 is None:
            return True
        left = self._t0 + self.deadline_s - self._clock()
        if self._done.wait(max(0.0, left)):
            return True
        self.late(what)
        return False

    def late(self, what: str) -> None:
        with self._lock:
            if self.escalated:
                return
            self.escalated = True
        self._escalate(f"{what} did not return within {self.deadline_s:g} s (at: {self.stage})")

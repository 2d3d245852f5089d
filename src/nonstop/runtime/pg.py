"""The process group of one generation, and its prompt teardown.

gloo cannot abort a collective: a rank blocked in a receive from a live peer waits the whole group
timeout. We note which sockets the group opened and, to abort, shut down its connected sockets (never
its listening one: gloo's listener thread terminates the process when its socket is shut). Every
blocked operation on those sockets errors at once, and the peers' sockets error in turn.
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
import struct
import sys
import threading
import time
from typing import Callable, Iterator

from . import nccl
from ..torch_internals import get as torch_private


def socket_fds() -> dict[int, str]:
    """This process's socket descriptors, fd -> 'socket:[inode]'."""
    out: dict[int, str] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out[int(name)] = link
    return out


def _noted_sockets(fds: dict[int, str]) -> Iterator[socket.socket]:
    """A duplicate of each socket among ``fds`` that is still the one noted (an fd closed and
    reused by something else since is not ours to touch). Each duplicate is closed after its
    turn: that closes our copy only."""
    for fd, link in fds.items():
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != link:
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            yield sock
        finally:
            sock.close()


def shutdown_sockets(fds: dict[int, str]) -> int:
    """Shut down the connected sockets among ``fds``. Returns how many were shut."""
    done = 0
    for sock in _noted_sockets(fds):
        try:
            if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                sock.shutdown(socket.SHUT_RDWR)
                done += 1
        except OSError:
            pass
    return done


_TCP_INFO_BYTES = 120  # struct tcp_info: tcpi_bytes_acked, then tcpi_bytes_received (u64 each)


def bytes_moved(fds: dict[int, str]) -> int:
    """Bytes acknowledged plus bytes received on the TCP sockets among ``fds``, from the
    kernel's counters: reading them costs the connections nothing."""
    total = 0
    for sock in _noted_sockets(fds):
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        except OSError:
            continue
        if len(info) >= _TCP_INFO_BYTES + 16:
            acked, received = struct.unpack_from("QQ", info, _TCP_INFO_BYTES)
            total += acked + received
    return total


def with_cpu_backend(backend: str) -> str:
    """The backend string for a generation's group: nonstop's own collectives (the restore's
    offers and copies, the snapshot interval) are on CPU tensors, which NCCL cannot carry, so a
    plain ``nccl`` gets gloo beside it for the CPU (``cpu:gloo,cuda:nccl``); CUDA tensors still go
    through NCCL. Anything else (``gloo``, an explicit ``device:backend`` list) is kept as given."""
    return "cpu:gloo,cuda:nccl" if backend.strip().lower() == "nccl" else backend


NCCL_QUIET_S = 30.0  # an aborted NCCL group is ended no sooner (its watchdog is then idle)
DRAIN_OPS = 2  # gloo's worker threads per group (torch's default), when they cannot be told
DRAIN_S = 0.5  # how long a kept group may take to drain before it is kept for now
DRAIN_HOLD_S = 0.005  # a worker that ran a probe is held this long: the next goes to another
GLOO_WORKER = "pt_gloo_runloop"  # the name of gloo's worker threads (/proc/self/task/*/comm)


def _threads() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def _gloo_workers(tids: set[int]) -> set[int]:
    """Those of the threads ``tids`` that are gloo worker threads (named once they run)."""
    out = set()
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == GLOO_WORKER:
                    out.add(tid)
        except OSError:  # ended
            continue
    return out


def _drain(kept, fds: dict[int, str] | None, workers: set[int], budget_s: float) -> bool:
    """Whether every worker thread of the group ``kept`` ran a probe (see ``release``) within
    ``budget_s``. ``workers``: their thread ids (empty: any ``DRAIN_OPS`` distinct threads)."""
    import torch

    if fds:
        shutdown_sockets(fds)
    seen: set[int] = set()
    lock = threading.Lock()

    caller = threading.get_native_id()

    def note(_fut):
        # a probe already complete when its callback is added runs it here, in the caller:
        # that says nothing of the group's workers
        if threading.get_native_id() == caller:
            return
        with lock:
            seen.add(threading.get_native_id())
        time.sleep(DRAIN_HOLD_S)

    def done() -> bool:
        with lock:
            return workers <= seen if workers else len(seen) >= DRAIN_OPS

    deadline = time.monotonic() + budget_s
    chained, probes = [], []  # alive until the caller drops the group
    while not done() and time.monotonic() < deadline:
        rnd = []
        for _ in range(max(DRAIN_OPS, len(workers))):
            probe = torch.zeros(1)
            try:
                fut = kept.allreduce([probe]).get_future().then(note)
            except Exception:  # noqa: BLE001 - a backend that refuses at once queues nothing
                return True
            probes.append(probe)
            rnd.append(fut)
        chained += rnd
        while not all(f.done() for f in rnd) and time.monotonic() < deadline:
            time.sleep(0.001)  # the GIL released: a worker that needs it gets it
    while not all(f.done() for f in chained) and time.monotonic() < deadline:
        time.sleep(0.001)
    if not (done() and all(f.done() for f in chained)):
        return False
    time.sleep(DRAIN_HOLD_S)  # the workers let go of the probes' callbacks (that takes the GIL)
    return True

def _cannot_escalate(why: str) -> None:
    raise RuntimeError(f"{why}, and nothing here can replace this process")


SWEEP_EVERY_S = 0.02  # an aborted group still forming: how often its new sockets are shut...
SWEEP_LIMIT_S = 10.0  # ...and for how long at most


def _reset_group_names() -> None:
    """Name the next default group "0" again. torch numbers default groups from a counter that
    it advances before constructing one and resets only when a group is destroyed; a construction
    that failed (aborted mid-rendezvous) leaves it advanced, so this rank's next group would take
    its keys under another name than a fresh process's, and the two would wait for each other
    until the rendezvous timeout."""
    torch_private("c10d.world").group_count = 0


class GenerationGroup:
    """torch.distributed's default group for one generation, under a fresh store prefix.

    With NCCL, the group is bound to the rank's GPU so that its communicators are created while
    it forms (every peer was just seen alive), and an abort also aborts every NCCL communicator
    of the process, in a thread with a deadline (``nccl.CommAbort``): ``escalate`` is called with
    the reason when one does not return in time (the process must then be replaced)."""

    def __init__(self, host: str, port: int, gen: int, rank: int, world: int, backend: str,
                 prefix: str, rendezvous_timeout_s: float, collective_timeout_s: float,
                 escalate: Callable[[str], None] | None = None,
                 abort_s: float = nccl.ABORT_S):
        self.host, self.port, self.gen, self.rank, self.world = host, port, gen, rank, world
        self.backend, self.prefix = with_cpu_backend(backend), prefix
        self.nccl = nccl.uses_nccl(self.backend)
        self._escalate = escalate if escalate is not None else _cannot_escalate
        self.nccl_abort = nccl.CommAbort(self._escalate, abort_s) if self.nccl else None
        self.nccl_env: dict[str, str] = {}  # what nonstop set for NCCL in this process
        self._deferred = False  # left while its NCCL abort ran: destroyed by ``settle``
        # NCCL: (steps done, a CUDA event after their work) of the last step, and the newest
        # step whose work had ended on the GPU when the communicators were aborted
        self._mark: tuple[int, object] | None = None
        self.trusted_step: int | None = None
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self.collective_timeout_s = collective_timeout_s
        self._lock = threading.Lock()
        self._before: dict[int, str] = {}
        self._store_fds: dict[int, str] = {}
        self._group_fds: dict[int, str] | None = None
        self.aborted = False
        self._started = False  # whether open() noted the sockets that existed before it
        self.is_open = False
        self.sockets_shut = 0
        self.collected = 0
        self._kept = None
        self._kept_all: list = []  # every group of an aborted NCCL generation, until released
        self._new_threads: set[int] = set()  # threads that appeared while the group formed
        self.undrained = 0  # times ``release`` found a worker still busy
        self._forming_done = threading.Event()  # init_process_group returned or raised
        self._extending = False  # more groups of this generation forming (``extend``)
        # works of a mesh's groups its rank gave up waiting for (``mesh.AbortableWork``), as
        # callables saying whether each has ended: the groups are kept until then (gloo's worker
        # thread is blocked in it)
        self.abandoned: list = []

    def open(self, joined_store: Callable[[], None] | None = None) -> None:
        """Form the group. ``joined_store`` (a fault injection point) is called once this rank
        is connected to the generation's store, before the group connects its peers."""
        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError("a default process group already exists: nonstop.wrap creates and "
                               "tears down the group itself; remove the init_process_group call")
        with self._lock:
            if self.aborted:
                raise RuntimeError(f"generation {self.gen} was aborted before rendezvous")
            before = socket_fds()
            self._before = before
            self._started = True
        store = dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=self.rendezvous_timeout_s))
        after_store = socket_fds()
        with self._lock:
            self._before = after_store
            self._store_fds = {fd: link for fd, link in after_store.items() if before.get(fd) != link}
            if self.aborted:
                shutdown_sockets(self._store_fds)
                raise RuntimeError(f"generation {self.gen} was aborted during rendezvous")
        if joined_store is not None:
            joined_store()
        _reset_group_names()
        gpu = None
        if self.nccl:
            self.nccl_env = nccl.prepare()
            gpu = nccl.device()
        threads_before = _threads()
        try:
            dist.init_process_group(
                self.backend, store=dist.PrefixStore(self.prefix, store), rank=self.rank,
                world_size=self.world, timeout=datetime.timedelta(seconds=self.collective_timeout_s))
        finally:
            self._forming_done.set()
        del store
        self._new_threads = _threads() - threads_before  # the group's workers among them
        opened = socket_fds()
        with self._lock:
            self._group_fds = {fd: link for fd, link in opened.items() if self._before.get(fd) != link}
            self.is_open = True
            if self.aborted:  # raced with an abort during rendezvous
                self.sockets_shut += shutdown_sockets(self._group_fds)
        if self.aborted:
            raise RuntimeError(f"generation {self.gen} was aborted during rendezvous")
        if gpu is not None:
            # now, every peer just seen alive (not in the script's first collective); after the
            # gloo half's sockets were noted, so that an abort never shuts NCCL's own
            nccl.connect(torch_private("c10d.get_default_group")(), gpu)
            if self.aborted:
                raise RuntimeError(f"generation {self.gen} was aborted during rendezvous")

    def extend(self, form: Callable[[], None]) -> None:
        """Form more groups of this generation (a mesh's subgroups) with ``form``, after ``open``:
        the sockets they open are this generation's too (an abort shuts them, and while they
        form, it shuts each new one as ``open``'s rendezvous does)."""
        with self._lock:
            if self.aborted or self._group_fds is None:
                raise RuntimeError(f"generation {self.gen} was aborted before its mesh formed")
            self._before = socket_fds()
            self._extending = True
            self._forming_done.clear()
        try:
            form()
        finally:
            opened = socket_fds()
            with self._lock:
                self._group_fds.update(
                    {fd: link for fd, link in opened.items() if self._before.get(fd) != link})
                self._extending = False
                self._forming_done.set()
                if self.aborted:
                    self.sockets_shut += shutdown_sockets(self._group_fds)
        if self.aborted:
            raise RuntimeError(f"generation {self.gen} was aborted while its mesh formed")

    def _forming(self) -> bool:
        return self._group_fds is None or self._extending

    def mark_step(self, step: int) -> None:
        """NCCL: ``step`` steps are done on the CPU; their GPU work (collectives included) is
        queued behind an event, so that an abort can tell whether it had ended."""
        if self.nccl and self.is_open:
            import torch

            event = torch.cuda.Event()
            event.record()
            self._mark = (step, event)

    def _finished_step(self) -> int | None:
        mark = self._mark
        if mark is None:
            return None
        try:
            return mark[0] if mark[1].query() else None
        except Exception:  # noqa: BLE001 - a broken context: nothing of it can be trusted
            return None

    def may_commit(self, step: int) -> bool:
        """Whether a snapshot of ``step`` steps may be committed: no NCCL abort, or that step's
        GPU work had ended before the abort began."""
        abort = self.nccl_abort
        if abort is None or not abort.started:
            return True
        return self.trusted_step is not None and self.trusted_step >= step

    def untrusted(self, step: int) -> bool:
        """Whether a rank that leaves this group at ``step`` steps done must not resume from its
        own state: NCCL was aborted before the GPU had ended that step's work (an aborted NCCL
        collective returns no error: its output is whatever it had received)."""
        return bool(self.nccl and self.nccl_abort is not None and self.nccl_abort.started
                    and self.trusted_step != step)

    def traffic(self) -> int | None:
        """Bytes the formed group's connections have moved so far (None: not formed)."""
        with self._lock:
            fds = dict(self._group_fds) if self._group_fds is not None else None
        return None if fds is None else bytes_moved(fds)

    def abort(self, device: bool = True) -> None:
        """Release every operation blocked on this group. Safe from any thread, idempotent.
        ``device=False``: sockets only, nothing that calls into CUDA or NCCL (the process's CUDA
        context is broken: it is about to end)."""
        with self._lock:
            self.aborted = True
            if not self._started:
                return  # open() sees the flag and does not start
            targets = dict(self._store_fds)
            if self._group_fds is not None:
                targets.update(self._group_fds)
            forming = self._forming()
            if forming:  # rendezvous in progress: whatever sockets appeared since it began
                targets.update(self._new_sockets())
            self.sockets_shut += shutdown_sockets(targets)
        if self.nccl_abort is not None and device and not forming:
            if not self.nccl_abort.started:
                self.trusted_step = self._finished_step()
            self.nccl_abort.start()  # not waited for here: ``settle`` does, before the next group
        if forming:
            self._sweep_while_forming()

    def _new_sockets(self) -> dict[int, str]:
        return {fd: link for fd, link in socket_fds().items() if self._before.get(fd) != link}

    def _sweep_while_forming(self) -> None:
        """While the group is still connecting its peers, gloo may open new sockets after the
        first shutdown (it retries a connection to a peer that is not listening yet): shut those
        too, until the group's construction gives up. Bounded: the caller is the abort watcher,
        which has nothing else to do for this generation."""
        deadline = time.monotonic() + SWEEP_LIMIT_S
        while not self._forming_done.wait(SWEEP_EVERY_S) and time.monotonic() < deadline:
            with self._lock:
                if not self._forming():
                    return
                self.sockets_shut += shutdown_sockets(self._new_sockets())

    def close(self) -> float:
        """Leave the group: unregister it and drop the references the failure left behind.
        Returns the seconds it took.

        The group object itself is kept (see ``release``): destroying a gloo group joins its
        worker threads while holding the GIL, and a worker still finishing an aborted operation
        may need the GIL to free a tensor Python handed it - a deadlock. Kept until the next
        generation has run a step, it is destroyed when its workers are long idle, and off the
        recovery path.
        """
        t0 = time.monotonic()
        abort = self.nccl_abort
        if abort is not None and abort.started:
            # the rank leaves now: an aborted NCCL group is ended before the next one forms
            # (its abort may still run; its watchdog may still be busy with the failure)
            self._deferred = True
            self.is_open = False
            return time.monotonic() - t0
        # gloo: unregistered, not shut down - shutting a group down joins its worker threads,
        # and one may still be blocked in an operation of the aborted generation that its rank
        # gave up waiting for (a mesh's ``AbortableWork``): ``release`` ends them, later
        self._forget()
        return time.monotonic() - t0

    def settle(self) -> None:
        """End a group left while its NCCL abort still ran: wait for the abort (past its deadline
        the process is escalated: replaced), then destroy the group. Called in the main thread
        before the next generation's group forms (there is one default group at a time)."""
        if not self._deferred:
            return
        if not self.nccl_abort.wait():
            raise RuntimeError(f"the NCCL abort of generation {self.gen} did not return")
        self._deferred = False
        self._forget()

    def _forget(self) -> None:
        """Unregister every group of this process, shutting none down: an aborted NCCL group's
        shutdown (and its destructor) waits for PyTorch's watchdog thread, which a failure keeps
        busy for seconds (measured on an H200: over 5 s); a gloo group's joins its worker
        threads, one of which may be blocked until the collective timeout; and the next group
        needs none of it. The objects are kept, referenced here, until ``release`` ends them off
        the path, once drained."""
        import torch.distributed as dist

        world = torch_private("c10d.world")
        self._kept = torch_private("c10d.get_default_group")() \
            if dist.is_initialized() else None
        self._kept_all = list(world.pg_map)  # a mesh's groups too: none is destroyed here
        try:
            torch_private("c10d.update_default_pg")(None)
            for name in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config",
                         "pg_to_tag", "tags_to_pg", "pg_coalesce_state"):
                getattr(world, name).clear()
            torch_private("c10d.unregister_all_process_groups")()
        except RuntimeError:  # the registry refused: destroy, bounded
            self._end()
            return
        _reset_group_names()
        self.is_open = False
        self.collected = gc.collect()

    def _end(self) -> None:
        """Destroy the group; an NCCL group in a thread of its own, with a deadline (its
        teardown waits for PyTorch's watchdog thread, which a failure can keep busy)."""
        if not self.nccl:
            self._destroy()
            return
        done = threading.Event()

        def run() -> None:
            try:
                self._destroy()
            finally:
                done.set()

        threading.Thread(target=run, name="nonstop-nccl-destroy", daemon=True).start()
        if not done.wait(self.nccl_abort.deadline_s):
            self._escalate(f"the destruction of generation {self.gen}'s NCCL group did not "
                           f"return within {self.nccl_abort.deadline_s:g} s")
            raise RuntimeError(f"the NCCL group of generation {self.gen} could not be destroyed")

    def _destroy(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            self._kept = torch_private("c10d.get_default_group")()
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group may fail its own teardown
                pass
        self.is_open = False
        # DDP's reducer may sit in a reference cycle: collect it now, in this thread.
        self.collected = gc.collect()

    def workers(self) -> set[int]:
        """The ids of the group's gloo worker threads."""
        return _gloo_workers(self._new_threads)

    def release(self, budget_s: float | None = None) -> bool:
        """Destroy the group object kept by ``close``, unless that could hang; True when it is
        gone (or there was none), False when it is still kept (``release`` again later).

        Its destruction, holding the GIL, waits for its work queue to empty and joins its worker
        threads. A worker may still be in an operation of the aborted generation - one that the
        shut sockets do not release (gloo's ring can wait for a send the vanished peer never
        asks for, until the group's timeout) - or may need the GIL to finish one: joining it
        would hang the rank. So every worker thread of the group must first be seen idle: its
        sockets are shut again (any operation on them fails at once), no-op probes are posted,
        and each probe's completion notes the thread that ran it, holding that thread a moment
        so the next probe goes to another one. Only when each of the group's workers ran one
        (and finished with it) is the last reference dropped; a worker still busy after
        ``budget_s`` (``DRAIN_S``) leaves the group kept."""
        kept = self._kept
        if kept is None:
            return True
        abort = self.nccl_abort
        if abort is not None and abort.started and abort.age() < NCCL_QUIET_S:
            return False  # its watchdog may still be busy with the failure: not yet
        self.abandoned = [ended for ended in self.abandoned if not ended()]
        if self.abandoned or not _drain(kept, self._group_fds, self.workers(),
                                        DRAIN_S if budget_s is None else budget_s):
            if not self.undrained:
                print(f"nonstop: the group of generation {self.gen} is still busy in an "
                      f"operation of its own; kept, to be destroyed later", file=sys.stderr,
                      flush=True)
            self.undrained += 1
            return False
        self._kept = None
        self._kept_all = []
        del kept
        return True

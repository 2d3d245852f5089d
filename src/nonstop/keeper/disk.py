"""Disk checkpoints from a keeper's snapshots: the keeper's ``DiskWrites``. A snapshot going to
disk is first copied by the kernel into memory of its own (its slot is free at once for the next
snapshot), in a stager thread; a writer process of the keeper's (``nonstop.keeper.writer``) takes
it from there, talked to from the keeper's loop.

The copy of a part that could not be written is kept (one per holder: the newest) so that the
launcher can have it written again (``persist`` with ``again``) once the disk may take it, even
after the slot has moved on; ``forget`` frees it when the launcher gives that step up.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import selectors
import socket
import subprocess
import sys
from typing import Callable

from ..zygote_client import TemplatedProcess, from_templates
from ..protocol import keeper_messages as km
from ..state import shm, wire
from .slots import Holder, Slots

Job = tuple[km.DiskPart, shm.SlotInfo, int]  # a part to write: (job, snapshot, staged copy)


class DiskWrites:
    """``emit``: an event for the keeper's subscribers; ``wake``: the keeper's loop looks again
    (a staged copy is ready); ``sel``: the keeper's selector, which watches the writer's socket
    (tagged ``"writer"``: the loop calls ``from_writer``)."""

    def __init__(self, slots: Slots, emit: Callable[[km.Report], None],
                 wake: Callable[[], None], sel: selectors.BaseSelector):
        self.slots, self.emit, self.wake, self.sel = slots, emit, wake, sel
        # parts to stage, with the slot leased for each (None: the holder's snapshot of its step)
        self.stage_queue: collections.deque[tuple[km.DiskPart, int | None]] = collections.deque()
        self.write_queue: collections.deque[Job] = collections.deque()
        self.writer: subprocess.Popen | TemplatedProcess | None = None
        self.writer_sock: socket.socket | None = None
        self.writer_job: Job | None = None
        # holder -> the staged copy of its newest part that failed to be written
        self.kept: dict[str, Job] = {}

    def _unlease_stager(self, h: Holder, i: int) -> None:
        h.unlease(i, "stager")
        self.slots.changed.notify_all()

    def stage(self, h: Holder, i: int, info: shm.SlotInfo, persist: km.DiskPart) -> None:
        """A snapshot just committed goes to disk (``persist``: the part, of the snapshot in
        slot ``i``). Called with the slots' lock held."""
        # the stager's lease is taken now: by the time it runs, two more snapshots may have
        # come, and the slot must not be written over before it is copied
        h.leases[i]["stager"] += 1
        self.stage_queue.append((dataclasses.replace(persist, holder=h.name, step=info.step), i))

    def stager(self) -> None:
        """The staging thread: each job's snapshot copied into memory of its own, for the
        writer."""
        while True:
            with self.slots.changed:
                while not self.stage_queue:
                    self.slots.changed.wait(1.0)
                job, slot = self.stage_queue.popleft()  # (slot: leased when the snapshot came in)
                h = self.slots.holders.get(job.holder)
                if h is not None and slot is not None:
                    info = h.infos()[slot]
                    found = (slot, info) if info is not None and info.step == job.step else None
                    if found is None:
                        self._unlease_stager(h, slot)
                else:
                    found = h.newest(job.step) if h is not None else None
                    if found is not None:
                        h.leases[found[0]]["stager"] += 1
                if found is None:  # nothing left to write from: not worth retrying
                    self.emit(km.PartFailed(
                        job=job, retryable=False,
                        error=f"no snapshot of step {job.step} in {job.holder}"))
                    continue
                i, info = found
                src = os.dup(h.fds[i])
            try:
                staged = shm.create(f"{job.holder}.disk", info.total)
                done = 0
                while done < info.total:  # in the kernel: no copy through this process
                    n = os.sendfile(staged, src, done, info.total - done)
                    if n <= 0:
                        raise OSError("short copy")
                    done += n
                os.lseek(staged, 0, os.SEEK_SET)
            except OSError as exc:
                self.emit(km.PartFailed(job=job, error=f"staging: {exc}"))
                staged = None
            finally:
                os.close(src)
                with self.slots.changed:
                    self._unlease_stager(h, i)
            if staged is not None:
                # a failed step's kept copy stays until a newer step is written (or fails and
                # is kept instead): its retry may already be on its way
                with self.slots.lock:
                    self.write_queue.append((job, info, staged))
            self.wake()

    def request(self, request: km.Persist | km.Forget) -> km.Answer:
        """``persist`` (``again``: from the copy kept after a failure, if there is one) or
        ``forget``. Called with the slots' lock held."""
        match request:
            case km.Forget(holder=holder, step=step):
                kept = self.kept.get(holder)
                if kept is not None and kept[0].step == step:
                    self._forget(holder)
                return km.Forgotten()
            case km.Persist(part=part, again=again):
                kept = self.kept.get(part.holder)
                if again and kept is not None and kept[0].step == part.step:
                    del self.kept[part.holder]
                    self.write_queue.append(kept)
                    return km.Persisting(kept=True)
                self.stage_queue.append((part, None))
                self.slots.changed.notify_all()
                return km.Persisting(kept=False)

    def _keep(self, job: km.DiskPart, info: shm.SlotInfo, fd: int) -> None:
        with self.slots.lock:
            kept = self.kept.get(job.holder)
            if kept is not None and kept[0].step > job.step:
                os.close(fd)  # a newer failed step's copy is the one worth keeping
                return
            self._forget(job.holder)
            self.kept[job.holder] = (job, info, fd)

    def _forget(self, holder: str) -> None:
        kept = self.kept.pop(holder, None)
        if kept is not None:
            os.close(kept[2])

    def start_writer(self) -> None:
        """The writer process, unless one is running; its socket watched by the selector."""
        if self.writer is not None and self.writer.poll() is None:
            return
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # forked by a zygote template where the environment names one (torch and DCP imported
        # already: the first part is written at once), else a process of its own that imports them
        pid, refused = from_templates("writer", theirs.fileno(), dict(os.environ),
                                             sys.stderr.fileno())
        if refused:
            print("\n".join(refused) + ("\nstarting a checkpoint writer" if pid is None else ""),
                  file=sys.stderr, flush=True)
        if pid is not None:
            self.writer = TemplatedProcess(pid)
        else:
            self.writer = subprocess.Popen(
                [sys.executable, "-m", "nonstop.keeper.writer", str(theirs.fileno()),
                 str(os.getpid())],
                pass_fds=[theirs.fileno()], start_new_session=True, stdin=subprocess.DEVNULL)
        theirs.close()
        self.writer_sock = mine
        self.sel.register(mine, selectors.EVENT_READ, "writer")

    def dispatch(self) -> None:
        """The keeper's loop: the next staged part to the writer, once it is done with the one
        before (a writer that died is started again first)."""
        with self.slots.lock:
            if self.writer_job is not None or not self.write_queue:
                return
            job, info, fd = self.write_queue.popleft()
            self.writer_job = (job, info, fd)
        if self.writer is None or self.writer.poll() is not None:
            self._writer_gone(keep_job=True)
            self.start_writer()
        try:
            wire.send(self.writer_sock, km.encode(km.Write(job=job, info=info)), [fd])
        except OSError:
            self._writer_gone()

    def from_writer(self) -> None:
        """The keeper's loop: the writer said something (a part done or failed) or went away.
        Something malformed fails the part it was writing."""
        fds: list[int] = []
        said: km.WriterMessage | str | None
        try:
            raw, fds = wire.recv(self.writer_sock)
            said = km.decode_writer(raw) if raw is not None else None
        except OSError:
            said = None
        except ValueError as exc:  # not JSON, or not a writer's message (BadKeeperMessage)
            said = f"the checkpoint writer said something malformed: {exc}"
        for fd in fds:
            os.close(fd)
        if said is None:
            self._writer_gone()
            return
        if self.writer_job is None:
            return
        job, info, fd = self.writer_job
        self.writer_job = None
        match said:
            case km.WriteDone(part=part):
                os.close(fd)  # the staged copy: freed once the writer unmaps it too
                with self.slots.lock:
                    kept = self.kept.get(job.holder)
                    if kept is not None and kept[0].step <= job.step:
                        self._forget(job.holder)  # a newer step written supersedes the failed one
                self.emit(km.PartDone(job=job, part=part))
            case km.WriteFailed():  # its cause, passed on to the launcher as it is
                self._keep(job, info, fd)
                self.emit(km.PartFailed(job=job, error=said.error, errno=said.errno,
                                        message=said.message, path=said.path, need=said.need,
                                        traceback=said.traceback))
            case _:
                self._keep(job, info, fd)
                self.emit(km.PartFailed(job=job, error=said if isinstance(said, str) else
                                        f"the checkpoint writer said {said.op!r}"))

    def _writer_gone(self, keep_job: bool = False) -> None:
        if self.writer_sock is not None:
            try:
                self.sel.unregister(self.writer_sock)
            except (KeyError, ValueError):
                pass
            self.writer_sock.close()
            self.writer_sock = None
        if self.writer is not None and self.writer.poll() is None:
            self.writer.kill()
        if self.writer is not None:
            self.writer.wait(timeout=10)
        self.writer = None
        if self.writer_job is not None and not keep_job:
            job, info, fd = self.writer_job
            self.writer_job = None
            self._keep(job, info, fd)
            self.emit(km.PartFailed(job=job, error="the checkpoint writer died"))

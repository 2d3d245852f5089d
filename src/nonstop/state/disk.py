"""Disk checkpoints from a keeper's snapshots: the keeper's ``DiskWrites``. A snapshot going to
disk is first copied by the kernel into memory of its own (its slot is free at once for the next
snapshot), in a stager thread; a writer process of the keeper's (``nonstop.state.writer``) takes
it from there, talked to from the keeper's loop.

The copy of a part that could not be written is kept (one per holder: the newest) so that the
launcher can have it written again (``persist`` with ``again``) once the disk may take it, even
after the slot has moved on; ``forget`` frees it when the launcher gives that step up.
"""

from __future__ import annotations

import collections
import os
import selectors
import socket
import subprocess
import sys
from typing import Any, Callable

from . import shm, wire
from .slots import Holder, Slots

# What the writer says about a failed write, passed on to the launcher as it is.
_CAUSE = ("error", "errno", "message", "path", "need", "traceback")

Job = tuple[dict[str, Any], shm.SlotInfo, int]  # a part to write: (job, snapshot, staged copy)


class DiskWrites:
    """``emit``: an event for the keeper's subscribers; ``wake``: the keeper's loop looks again
    (a staged copy is ready); ``sel``: the keeper's selector, which watches the writer's socket
    (tagged ``"writer"``: the loop calls ``from_writer``)."""

    def __init__(self, slots: Slots, emit: Callable[[dict[str, Any]], None],
                 wake: Callable[[], None], sel: selectors.BaseSelector):
        self.slots, self.emit, self.wake, self.sel = slots, emit, wake, sel
        self.stage_queue: collections.deque[dict[str, Any]] = collections.deque()
        self.write_queue: collections.deque[Job] = collections.deque()
        self.writer: subprocess.Popen | None = None
        self.writer_sock: socket.socket | None = None
        self.writer_job: Job | None = None
        # holder -> the staged copy of its newest part that failed to be written
        self.kept: dict[str, Job] = {}

    def _unlease_stager(self, h: Holder, i: int) -> None:
        h.unlease(i, "stager")
        self.slots.changed.notify_all()

    def stage(self, h: Holder, i: int, info: shm.SlotInfo, persist: dict[str, Any]) -> None:
        """A snapshot just committed goes to disk (``persist``: the part's job). Called with the
        slots' lock held."""
        # the stager's lease is taken now: by the time it runs, two more snapshots may have
        # come, and the slot must not be written over before it is copied
        h.leases[i]["stager"] += 1
        self.stage_queue.append(dict(persist, holder=h.name, step=info.step, slot=i))

    def stager(self) -> None:
        """The staging thread: each job's snapshot copied into memory of its own, for the
        writer."""
        while True:
            with self.slots.changed:
                while not self.stage_queue:
                    self.slots.changed.wait(1.0)
                job = self.stage_queue.popleft()
                h = self.slots.holders.get(job["holder"])
                slot = job.pop("slot", None)  # leased for us when the snapshot came in
                if h is not None and slot is not None:
                    info = h.infos()[slot]
                    found = (slot, info) if info is not None and info.step == job["step"] else None
                    if found is None:
                        self._unlease_stager(h, slot)
                else:
                    found = h.newest(job["step"]) if h is not None else None
                    if found is not None:
                        h.leases[found[0]]["stager"] += 1
                if found is None:  # nothing left to write from: not worth retrying
                    self.emit({"ev": "part_failed", "job": job, "retryable": False,
                               "error": f"no snapshot of step {job['step']} in {job['holder']}"})
                    continue
                i, info = found
                src = os.dup(h.fds[i])
            try:
                staged = shm.create(f"{job['holder']}.disk", info.total)
                done = 0
                while done < info.total:  # in the kernel: no copy through this process
                    n = os.sendfile(staged, src, done, info.total - done)
                    if n <= 0:
                        raise OSError("short copy")
                    done += n
                os.lseek(staged, 0, os.SEEK_SET)
            except OSError as exc:
                self.emit({"ev": "part_failed", "job": job, "error": f"staging: {exc}"})
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

    def request(self, msg: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """``persist`` (``again``: from the copy kept after a failure, if there is one) or
        ``forget``. Called with the slots' lock held."""
        holder, step = msg["holder"], msg["step"]
        kept = self.kept.get(holder)
        if msg["op"] == "forget":
            if kept is not None and kept[0]["step"] == step:
                self._forget(holder)
            return {"ok": True}, []
        if msg.get("again") and kept is not None and kept[0]["step"] == step:
            del self.kept[holder]
            self.write_queue.append(kept)
            return {"ok": True, "kept": True}, []
        self.stage_queue.append({k: v for k, v in msg.items() if k != "again"})
        self.slots.changed.notify_all()
        return {"ok": True, "kept": False}, []

    def _keep(self, job: dict[str, Any], info: shm.SlotInfo, fd: int) -> None:
        with self.slots.lock:
            kept = self.kept.get(job["holder"])
            if kept is not None and kept[0]["step"] > job["step"]:
                os.close(fd)  # a newer failed step's copy is the one worth keeping
                return
            self._forget(job["holder"])
            self.kept[job["holder"]] = (job, info, fd)

    def _forget(self, holder: str) -> None:
        kept = self.kept.pop(holder, None)
        if kept is not None:
            os.close(kept[2])

    def start_writer(self) -> None:
        """The writer process, unless one is running; its socket watched by the selector."""
        if self.writer is not None and self.writer.poll() is None:
            return
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.writer = subprocess.Popen(
            [sys.executable, "-m", "nonstop.state.writer", str(theirs.fileno()), str(os.getpid())],
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
            wire.send(self.writer_sock, {"op": "write", "job": job, "info": info.to_wire()}, [fd])
        except OSError:
            self._writer_gone()

    def from_writer(self) -> None:
        """The keeper's loop: the writer said something (a part done or failed) or went away."""
        try:
            msg, fds = wire.recv(self.writer_sock)
        except OSError:
            msg, fds = None, []
        for fd in fds:
            os.close(fd)
        if msg is None:
            self._writer_gone()
            return
        if self.writer_job is None or msg.get("op") not in ("done", "failed"):
            return
        job, info, fd = self.writer_job
        self.writer_job = None
        if msg["op"] == "done":
            os.close(fd)  # the staged copy: freed once the writer unmaps it too
            with self.slots.lock:
                kept = self.kept.get(job["holder"])
                if kept is not None and kept[0]["step"] <= job["step"]:
                    self._forget(job["holder"])  # a newer step written supersedes the failed one
            self.emit({"ev": "part_done", "job": job, "part": msg.get("part")})
            return
        self._keep(job, info, fd)
        self.emit({"ev": "part_failed", "job": job, **{k: msg.get(k) for k in _CAUSE}})

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
            self.emit({"ev": "part_failed", "job": job, "error": "the checkpoint writer died"})

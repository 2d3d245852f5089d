"""Disk checkpoints from a keeper's snapshots: a mixin of ``Keeper``. A snapshot going to disk is
first copied by the kernel into memory of its own (its slot is free at once for the next
snapshot); a writer process of the keeper's (``nonstop.state.writer``) takes it from there.
"""

from __future__ import annotations

import os
import selectors
import socket
import subprocess
import sys
from typing import TYPE_CHECKING

from . import shm, wire

if TYPE_CHECKING:
    from .keeper import Keeper as _Base
else:
    _Base = object


class DiskWrites(_Base):
    def _stager(self) -> None:
        while True:
            with self.changed:
                while not self.stage_queue:
                    self.changed.wait(1.0)
                job = self.stage_queue.popleft()
                h = self.holders.get(job["holder"])
                found = h.newest(job["step"]) if h is not None else None
                if found is None:
                    self.emit({"ev": "part_failed", "job": job,
                               "error": f"no snapshot of step {job['step']} in {job['holder']}"})
                    continue
                i, info = found
                h.leases[i]["stager"] += 1
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
                with self.changed:
                    h.leases[i]["stager"] -= 1
                    if h.leases[i]["stager"] <= 0:
                        del h.leases[i]["stager"]
                    self.changed.notify_all()
            if staged is not None:
                with self.lock:
                    self.write_queue.append((job, info, staged))
            self.wake()

    def _start_writer(self) -> None:
        if self.writer is not None and self.writer.poll() is None:
            return
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.writer = subprocess.Popen(
            [sys.executable, "-m", "nonstop.state.writer", str(theirs.fileno()), str(os.getpid())],
            pass_fds=[theirs.fileno()], start_new_session=True, stdin=subprocess.DEVNULL)
        theirs.close()
        self.writer_sock = mine
        self.sel.register(mine, selectors.EVENT_READ, "writer")

    def _dispatch_persist(self) -> None:
        with self.lock:
            if self.writer_job is not None or not self.write_queue:
                return
            job, info, fd = self.write_queue.popleft()
            self.writer_job = (job, fd)
        if self.writer is None or self.writer.poll() is not None:
            self._writer_gone(keep_job=True)
            self._start_writer()
        try:
            wire.send(self.writer_sock, {"op": "write", "job": job, "info": info.to_wire()}, [fd])
        except OSError:
            self._writer_gone()

    def _from_writer(self) -> None:
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
        job, fd = self.writer_job
        self.writer_job = None
        os.close(fd)  # the staged copy: freed once the writer unmaps it too
        ev = "part_done" if msg["op"] == "done" else "part_failed"
        self.emit({"ev": ev, "job": job, "part": msg.get("part"), "error": msg.get("error")})

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
            job, fd = self.writer_job
            self.writer_job = None
            os.close(fd)
            self.emit({"ev": "part_failed", "job": job, "error": "the checkpoint writer died"})

"""Copying snapshots to the buddy node's keeper, and taking in other nodes' copies: a mixin of
``Keeper`` (it shares the keeper's holders and lock), run in the keeper's own threads.

A copy goes from the slot's memfd straight into a TCP socket (``sendfile``) and from the socket
straight into the replica slot; its header is written last, so a copy cut short is never valid.
"""

from __future__ import annotations

import hmac
import json
import os
import socket
import struct
import time
from typing import TYPE_CHECKING

from . import shm

if TYPE_CHECKING:
    from .keeper import Keeper as _Base
else:
    _Base = object

REPLICA_TIMEOUT_S = 120.0
DEFER_LIMIT_S = 120.0  # a write (a snapshot, a replica) waits at most this long for a free slot


class Replication(_Base):
    def _replicator(self) -> None:
        conns: dict[str, socket.socket] = {}
        while True:
            with self.changed:
                while not self.repl_queue:
                    self.changed.wait(1.0)
                name = self.repl_queue.popleft()
                h, addr = self.holders.get(name), self.replicate_to.get(name)
                found = h.newest() if h is not None and addr is not None else None
                if found is None or found[1].seq <= h.replicated:
                    continue
                i, info = found
                h.leases[i]["replication"] += 1
                fd = os.dup(h.fds[i])
            t0 = time.time()
            error, fresh = self._send_replica(conns, addr, name, info, fd)
            os.close(fd)
            with self.changed:
                h.leases[i]["replication"] -= 1
                if error is None and self.replicate_to.get(name) == addr:
                    h.replicated = max(h.replicated, info.seq)
                    h.replicated_step = info.step
                    if fresh:  # into memory the buddy had to allocate: not a steady cost
                        h.repl_first_s = time.time() - t0
                    else:
                        h.repl_s = time.time() - t0
                elif error is not None:
                    h.repl_error = error
                self.changed.notify_all()
            self.emit({"ev": "replicated" if error is None else "replication_failed",
                       "holder": name, "step": info.step, "bytes": info.total,
                       "seconds": round(time.time() - t0, 6), "to": addr, "error": error})

    def _send_replica(self, conns: dict[str, socket.socket], addr: str, name: str,
                      info: shm.SlotInfo, fd: int) -> tuple[str | None, bool]:
        """Send one snapshot; returns (error or None, whether the buddy wrote it into new memory)."""
        try:
            sock = conns.get(addr)
            if sock is None:
                host, _, port = addr.rpartition(":")
                sock = socket.create_connection((host, int(port)), timeout=10.0)
                sock.settimeout(REPLICA_TIMEOUT_S)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small frames, no waits
                conns[addr] = sock
            head = json.dumps({"owner": name, "total": info.total, "step": info.step,
                               "seq": info.seq, "from": self.node, "token": self.token}).encode()
            sock.sendall(struct.pack("<I", len(head)) + head)
            with os.fdopen(os.dup(fd), "rb") as fh:
                sock.sendfile(fh, 0, info.total)  # from the memfd straight into the socket
            ack = _recv_exact(sock, 1)
            if ack not in (b"k", b"f"):
                raise ConnectionError("the buddy did not acknowledge the replica")
            return None, ack == b"f"
        except (OSError, ValueError) as exc:
            sock = conns.pop(addr, None)
            if sock is not None:
                sock.close()
            return f"{type(exc).__name__}: {exc}", False

    def _receive(self, sock: socket.socket) -> None:
        """Replicas pushed by other nodes' keepers, straight into this node's slots."""
        sock.settimeout(REPLICA_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mapped: dict[tuple[str, int], shm.Slot] = {}
        try:
            while True:
                (n,) = struct.unpack("<I", _recv_exact(sock, 4))
                head = json.loads(_recv_exact(sock, n))
                if not hmac.compare_digest(str(head.get("token", "")), self.token):
                    raise ValueError("a replica without this job's token: refused")
                name = "rep" + head["owner"].lstrip("r")
                total = int(head["total"])
                with self.changed:
                    h = self.holder(name)
                    deadline = time.time() + DEFER_LIMIT_S
                    while not h.free(h.older()) and time.time() < deadline:
                        self.changed.wait(0.5)
                    i = h.older()
                    fd, fresh = h.ensure(i, total)
                    h.writing[i] = "replica-in"
                    slot = mapped.get((name, i))
                    if slot is None or slot.inode != os.fstat(fd).st_ino or slot.size < total:
                        slot = mapped[(name, i)] = shm.Slot(fd, populate=True)
                try:
                    slot.invalidate()
                    header = _recv_exact(sock, shm.HEADER)
                    info = shm.parse_header(header)
                    view = slot.buffer[shm.HEADER:total]
                    got = 0
                    while got < len(view):
                        k = sock.recv_into(view[got:])
                        if not k:
                            raise ConnectionError("the sender went away mid-replica")
                        got += k
                    if info is not None:
                        slot.commit(info)  # the header last: valid only once complete
                finally:
                    with self.changed:
                        h.writing[i] = None
                        self.changed.notify_all()
                sock.sendall(b"f" if fresh else b"k")
                self.wake()
        except (OSError, ValueError, struct.error):
            sock.close()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)

"""Copying snapshots to the buddy node's keeper, and taking in other nodes' copies: a mixin of
``Keeper`` (it shares the keeper's holders and lock), run in the keeper's own threads.

Two ways over TCP, chosen by the keeper's environment:

- with the job's secret (``$NONSTOP_JOB_SECRET``: many hosts, replicas between real addresses),
  the authenticated channel (``nonstop.net.channel``): the listener proves both ends hold the
  secret, every frame is MACed, and a frame that fails its check never reaches a slot. One frame
  per replica: a JSON header and the slot's bytes as payload, sent from a mapping of the memfd;
  the answer is a frame ``{"ack": "k"|"f"}``.
- without it (one host, loopback), a plain socket: each replica's header carries the token
  ``$NONSTOP_KEEPER_TOKEN``; the copy goes from the slot's memfd straight into the socket
  (``sendfile``) and from the socket straight into the replica slot; the ack is one byte.

Either way the replica's header is written last, so a copy cut short is never valid, and ``k``
says the buddy wrote into memory in place, ``f`` into memory it had to allocate.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import socket
import struct
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from ..net import channel
from . import shm

if TYPE_CHECKING:
    from .keeper import Keeper as _Base
else:
    _Base = object

REPLICA_TIMEOUT_S = 120.0
# a snapshot waits this long (or 3 replications' time) for the one before to reach the buddy;
# then it goes on without waiting (the buddy falls behind: a cut-off or slow host must not
# stall training) until a replica is taken again
REPL_WAIT_S = 0.5
DEFER_LIMIT_S = 120.0  # a write (a snapshot, a replica) waits at most this long for a free slot
CONNECT_S = 10.0
TEND_S = 1.0  # how often handshakes under way are looked at without a byte coming in


def job_secret(env: Mapping[str, str] = os.environ) -> bytes | None:
    """The job's secret when the environment names one, else None (one host: the token path).
    Set but empty is a ValueError, never an unauthenticated listener."""
    if channel.SECRET_ENV not in env:
        return None
    return channel.load_secret(env=env)


class Replication(_Base):
    # == the listener ============================================================================
    def _listen_for_replicas(self, host: str) -> None:
        """``self.tcp`` (a selector-ready object) and ``self.tcp_addr`` ("host:port")."""
        self._next_tend = 0.0
        if self.secret is None:
            self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            self.tcp.bind((host, 0))
            self.tcp.listen(16)
            port = self.tcp.getsockname()[1]
        else:
            self.tcp = channel.Listener(host, self.secret, on_refused=self._replica_refused)
            port = self.tcp.port
        self.tcp_addr = f"{host}:{port}"

    def _accept_replicas(self) -> None:
        """Main thread: a connection (or handshake bytes) came in. Each accepted connection gets
        a receiving thread of its own."""
        if self.secret is None:
            conn, _ = self.tcp.accept()
            threading.Thread(target=self._receive, args=(conn,), daemon=True,
                             name="replica-in").start()
            return
        self._next_tend = time.monotonic() + TEND_S
        while True:  # the listener advances the handshakes itself; never blocks here
            ch = self.tcp.accept(0)
            if ch is None:
                return
            threading.Thread(target=self._receive_framed, args=(ch,), daemon=True,
                             name="replica-in").start()

    def _tend_replicas(self) -> None:
        """Main thread, now and then: a handshake that stalled is refused when its time is up
        (the listener sees that only when asked)."""
        if self.secret is not None and time.monotonic() >= self._next_tend:
            self._accept_replicas()

    def _replica_refused(self, peer: tuple[str, int], why: str) -> None:
        # the listener has logged it (one line on stderr); the subscribers hear of it too
        self.emit({"ev": "replica_refused", "peer": f"{peer[0]}:{peer[1]}", "why": why})

    # == sending =================================================================================
    def _replicator(self) -> None:
        conns = self.repl_conns  # buddy address -> socket or channel, kept open
        mapped: dict[tuple[str, int], shm.Slot] = {}  # own slots mapped for the channel
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
            try:
                if self.secret is None:
                    error, fresh = self._send_replica(conns, addr, name, info, fd)
                else:
                    slot = _mapped(mapped, (name, i), fd, info.total)
                    error, fresh = self._send_framed(conns, addr, name, info, slot)
            finally:
                os.close(fd)
            with self.changed:
                h.leases[i]["replication"] -= 1
                if error is None and self.replicate_to.get(name) == addr:
                    h.repl_error = None  # caught up: writes keep in step with the buddy again
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

    def _send_replica(self, conns: dict[str, Any], addr: str, name: str,
                      info: shm.SlotInfo, fd: int) -> tuple[str | None, bool]:
        """Send one snapshot (token path); returns (error or None, whether the buddy wrote it
        into new memory)."""
        try:
            sock = conns.get(addr)
            if sock is None:
                host, _, port = addr.rpartition(":")
                sock = socket.create_connection((host, int(port)), timeout=CONNECT_S)
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
            _forget(conns, addr)
            return f"{type(exc).__name__}: {exc}", False

    def _send_framed(self, conns: dict[str, Any], addr: str, name: str, info: shm.SlotInfo,
                     slot: shm.Slot) -> tuple[str | None, bool]:
        """Send one snapshot over the authenticated channel: one frame, its payload the slot's
        mapping itself (no copy here); then wait for the buddy's ack frame."""
        try:
            ch = conns.get(addr)
            if ch is None:
                host, _, port = addr.rpartition(":")
                ch = conns[addr] = channel.connect(host, int(port), self.secret, CONNECT_S)
            ch.send({"owner": name, "total": info.total, "step": info.step, "seq": info.seq,
                     "from": self.node}, payload=slot.buffer[:info.total])
            reply, _ = ch.recv(timeout=REPLICA_TIMEOUT_S)
            ack = reply.get("ack")
            if ack not in ("k", "f"):
                raise ConnectionError(f"the buddy did not acknowledge the replica: {reply}")
            return None, ack == "f"
        except (OSError, ValueError, channel.AuthError, channel.ChannelClosed) as exc:
            _forget(conns, addr)
            return f"{type(exc).__name__}: {exc}", False

    # == receiving ===============================================================================
    @contextlib.contextmanager
    def _incoming(self, mapped: dict[tuple[str, int], shm.Slot], owner: str,
                  total: int) -> Iterator[tuple[shm.Slot, bool]]:
        """The replica slot a copy of ``owner``'s snapshot goes to (waiting for a free one),
        invalidated and marked as being written until the block ends; and whether its memory
        was just allocated. The block writes the data, and the header last."""
        name = "rep" + owner.lstrip("r")
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
            yield slot, fresh
        finally:
            with self.changed:
                h.writing[i] = None
                self.changed.notify_all()

    def _receive(self, sock: socket.socket) -> None:
        """Replicas pushed by other nodes' keepers (token path), straight into this node's slots."""
        sock.settimeout(REPLICA_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mapped: dict[tuple[str, int], shm.Slot] = {}
        try:
            while True:
                (n,) = struct.unpack("<I", _recv_exact(sock, 4))
                head = json.loads(_recv_exact(sock, n))
                if not hmac.compare_digest(str(head.get("token", "")), self.token):
                    raise ValueError("a replica without this job's token: refused")
                total = int(head["total"])
                with self._incoming(mapped, head["owner"], total) as (slot, fresh):
                    info = shm.parse_header(_recv_exact(sock, shm.HEADER))
                    view = slot.buffer[shm.HEADER:total]
                    got = 0
                    while got < len(view):
                        k = sock.recv_into(view[got:])
                        if not k:
                            raise ConnectionError("the sender went away mid-replica")
                        got += k
                    if info is not None:
                        slot.commit(info)  # the header last: valid only once complete
                sock.sendall(b"f" if fresh else b"k")
                self.wake()
        except (OSError, ValueError, struct.error):
            sock.close()

    def _receive_framed(self, ch: channel.Channel) -> None:
        """Replicas over the authenticated channel: a frame is delivered only once its MAC is
        checked, then copied into the replica slot, the header last."""
        mapped: dict[tuple[str, int], shm.Slot] = {}
        try:
            while True:
                msg, payload = ch.recv(timeout=None)  # an idle buddy stays connected
                total = int(msg["total"])
                if total < shm.HEADER or len(payload) != total:
                    raise ValueError(f"a replica of {len(payload)} bytes says {total}")
                info = shm.parse_header(payload[:shm.HEADER])
                if info is not None and info.total != total:
                    raise ValueError(f"a replica of {total} bytes whose header says {info.total}")
                with self._incoming(mapped, str(msg["owner"]), total) as (slot, fresh):
                    buf = slot.buffer
                    for off in range(shm.HEADER, total, shm.CHUNK):  # other threads run between
                        end = min(total, off + shm.CHUNK)
                        buf[off:end] = payload[off:end]
                    if info is not None:
                        slot.commit(info)  # the header last: valid only once complete
                del payload
                ch.send({"ack": "f" if fresh else "k"})
                self.wake()
        except (OSError, ValueError, KeyError, TypeError, channel.AuthError,
                channel.ChannelClosed) as exc:
            if not isinstance(exc, channel.ChannelClosed):  # a sender going away is no news
                print(f"keeper {self.name}: replicas from {ch.peer[0]}:{ch.peer[1]} ended: "
                      f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            ch.close()


def _mapped(cache: dict[tuple[str, int], shm.Slot], key: tuple[str, int], fd: int,
            total: int) -> shm.Slot:
    """A slot mapped once and reused (mapped again when it was grown)."""
    slot = cache.get(key)
    if slot is None or slot.inode != os.fstat(fd).st_ino or slot.size < total:
        slot = cache[key] = shm.Slot(fd)
    return slot


def _forget(conns: dict[str, Any], addr: str) -> None:
    """Close the connection to ``addr`` (from any thread: a send or a wait on it ends at once)."""
    conn = conns.pop(addr, None)
    if conn is None:
        return
    if isinstance(conn, socket.socket):
        try:
            conn.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it
        except OSError:
            pass
    conn.close()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)

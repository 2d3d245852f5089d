"""Copying snapshots to the buddy nodes' keepers, and taking in other nodes' copies: the keeper's
``Replication``, which owns where each holder's snapshots go (``replicate_to``: one buddy or
more, ``state.snapshot.replicas``) and the connections to the buddies, and works on the keeper's
slots (``slots.Slots``) in threads of its own: one sender per buddy (a buddy slow or cut off
holds up no other), one receiver per incoming connection. The keeper calls it from its loop (a
connection coming in) and from its requests (a commit, a write waiting for the buddies, a new
configuration).

Two ways over TCP, chosen by the keeper's environment:

- with the job's secret (``$NONSTOP_JOB_SECRET``: many hosts, replicas between real addresses),
  the authenticated channel (``nonstop.net.channel``): the listener proves both ends hold the
  secret, every frame is MACed, and a frame that fails its check never reaches a slot. One frame
  per replica: a JSON header and the slot's bytes as payload, sent from a mapping of the memfd;
  the answer is a frame ``{"ack": "k"|"f"|"refused"}``.
- without it (one host, loopback), a plain socket: each replica's header carries the token
  ``$NONSTOP_KEEPER_TOKEN``; the copy goes from the slot's memfd straight into the socket
  (``sendfile``) and from the socket straight into the replica slot; the ack is one byte.

The header and the channel's ack are records of ``protocol/keeper_messages.py``
(``ReplicaHeader``, ``ReplicaAck``), read strictly: a malformed one ends the connection. Either
way the replica's header is written last, so a copy cut short is never valid, and ``k`` says the
buddy wrote into memory in place, ``f`` into memory it had to allocate.
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import json
import os
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable, Iterator, Mapping

from ..net import channel, listener
from ..protocol import keeper_messages as km
from ..state import shm
from .slots import DEFER_LIMIT_S, Holder, Slots

REPLICA_TIMEOUT_S = 120.0
# a snapshot waits this long (or 3 replications' time) for the one before to reach the buddy;
# then it goes on without waiting (the buddy falls behind: a cut-off or slow host must not
# stall training) until a replica is taken again
REPL_WAIT_S = 0.5  # (across hosts only)
CONNECT_S = 10.0
TEND_S = 1.0  # how often handshakes under way are looked at without a byte coming in


def job_secret(env: Mapping[str, str] = os.environ) -> bytes | None:
    """The job's secret when the environment names one, else None (one host: the token path).
    Set but empty is a ValueError, never an unauthenticated listener."""
    if channel.SECRET_ENV not in env:
        return None
    return channel.load_secret(env=env)


class _Buddy:
    """One keeper this node's snapshots are copied to: the holders with news for it, its
    connection, and whether it was given up (its sending thread then ends). A sending thread
    per buddy: one that is slow or cut off holds up no other."""

    def __init__(self, addr: str):
        self.addr = addr
        self.queue: collections.deque[str] = collections.deque()
        self.conn: Any = None  # a socket (token path) or a channel
        self.gone = False

    def forget(self) -> None:
        """Close the connection (from any thread: a send or a wait on it ends at once)."""
        conn, self.conn = self.conn, None
        if conn is None:
            return
        if isinstance(conn, socket.socket):
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it
            except OSError:
                pass
        conn.close()


class Replication:
    """``emit``: an event for the keeper's subscribers; ``wake``: the keeper's loop looks again
    (a replica came in); ``name``: the keeper's, for its log; ``host``: the address replicas
    arrive at; ``secret``: the job's (the channel), else None and ``token`` (the token path)."""

    def __init__(self, slots: Slots, emit: Callable[[km.Report], None],
                 wake: Callable[[], None], *, name: str, node: int, host: str, token: str,
                 secret: bytes | None):
        self.slots, self.emit, self.wake = slots, emit, wake
        self.name, self.node, self.token, self.secret = name, node, token, secret
        # holder -> "host:port" of each buddy node's keeper its snapshots are copied to
        self.replicate_to: dict[str, tuple[str, ...]] = {}
        self.buddies: dict[str, _Buddy] = {}  # by address, each with its sending thread
        self._next_tend = 0.0
        self.free_within_s = DEFER_LIMIT_S  # how long a replica waits for its slot to come free
        # ``tcp``: what replicas arrive at, for the keeper's selector; ``tcp_addr``: "host:port"
        if secret is None:
            self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            self.tcp.bind((host, 0))
            self.tcp.listen(16)
            port = self.tcp.getsockname()[1]
        else:
            self.tcp = listener.Listener(host, secret, on_refused=self._replica_refused)
            port = self.tcp.port
        self.tcp_addr = f"{host}:{port}"

    # == the keeper's requests (called with the slots' lock held) ================================
    def targets(self, name: str) -> list[str]:
        """Where the holder's snapshots are copied to."""
        return list(self.replicate_to.get(name, ()))

    def caught_up(self, h: Holder) -> int | None:
        """The newest step every buddy of ``h`` holds (None: one holds none yet, or it has
        none)."""
        held = [h.sent.get(addr) for addr in self.replicate_to.get(h.name, ())]
        if not held or None in held:
            return None
        return min(held)[1]  # type: ignore[type-var]

    def error(self, h: Holder) -> str | None:
        """Why writes no longer wait for some of ``h``'s buddies (None: they wait for all)."""
        return "; ".join(f"{addr}: {why}" for addr, why in sorted(h.behind.items())) or None

    def _lagging(self, h: Holder, seq: int) -> list[str]:
        """The buddies that writes wait for and that do not hold snapshot ``seq`` of ``h``."""
        return [addr for addr in self.replicate_to.get(h.name, ())
                if addr not in h.behind and h.sent.get(addr, (-1, 0))[0] < seq]

    def pending(self, h: Holder, seq: int) -> bool:
        """Whether writes must wait for snapshot ``seq`` of ``h`` to reach its buddies: one has
        not taken it yet, and has not fallen behind."""
        return bool(self._lagging(h, seq))

    def holds_back(self, h: Holder, newer: shm.SlotInfo | None) -> bool:
        """Whether a write into ``h``'s older slot waits for now: the ``newer`` snapshot has not
        reached every buddy yet. Across hosts it waits ``REPL_WAIT_S`` (or 3 copies' time) at
        most; then the buddies still without it are behind (``replication_behind``) and writes
        stop waiting for them. (On one host a buddy is never cut off: a keeper gone refuses the
        connection at once.)"""
        if newer is not None and self.pending(h, newer.seq):
            if self.secret is None:
                return True
            now = time.time()
            h.repl_wait_since = h.repl_wait_since or now
            limit = max(REPL_WAIT_S, 3 * (h.repl_s or 0.0))
            if now - h.repl_wait_since < limit:
                return True
            for addr in self._lagging(h, newer.seq):
                h.behind[addr] = (f"the buddy did not take step {newer.step} within "
                                  f"{limit:.2f} s: snapshots go on without waiting for it")
                self.emit(km.ReplicationBehind(holder=h.name, step=newer.step, to=addr,
                                               waited_s=round(limit, 3)))
        h.repl_wait_since = None
        return False

    def expected_s(self, h: Holder) -> float | None:
        """How long copying ``h``'s next snapshot to its buddies may take, if known: the copies
        share this machine's CPUs, one per buddy."""
        repl_s = h.repl_s if h.repl_s is not None else h.repl_first_s
        to = self.replicate_to.get(h.name, ())
        if repl_s is None or not to:
            return None
        here = self.tcp_addr.rpartition(":")[0]
        # a buddy on this very machine: its CPUs pay for both ends of the copy
        return sum(repl_s * (2 if addr.rpartition(":")[0] == here else 1) for addr in to)

    def committed(self, name: str) -> None:
        """A new snapshot of the holder: each buddy's sender copies it there."""
        for addr in self.replicate_to.get(name, ()):
            b = self.buddies.get(addr)
            if b is not None and name not in b.queue:
                b.queue.append(name)
        self.slots.changed.notify_all()

    def configure(self, new: dict[str, list[str]]) -> None:
        """Where each holder's snapshots go from now on (holder -> "host:port" of each buddy).
        A buddy new to a holder holds nothing of it yet; a buddy no holder names any more is
        given up (a send stuck on it ends now)."""
        for name in set(self.replicate_to) | set(new):
            h = self.slots.holder(name)
            keep = set(new.get(name, ()))
            for addr in set(h.sent) - keep:
                del h.sent[addr]
            for addr in set(h.behind) - keep:
                del h.behind[addr]
        self.replicate_to = {name: tuple(dict.fromkeys(to)) for name, to in new.items() if to}
        used = {addr for to in self.replicate_to.values() for addr in to}
        for addr in set(self.buddies) - used:
            b = self.buddies.pop(addr)
            b.gone = True
            b.forget()
        for addr in sorted(used - set(self.buddies)):
            b = self.buddies[addr] = _Buddy(addr)
            threading.Thread(target=self._sender, args=(b,), daemon=True,
                             name=f"replicas-to-{addr}").start()
        for name in self.replicate_to:
            self.committed(name)  # each buddy takes the newest snapshot it lacks

    # == the listener (the keeper's main thread) =================================================
    def accept(self) -> None:
        """A connection (or handshake bytes) came in. Each accepted connection gets a receiving
        thread of its own."""
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

    def tend(self) -> None:
        """Now and then: a handshake that stalled is refused when its time is up (the listener
        sees that only when asked)."""
        if self.secret is not None and time.monotonic() >= self._next_tend:
            self.accept()

    def _replica_refused(self, peer: tuple[str, int], why: str) -> None:
        # the listener has logged it (one line on stderr); the subscribers hear of it too
        self.emit(km.PeerRefused(peer=f"{peer[0]}:{peer[1]}", why=why))

    # == sending =================================================================================
    def _sender(self, b: _Buddy) -> None:
        """One buddy's sending thread: each holder queued for it, its newest snapshot, unless
        the buddy has it already; until the buddy is given up. The snapshot's slot is leased
        (not written again) only while its bytes are handed over: not while the connection is
        made, nor while the buddy's ack is awaited - a buddy that stops answering must not hold
        up the next snapshot into that slot."""
        mapped: dict[tuple[str, int], shm.Slot] = {}  # own slots mapped for the channel
        while True:
            with self.slots.changed:
                while not b.queue and not b.gone:
                    self.slots.changed.wait(1.0)
                if b.gone:
                    return
                name = b.queue.popleft()
                h = self.slots.holders.get(name)
                found = self._news(h, name, b) if h is not None else None
            if h is None or found is None:
                continue
            t0 = time.time()
            error = self._connect(b) if b.conn is None else None
            if error is None:
                error, fresh, info = self._send(b, h, name, mapped)
                if info is None:
                    continue  # (no news any more)
            else:
                fresh, info = False, found[1]
            with self.slots.changed:
                if b.addr in self.replicate_to.get(name, ()):  # (still its buddy)
                    if error is None:
                        h.behind.pop(b.addr, None)  # caught up: writes keep in step with it again
                        if info.seq > h.sent.get(b.addr, (-1, 0))[0]:
                            h.sent[b.addr] = (info.seq, info.step)
                        if fresh:  # into memory the buddy had to allocate: not a steady cost
                            h.repl_first_s = time.time() - t0
                        else:
                            h.repl_s = time.time() - t0
                    else:
                        h.behind[b.addr] = error
                self.slots.changed.notify_all()
            if b.gone:  # given up while this copy was under way: its connection goes too
                b.forget()
            seconds = round(time.time() - t0, 6)
            self.emit(km.Replicated(holder=name, step=info.step, bytes=info.total,
                                    seconds=seconds, to=b.addr) if error is None else
                      km.ReplicationFailed(holder=name, step=info.step, bytes=info.total,
                                           seconds=seconds, to=b.addr, error=error))

    def _news(self, h: Holder, name: str, b: _Buddy) -> tuple[int, shm.SlotInfo] | None:
        """The holder's newest snapshot, if ``b`` is its buddy and lacks it (the slots' lock
        held)."""
        if b.addr not in self.replicate_to.get(name, ()):
            return None
        found = h.newest()
        if found is None or found[1].seq <= h.sent.get(b.addr, (-1, 0))[0]:
            return None
        return found

    def _connect(self, b: _Buddy) -> str | None:
        """A connection to the buddy (None), or why there is none."""
        host, _, port = b.addr.rpartition(":")
        try:
            if self.secret is None:
                sock = socket.create_connection((host, int(port)), timeout=CONNECT_S)
                sock.settimeout(REPLICA_TIMEOUT_S)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small frames
                b.conn = sock
            else:
                b.conn = channel.connect(host, int(port), self.secret, CONNECT_S)
        except (OSError, ValueError, channel.AuthError, channel.ChannelClosed) as exc:
            return f"{type(exc).__name__}: {exc}"
        if b.gone:
            b.forget()
            return "the buddy was given up"
        return None

    def _send(self, b: _Buddy, h: Holder, name: str, mapped: dict[tuple[str, int], shm.Slot]
              ) -> tuple[str | None, bool, shm.SlotInfo | None]:
        """Copy the holder's newest snapshot to the buddy, its slot leased until the bytes are
        handed over: (error or None, whether the buddy wrote it into new memory, the snapshot;
        None: the buddy needs none now)."""
        lease = ("replication", b.addr)
        with self.slots.changed:
            found = self._news(h, name, b)
            if found is None:
                return None, False, None
            i, info = found
            h.leases[i][lease] += 1
            fd = os.dup(h.fds[i])
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                with self.slots.changed:
                    h.unlease(i, lease)
                    self.slots.changed.notify_all()
        try:
            if self.secret is None:
                error, fresh = self._send_replica(b, name, info, fd, release)
            else:
                slot = _mapped(mapped, (name, i), fd, info.total)
                error, fresh = self._send_framed(b, name, info, slot, release)
        finally:
            os.close(fd)
            release()
        return error, fresh, info

    def _send_replica(self, b: _Buddy, name: str, info: shm.SlotInfo, fd: int,
                      handed: Callable[[], None]) -> tuple[str | None, bool]:
        """Send one snapshot (token path); ``handed()`` once its bytes are in the socket.
        Returns (error or None, whether the buddy wrote it into new memory)."""
        sock = b.conn
        if sock is None:
            return "the buddy was given up", False
        try:
            head = json.dumps(km.encode(km.ReplicaHeader(
                owner=name, total=info.total, step=info.step, seq=info.seq, node=self.node,
                token=self.token))).encode()
            sock.sendall(struct.pack("<I", len(head)) + head)
            with os.fdopen(os.dup(fd), "rb") as fh:
                sock.sendfile(fh, 0, info.total)  # from the memfd straight into the socket
            handed()
            ack = _recv_exact(sock, 1)
            if ack == b"r":  # the buddy's slot is leased to a restore: try the next snapshot
                return "the buddy refused it: its slot is leased to a reader", False
            if ack not in (b"k", b"f"):
                raise ConnectionError("the buddy did not acknowledge the replica")
            return None, ack == b"f"
        except (OSError, ValueError) as exc:
            b.forget()
            return f"{type(exc).__name__}: {exc}", False

    def _send_framed(self, b: _Buddy, name: str, info: shm.SlotInfo, slot: shm.Slot,
                     handed: Callable[[], None]) -> tuple[str | None, bool]:
        """Send one snapshot over the authenticated channel: one frame, its payload the slot's
        mapping itself (no copy here); ``handed()`` once it is sent; then wait for the buddy's
        ack frame."""
        ch = b.conn
        if ch is None:
            return "the buddy was given up", False
        try:
            ch.send(km.encode(km.ReplicaHeader(owner=name, total=info.total, step=info.step,
                                               seq=info.seq, node=self.node)),
                    payload=slot.buffer[:info.total])
            handed()
            reply, _ = ch.recv(timeout=REPLICA_TIMEOUT_S)
            ack = km.read(km.ReplicaAck, reply).ack  # (malformed: a ValueError, as is)
            if ack == "refused":
                return "the buddy refused it: its slot is leased to a reader", False
            return None, ack == "f"
        except (OSError, ValueError, channel.AuthError, channel.ChannelClosed) as exc:
            b.forget()
            return f"{type(exc).__name__}: {exc}", False

    # == receiving ===============================================================================
    @contextlib.contextmanager
    def _incoming(self, mapped: dict[tuple[str, int], shm.Slot], owner: str,
                  total: int) -> Iterator[tuple[shm.Slot, bool] | None]:
        """The replica slot a copy of ``owner``'s snapshot goes to (waiting for a free one),
        invalidated and marked as being written until the block ends; and whether its memory
        was just allocated. The block writes the data, and the header last. None when no slot
        came free within ``free_within_s``: a slot leased to a reader (a restore loading it)
        is never overwritten under it, the replica is refused instead."""
        name = "rep" + owner.lstrip("r")
        with self.slots.changed:
            h = self.slots.holder(name)
            deadline = time.time() + self.free_within_s
            while not h.free(h.older()) and time.time() < deadline:
                self.slots.changed.wait(min(0.5, max(0.001, deadline - time.time())))
            i = h.older()
            refused = not h.free(i)
            if not refused:
                fd, fresh = h.ensure(i, total)
                h.writing[i] = "replica-in"
                slot = mapped.get((name, i))
                if slot is None or slot.inode != os.fstat(fd).st_ino or slot.size < total:
                    slot = mapped[(name, i)] = shm.Slot(fd, populate=True)
                held = self._held() if fresh else None
        if refused:
            self.emit(km.ReplicaRefused(holder=name, why=f"its slot stayed leased for "
                                                         f"{self.free_within_s:g} s"))
            yield None
            return
        if held is not None:  # the replicas' memory here grew: what they cost is said
            self.emit(held)
        try:
            slot.invalidate()
            yield slot, fresh
        finally:
            with self.slots.changed:
                h.writing[i] = None
                self.slots.changed.notify_all()

    def _held(self) -> km.ReplicasHeld:
        """The memory the replicas of other nodes' snapshots take here (their slots' sizes).
        Called with the slots' lock held."""
        reps = [h for name, h in self.slots.holders.items() if name.startswith("rep")]
        return km.ReplicasHeld(bytes=sum(os.fstat(fd).st_size for h in reps for fd in h.fds
                                         if fd is not None), holders=len(reps))

    def _receive(self, sock: socket.socket) -> None:
        """Replicas pushed by other nodes' keepers (token path), straight into this node's slots."""
        sock.settimeout(REPLICA_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mapped: dict[tuple[str, int], shm.Slot] = {}
        try:
            while True:
                (n,) = struct.unpack("<I", _recv_exact(sock, 4))
                raw = json.loads(_recv_exact(sock, n))
                if not self.token:  # fail closed: a keeper told no token takes nothing
                    self._replica_refused(sock.getpeername()[:2], "this keeper has no token")
                    raise ValueError("this keeper has no token: every replica is refused")
                token = raw.get("token") if type(raw) is dict else None
                if type(token) is not str or not hmac.compare_digest(token.encode(),
                                                                     self.token.encode()):
                    self._replica_refused(sock.getpeername()[:2], "a wrong token")
                    raise ValueError("a replica without this job's token: refused")
                head = km.read(km.ReplicaHeader, raw)
                total = head.total
                with self._incoming(mapped, head.owner, total) as into:
                    if into is None:  # read and dropped: the connection stays in step
                        _discard(sock, total)
                        sock.sendall(b"r")
                        continue
                    slot, fresh = into
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
                head = km.read(km.ReplicaHeader, msg)
                total = head.total
                if total < shm.HEADER or len(payload) != total:
                    raise ValueError(f"a replica of {len(payload)} bytes says {total}")
                info = shm.parse_header(payload[:shm.HEADER])
                if info is not None and info.total != total:
                    raise ValueError(f"a replica of {total} bytes whose header says {info.total}")
                with self._incoming(mapped, head.owner, total) as into:
                    if into is None:
                        del payload
                        ch.send(km.encode(km.ReplicaAck(ack="refused")))
                        continue
                    slot, fresh = into
                    buf = slot.buffer
                    for off in range(shm.HEADER, total, shm.CHUNK):  # other threads run between
                        end = min(total, off + shm.CHUNK)
                        buf[off:end] = payload[off:end]
                    if info is not None:
                        slot.commit(info)  # the header last: valid only once complete
                del payload
                ch.send(km.encode(km.ReplicaAck(ack="f" if fresh else "k")))
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


def _discard(sock: socket.socket, n: int) -> None:
    """Read and drop ``n`` bytes."""
    buf = bytearray(min(n, 1 << 20))
    while n > 0:
        k = sock.recv_into(buf, min(n, len(buf)))
        if not k:
            raise ConnectionError("the sender went away mid-replica")
        n -= k


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)

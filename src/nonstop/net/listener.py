"""The server side of the channel: a listener that runs every handshake side by side (a silent or
garbage client holds nobody up) and hands out only authenticated channels."""

from __future__ import annotations

import errno
import hmac
import logging
import secrets
import selectors
import socket
import threading
import time
from typing import Callable

from .channel import (_ACCEPTED, _HELLO, _HELLO_MAGIC, _NONCE, _PROOF, _REFUSED, Channel,
                      ChannelClosed, _check_secret, _keys, _proof, _tune)

log = logging.getLogger("nonstop.net.channel")


class _Pending:
    """A connection whose handshake is under way: the client's hello and proof arrive into buf."""

    __slots__ = ("sock", "peer", "hello_s", "buf", "got", "deadline", "hello_ok")

    def __init__(self, sock: socket.socket, peer: tuple[str, int], hello_s: bytes, deadline: float):
        self.sock = sock
        self.peer = peer
        self.hello_s = hello_s
        self.buf = bytearray(_HELLO.size + _PROOF)
        self.got = 0
        self.deadline = deadline
        self.hello_ok = False


class Listener:
    """Accepts authenticated channels on one address.

    It binds exactly ``addr`` (an empty address is refused: every interface must be asked for
    as ``0.0.0.0`` or ``::``). Handshakes run side by side inside ``accept``, each limited by
    ``handshake_timeout_s``, so a client that sends garbage or nothing never holds up another.
    A refused peer is closed, logged, and reported to ``on_refused(address, why)``.
    """

    def __init__(self, addr: str, secret: bytes, port: int = 0, backlog: int = 64,
                 handshake_timeout_s: float = 5.0,
                 on_refused: Callable[[tuple[str, int], str], None] | None = None,
                 stall_timeout_s: float = 30.0, tos: int = 0):
        self._secret = _check_secret(secret)
        self.tos = tos  # the class of service of what it sends (channel.CONTROL_TOS)
        if not addr:
            raise ValueError("a listener needs the address to bind; give 0.0.0.0 or :: "
                             "to listen on every interface")
        family, type_, proto, _, sockaddr = socket.getaddrinfo(
            addr, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)[0]
        sock = socket.socket(family, type_, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
            sock.listen(backlog)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self.addr, self.port = sock.getsockname()[:2]
        self.handshake_timeout_s = handshake_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.on_refused = on_refused
        self._max_pending = max(1, backlog)
        self._pending: dict[int, _Pending] = {}
        self._listening = True  # whether the listening socket is in the selector
        self._lock = threading.RLock()  # one accept at a time; RLock: on_refused may close us
        self._closed = False
        self._state_lock = threading.Lock()
        # close() from another thread wakes a blocked accept through this pair
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")

    def __repr__(self) -> str:
        return f"<Listener {self.addr}:{self.port}{' closed' if self._closed else ''}>"

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fileno(self) -> int:
        """For selectors: readable when accept has something to do (a new connection, or
        handshake bytes). Where the selector has a descriptor (epoll, kqueue) that is it, so
        handshakes under way are seen too; else the listening socket."""
        sel_fileno = getattr(self._sel, "fileno", None)
        return sel_fileno() if sel_fileno is not None else self._sock.fileno()

    def accept(self, timeout: float | None = None) -> Channel | None:
        """The next authenticated channel, or None when ``timeout`` passes first.
        Refused peers do not end the wait."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                if self._closed:
                    raise ChannelClosed(f"listener {self.addr}:{self.port} is closed")
                now = time.monotonic()
                self._expire(now)
                ends = [p.deadline for p in self._pending.values()]
                if deadline is not None:
                    ends.append(deadline)
                wait = max(0.0, min(ends) - now) if ends else None
                for key, _ in self._sel.select(wait):
                    if self._closed:  # by on_refused, or another thread
                        break
                    if key.data == "listen":
                        self._take_new()
                    elif key.data == "wake":
                        continue  # closed: seen at the top of the loop
                    elif self._pending.get(key.data.sock.fileno()) is key.data:
                        channel = self._advance(key.data)
                        if channel is not None:
                            return channel  # the other ready events stay for the next call
                if deadline is not None and time.monotonic() >= deadline:
                    self._expire(time.monotonic())
                    return None

    def close(self) -> None:
        """Idempotent: stops listening and refuses the handshakes under way."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        with self._lock:  # a blocked accept wakes, sees _closed and lets go of the lock
            for p in list(self._pending.values()):
                self._drop(p)
                p.sock.close()
            self._sel.close()
            self._sock.close()
            self._wake_r.close()
            self._wake_w.close()

    # -- handshakes --

    def _take_new(self) -> None:
        """Accept what is waiting (up to the cap of handshakes under way) and say hello."""
        while len(self._pending) < self._max_pending:
            try:
                conn, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("listener %s:%s cannot accept now: %s", self.addr, self.port, e)
                    time.sleep(0.05)  # the connection stays queued; do not spin on it
                    return
                raise
            peer = (addr[0], addr[1])
            try:
                conn.setblocking(False)
                _tune(conn, self.tos)
                hello_s = _HELLO.pack(_HELLO_MAGIC, b"S", secrets.token_bytes(_NONCE))
                if conn.send(hello_s) != len(hello_s):
                    raise OSError("could not send the hello")
            except OSError as e:
                conn.close()
                self._report(peer, f"connection failed before the handshake: {e}")
                continue
            p = _Pending(conn, peer, hello_s, time.monotonic() + self.handshake_timeout_s)
            self._pending[conn.fileno()] = p
            self._sel.register(conn, selectors.EVENT_READ, p)
        if self._listening:  # full: leave new connections in the kernel's queue for now
            self._sel.unregister(self._sock)
            self._listening = False

    def _advance(self, p: _Pending) -> Channel | None:
        """Read what the client sent; on a complete and correct proof, its channel."""
        try:
            n = p.sock.recv_into(memoryview(p.buf)[p.got:])
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as e:
            if p.got == 0:  # reset before a byte: a liveness probe too (closed in a hurry)
                self._drop(p)
                p.sock.close()
                log.debug("%s:%s connected and reset without a byte: %s", *p.peer, e)
                return None
            self._refuse(p, f"connection failed during the handshake: {e}", tell=False)
            return None
        if n == 0:
            if p.got == 0:  # connected and left without a byte: a liveness probe, not an attempt
                self._drop(p)
                p.sock.close()
                log.debug("%s:%s connected and closed without a byte", *p.peer)
                return None
            self._refuse(p, "closed the connection during the handshake", tell=False)
            return None
        p.got += n
        if not p.hello_ok and p.got >= _HELLO.size:
            magic, role, _ = _HELLO.unpack_from(p.buf)
            if magic != _HELLO_MAGIC or role != b"C":
                self._refuse(p, "bad hello: not a nonstop channel client (or another version)")
                return None
            p.hello_ok = True
        if p.got < len(p.buf):
            return None
        hello_c = bytes(p.buf[:_HELLO.size])
        keys = _keys(self._secret, hello_c, p.hello_s)
        proof_c = _proof(keys, "C", hello_c, p.hello_s)
        if not hmac.compare_digest(bytes(p.buf[_HELLO.size:]), proof_c):
            self._refuse(p, "wrong secret: the client's proof does not match")
            return None
        reply = _ACCEPTED + _proof(keys, "S", hello_c, p.hello_s)
        try:
            if p.sock.send(reply) != len(reply):
                raise OSError("short write")
        except OSError as e:
            self._refuse(p, f"connection failed at the end of the handshake: {e}", tell=False)
            return None
        self._drop(p)
        return Channel(p.sock, p.peer, keys["frames S>C"], keys["frames C>S"], "S",
                       self.stall_timeout_s)

    def _expire(self, now: float) -> None:
        for p in [p for p in self._pending.values() if p.deadline <= now]:
            self._refuse(p, f"no complete handshake within {self.handshake_timeout_s}s")

    def _drop(self, p: _Pending) -> None:
        """Forget a handshake (the socket stays open) and listen again if we were full."""
        self._pending.pop(p.sock.fileno(), None)
        try:
            self._sel.unregister(p.sock)
        except (KeyError, ValueError):
            pass
        if not self._listening and not self._closed:
            self._sel.register(self._sock, selectors.EVENT_READ, "listen")
            self._listening = True

    def _refuse(self, p: _Pending, why: str, tell: bool = True) -> None:
        self._drop(p)
        if tell:  # so that a client of ours says "refused" rather than "connection lost"
            try:
                p.sock.send(_REFUSED)
            except OSError:
                pass
        p.sock.close()
        self._report(p.peer, why)

    def _report(self, peer: tuple[str, int], why: str) -> None:
        log.warning("refused %s:%s on %s:%s: %s", peer[0], peer[1], self.addr, self.port, why)
        if self.on_refused is not None:
            try:
                self.on_refused(peer, why)
            except Exception:
                log.exception("on_refused failed")



"""torch's ``TCPStore``, served from Python: the ranks connect with torch's own client
(``init_process_group``, ``TCPStore(..., is_master=False)``), and the process that serves it
reads and writes the keys directly, without a client and without importing torch.

Why not torch's server on one host: it lives in torch, and importing torch costs ``nonstop run``
two seconds of CPU (more on a busy host) for a dictionary behind a socket; the launcher's own
work (watching the ranks, deciding) has no other use for torch. Across hosts the agents serve
torch's own (``net.netif.torch_store``): thousands of ranks may meet on one, and this server,
behind its process's interpreter lock, made that rendezvous twice as slow.

The wire protocol is torch's (``torch/csrc/distributed/c10d/TCPStoreBackend.hpp`` and the libuv
backend): each request is a one-byte query type and its fields, integers in the machine's byte
order (little-endian on every platform torch ships for), strings and values as a 64-bit length
and the bytes. A connection's first request must be ``VALIDATE`` with the protocol's magic
number. Only ``PING``, ``COMPARE_SET``, ``GET``, ``ADD``, ``CHECK``, ``GETNUMKEYS``,
``DELETE_KEY``, ``MULTI_GET``, ``CANCEL_WAIT``, ``QUEUE_POP``, ``QUEUE_LEN`` and ``LIST_KEYS``
answer at once; ``WAIT`` and ``BARRIER`` answer when their keys are there (or when cancelled);
``SET``, ``APPEND``, ``MULTI_SET`` and ``QUEUE_PUSH`` answer nothing.

One thread per server runs a selector loop; the in-process methods (``set``, ``get``...) take the
same lock, so a waiting rank is woken by a key set from either side.
"""

from __future__ import annotations

import collections
import os
import selectors
import socket
import struct
import sys
import threading
import time
from typing import Iterable

MAGIC = 0x3C85F7CE
(VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY, APPEND, MULTI_GET,
 MULTI_SET, CANCEL_WAIT, PING, QUEUE_PUSH, QUEUE_POP, QUEUE_LEN, LIST_KEYS, BARRIER) = range(19)
READY, NOT_READY = 0, 1  # CHECK's answer
STOP_WAITING, WAIT_CANCELED = 0, 1  # WAIT's and CANCEL_WAIT's
MAX_KEY_LEN = 8 * 1024  # torch's own server refuses longer keys, larger values, more keys
MAX_VALUE_LEN = 8 * 1024 * 1024
MAX_KEYS = 128 * 1024
SWITCH_INTERVAL_S = 0.0005
PREFIX = "/"  # what torch's TCPStore client puts before every key it sends

_U32, _U64, _I64 = struct.Struct("<I"), struct.Struct("<Q"), struct.Struct("<q")


class _Incomplete(Exception):
    """The request's bytes have not all arrived yet."""


class BadRequest(ValueError):
    """Bytes that are no request of the protocol: the connection is closed."""


def _key(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def _raw(key: str) -> bytes:
    return key.encode("utf-8", "surrogateescape")


def _value(v: str | bytes | bytearray) -> bytes:
    return v.encode() if isinstance(v, str) else bytes(v)


def _vector(b: bytes) -> bytes:
    return _U64.pack(len(b)) + b


class _Request:
    """Reads one request's fields from a connection's received bytes."""

    def __init__(self, buf: bytearray):
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise _Incomplete
        out = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return out

    def u32(self) -> int:
        return _U32.unpack(self.take(4))[0]

    def u64(self) -> int:
        return _U64.unpack(self.take(8))[0]

    def i64(self) -> int:
        return _I64.unpack(self.take(8))[0]

    def key(self) -> str:
        n = self.u64()
        if n > MAX_KEY_LEN:
            raise BadRequest(f"a key of {n} bytes (at most {MAX_KEY_LEN})")
        return _key(self.take(n))

    def value(self) -> bytes:
        n = self.u64()
        if n > MAX_VALUE_LEN:
            raise BadRequest(f"a value of {n} bytes (at most {MAX_VALUE_LEN})")
        return self.take(n)

    def keys(self) -> list[str]:
        n = self.u64()
        if n > MAX_KEYS:
            raise BadRequest(f"{n} keys in one request (at most {MAX_KEYS})")
        return [self.key() for _ in range(n)]


class _Conn:
    __slots__ = ("sock", "inbox", "outbox", "validated", "awaited", "closed")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.inbox = bytearray()
        self.outbox = bytearray()
        self.validated = False
        self.awaited = 0  # keys its WAIT (or BARRIER) still waits for; 0: none
        self.closed = False


class StoreServer:
    """A TCPStore server on ``sock`` (a listening socket, which it takes over). ``port`` is where
    torch's clients connect."""

    def __init__(self, sock: socket.socket):
        self._listener = sock
        self.port: int = sock.getsockname()[1]
        sock.setblocking(False)
        self._data: dict[str, bytes] = {}
        self._queues: dict[str, collections.deque[bytes]] = {}
        self._waiting: dict[str, list[_Conn]] = {}  # key -> the connections whose WAIT needs it
        self._lock = threading.Condition()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._sel.register(sock, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._writable: set[_Conn] = set()  # connections with bytes the loop must still send
        self._pending: list[_Conn] = []  # ...of which those it must start watching (other thread)
        self._closing = False
        # a request waits for this process's interpreter lock: handed over every 5 ms by default,
        # which a recovery's rendezvous (a few round trips per rank) pays each time
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._loop, name="nonstop-tcpstore", daemon=True)
        self._thread.start()

    # -- in this process ------------------------------------------------------------------------
    # (keys as torch's TCPStore object takes them: its client puts PREFIX before each on the wire)
    def set(self, key: str, value: str | bytes) -> None:
        with self._lock:
            self._set(PREFIX + key, _value(value))

    def get(self, key: str, timeout: float = 300.0) -> bytes:
        """The key's value, once it is there (as torch's ``get``: waits, up to ``timeout``)."""
        deadline = time.monotonic() + timeout
        key = PREFIX + key
        with self._lock:
            while key not in self._data:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"key {key!r} not set within {timeout:g} s")
                self._lock.wait(left)
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            return self._add(PREFIX + key, amount)

    def check(self, keys: Iterable[str]) -> bool:
        with self._lock:
            return self._check([PREFIX + k for k in keys])

    def multi_get(self, keys: Iterable[str]) -> list[bytes]:
        with self._lock:
            return [self._data.get(PREFIX + k, b"") for k in keys]

    def multi_set(self, keys: Iterable[str], values: Iterable[str | bytes]) -> None:
        with self._lock:
            for k, v in zip(keys, values, strict=True):
                self._set(PREFIX + k, _value(v))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        with self._lock:
            return self._compare_set(PREFIX + key, _value(expected), _value(desired))

    def delete_key(self, key: str) -> bool:
        with self._lock:
            return self._data.pop(PREFIX + key, None) is not None

    def num_keys(self) -> int:
        with self._lock:
            return len(self._data)

    def close(self) -> None:
        """Stop serving: every connection is closed (its clients see the store gone)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._wake()
        if threading.current_thread() is not self._thread:
            self._thread.join(5.0)

    # -- the store itself (lock held) -----------------------------------------------------------
    def _set(self, key: str, value: bytes) -> None:
        self._data[key] = value
        self._wake_waiters(key)

    def _add(self, key: str, amount: int) -> int:
        old = self._data.get(key)
        if old is not None:
            try:
                amount += int(old)
            except ValueError:
                raise BadRequest(f"add to key {key!r}, whose value is not a number") from None
        self._set(key, str(amount).encode())
        return amount

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        old = self._data.get(key)
        if old is None:
            if expected:
                # (as torch's: a missing key answers with the expected value, and sets nothing)
                self._wake_waiters(key)
                return expected
            self._set(key, desired)
            return desired
        if old == expected:
            self._data[key] = desired
        self._wake_waiters(key)
        return self._data[key]

    def _check(self, keys: list[str]) -> bool:
        return all(k in self._data or bool(self._queues.get(k)) for k in keys)

    def _wake_waiters(self, key: str, one: bool = False) -> None:
        self._lock.notify_all()
        conns = self._waiting.get(key)
        if not conns:
            return
        for c in list(conns):
            conns.remove(c)
            c.awaited -= 1
            if c.awaited == 0:
                self._send(c, bytes([STOP_WAITING]))
                if one:
                    break
        if not conns:
            self._waiting.pop(key, None)

    def _forget_waits(self, c: _Conn) -> None:
        if c.awaited == 0:
            return
        c.awaited = 0
        for key in [k for k, conns in self._waiting.items() if c in conns]:
            self._waiting[key] = [x for x in self._waiting[key] if x is not c]
            if not self._waiting[key]:
                del self._waiting[key]

    # -- the wire -------------------------------------------------------------------------------
    def _send(self, c: _Conn, data: bytes) -> None:
        if c.closed:
            return
        if not c.outbox:
            try:
                n = c.sock.send(data)
            except BlockingIOError:
                n = 0
            except OSError:
                self._drop(c)
                return
            data = data[n:]
            if not data:
                return
        c.outbox += data
        if c not in self._writable:
            self._writable.add(c)
            if threading.current_thread() is self._thread:
                self._sel.modify(c.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, c)
            else:
                self._pending.append(c)
                self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def _serve(self, c: _Conn) -> None:
        """Answer every complete request that ``c`` sent."""
        while c.inbox and not c.closed:
            r = _Request(c.inbox)
            try:
                query = r.take(1)[0]
                if not c.validated:
                    if query != VALIDATE or r.u32() != MAGIC:
                        raise BadRequest("the first request is not VALIDATE with the magic number")
                    c.validated = True
                else:
                    self._answer(c, query, r)
            except _Incomplete:
                return
            except BadRequest:
                self._drop(c)
                return
            del c.inbox[:r.pos]

    def _answer(self, c: _Conn, query: int, r: _Request) -> None:
        match query:
            case 1:  # SET
                key, value = r.key(), r.value()
                self._set(key, value)
            case 2:  # COMPARE_SET
                key, expected, desired = r.key(), r.value(), r.value()
                self._send(c, _vector(self._compare_set(key, expected, desired)))
            case 3:  # GET
                self._send(c, _vector(self._data.get(r.key(), b"")))
            case 4:  # ADD
                key, amount = r.key(), r.i64()
                self._send(c, _I64.pack(self._add(key, amount)))
            case 5:  # CHECK
                self._send(c, bytes([READY if self._check(r.keys()) else NOT_READY]))
            case 6:  # WAIT
                self._wait(c, r.keys())
            case 7:  # GETNUMKEYS
                self._send(c, _I64.pack(len(self._data)))
            case 8:  # DELETE_KEY
                self._send(c, _I64.pack(int(self._data.pop(r.key(), None) is not None)))
            case 9:  # APPEND
                key, value = r.key(), r.value()
                self._set(key, self._data.get(key, b"") + value)
            case 10:  # MULTI_GET
                self._send(c, b"".join(_vector(self._data.get(k, b"")) for k in r.keys()))
            case 11:  # MULTI_SET
                n = r.u64()
                if n > MAX_KEYS:
                    raise BadRequest(f"{n} keys in one request")
                pairs = [(r.key(), r.value()) for _ in range(n)]  # (all read before any is set)
                for key, value in pairs:
                    self._set(key, value)
            case 12:  # CANCEL_WAIT
                self._forget_waits(c)
                self._send(c, bytes([WAIT_CANCELED]))
            case 13:  # PING
                self._send(c, _U32.pack(r.u32()))
            case 14:  # QUEUE_PUSH
                key, value = r.key(), r.value()
                self._queues.setdefault(key, collections.deque()).append(value)
                self._wake_waiters(key, one=True)
            case 15:  # QUEUE_POP
                q = self._queues.setdefault(r.key(), collections.deque())
                out = _I64.pack(len(q))
                if q:
                    out += _vector(q.popleft())
                self._send(c, out)
            case 16:  # QUEUE_LEN
                self._send(c, _I64.pack(len(self._queues.get(r.key(), ()))))
            case 17:  # LIST_KEYS
                keys = list(self._data)
                self._send(c, _I64.pack(len(keys)) + b"".join(_vector(_raw(k)) for k in keys))
            case 18:  # BARRIER
                key, world = r.key(), r.i64()
                count = int(self._data.get(key, b"0")) + 1
                self._data[key] = str(count).encode()  # (the ones waiting wake at the last only)
                if count >= world:
                    self._wake_waiters(key)
                    self._send(c, bytes([STOP_WAITING]))
                else:
                    c.awaited = 1
                    self._waiting.setdefault(key, []).append(c)
            case _:
                raise BadRequest(f"unknown query type {query}")

    def _wait(self, c: _Conn, keys: list[str]) -> None:
        if self._check(keys):
            self._send(c, bytes([STOP_WAITING]))
            return
        missing = [k for k in keys if k not in self._data]
        c.awaited = len(missing)
        for k in missing:
            self._waiting.setdefault(k, []).append(c)

    def _drop(self, c: _Conn) -> None:
        if c.closed:
            return
        c.closed = True
        self._forget_waits(c)
        self._writable.discard(c)
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.sock.close()

    def _loop(self) -> None:
        try:
            while True:
                events = self._sel.select(timeout=1.0)
                with self._lock:
                    if self._closing:
                        return
                    for key, mask in events:
                        if key.data is None:
                            self._accept()
                        elif key.data == "wake":
                            try:
                                os.read(self._wake_r, 4096)
                            except BlockingIOError:
                                pass
                        else:
                            self._io(key.data, mask)
                    for c in self._pending:  # sends queued from another thread
                        if not c.closed and c.outbox:
                            self._sel.modify(c.sock, selectors.EVENT_READ | selectors.EVENT_WRITE,
                                             c)
                    self._pending.clear()
        finally:
            with self._lock:
                for key in list(self._sel.get_map().values()):
                    if isinstance(key.data, _Conn):
                        self._drop(key.data)
                self._sel.close()
                self._listener.close()
                os.close(self._wake_r)
                os.close(self._wake_w)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, a connection reset before it was taken
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            c = _Conn(sock)
            self._sel.register(sock, selectors.EVENT_READ, c)

    def _io(self, c: _Conn, mask: int) -> None:
        if mask & selectors.EVENT_WRITE and c.outbox:
            try:
                n = c.sock.send(c.outbox)
                del c.outbox[:n]
            except BlockingIOError:
                pass
            except OSError:
                self._drop(c)
                return
            if not c.outbox:
                self._writable.discard(c)
                self._sel.modify(c.sock, selectors.EVENT_READ, c)
        if mask & selectors.EVENT_READ:
            try:
                data = c.sock.recv(65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._drop(c)
                return
            c.inbox += data
            self._serve(c)

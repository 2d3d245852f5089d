"""An authenticated message channel between hosts.

Why: the host agents, the elected controller and (later) state transfer talk over TCP, where anyone
who can reach a port can connect. So every frame is authenticated with the job's secret, and the
channel fails closed: an empty or wrong secret, a bad handshake, a tampered, replayed or reordered
frame end the connection; none of them delivers a message. Nothing received becomes code or
objects: a message is a JSON object, with an optional raw byte payload beside it (tensors travel
as raw bytes next to a JSON skeleton). The channel authenticates, it does not encrypt: what it
carries can be read by anyone on the path.

Handshake (client C, server S; every step bounded by a timeout)::

    C -> S  hello_c = "NSH\\x01" | role "C" | 3 reserved | nonce_c (16 random bytes)
    S -> C  hello_s = "NSH\\x01" | role "S" | 3 reserved | nonce_s
    C -> S  proof_c = HMAC(K["proof C"], hello_c | hello_s)
    S -> C  0x01 | proof_s = HMAC(K["proof S"], hello_c | hello_s)      or 0x00, and close
    PRK = HMAC(key="nonstop/channel/1" | nonce_c | nonce_s, msg=secret)
    K[label] = HMAC(PRK, label | 0x01)                      (HKDF-SHA256, one output block)

The client proves first, so a peer without the secret gets nothing it could test guesses against;
both nonces enter every key, so one secret never MACs two sessions alike.

Frame (one per message)::

    prefix   "NSF\\x01" | version | 3 reserved | header length (u32) | payload length (u64)
    tag      HMAC(K_dir, "L" | seq | prefix)[:16]   - lengths are authentic before we allocate
    header   UTF-8 JSON object, at most 16 MiB
    payload  raw bytes, at most 1 << 40
    mac      HMAC(K_dir, "F" | direction | seq | prefix | header | payload)

K_dir is the key of the direction (client to server or back) and seq counts that direction's
frames from 0. seq is never sent: a replayed, dropped or reordered frame fails its MAC.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import select
import socket
import stat
import struct
import threading
import time
import warnings
from typing import Any, Mapping

from ..protocol import fastjson

log = logging.getLogger(__name__)

SECRET_ENV = "NONSTOP_JOB_SECRET"
MAX_HEADER = 16 << 20  # bytes of JSON in one frame
MAX_PAYLOAD = 1 << 40  # bytes of payload in one frame
SHORT_SECRET = 16  # fewer bytes than this is accepted, with a warning

VERSION = 1
_HELLO_MAGIC = b"NSH\x01"
_HELLO = struct.Struct(">4sc3x16s")  # magic, role, nonce: 24 bytes
_NONCE = 16
_PROOF = 32  # bytes of an HMAC-SHA256
_ACCEPTED, _REFUSED = b"\x01", b"\x00"
_FRAME_MAGIC = b"NSF\x01"
_PREFIX = struct.Struct(">4sB3xIQ")  # magic, version, header length, payload length: 20 bytes
_TAG = 16
_MAC = 32
_SEQ = struct.Struct(">Q")
# The payload is MACed and moved this much at a time, so that hashing on one side overlaps the
# transfer and the hashing on the other side instead of following them.
_CHUNK = 1 << 19
_READ = 1 << 16  # recv_ready reads this much at a time
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)  # a dead peer is an error, never a SIGPIPE


class AuthError(Exception):
    """A peer failed to prove it holds the job's secret, or a frame failed its check."""


class ChannelClosed(Exception):
    """The peer is gone (EOF, reset, stalled mid-frame) or the channel was closed here."""


# -- the secret ----------------------------------------------------------------------------------


def load_secret(path: str | None = None, env: Mapping[str, str] = os.environ) -> bytes:
    """The job's secret: the file's content if a path is given, else ``$NONSTOP_JOB_SECRET``.

    Surrounding whitespace is stripped (so an editor's newline does not change the secret). Empty
    or missing is a ``ValueError`` of one sentence, never an open channel. A file other users
    can read is used but warned about: refusing it would only stop the job, not undo the leak.
    """
    if path is not None:
        try:
            with open(path, "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                data = f.read()
        except FileNotFoundError:
            raise ValueError(f"the job secret file {path} does not exist") from None
        except OSError as e:
            raise ValueError(f"cannot read the job secret file {path}: {e.strerror or e}") from None
        if mode & (stat.S_IRGRP | stat.S_IROTH):
            warnings.warn(f"the job secret file {path} is readable by other users (chmod 600 it)",
                          stacklevel=2)
        secret = data.strip()
        if not secret:
            raise ValueError(f"the job secret file {path} is empty")
    else:
        secret = env.get(SECRET_ENV, "").strip().encode("utf-8")
        if not secret:
            raise ValueError(f"no job secret: set {SECRET_ENV} or give a secret file")
    if len(secret) < SHORT_SECRET:
        warnings.warn(f"the job secret is only {len(secret)} bytes; use new_secret() for one that "
                      "cannot be guessed", stacklevel=2)
    return secret


def new_secret() -> str:
    """A fresh job secret: 32 random bytes as hex (text, so it fits a file or a variable)."""
    return secrets.token_hex(32)


def _check_secret(secret: bytes | bytearray | str) -> bytes:
    """Fail closed: an empty secret would authenticate anyone who also has none."""
    if isinstance(secret, str):
        secret = secret.encode("utf-8")  # as load_secret reads a hex text secret
    if not isinstance(secret, (bytes, bytearray, memoryview)):
        raise TypeError(f"the job secret must be bytes, not {type(secret).__name__}")
    secret = bytes(secret)
    if not secret.strip():
        raise ValueError("the job secret is empty: refusing an unauthenticated channel")
    return secret


def _keys(secret: bytes, hello_c: bytes, hello_s: bytes) -> dict[str, bytes]:
    """Session keys from the secret and both nonces (HKDF-SHA256: extract, then one block each)."""
    salt = b"nonstop/channel/1" + hello_c[-_NONCE:] + hello_s[-_NONCE:]
    prk = hmac.digest(salt, secret, "sha256")
    labels = ("proof C", "proof S", "frames C>S", "frames S>C")
    return {label: hmac.digest(prk, label.encode() + b"\x01", "sha256") for label in labels}


def _proof(keys: dict[str, bytes], role: str, hello_c: bytes, hello_s: bytes) -> bytes:
    return hmac.digest(keys[f"proof {role}"], hello_c + hello_s, "sha256")


#: the IP TOS byte of the control plane's connections (the controller's to each host's agent):
#: DSCP CS6, network control - a network with classes of service keeps them ahead of the bulk
#: traffic (collectives, snapshot copies) on a slow or congested link
CONTROL_TOS = 0xC0


def _tune(sock: socket.socket, tos: int = 0) -> None:
    """Small messages go out at once (no Nagle); an idle connection to a dead host is noticed;
    ``tos``: the class of service its packets ask for (``CONTROL_TOS``)."""
    if tos and sock.family == socket.AF_INET:
        try:
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
        except OSError:  # not allowed here: the default class
            pass
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
            except OSError:
                pass


class _Mac:
    """HMAC-SHA256 (RFC 2104) keyed once, written over hashlib.sha256: that lets go of the GIL
    while it hashes a large buffer and _hashlib's HMAC (Python 3.11) does not, so a payload being
    checked does not stop the process's other threads."""

    __slots__ = ("_inner", "_outer")

    def __init__(self, key: bytes):
        if len(key) > 64:
            key = hashlib.sha256(key).digest()
        key = key.ljust(64, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in key))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in key))

    def start(self) -> Any:
        return self._inner.copy()

    def finish(self, inner: Any) -> bytes:
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()


def _wait(poller: Any, timeout: float | None) -> bool:
    """Whether the poller's socket became ready within ``timeout`` seconds (None: no limit)."""
    ms = -1 if timeout is None else max(0, int(timeout * 1000 + 0.999))
    return bool(poller.poll(ms))


# -- the channel ---------------------------------------------------------------------------------


class Channel:
    """One authenticated connection; made by :func:`connect` and :meth:`Listener.accept`.

    Sending and receiving are independent (one lock each), so one thread may block in ``recv``
    while others send. The socket is non-blocking and every wait is a ``poll`` with a limit of
    its own, so neither direction's timeout disturbs the other.
    """

    def __init__(self, sock: socket.socket, peer: tuple[str, int], send_key: bytes,
                 recv_key: bytes, role: str, stall_timeout_s: float = 30.0):
        sock.setblocking(False)
        self._sock = sock
        self.peer = peer
        self.stall_timeout_s = stall_timeout_s  # a frame that stops moving this long ends it
        self._fd = sock.fileno()
        self._send_mac = _Mac(send_key)  # keyed once, not once a frame
        self._recv_mac = _Mac(recv_key)
        self._send_dir = b"C" if role == "C" else b"S"
        self._recv_dir = b"S" if role == "C" else b"C"
        self._send_seq = 0
        self._recv_seq = 0
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._closed = False
        self._rbuf = bytearray()  # recv_ready: the start of a frame not yet complete
        self._pollin = select.poll()
        self._pollin.register(self._fd, select.POLLIN)
        self._pollout = select.poll()
        self._pollout.register(self._fd, select.POLLOUT)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<Channel {self.peer[0]}:{self.peer[1]} {state}>"

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def fileno(self) -> int:
        """For selectors: readable when a frame (or EOF) is coming. recv never reads ahead, so
        nothing of the next frame waits in a buffer of ours that a selector cannot see."""
        return self._fd

    def close(self) -> None:
        """Idempotent. Shutting down first wakes any thread waiting on the socket."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _fail(self, exc: Exception) -> Exception:
        """Close (the stream can no longer be trusted or followed) and hand back exc to raise."""
        self.close()
        return exc

    # -- sending --

    def send(self, msg: dict, payload: bytes | bytearray | memoryview | None = None) -> None:
        """Send one frame; thread-safe. The whole frame is written, or ChannelClosed (and the
        channel is closed: half a frame cannot be taken back). A message that cannot be JSON or
        is too big is refused here, before anything is written."""
        if not isinstance(msg, dict):
            raise TypeError(f"a message is a dict, not {type(msg).__name__}")
        header_b = fastjson.dumps(msg)
        if len(header_b) > MAX_HEADER:
            raise ValueError(f"message of {len(header_b)} bytes of JSON; the limit is {MAX_HEADER}")
        pv = memoryview(b"" if payload is None else payload)
        if pv.ndim != 1 or pv.format != "B":
            pv = pv.cast("B")  # any C-contiguous buffer (an array of floats) as its bytes
        size = pv.nbytes
        if size > MAX_PAYLOAD:
            raise ValueError(f"payload of {size} bytes; the limit is {MAX_PAYLOAD}")
        with self._send_lock:
            if self._closed:
                raise ChannelClosed(f"channel to {self._where()} is closed")
            seq = _SEQ.pack(self._send_seq)
            prefix = _PREFIX.pack(_FRAME_MAGIC, VERSION, len(header_b), size)
            tag = self._send_mac.start()
            tag.update(b"L" + seq + prefix)
            mac = self._send_mac.start()
            mac.update(b"F" + self._send_dir + seq + prefix)
            mac.update(header_b)
            views: list[Any] = [prefix + self._send_mac.finish(tag)[:_TAG], header_b]
            if size == 0:
                views.append(self._send_mac.finish(mac))
                self._send_views(views)
            for off in range(0, size, _CHUNK):
                part = pv[off:off + _CHUNK]
                mac.update(part)
                views.append(part)
                if off + _CHUNK >= size:
                    views.append(self._send_mac.finish(mac))
                self._send_views(views)
                views = []
            self._send_seq += 1

    def _send_views(self, views: list[Any]) -> None:
        """Write all the buffers (gathered, no concatenation); a peer that takes nothing for
        stall_timeout_s is treated as gone."""
        while views:
            try:
                sent = self._sock.sendmsg(views, (), _NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                if not _wait(self._pollout, self.stall_timeout_s):
                    raise self._fail(ChannelClosed(
                        f"{self._where()} took nothing for {self.stall_timeout_s}s")) from None
                continue
            except OSError as e:
                raise self._fail(ChannelClosed(f"sending to {self._where()}: {e}")) from e
            while sent:
                n = len(views[0])
                if sent >= n:
                    sent -= n
                    views.pop(0)
                else:
                    views[0] = memoryview(views[0])[sent:]
                    sent = 0

    # -- receiving --

    def recv(self, timeout: float | None = None) -> tuple[dict, memoryview]:
        """The next message and its payload (an empty memoryview when none).

        ``timeout`` bounds the wait for a frame to begin (TimeoutError; the channel stays
        usable). Once a frame has begun, it must keep moving (``stall_timeout_s``) or the channel
        is closed: ChannelClosed. A frame that fails its check closes the channel: AuthError.
        The payload is received in place into its own buffer, never copied afterwards.
        """
        with self._recv_lock:
            if self._closed:
                raise ChannelClosed(f"channel to {self._where()} is closed")
            head = bytearray(_PREFIX.size + _TAG)
            self._read_exact(memoryview(head), first=True, timeout=timeout)
            seq, prefix, hlen, plen = self._check_head(head)
            header = bytearray(hlen)
            try:
                payload = bytearray(plen)
            except MemoryError:
                self.close()
                raise
            mac = self._recv_mac.start()
            mac.update(b"F" + self._recv_dir + seq + prefix)
            self._read_exact(memoryview(header))
            mac.update(header)
            pv = memoryview(payload)
            for off in range(0, plen, _CHUNK):
                part = pv[off:off + _CHUNK]
                self._read_exact(part)
                mac.update(part)
            got = bytearray(_MAC)
            self._read_exact(memoryview(got))
            return self._check_frame(mac, got, header), pv

    def recv_ready(self) -> list[tuple[dict, memoryview]]:
        """Never waits: reads what the socket holds and returns the frames complete so far (the
        rest of one stays here until more comes; a selector sees it coming). For one thread
        reading many channels; not to be mixed with ``recv`` on the same channel. ChannelClosed
        once the peer has closed (after the frames it completed), AuthError as ``recv``."""
        with self._recv_lock:
            if self._closed:
                raise ChannelClosed(f"channel to {self._where()} is closed")
            buf = self._rbuf
            eof = False
            while True:
                try:
                    data = self._sock.recv(_READ)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as e:
                    raise self._fail(ChannelClosed(f"receiving from {self._where()}: {e}")) from e
                if not data:
                    eof = True
                    break
                buf += data
                if len(data) < _READ:
                    break
            frames = []
            pos = 0
            lead = _PREFIX.size + _TAG
            while len(buf) - pos >= lead:
                seq, prefix, hlen, plen = self._check_head(buf[pos:pos + lead])
                end = pos + lead + hlen + plen + _MAC
                if len(buf) < end:
                    break
                view = memoryview(buf)
                header = bytes(view[pos + lead:pos + lead + hlen])
                payload = bytearray(view[pos + lead + hlen:end - _MAC])
                mac = self._recv_mac.start()
                mac.update(b"F" + self._recv_dir + seq + prefix)
                mac.update(header)
                mac.update(payload)
                got = bytes(view[end - _MAC:end])
                view.release()
                frames.append((self._check_frame(mac, got, header), memoryview(payload)))
                pos = end
            del buf[:pos]
            if eof and not frames:
                raise self._fail(ChannelClosed(f"{self._where()} closed the channel"))
            return frames

    def _check_head(self, head: bytes | bytearray) -> tuple[bytes, bytes, int, int]:
        """A frame's prefix and its tag checked: (seq, prefix, header length, payload length)."""
        magic, version, hlen, plen = _PREFIX.unpack_from(head)
        if magic != _FRAME_MAGIC or version != VERSION:
            raise self._fail(AuthError(f"{self._where()} sent something that is not a frame"))
        seq = _SEQ.pack(self._recv_seq)
        prefix = bytes(head[:_PREFIX.size])
        tag = self._recv_mac.start()
        tag.update(b"L" + seq + prefix)
        expected = self._recv_mac.finish(tag)[:_TAG]
        if not hmac.compare_digest(expected, bytes(head[_PREFIX.size:_PREFIX.size + _TAG])):
            raise self._fail(AuthError(
                f"frame {self._recv_seq} from {self._where()} failed its check "
                "(tampered, replayed or out of order)"))
        if hlen > MAX_HEADER or plen > MAX_PAYLOAD or hlen == 0:
            raise self._fail(AuthError(
                f"{self._where()} claims a frame of {hlen} + {plen} bytes; refused"))
        return seq, prefix, hlen, plen

    def _check_frame(self, mac: Any, got: bytes | bytearray, header: bytes | bytearray) -> dict:
        """A whole frame's MAC checked, and its header parsed: the message."""
        if not hmac.compare_digest(self._recv_mac.finish(mac), bytes(got)):
            raise self._fail(AuthError(
                f"frame {self._recv_seq} from {self._where()} failed its check "
                "(tampered, replayed or out of order)"))
        self._recv_seq += 1
        try:
            msg = fastjson.loads(header)
        except ValueError:
            msg = None
        if not isinstance(msg, dict):
            raise self._fail(AuthError(
                f"{self._where()} sent a header that is not a JSON object"))
        return msg

    def _read_exact(self, view: memoryview, first: bool = False,
                    timeout: float | None = None) -> None:
        """Fill view from the socket. With ``first``, ``timeout`` limits the wait for the first
        byte (TimeoutError, nothing consumed); every other wait is limited by stall_timeout_s."""
        want = len(view)
        got = 0
        deadline = None if timeout is None else time.monotonic() + timeout
        while got < want:
            try:
                n = self._sock.recv_into(view[got:] if got else view)
            except (BlockingIOError, InterruptedError):
                if first and got == 0:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(
                            f"no message from {self._where()} within {timeout}s") from None
                    _wait(self._pollin, left)
                elif not _wait(self._pollin, self.stall_timeout_s):
                    raise self._fail(ChannelClosed(
                        f"{self._where()} stalled mid-frame for {self.stall_timeout_s}s")) from None
                continue
            except OSError as e:
                if self._closed:
                    raise ChannelClosed(f"channel to {self._where()} is closed") from e
                raise self._fail(ChannelClosed(f"receiving from {self._where()}: {e}")) from e
            if n == 0:
                if self._closed:
                    raise ChannelClosed(f"channel to {self._where()} is closed")
                raise self._fail(ChannelClosed(f"{self._where()} closed the connection"))
            got += n

    def _where(self) -> str:
        return f"{self.peer[0]}:{self.peer[1]}"


# -- the client side -----------------------------------------------------------------------------


def connect(addr: str, port: int, secret: bytes, timeout_s: float = 5.0,
            stall_timeout_s: float = 30.0, tos: int = 0) -> Channel:
    """An authenticated channel to a Listener. ``timeout_s`` bounds the connection and the whole
    handshake; ``tos``: the class of service of what this side sends (``CONTROL_TOS``). AuthError when the server refuses us (wrong secret) or fails to prove it holds the
    secret; ConnectionError or TimeoutError when it cannot be reached."""
    secret = _check_secret(secret)
    deadline = time.monotonic() + timeout_s
    try:
        sock = socket.create_connection((addr, port), timeout=timeout_s)
        try:
            peer, keys = _client_handshake(sock, f"{addr}:{port}", secret, deadline, tos)
        except BaseException:
            sock.close()
            raise
    except (ConnectionError, TimeoutError):
        raise
    except OSError as e:  # unreachable host, unknown name...: one kind of error for callers
        raise ConnectionError(f"cannot reach {addr}:{port}: {e}") from e
    return Channel(sock, peer, keys["frames C>S"], keys["frames S>C"], "C", stall_timeout_s)


def _client_handshake(sock: socket.socket, where: str, secret: bytes, deadline: float,
                      tos: int = 0) -> tuple[tuple[str, int], dict[str, bytes]]:
    _tune(sock, tos)
    host, port = sock.getpeername()[:2]
    hello_c = _HELLO.pack(_HELLO_MAGIC, b"C", secrets.token_bytes(_NONCE))
    _send_by(sock, hello_c, deadline)
    hello_s = _recv_by(sock, _HELLO.size, deadline)
    magic, role, _ = _HELLO.unpack(hello_s)
    if magic != _HELLO_MAGIC or role != b"S":
        raise AuthError(f"{where} is not a nonstop channel server (or another version)")
    keys = _keys(secret, hello_c, hello_s)
    _send_by(sock, _proof(keys, "C", hello_c, hello_s), deadline)
    answer = _recv_by(sock, 1, deadline)
    if answer == _REFUSED:
        raise AuthError(f"{where} refused us: is the job secret the same on both hosts?")
    if answer != _ACCEPTED:
        raise AuthError(f"{where} answered the handshake with nonsense")
    proof_s = _recv_by(sock, _PROOF, deadline)
    if not hmac.compare_digest(proof_s, _proof(keys, "S", hello_c, hello_s)):
        raise AuthError(f"{where} did not prove it holds the job secret")
    return (host, port), keys


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the handshake did not finish in time")
    return left


def _send_by(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(_left(deadline))
    sock.sendall(data)


def _recv_by(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        sock.settimeout(_left(deadline))
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("the server closed the connection during the handshake")
        got += k
    return bytes(buf)


__all__ = ["AuthError", "ChannelClosed", "SECRET_ENV", "load_secret", "new_secret", "Channel",
           "connect", "MAX_HEADER", "MAX_PAYLOAD"]  # the server side: net.listener.Listener

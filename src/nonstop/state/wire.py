"""Messages between a node's keeper and its clients: JSON over a local SEQPACKET socket, with
descriptors passed alongside (SCM_RIGHTS). The socket has an abstract address, and the keeper
serves only processes of its own user. What is sent is typed in ``protocol/keeper_messages.py``:
a client sends a request record and gets its answer record back."""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
from typing import Any

from ..protocol import keeper_messages as km

MAX_MESSAGE = 1 << 20
MAX_FDS = 4


def address(name: str) -> str:
    """An abstract socket address: nothing on disk, gone with the process that bound it."""
    return "\0" + name


def encode(msg: dict[str, Any]) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode()


def send(sock: socket.socket, msg: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> None:
    data = encode(msg)
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def recv(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the descriptors that came with it; (None, []) when the peer is gone.
    ValueError: what came is not JSON (its descriptors are closed)."""
    data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    try:
        return json.loads(data), fds
    except ValueError:
        for fd in fds:
            os.close(fd)
        raise


def peer_pid_uid(sock: socket.socket) -> tuple[int, int]:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    return pid, uid


class Client:
    """A connection to a keeper: one request at a time, each answered in order."""

    def __init__(self, name: str, timeout_s: float = 60.0):
        self.name = name
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.sock.settimeout(timeout_s)
        self.sock.connect(address(name))
        self.pid, _ = peer_pid_uid(self.sock)

    def call(self, request: km.Request) -> tuple[km.Answer, list[int]]:
        """The answer to ``request`` (of its type, ``request.answer``) and the descriptors that
        came with it. KeeperError: the keeper refused it, or answered something malformed."""
        send(self.sock, km.encode(request))
        try:
            raw, got = recv(self.sock)
        except ValueError as exc:
            raise KeeperError(f"a malformed answer to {request.op!r}: {exc}") from None
        if raw is None:
            raise ConnectionError(f"the node keeper {self.name!r} went away")
        try:
            answer = km.decode_answer(type(request), raw)
        except km.BadKeeperMessage as exc:
            answer = km.Refused(error=f"a malformed answer to {request.op!r}: {exc}")
        if isinstance(answer, km.Refused):
            for fd in got:
                os.close(fd)
            raise KeeperError(answer.error)
        return answer, got

    def tell(self, request: km.Request) -> None:
        """A request the keeper never answers (``commit``, ``release``): an answer left unread
        would be taken for the one to the next request."""
        if request.answer is not None:
            raise ValueError(f"{request.op!r} is answered: call it")
        send(self.sock, km.encode(request))

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class KeeperError(RuntimeError):
    """The keeper refused a request (it says why)."""


class KeeperLink:
    """The launcher's connection to a keeper of its own host: requests on one socket, the
    keeper's reports on another. (Across hosts the same interface goes through the host's agent:
    ``nonstop.controller.remote_keepers``.)"""

    def __init__(self, name: str, timeout_s: float = 30.0):
        self.client = Client(name, timeout_s=timeout_s)
        self._events: Client | None = Client(name, timeout_s=timeout_s)
        reply, _ = self._events.call(km.Subscribe())
        self._events.sock.setblocking(False)
        self.tcp: str = reply.tcp  # where other nodes' keepers push replicas

    @classmethod
    def open(cls, name: str, deadline: float, poll_s: float = 0.02) -> KeeperLink:
        """Connect once the keeper listens; TimeoutError at ``deadline``."""
        import time

        while True:
            try:
                return cls(name)
            except (FileNotFoundError, ConnectionRefusedError):
                if time.time() > deadline:
                    raise TimeoutError(f"keeper {name!r} is not listening") from None
                time.sleep(poll_s)

    def call(self, request: km.Request) -> km.Answer:
        return self.client.call(request)[0]

    def tell(self, request: km.Request) -> None:
        if request.answer is None:
            self.client.tell(request)
        else:
            self.call(request)  # a keeper of this host answers at once

    def answers(self, timeout_s: float) -> bool:
        """False once the keeper's connection has ended (it died); a slow answer counts as alive,
        unless its process is on its way out (killed, still releasing its memory: its sockets
        stay open until then). Asked on a connection of its own: a late answer must not become
        another request's."""
        from ..pids import dying

        if dying(self.client.pid):
            return False
        try:
            probe = Client(self.client.name, timeout_s=timeout_s)
        except TimeoutError:
            return not dying(self.client.pid)
        except OSError:
            return False
        try:
            probe.call(km.Ping())
        except TimeoutError:
            return not dying(self.client.pid)
        except (OSError, ConnectionError):
            return False
        except KeeperError:
            return True
        finally:
            probe.close()
        return True

    def events(self) -> list[dict[str, Any]]:
        """What the keeper reported since, as it was sent (never blocks): read where it arrives
        (``km.decode_report``), here or at the controller the host's agent relays it to."""
        out: list[dict[str, Any]] = []
        while self._events is not None:
            try:
                msg, fds = recv(self._events.sock)
            except BlockingIOError:
                break
            except OSError:
                msg, fds = None, []
            except ValueError as exc:  # not JSON: passed over (the keeper writes none such)
                logging.getLogger(__name__).warning("a report of keeper %r that is not JSON: %s",
                                                    self.client.name, exc)
                continue
            for fd in fds:
                os.close(fd)
            if msg is None:
                self._events.close()
                self._events = None
                break
            out.append(msg)
        return out

    def close(self) -> None:
        self.client.close()
        if self._events is not None:
            self._events.close()
            self._events = None

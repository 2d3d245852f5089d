"""The etcd client's endpoints and HTTP plumbing: parsing ``--rdzv-endpoint``, TLS settings,
base64 keys, etcd's error answers, the authenticated session, watch streams."""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import queue
import socket
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import requests

from .etcd_errors import AuthFailed

log = logging.getLogger("nonstop.store.etcd")

API_PATH = "/v3/"  # etcd >= 3.4; fixed so a call never spends a round trip discovering it
# gRPC codes worth another endpoint: DeadlineExceeded, Unavailable ("no leader", "leader changed",
# "request timed out", "too many requests"); HTTP 5xx likewise
_RETRY_CODES = {4, 14}
_NOT_FOUND = 5


# ---------------------------------------------------------------------------------------------
# endpoints


_SCHEMES = {"etcd": False, "http": False, "https": True}
_USAGE = "expected 'etcd://host:port[,host:port...]' or 'host:port[,host:port...]'"


def _split_scheme(text: str) -> tuple[str | None, str]:
    if "://" not in text:
        return None, text
    scheme, rest = text.split("://", 1)
    if scheme.lower() not in _SCHEMES:
        raise ValueError(f"unknown scheme {scheme + '://'!r} in etcd endpoint {text!r}: {_USAGE} "
                         "(or https:// for TLS)")
    return scheme.lower(), rest


def _parse(text: str) -> tuple[list[tuple[str, int]], bool]:
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"no etcd endpoint given: {_USAGE}")
    scheme, rest = _split_scheme(text.strip())
    tls = {_SCHEMES[scheme]} if scheme else set()
    out: list[tuple[str, int]] = []
    for raw in rest.split(","):
        item = raw.strip()
        if not item:
            raise ValueError(f"empty endpoint in {text!r}: {_USAGE}")
        s, item = _split_scheme(item)
        if s is not None:
            tls.add(_SCHEMES[s])
        item = item[:-1] if item.endswith("/") else item
        if item.startswith("["):  # [v6 address]:port
            host, sep, port = item[1:].partition("]:")
            if not sep:
                raise ValueError(f"etcd endpoint {item!r} has no port: write [address]:port")
        else:
            host, sep, port = item.rpartition(":")
            if not sep:
                raise ValueError(f"etcd endpoint {item!r} has no port: write host:port "
                                 "(etcd's client port is usually 2379)")
            if ":" in host:
                raise ValueError(f"etcd endpoint {item!r}: put an IPv6 address in brackets, "
                                 "[address]:port")
        if not host or any(c in host for c in "/@ \t"):
            raise ValueError(f"etcd endpoint {item!r} has no valid host name")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"etcd endpoint {item!r} has a bad port {port!r}: it must be a "
                             "number from 1 to 65535")
        out.append((host, int(port)))
    if len(tls) > 1:
        raise ValueError(f"etcd endpoints {text!r} mix http:// and https://: use one for all")
    return out, tls == {True}


def parse_endpoints(text: str) -> list[tuple[str, int]]:
    """``"etcd://h:p[,h:p...]"``, ``"h:p[,h:p]"`` or ``"https://h:p[,...]"`` as (host, port)
    pairs; ValueError (one sentence) on anything else."""
    return _parse(text)[0]


def wants_tls(text: str) -> bool:
    """Whether an endpoint string asks for TLS (``https://``)."""
    return _parse(text)[1]


@dataclasses.dataclass
class TLS:
    """Client TLS: ``ca`` verifies the server (None: the system's CAs); ``cert``/``key`` are the
    client certificate, when etcd asks for one."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None


# ---------------------------------------------------------------------------------------------
# encoding


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def _value(value: bytes | bytearray | str) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"an etcd value is bytes or str, not {type(value).__name__}")


def _prefix_end(prefix: bytes) -> bytes:
    """The first key past every key starting with ``prefix`` (etcd's range_end for a prefix)."""
    b = bytearray(prefix)
    while b and b[-1] == 0xFF:
        b.pop()
    if not b:
        return b"\0"  # etcd: every key
    b[-1] += 1
    return bytes(b)


def _error_text(resp: "requests.Response") -> tuple[str, int | None]:
    try:
        body = resp.json()
    except ValueError:
        return f"HTTP {resp.status_code}: {resp.text[:200]}", None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):  # a stream's error
        body = body["error"]
    if not isinstance(body, dict):
        return f"HTTP {resp.status_code}: {str(body)[:200]}", None
    code = body.get("code", body.get("grpc_code"))
    return (str(body.get("message") or body.get("error") or f"HTTP {resp.status_code}"),
            int(code) if code is not None else None)


# ---------------------------------------------------------------------------------------------
# HTTP plumbing


_AUTH_SESSION: type | None = None


def _auth_session_class() -> type:
    """A requests session (what etcd3gw's ``session=`` takes) that logs in with user/password and
    sends the token on every request, logging in again when etcd says the token expired."""
    global _AUTH_SESSION
    if _AUTH_SESSION is not None:
        return _AUTH_SESSION
    import requests

    class AuthSession(requests.Session):
        def __init__(self, user: str, password: str):
            super().__init__()
            self.auth_url = ""  # set once the endpoint's client exists
            self._user, self._password = user, password
            self._token: str | None = None
            self._lock = threading.Lock()

        @property
        def token(self) -> str | None:
            return self._token

        def invalidate(self, token: str | None = None) -> None:
            with self._lock:
                if token is None or self._token == token:
                    self._token = None

        def _login(self, timeout: Any) -> str:
            r = super().request("POST", self.auth_url, timeout=timeout, verify=self.verify,
                                json={"name": self._user, "password": self._password})
            if r.status_code != 200:
                text, code = _error_text(r)
                if r.status_code >= 500 or code in _RETRY_CODES:
                    raise requests.ConnectionError(f"authentication: {text}")
                raise AuthFailed(f"etcd refused user {self._user!r}: {text}", code)
            self._token = str(r.json()["token"])
            return self._token

        def request(self, method: str, url: str,  # type: ignore[override]
                    *args: Any, **kwargs: Any) -> requests.Response:
            if url == self.auth_url:
                return super().request(method, url, *args, **kwargs)
            headers = dict(kwargs.pop("headers", None) or {})
            for attempt in (0, 1):
                with self._lock:
                    token = self._token or self._login(kwargs.get("timeout"))
                r = super().request(method, url, *args,
                                    headers={**headers, "Authorization": token}, **kwargs)
                if r.status_code == 401 and attempt == 0:  # "invalid auth token": expired
                    r.close()
                    self.invalidate(token)
                    continue
                return r
            raise AssertionError("unreachable")

    _AUTH_SESSION = AuthSession
    return AuthSession


def _abort(resp: "requests.Response") -> None:
    """Close a streaming response now, waking a thread blocked reading it (a plain close leaves
    that read to its timeout)."""
    raw = resp.raw
    sock = getattr(getattr(raw, "_connection", None), "sock", None)
    if sock is None:
        try:
            sock = raw._fp.fp.raw._sock  # urllib3 1.x
        except AttributeError:
            sock = None
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
    try:
        resp.close()
    except Exception:  # noqa: BLE001 - closing is best effort
        pass


class _Stream:
    """One watch stream: a daemon thread turns its newline-delimited JSON into queue items, so
    the caller waits on the queue with its own deadline. The thread ends when the stream is
    aborted or its read timeout (set just past the caller's deadline) expires."""

    def __init__(self, resp: "requests.Response"):
        self.resp = resp
        self.q: queue.Queue[tuple[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, name="nonstop-etcd-watch", daemon=True).start()

    def _read(self) -> None:
        buf = b""
        try:
            for chunk in self.resp.iter_content(chunk_size=None):
                buf += chunk
                while (i := buf.find(b"\n")) >= 0:
                    line, buf = buf[:i], buf[i + 1:]
                    if line.strip():
                        self.q.put(("msg", json.loads(line)))
            self.q.put(("eof", "stream ended"))
        except Exception as e:  # noqa: BLE001 - any failure ends the stream; the caller decides
            self.q.put(("err", f"{type(e).__name__}: {e}"))
        finally:
            try:
                self.resp.close()
            except Exception:  # noqa: BLE001
                pass

    def get(self, timeout: float) -> tuple[str, Any] | None:
        try:
            return self.q.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None

    def close(self) -> None:
        _abort(self.resp)


# ---------------------------------------------------------------------------------------------
# the client

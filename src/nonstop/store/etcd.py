"""nonstop's etcd client: the control plane's store when a job spans hosts.

A thin layer over ``etcd3gw`` (etcd's v3 API through its JSON gateway: plain HTTP, no gRPC stack).
What it adds is what the control plane relies on:

* every key lives under ``/nonstop/<job>/`` and is named relative to it, so jobs sharing an etcd
  never see each other;
* every call has one deadline (``timeout_s``) across all endpoints: the endpoint in use is tried
  first, then the others (failover), then :class:`StoreUnavailable` - never a hang;
* writes fenced by the leader's epoch (:meth:`Etcd.guarded`): a deposed leader cannot overwrite
  its successor's state;
* leases kept alive in a thread that says, once, when the lease can no longer be trusted;
* an election (:meth:`Etcd.campaign`) whose epoch (the key's create revision) grows with each
  leader, and watches (:meth:`Etcd.wait`) with a deadline.

``requests`` and ``etcd3gw`` are imported when the first :class:`Etcd` is made, so importing this
module (for :func:`parse_endpoints` or the exceptions) costs nothing.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import math
import queue
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

if TYPE_CHECKING:
    import requests

log = logging.getLogger(__name__)

ROOT = "/nonstop/"
API_PATH = "/v3/"  # etcd >= 3.4; fixed so a call never spends a round trip discovering it
# gRPC codes worth another endpoint: DeadlineExceeded, Unavailable ("no leader", "leader changed",
# "request timed out", "too many requests"); HTTP 5xx likewise
_RETRY_CODES = {4, 14}
_NOT_FOUND = 5
_MIN_ATTEMPT_S = 0.5  # one endpoint's share of a deadline, when there are others to try


class StoreError(Exception):
    """etcd answered but refused the request (bad argument, permission, too many operations)."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.code = code


class StoreUnavailable(StoreError):
    """No endpoint answered within the deadline; the message names them and the last error."""


class Fenced(StoreError):
    """A guarded write found its guard changed: whoever wrote it is no longer the leader."""

    def __init__(self, message: str, guard_key: str, expected: int, found: int):
        super().__init__(message)
        self.guard_key, self.expected, self.found = guard_key, expected, found


class Compacted(StoreError):
    """A watch asked for history etcd has compacted away: read the current state again
    (``get_prefix``) and wait from its revision."""

    def __init__(self, message: str, compact_revision: int):
        super().__init__(message)
        self.compact_revision = compact_revision


class AuthFailed(StoreError):
    """etcd rejected the user name or password (or has no authentication enabled)."""


class _Retry(Exception):
    """This endpoint did not answer usefully; another may."""


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


class Etcd:
    """An etcd client for one job: keys are relative to ``/nonstop/<job>/``.

    ``endpoints`` are (host, port) pairs of one etcd cluster. Every call tries the endpoint in
    use, then the others, until ``timeout_s`` in total (then :class:`StoreUnavailable`). A retried
    write may have been applied by the attempt that timed out: ``put`` and ``guarded`` are safe to
    repeat; ``create``/``cas`` may then report False for a write of their own (campaign checks
    the lease to tell)."""

    def __init__(self, endpoints: Iterable[tuple[str, int]], job: str, timeout_s: float = 2.0,
                 tls: TLS | None = None, user: str | None = None, password: str | None = None):
        import etcd3gw
        import requests

        self._requests = requests
        self.endpoints = [(str(h), int(p)) for h, p in endpoints]
        if not self.endpoints:
            raise ValueError("no etcd endpoint given")
        if not job or "/" in job:
            raise ValueError(f"bad job id {job!r}: it must be non-empty and without '/'")
        if (user is None) != (password is None):
            raise ValueError("etcd authentication needs both a user and a password")
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.job = job
        self.prefix = f"{ROOT}{job}/"
        self._prefix_b = _utf8(self.prefix)
        self.timeout_s = float(timeout_s)
        # one endpoint's share of a call: enough for a healthy answer, short enough that a hung
        # member (partitioned, waiting on a dead leader) leaves time to ask another
        self._attempt_s = (self.timeout_s if len(self.endpoints) == 1
                           else min(self.timeout_s, max(_MIN_ATTEMPT_S, self.timeout_s / 2)))
        protocol = "https" if tls is not None else "http"
        self._clients = []
        for host, port in self.endpoints:
            session = (_auth_session_class()(user, password) if user is not None
                       else requests.Session())
            if tls is not None:
                session.verify = tls.ca or True
                if tls.cert:
                    session.cert = (tls.cert, tls.key) if tls.key else tls.cert
            client = etcd3gw.client(host=host, port=port, protocol=protocol,
                                    ca_cert=tls.ca if tls else None,
                                    cert_key=tls.key if tls else None,
                                    cert_cert=tls.cert if tls else None,
                                    timeout=self.timeout_s, api_path=API_PATH, session=session)
            if user is not None:
                session.auth_url = client.get_url("/auth/authenticate")
            self._clients.append(client)
        self._authenticated = user is not None
        self._current = 0
        self._lock = threading.Lock()
        self._leases: set[Lease] = set()

    @classmethod
    def from_url(cls, url: str, job: str, tls: TLS | None = None, **kwargs: Any) -> "Etcd":
        """From an ``--rdzv-endpoint`` string; ``https://`` turns TLS on (system CAs unless
        ``tls`` names them)."""
        endpoints, use_tls = _parse(url)
        return cls(endpoints, job, tls=tls if tls is not None or not use_tls else TLS(), **kwargs)

    def __enter__(self) -> "Etcd":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Etcd({self.endpoint}, job={self.job!r})"

    @property
    def endpoint(self) -> str:
        """The endpoint in use, ``host:port``."""
        host, port = self.endpoints[self._current]
        return f"{host}:{port}"

    # -- keys --

    def _key(self, key: str) -> bytes:
        return self._prefix_b + _utf8(key)

    def _rel(self, key_b64: str) -> str:
        full = _unb64(key_b64)
        return full[len(self._prefix_b):].decode("utf-8", "surrogateescape")

    # -- one request, with failover --

    def _post(self, client: Any, path: str, payload: Mapping[str, Any], timeout: float) -> dict:
        requests = self._requests
        try:
            # verify given per request: requests lets $REQUESTS_CA_BUNDLE override a session's
            resp = client.session.post(client.get_url(path), json=payload, timeout=timeout,
                                       verify=client.session.verify)
        except (requests.Timeout, requests.ConnectionError) as e:
            raise _Retry(f"{type(e).__name__}: {e}") from None
        if resp.status_code == 200:
            try:
                body = resp.json()
            except ValueError:
                raise _Retry(f"not etcd's JSON: {resp.text[:200]!r}") from None
            if isinstance(body, dict) and "error" in body and "result" not in body:
                text, code = _error_text(resp)  # a stream endpoint's error, sent with HTTP 200
                if code in _RETRY_CODES:
                    raise _Retry(text)
                raise StoreError(f"etcd {path}: {text}", code)
            return body
        text, code = _error_text(resp)
        if resp.status_code >= 500 or resp.status_code in (408, 429) or code in _RETRY_CODES:
            raise _Retry(text)
        raise StoreError(f"etcd {path}: {text}", code)

    def _call(self, path: str, payload: Mapping[str, Any], deadline: float | None = None) -> dict:
        deadline = time.monotonic() + self.timeout_s if deadline is None else deadline
        n = len(self._clients)
        last = "no attempt: the deadline had passed"
        delay = 0.02
        while True:
            start = self._current
            for i in range(n):
                idx = (start + i) % n
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    out = self._post(self._clients[idx], path, payload,
                                     min(remaining, self._attempt_s))
                except _Retry as e:
                    last = f"{self._name(idx)}: {e}"
                    log.debug("etcd %s failed: %s", path, last)
                    continue
                if idx != self._current:
                    log.info("etcd: now using %s (%s)", self._name(idx), last)
                    self._current = idx
                return out
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreUnavailable(self._unavailable(last))
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.25)

    def _name(self, idx: int) -> str:
        host, port = self.endpoints[idx]
        return f"{host}:{port}"

    def _unavailable(self, last: str) -> str:
        names = ", ".join(self._name(i) for i in range(len(self.endpoints)))
        return (f"etcd unavailable: no answer from {names} within {self.timeout_s:g} s "
                f"(last error: {last})")

    def _txn(self, compare: list, success: list, failure: list | None = None,
             deadline: float | None = None) -> dict:
        return self._call("/kv/txn", {"compare": compare, "success": success,
                                      "failure": failure or []}, deadline)

    # -- reads --

    def get(self, key: str) -> tuple[bytes | None, int]:
        """(value, mod_revision), or (None, 0) when absent."""
        r = self._call("/kv/range", {"key": _b64(self._key(key))})
        kvs = r.get("kvs") or []
        if not kvs:
            return None, 0
        return _unb64(kvs[0].get("value")), int(kvs[0].get("mod_revision", 0))

    def get_prefix(self, key: str = "") -> list[tuple[str, bytes, int, int]]:
        """(relative key, value, mod_revision, create_revision) of every key under ``key``,
        sorted by key."""
        k = self._key(key)
        r = self._call("/kv/range", {"key": _b64(k), "range_end": _b64(_prefix_end(k)),
                                     "sort_order": "ASCEND", "sort_target": "KEY"})
        return [(self._rel(kv["key"]), _unb64(kv.get("value")), int(kv.get("mod_revision", 0)),
                 int(kv.get("create_revision", 0))) for kv in r.get("kvs") or []]

    def count(self, key: str = "") -> int:
        """How many keys lie under ``key`` (the whole job by default); etcd counts, sends none."""
        k = self._key(key)
        r = self._call("/kv/range", {"key": _b64(k), "range_end": _b64(_prefix_end(k)),
                                     "count_only": True})
        return int(r.get("count", 0))

    def revision(self) -> int:
        """etcd's current revision (of the whole store, not only this job)."""
        r = self._call("/kv/range", {"key": _b64(self._prefix_b), "count_only": True})
        return int(r["header"]["revision"])

    def db_size(self) -> int:
        """Bytes of the database file of the endpoint in use (does not shrink without defrag)."""
        return int(self._call("/maintenance/status", {}).get("dbSize", 0))

    # -- writes --

    @staticmethod
    def _lease_id(lease: "Lease | int | None") -> int:
        if lease is None:
            return 0
        return int(lease.id if isinstance(lease, Lease) else lease)

    def _put_op(self, key: str, value: bytes | str, lease: "Lease | int | None" = None) -> dict:
        op: dict[str, Any] = {"key": _b64(self._key(key)), "value": _b64(_value(value))}
        if lease is not None:
            op["lease"] = self._lease_id(lease)
        return op

    def put(self, key: str, value: bytes | str, lease: "Lease | int | None" = None) -> int:
        """Write ``key``; returns the store's new revision (the key's mod_revision)."""
        r = self._call("/kv/put", self._put_op(key, value, lease))
        return int(r["header"]["revision"])

    def create(self, key: str, value: bytes | str, lease: "Lease | int | None" = None) -> bool:
        """Write ``key`` only if it is absent."""
        return self.cas(key, value, 0, lease)

    def cas(self, key: str, value: bytes | str, mod_revision: int,
            lease: "Lease | int | None" = None) -> bool:
        """Write ``key`` only if unchanged since ``mod_revision`` (0: only if absent)."""
        k = _b64(self._key(key))
        if mod_revision == 0:
            cmp = {"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": 0}
        else:
            cmp = {"key": k, "target": "MOD", "result": "EQUAL", "mod_revision": int(mod_revision)}
        r = self._txn([cmp], [{"request_put": self._put_op(key, value, lease)}])
        return bool(r.get("succeeded", False))

    def guarded(self, guard_key: str, guard_create_revision: int,
                puts: Mapping[str, bytes | str] | None = None, deletes: Iterable[str] = (),
                delete_prefixes: Iterable[str] = ()) -> int:
        """Apply ``puts``, ``deletes`` and ``delete_prefixes`` in one transaction, only while
        ``guard_key`` exists with that create revision (the leader's epoch): a leader that lost
        its key cannot write over its successor. Returns the revision; raises :class:`Fenced`.
        etcd refuses (StoreError) a transaction that touches one key twice (a put inside a
        deleted prefix included) or holds more operations than its --max-txn-ops (128)."""
        if guard_create_revision <= 0:
            raise ValueError("guard_create_revision must be a key's create revision (> 0)")
        g = _b64(self._key(guard_key))
        ops: list[dict] = [{"request_put": self._put_op(k, v)} for k, v in (puts or {}).items()]
        ops += [{"request_delete_range": {"key": _b64(self._key(k))}} for k in deletes]
        for p in delete_prefixes:
            kp = self._key(p)
            ops.append({"request_delete_range": {"key": _b64(kp),
                                                 "range_end": _b64(_prefix_end(kp))}})
        r = self._txn([{"key": g, "target": "CREATE", "result": "EQUAL",
                        "create_revision": int(guard_create_revision)}], ops,
                      [{"request_range": {"key": g}}])
        if r.get("succeeded"):
            return int(r["header"]["revision"])
        kvs = ((r.get("responses") or [{}])[0].get("response_range") or {}).get("kvs") or []
        found = int(kvs[0].get("create_revision", 0)) if kvs else 0
        now = f"now created at revision {found}" if found else "now absent"
        raise Fenced(f"fenced: {guard_key!r} is {now}, not at epoch {guard_create_revision}: "
                     "another leader took over", guard_key, int(guard_create_revision), found)

    def delete(self, key: str) -> None:
        self._call("/kv/deleterange", {"key": _b64(self._key(key))})

    def delete_prefix(self, key: str) -> int:
        """Delete every key under ``key``; returns how many there were."""
        k = self._key(key)
        r = self._call("/kv/deleterange", {"key": _b64(k), "range_end": _b64(_prefix_end(k))})
        return int(r.get("deleted", 0))

    def compact(self, revision: int) -> None:
        """Drop the history before ``revision`` (a watch from before it then raises
        :class:`Compacted`), so that a long job's recoveries do not grow etcd without bound.
        Compacting to an already compacted revision does nothing."""
        if revision <= 0:
            return
        try:
            self._call("/kv/compaction", {"revision": int(revision), "physical": True})
        except StoreError as e:
            if isinstance(e, StoreUnavailable):
                raise
            if "has been compacted" in str(e):
                return
            if "future revision" in str(e):
                raise ValueError(f"cannot compact to revision {revision}: the store is not "
                                 "there yet") from None
            raise

    # -- leases --

    def lease(self, ttl_s: int) -> "Lease":
        """A new lease. etcd counts whole seconds and may raise a short TTL to its minimum: the
        lease's ``ttl_s`` is what etcd granted."""
        if ttl_s < 1:
            raise ValueError("an etcd lease lasts at least 1 s")
        sent = time.monotonic()
        r = self._call("/lease/grant", {"TTL": int(math.ceil(ttl_s)), "ID": 0})
        if r.get("error"):
            raise StoreError(f"etcd refused a lease: {r['error']}")
        return Lease(self, int(r["ID"]), int(r["TTL"]), sent)

    def _keepalive_once(self, lease_id: int, deadline: float) -> int:
        r = self._call("/lease/keepalive", {"ID": lease_id}, deadline)
        return int((r.get("result") or {}).get("TTL", 0))  # absent: the lease is gone

    def _revoke(self, lease_id: int) -> None:
        try:
            self._call("/lease/revoke", {"ID": lease_id})
        except StoreError as e:
            if e.code != _NOT_FOUND:  # already expired
                raise

    # -- watches --

    def wait(self, key_prefix: str, after_revision: int,
             timeout_s: float) -> list[tuple[str, bytes | None, int]]:
        """The changes under ``key_prefix`` after ``after_revision``: (relative key, value or
        None for a delete, mod_revision), as soon as there is one, or [] after ``timeout_s``
        (at least 0.1 s: a poll still sees changes already made). Raises :class:`Compacted` when
        that history is gone, :class:`StoreUnavailable` when no endpoint took the watch within
        the client's timeout_s."""
        k = self._key(key_prefix)
        events = self._watch(k, _prefix_end(k), int(after_revision) + 1,
                             time.monotonic() + max(0.1, timeout_s))
        return [(self._rel(key), value, rev) for key, value, rev in events]

    def _watch(self, key: bytes, range_end: bytes | None, start_revision: int, deadline: float,
               stop: threading.Event | None = None) -> list[tuple[str, bytes | None, int]]:
        """Events (base64 key, value or None, mod_revision) from ``start_revision`` on, or []
        at the deadline or once ``stop`` is set. When the stream breaks it is opened again,
        from the same revision (nothing is skipped), on the next endpoint; no watch for the
        client's timeout_s, or none at all by the deadline, is StoreUnavailable."""
        create: dict[str, Any] = {"key": _b64(key), "start_revision": max(1, start_revision)}
        if range_end is not None:
            create["range_end"] = _b64(range_end)
        requests = self._requests
        n = len(self._clients)
        last = "no attempt: the deadline had passed"
        ever_live = False
        unwatched_until = time.monotonic() + self.timeout_s  # a watch must be up by then
        auth_retried = False
        base, failures, slept = self._current, 0, 0
        delay = 0.02
        while True:
            now = time.monotonic()
            if stop is not None and stop.is_set():
                return []
            if now >= unwatched_until or (now >= deadline and not ever_live):
                raise StoreUnavailable(self._unavailable(last))
            if now >= deadline:
                return []  # the watch broke near the end; the caller asks again from `rev`
            remaining = min(deadline, unwatched_until) - now
            if failures and failures % n == 0 and slept < failures:  # a round failed: pause
                slept = failures
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, 0.25)
                continue
            idx = (base + failures) % n
            client = self._clients[idx]
            try:
                resp = client.session.post(
                    client.get_url("/watch"), json={"create_request": create}, stream=True,
                    verify=client.session.verify,
                    timeout=(min(remaining, self._attempt_s), deadline - now + 1.0))
            except (requests.Timeout, requests.ConnectionError) as e:
                last, failures = f"{self._name(idx)}: {type(e).__name__}: {e}", failures + 1
                continue
            if resp.status_code != 200:
                text, code = _error_text(resp)
                resp.close()
                if resp.status_code >= 500 or code in _RETRY_CODES:
                    last, failures = f"{self._name(idx)}: {text}", failures + 1
                    continue
                raise StoreError(f"etcd watch: {text}", code)
            stream = _Stream(resp)
            try:
                while True:
                    now = time.monotonic()
                    if now >= deadline or (stop is not None and stop.is_set()):
                        return []
                    item = stream.get(min(deadline - now, 0.1 if stop is not None else 3600))
                    if item is None:
                        continue
                    kind, body = item
                    if kind != "msg":
                        last, failures = f"{self._name(idx)}: watch stream: {body}", failures + 1
                        unwatched_until = min(unwatched_until, time.monotonic() + self.timeout_s)
                        break
                    if "error" in body and "result" not in body:
                        err = body["error"] if isinstance(body["error"], dict) else {}
                        code = err.get("grpc_code", err.get("code"))
                        text = str(err.get("message") or body["error"])
                        if code in _RETRY_CODES or code is None:
                            last, failures = f"{self._name(idx)}: {text}", failures + 1
                            unwatched_until = min(unwatched_until,
                                                  time.monotonic() + self.timeout_s)
                            break
                        raise StoreError(f"etcd watch: {text}", code)
                    result = body.get("result") or {}
                    if result.get("canceled"):
                        compacted = int(result.get("compact_revision", 0))
                        if compacted:
                            raise Compacted(f"etcd compacted its history up to revision "
                                            f"{compacted}: changes from {start_revision} are gone",
                                            compacted)
                        reason = str(result.get("cancel_reason", "canceled"))
                        if ("permission denied" in reason and self._authenticated
                                and not auth_retried):
                            auth_retried = True  # the token expired: log in again, once
                            client.session.invalidate()
                            break
                        raise StoreError(f"etcd watch canceled: {reason}")
                    if result.get("created"):
                        ever_live, unwatched_until = True, math.inf
                        self._current = idx
                        continue
                    events = [self._event(ev) for ev in result.get("events") or []]
                    while events:  # and whatever else already arrived
                        more = stream.get(0)
                        if more is None or more[0] != "msg":
                            break
                        events += [self._event(ev)
                                   for ev in (more[1].get("result") or {}).get("events") or []]
                    if events:
                        return events
            finally:
                stream.close()

    @staticmethod
    def _event(ev: dict) -> tuple[str, bytes | None, int]:
        kv = ev.get("kv") or {}
        value = None if ev.get("type") == "DELETE" else _unb64(kv.get("value"))
        return kv.get("key", ""), value, int(kv.get("mod_revision", 0))

    # -- election --

    def campaign(self, key: str, value: str, ttl_s: int, stop: threading.Event,
                 on_lost: Callable[[], None],
                 on_doubt: Callable[[bool], None] | None = None) -> "Leadership | None":
        """Block until this caller holds ``key`` (created under a fresh lease, only if absent),
        or until ``stop`` is set (-> None). Waiting, it watches the key for its deletion. The
        lease is then kept alive in a thread; ``on_lost`` is called once if it cannot be for
        longer than its TTL, after which the caller must stop acting as leader (with
        ``on_doubt``: see :meth:`Lease.keepalive`)."""
        k = self._key(key)
        lease: Lease | None = None
        while not stop.is_set():
            try:
                if lease is None or not lease.alive:
                    lease = self.lease(ttl_s)
                r = self._txn([{"key": _b64(k), "target": "CREATE", "result": "EQUAL",
                                "create_revision": 0}],
                              [{"request_put": {"key": _b64(k), "value": _b64(_value(value)),
                                                "lease": lease.id}}],
                              [{"request_range": {"key": _b64(k)}}])
            except StoreUnavailable as e:
                log.debug("campaign for %s: %s", key, e)
                stop.wait(0.2)
                continue
            except StoreError as e:
                if e.code != _NOT_FOUND:  # "requested lease not found": it expired, take another
                    raise
                lease = None
                continue
            epoch = int(r["header"]["revision"]) if r.get("succeeded") else 0
            kvs = ((r.get("responses") or [{}])[0].get("response_range") or {}).get("kvs") or []
            if not epoch and kvs and int(kvs[0].get("lease", 0)) == lease.id:
                epoch = int(kvs[0]["create_revision"])  # an earlier, timed-out try of ours won
            if epoch:
                ld = Leadership(self, key, value, epoch, lease, on_lost, on_doubt)
                if stop.is_set():
                    ld.resign()
                    return None
                return ld
            try:  # someone else leads: give our lease back, watch their key go away
                lease.revoke()
            except StoreError:
                pass
            lease = None
            rev = int(r["header"]["revision"])
            try:
                while not stop.is_set():
                    events = self._watch(k, None, rev + 1, time.monotonic() + 5.0, stop)
                    if not events or any(v is None for _, v, _ in events):
                        break  # deleted (or a quiet while: ask again anyway)
                    rev = events[-1][2]
            except (StoreUnavailable, Compacted) as e:
                log.debug("campaign for %s: %s", key, e)
                stop.wait(0.2)
        if lease is not None:
            lease.stop()
        return None

    def leader(self, key: str) -> tuple[str, int] | None:
        """(value, epoch) of whoever holds ``key``, or None."""
        r = self._call("/kv/range", {"key": _b64(self._key(key))})
        kvs = r.get("kvs") or []
        if not kvs:
            return None
        return (_unb64(kvs[0].get("value")).decode("utf-8", "replace"),
                int(kvs[0]["create_revision"]))

    # -- lifetime --

    def close(self) -> None:
        """Stop every keep-alive thread this object started (their leases then expire on their
        own: nothing is revoked) and close the HTTP sessions."""
        with self._lock:
            leases = list(self._leases)
        for lease in leases:
            lease._stop.set()  # all at once: their refreshes in flight end together
        for lease in leases:
            lease.stop()
        for client in self._clients:
            client.session.close()


class Lease:
    """An etcd lease: keys attached to it vanish when it expires or is revoked."""

    def __init__(self, etcd: Etcd, id: int, ttl_s: int, granted_at: float):
        self.id = id
        self.ttl_s = ttl_s
        self._etcd = etcd
        self._last_ok = granted_at  # when the last successful grant/refresh was *sent*
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost = False
        self._revoked = False
        self._on_lost: Callable[[], None] | None = None
        self._on_doubt: Callable[[bool], None] | None = None
        self._doubt = False
        self._lost_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Lease({self.id:x}, ttl={self.ttl_s}s, alive={self.alive})"

    @property
    def alive(self) -> bool:
        """Whether the lease is surely still held: not revoked, not found expired, and refreshed
        less than a TTL ago on this host's monotonic clock (etcd's count started no earlier)."""
        return (not self._lost and not self._revoked
                and time.monotonic() < self._last_ok + self.ttl_s)

    @property
    def last_refresh(self) -> float:
        """time.monotonic() of the last successful grant/refresh (when it was sent)."""
        return self._last_ok

    def refresh(self) -> bool:
        """Refresh once, now; False when etcd says the lease is gone."""
        sent = time.monotonic()
        ttl = self._etcd._keepalive_once(self.id, sent + self._etcd.timeout_s)
        if ttl <= 0:
            return False
        self._last_ok = sent
        return True

    def keepalive(self, on_lost: Callable[[], None] | None = None,
                  on_doubt: Callable[[bool], None] | None = None) -> None:
        """Refresh every ttl/3 in a daemon thread; ``on_lost`` is called once (from that thread)
        when etcd says the lease expired, or when no refresh succeeded for ttl_s.

        With ``on_doubt``, not reaching etcd for ttl_s is not taken as the loss: etcd itself may
        be down (restarting), and it extends every lease when it comes back. ``on_doubt(True)`` is
        called then, the refreshes go on, and ``on_doubt(False)`` follows the first one that
        succeeds; ``on_lost`` only when etcd says the lease is gone. The caller decides meanwhile
        (a host that reaches none of its peers is the one cut off)."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError(f"lease {self.id:x} is already kept alive")
        self._on_lost = on_lost
        self._on_doubt = on_doubt
        self._doubt = False
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"nonstop-etcd-lease-{self.id:x}",
                                        daemon=True)
        with self._etcd._lock:
            self._etcd._leases.add(self)
        self._thread.start()

    def _run(self) -> None:
        period = self.ttl_s / 3
        while not self._stop.is_set():
            expires = self._last_ok + self.ttl_s
            sent = time.monotonic()
            doubting = self._on_doubt is not None
            if sent >= expires:
                if not doubting:
                    self._declare_lost(f"not refreshed for {self.ttl_s} s")
                    return
                if not self._doubt:
                    self._doubt = True
                    log.warning("etcd lease %x: not refreshed for %s s", self.id, self.ttl_s)
                    self._call_doubt(True)
            try:
                limit = sent + self._etcd.timeout_s if doubting else min(expires, sent + self._etcd.timeout_s)
                ttl = self._etcd._keepalive_once(self.id, limit)
            except StoreError as e:  # unavailable, or refused: try again until it expires
                log.debug("lease %x: refresh failed: %s", self.id, e)
                self._stop.wait(0.05)
                continue
            if ttl <= 0:
                self._declare_lost("etcd says it expired")
                return
            self._last_ok = sent
            if self._doubt:
                self._doubt = False
                self._call_doubt(False)
            self._stop.wait(max(0.0, period - (time.monotonic() - sent)))

    def _call_doubt(self, doubt: bool) -> None:
        try:
            self._on_doubt(doubt)
        except Exception:  # noqa: BLE001 - a callback's failure must not stop the refreshes
            log.exception("on_doubt callback of lease %x failed", self.id)

    def _declare_lost(self, why: str) -> None:
        with self._lost_lock:
            if self._lost or self._stop.is_set():
                return
            self._lost = True
        log.warning("etcd lease %x lost: %s", self.id, why)
        if self._on_lost is not None:
            try:
                self._on_lost()
            except Exception:  # noqa: BLE001 - a callback's failure must not hide the loss
                log.exception("on_lost callback of lease %x failed", self.id)

    def stop(self) -> None:
        """Stop refreshing (the lease then expires on its own); no on_lost after this returns."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(self._etcd.timeout_s + 1.0)  # a refresh in flight ends by its deadline
        with self._etcd._lock:
            self._etcd._leases.discard(self)

    def revoke(self) -> None:
        """Stop refreshing and end the lease now: its keys go at once."""
        self.stop()
        self._revoked = True
        self._etcd._revoke(self.id)


class Leadership:
    """Held ``key`` of an election. ``epoch`` (the key's create revision) grows with every new
    leader: pass (key, epoch) to :meth:`Etcd.guarded` so a deposed leader's writes fail."""

    def __init__(self, etcd: Etcd, key: str, value: str, epoch: int, lease: Lease,
                 on_lost: Callable[[], None], on_doubt: Callable[[bool], None] | None = None):
        self.key, self.value, self.epoch, self.lease = key, value, epoch, lease
        self._etcd = etcd
        self._resigned = False
        lease.keepalive(on_lost, on_doubt)

    def __repr__(self) -> str:
        return f"Leadership({self.key!r}, epoch={self.epoch}, alive={self.alive})"

    @property
    def alive(self) -> bool:
        return not self._resigned and self.lease.alive

    @property
    def guard(self) -> tuple[str, int]:
        """(guard_key, guard_create_revision) for :meth:`Etcd.guarded`."""
        return self.key, self.epoch

    def resign(self) -> None:
        """Give the key up now (revoking the lease deletes it); if etcd cannot be reached, the
        lease simply expires within its TTL."""
        self._resigned = True
        try:
            self.lease.revoke()
        except StoreError as e:
            log.warning("resigning %s: %s (the lease expires within %d s)", self.key, e,
                        self.lease.ttl_s)

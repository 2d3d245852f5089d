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

The client is here; its endpoints and HTTP plumbing are in ``etcd_http``, its leases and
leaderships in ``etcd_lease``, its exceptions in ``etcd_errors`` (all importable from here).
``requests`` and ``etcd3gw`` are imported when the first :class:`Etcd` is made, so importing this
module (for :func:`parse_endpoints` or the exceptions) costs nothing.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

if TYPE_CHECKING:
    import requests

log = logging.getLogger(__name__)

from .etcd_errors import (AuthFailed, Compacted, Fenced, StoreError, StoreUnavailable,  # noqa: F401
                          _Retry)
from .etcd_http import (API_PATH, TLS, _NOT_FOUND, _RETRY_CODES, _Stream, _abort,  # noqa: F401
                        _auth_session_class, _b64, _error_text, _parse, _prefix_end, _unb64,
                        _utf8, _value, parse_endpoints, wants_tls)
from .etcd_lease import Leadership, Lease  # noqa: F401

ROOT = "/nonstop/"
_MIN_ATTEMPT_S = 0.5  # one endpoint's share of a deadline, when there are others to try
HISTORY_S = 1.0  # a short wait whose history may hold changes gets this long once its watch is live


_CAUSES = (("Connection refused", "connection refused"), ("timed out", "timed out"),
           ("No route to host", "no route to host"),
           ("Name or service not known", "unknown host name"),
           ("certificate verify failed", "TLS certificate not trusted"),
           ("Connection reset", "connection reset"),
           ("Network is unreachable", "network unreachable"))


def _short(e: BaseException) -> str:
    """What a failed HTTP call to etcd comes down to, in a few words (urllib3's own text runs to
    hundreds of characters of pool and adapter names)."""
    text = str(e)
    for needle, said in _CAUSES:
        if needle in text:
            return said
    return f"{type(e).__name__}: {text[:120]}"


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
            raise _Retry(_short(e)) from None
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
                raise StoreUnavailable(self._unavailable(last), last)
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

    def _absent(self, key: str) -> dict:
        return {"key": _b64(self._key(key)), "target": "CREATE", "result": "EQUAL",
                "create_revision": 0}

    def rejoin(self, key: str, value: bytes | str, lease: "Lease | int", unless: str) -> str:
        """Write ``key`` under ``lease`` again, only while both it and ``unless`` are absent:
        "rejoined"; "gone" when ``unless`` exists; "present" when ``key`` does."""
        r = self._txn([self._absent(key), self._absent(unless)],
                      [{"request_put": self._put_op(key, value, lease)}],
                      [{"request_range": {"key": _b64(self._key(unless))}}])
        if r.get("succeeded"):
            return "rejoined"
        kvs = ((r.get("responses") or [{}])[0].get("response_range") or {}).get("kvs") or []
        return "gone" if kvs else "present"

    def mark_gone(self, guard_key: str, guard_create_revision: int, gone: str, unless: str,
                  value: bytes | str = b"1") -> bool:
        """Write ``gone`` while ``guard_key`` holds that epoch and ``unless`` is absent: True when
        written (or already there), False when ``unless`` exists (the host is back); raises
        :class:`Fenced` when the epoch is no longer the leader's."""
        g = _b64(self._key(guard_key))
        r = self._txn([{"key": g, "target": "CREATE", "result": "EQUAL",
                        "create_revision": int(guard_create_revision)}, self._absent(unless)],
                      [{"request_put": self._put_op(gone, value)}],
                      [{"request_range": {"key": g}},
                       {"request_range": {"key": _b64(self._key(unless))}}])
        if r.get("succeeded"):
            return True
        responses = r.get("responses") or [{}, {}]
        lead = (responses[0].get("response_range") or {}).get("kvs") or []
        found = int(lead[0].get("create_revision", 0)) if lead else 0
        if found != int(guard_create_revision):
            raise Fenced(f"fenced: {guard_key!r} is not at epoch {guard_create_revision}: another "
                         "leader took over", guard_key, int(guard_create_revision), found)
        return False

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

    def keepalive_once(self, lease_id: int, deadline: float) -> int:
        r = self._call("/lease/keepalive", {"ID": lease_id}, deadline)
        return int((r.get("result") or {}).get("TTL", 0))  # absent: the lease is gone

    def kept_alive(self, lease: Lease, alive: bool) -> None:
        with self._lock:
            if alive:
                self._leases.add(lease)
            else:
                self._leases.discard(lease)

    def revoke_lease(self, lease_id: int) -> None:
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
        (at least 0.1 s once the watch is live, however long it took to open it, and up to
        ``HISTORY_S`` when the store has changed since ``after_revision``: a poll still sees
        changes already made; it may take that long when they were not under the prefix).
        Raises :class:`Compacted` when that history is gone,
        :class:`StoreUnavailable` when no endpoint took the watch within the client's
        timeout_s."""
        k = self._key(key_prefix)
        events = self._watch(k, _prefix_end(k), int(after_revision) + 1,
                             time.monotonic() + max(0.1, timeout_s), live_for_s=0.1)
        return [(self._rel(key), value, rev) for key, value, rev in events]

    def _watch(self, key: bytes, range_end: bytes | None, start_revision: int, deadline: float,
               stop: threading.Event | None = None,
               live_for_s: float = 0.0) -> list[tuple[str, bytes | None, int]]:
        """Events (base64 key, value or None, mod_revision) from ``start_revision`` on, or []
        at the deadline or once ``stop`` is set. With ``live_for_s``, the deadline is at least
        that long after the watch went live (etcd sends its history then), and opening it may
        take the client's timeout_s. When the stream breaks it is opened again,
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
            if now >= unwatched_until or (now >= deadline and not ever_live and not live_for_s):
                raise StoreUnavailable(self._unavailable(last), last)
            if now >= deadline and ever_live:
                return []  # the watch broke near the end; the caller asks again from `rev`
            remaining = (unwatched_until if live_for_s and not ever_live
                         else min(deadline, unwatched_until)) - now
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
                    timeout=(min(remaining, self._attempt_s), max(deadline - now, 0.0) + 1.0))
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
                        # history made before the watch (the store is past our start) comes
                        # after this answer: on a loaded machine, well after it
                        past = int((result.get("header") or body.get("header") or {})
                                   .get("revision", 0) or 0) >= start_revision
                        deadline = max(deadline, time.monotonic()
                                       + (HISTORY_S if past and live_for_s else live_for_s))
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

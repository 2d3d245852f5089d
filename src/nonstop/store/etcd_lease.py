"""etcd leases kept alive in a thread, and the leadership an election gives."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Protocol

from .etcd_errors import StoreError, StoreUnavailable

log = logging.getLogger("nonstop.store.etcd")


class LeaseClient(Protocol):
    """What a lease needs of the etcd client that granted it (``store.etcd.Etcd``)."""

    timeout_s: float

    def keepalive_once(self, lease_id: int, deadline: float) -> int:
        """Refresh once; the TTL etcd gives back (0: the lease is gone)."""

    def revoke_lease(self, lease_id: int) -> None:
        """End the lease now (one already expired is no error)."""

    def kept_alive(self, lease: Lease, alive: bool) -> None:
        """Whether a lease is being kept alive by a thread (the client stops them all when it
        is closed)."""


class Lease:
    """An etcd lease: keys attached to it vanish when it expires or is revoked."""

    def __init__(self, etcd: LeaseClient, id: int, ttl_s: int, granted_at: float):
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
        # why the newest refresh failed (``host:port: cause``, or etcd's refusal); None once one
        # succeeds: what a holder says when it cannot reach etcd
        self.failure: str | None = None

    def __repr__(self) -> str:
        return f"Lease({self.id:x}, ttl={self.ttl_s}s, alive={self.alive})"

    @property
    def alive(self) -> bool:
        """Whether the lease is surely still held: not revoked, not found expired, and refreshed
        less than a TTL ago on this host's monotonic clock (etcd's count started no earlier)."""
        return (not self._lost and not self._revoked
                and time.monotonic() < self._last_ok + self.ttl_s)

    @property
    def period(self) -> float:
        """How often the lease is refreshed once kept alive: a third of its TTL (two refreshes
        may fail before it expires)."""
        return self.ttl_s / 3

    @property
    def last_refresh(self) -> float:
        """time.monotonic() of the last successful grant/refresh (when it was sent)."""
        return self._last_ok

    def refresh(self) -> bool:
        """Refresh once, now; False when etcd says the lease is gone."""
        sent = time.monotonic()
        ttl = self._etcd.keepalive_once(self.id, sent + self._etcd.timeout_s)
        if ttl <= 0:
            return False
        self._last_ok = sent
        return True

    def keepalive(self, on_lost: Callable[[], None] | None = None,
                  on_doubt: Callable[[bool], None] | None = None) -> None:
        """Refresh every ``period`` in a daemon thread; ``on_lost`` is called once (from that thread)
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
        self._etcd.kept_alive(self, True)
        self._thread.start()

    def _run(self) -> None:
        period = self.period
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
                ttl = self._etcd.keepalive_once(self.id, limit)
            except StoreError as e:  # unavailable, or refused: try again until it expires
                log.debug("lease %x: refresh failed: %s", self.id, e)
                self.failure = e.last if isinstance(e, StoreUnavailable) and e.last else str(e)
                self._stop.wait(0.05)
                continue
            if ttl <= 0:
                self._declare_lost("etcd says it expired")
                return
            self._last_ok = sent
            self.failure = None
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
        self._etcd.kept_alive(self, False)

    def revoke(self) -> None:
        """Stop refreshing and end the lease now: its keys go at once."""
        self.stop()
        self._revoked = True
        self._etcd.revoke_lease(self.id)


class Leadership:
    """Held ``key`` of an election. ``epoch`` (the key's create revision) grows with every new
    leader: pass (key, epoch) to :meth:`Etcd.guarded` so a deposed leader's writes fail."""

    def __init__(self, etcd: LeaseClient, key: str, value: str, epoch: int, lease: Lease,
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

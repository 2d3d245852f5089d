"""How the controller reaches its workers and hears from them: mailboxes, aborts, events,
progress, and the store each generation's group forms on.

On one host all of it is the launcher's TCPStore (``StoreMail``); across hosts each host's agent
relays it to its own ranks (``nonstop.controller.cluster.ClusterMail``). The controller sees only this
interface, so its decisions do not depend on where the ranks run.
"""

from __future__ import annotations

import contextlib
import heapq
import time
from typing import Any, Callable, Iterable, Iterator

from .. import protocol

SWEEP_S = 1.0  # every worker's events are looked for at least this often, doorbell or not


class StoreMail:
    """One host: the workers' mailboxes, events and progress are keys of the launcher's store.

    ``wids``: the workers whose events to read (those alive, and those that ended a short while
    ago: their last events may still be on the way)."""

    def __init__(self, wids: Callable[[], Iterable[int]]):
        self.store: Any = None  # attached once it is up (the processes start before it)
        self._wids = wids
        self._next: dict[int, int] = {}  # wid -> its next event to read
        self._rung = -1  # the doorbell's count at the last sweep
        self._next_sweep = 0.0
        self._gen_stores: dict[int, Any] = {}
        self._common: dict[str, Any] = {}  # what every message sent in a batch shares

    def attach(self, store: Any) -> None:
        self.store = store

    def send(self, wid: int, seq: int, msg: dict[str, Any]) -> None:
        if self._common:
            msg = {**self._common, **msg}
        self.store.set(protocol.mailbox_key(wid, seq), protocol.dumps(msg))

    @contextlib.contextmanager
    def batch(self, common: dict[str, Any] | None = None) -> Iterator[None]:
        """Messages sent inside go out as they are sent (across hosts they go as one frame per
        host: ``controller/cluster.py``); each is ``common``'s fields with its own over them."""
        self._common = common or {}
        try:
            yield
        finally:
            self._common = {}

    def abort(self, gen: int, wids: list[int], regroup: bool = False) -> None:
        """Tell the ranks to leave generation ``gen``: at once, or (``regroup``) at their next
        step boundary."""
        keys = [protocol.abort_key(gen, wid) for wid in wids]
        if keys:
            value = protocol.REGROUP if regroup else protocol.ABORT
            self.store.multi_set(keys, [value] * len(keys))

    def events(self) -> Iterator[dict[str, Any]]:
        """The workers' new events: each worker's in the order it wrote them, merged by time.
        The doorbell (one round trip) says whether any was written since the last sweep; a
        sweep reads each worker's from where it stopped. A writer delayed between its event
        and the doorbell is caught by the sweep every ``SWEEP_S``."""
        rung = self.store.add(protocol.EVENT_COUNT_KEY, 0)
        now = time.monotonic()
        if rung == self._rung and now < self._next_sweep:
            return iter(())
        self._rung, self._next_sweep = rung, now + SWEEP_S
        batches = []
        wids = set(self._wids())
        for wid in wids:
            n = start = self._next.get(wid, 0)
            got = []
            while self.store.check([protocol.event_key(wid, n)]):
                got.append(protocol.loads(self.store.get(protocol.event_key(wid, n))))
                n += 1
            if n != start:
                self._next[wid] = n
                batches.append(got)
        for wid in set(self._next) - wids:  # ended long ago: read for the last time
            del self._next[wid]
        return heapq.merge(*batches, key=lambda ev: ev.get("t", 0.0))

    def progress(self, wids: list[int]) -> dict[int, dict[str, Any]]:
        """The newest progress record of each worker that has one."""
        keys = [protocol.progress_key(wid) for wid in wids]
        if not keys:
            return {}
        if not self.store.check(keys):  # some have none yet (a process just started)
            have = [(w, k) for w, k in zip(wids, keys) if self.store.check([k])]
            if not have:
                return {}
            wids, keys = [w for w, _ in have], [k for _, k in have]
        return {wid: protocol.loads(raw) for wid, raw in zip(wids, self.store.multi_get(keys))}

    @staticmethod
    def host_of(node: int) -> int:
        """Nodes on one host are one host (for LOCAL_RANK and GROUP_RANK)."""
        return 0

    def generation_store(self, gen: int, node: int) -> dict[str, Any]:
        """Where generation ``gen`` forms its group. A plain script rendezvouses through
        MASTER_PORT with unprefixed keys: it gets a fresh store per generation so no key is ever
        reused (a managed rank uses the main store under ``g/<gen>/pg``)."""
        from . import loopback

        gen_store = loopback.master_store()
        self._gen_stores[gen] = gen_store
        for old in [g for g in self._gen_stores if g < gen - 1]:
            self._gen_stores.pop(old).close()
        return {"port": gen_store.port}

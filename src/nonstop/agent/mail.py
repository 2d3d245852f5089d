"""How the controller reaches its workers and hears from them: mailboxes, aborts, events,
progress, and the store each generation's group forms on.

On one host all of it is the launcher's TCPStore (``StoreMail``); across hosts each host's agent
relays it to its own ranks (``nonstop.hosts.cluster.ClusterMail``). The controller sees only this
interface, so its decisions do not depend on where the ranks run.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from .. import protocol

EVENT_HOLE_S = 2.0  # an event slot taken but never written is skipped after this long


class StoreMail:
    """One host: the workers' mailboxes, events and progress are keys of the launcher's store."""

    def __init__(self, on_lost_event: Callable[[int], None] | None = None):
        self.store: Any = None  # attached once it is up (the processes start before it)
        self._on_lost_event = on_lost_event
        self._events_read = 0
        self._hole_since: float | None = None
        self._gen_stores: dict[int, Any] = {}

    def attach(self, store: Any) -> None:
        self.store = store

    def send(self, wid: int, seq: int, msg: dict[str, Any]) -> None:
        self.store.set(protocol.mailbox_key(wid, seq), protocol.dumps(msg))

    def abort(self, gen: int, wids: list[int], regroup: bool = False) -> None:
        """Tell the ranks to leave generation ``gen``: at once, or (``regroup``) at their next
        step boundary."""
        keys = [protocol.abort_key(gen, wid) for wid in wids]
        if keys:
            value = protocol.REGROUP if regroup else protocol.ABORT
            self.store.multi_set(keys, [value] * len(keys))

    def events(self) -> Iterator[dict[str, Any]]:
        """The workers' new events, in the order they took their slots."""
        count = self.store.add(protocol.EVENT_COUNT_KEY, 0)
        while self._events_read < count:
            key = protocol.event_key(self._events_read)
            if not self.store.check([key]):
                # Taken but not written yet (a get would block): next tick. A writer killed
                # between taking and writing leaves a hole: skip it after a while.
                now = time.time()
                if self._hole_since is None:
                    self._hole_since = now
                if now - self._hole_since < EVENT_HOLE_S:
                    return
                if self._on_lost_event is not None:
                    self._on_lost_event(self._events_read)
                self._events_read += 1
                self._hole_since = None
                continue
            self._hole_since = None
            ev = protocol.loads(self.store.get(key))
            self._events_read += 1
            yield ev

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

        gen_store = loopback.master_store()  # torch's own would listen on every interface
        self._gen_stores[gen] = gen_store
        for old in [g for g in self._gen_stores if g < gen - 1]:
            del self._gen_stores[old]
        return {"port": gen_store.port}

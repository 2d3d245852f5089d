"""The controller's journal in etcd: written only while the writer holds its epoch, and etcd's
history kept short, so that however many recoveries a job goes through, its keys and etcd's
database stay bounded."""

from __future__ import annotations

import time
from typing import Any

from ..protocol import hosts as keys

KEEP_REVISIONS = 100  # history left for watchers a little behind (a watch older re-reads)
COMPACT_EVERY_S = 30.0


class Journal:
    def __init__(self, etcd: Any, epoch: int, clock: Any = time.monotonic):
        self.etcd, self.epoch = etcd, epoch
        self._clock = clock
        self._last_compact = clock()
        self.writes = 0
        self.compactions = 0

    def write(self, record: str) -> int:
        """One guarded write (raises Fenced when another controller took office); etcd's older
        revisions are compacted now and then."""
        rev = self.etcd.guarded(keys.LEADER, self.epoch, puts={keys.JOURNAL: record})
        self.writes += 1
        self.prune(rev)
        return rev

    def prune(self, revision: int, force: bool = False) -> None:
        """Compact etcd's history up to ``KEEP_REVISIONS`` before ``revision``: every journal
        write and every lease's key adds revisions; without this the database only grows."""
        now = self._clock()
        if not force and now - self._last_compact < COMPACT_EVERY_S:
            return
        self._last_compact = now
        target = revision - KEEP_REVISIONS
        if target > 0:
            try:
                self.etcd.compact(target)
                self.compactions += 1
            except Exception:  # noqa: BLE001 - compacted already (another writer): fine
                pass

"""A keeper's snapshot slots: every holder's memfds and who is using them, under one lock.

The keeper (``keeper.py``), its replication (``replicas.py``) and its disk writes (``disk.py``)
each get the one ``Slots`` object and use the holders only with its lock held; a change that a
thread may be waiting for (a slot come free, work queued) is announced on its condition
(``changed``).
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Any

from ..state import shm

SLOTS = 2
DEFER_LIMIT_S = 120.0  # a write (a snapshot, a replica) waits at most this long for a free slot


class Holder:
    """The slots of one holder and who is using them."""

    def __init__(self, name: str):
        self.name = name
        self.fds: list[int | None] = [None] * SLOTS
        self.writing: list[Any] = [None] * SLOTS  # who is writing the slot
        self.leases: list[collections.Counter] = [collections.Counter() for _ in range(SLOTS)]
        self.sent: dict[str, tuple[int, int]] = {}  # buddy -> (seq, step) of the newest it holds
        # buddies whose copy failed or fell behind, and why: writes no longer wait for them
        # (until a copy reaches them again)
        self.behind: dict[str, str] = {}
        self.repl_s: float | None = None  # how long the last copy took (into memory in place)
        self.repl_first_s: float | None = None  # ...into new memory: an upper bound until then
        self.repl_wait_since: float | None = None  # a write waits for the buddies since then

    def infos(self) -> list[shm.SlotInfo | None]:
        return [shm.read_header(fd) if fd is not None else None for fd in self.fds]

    def free(self, i: int) -> bool:
        return self.writing[i] is None and sum(self.leases[i].values()) == 0

    def unlease(self, i: int, who: Any) -> None:
        """``who`` gives back one lease of slot ``i``."""
        self.leases[i][who] -= 1
        if self.leases[i][who] <= 0:
            del self.leases[i][who]

    def older(self) -> int:
        """The slot a new snapshot goes to: the invalid one, else a departure snapshot's, else
        the one with the older seq. A departure snapshot (``SlotInfo.departure``) thus never
        takes the place of the newest periodic one, whose replicas were compared: by the older
        rule alone, a second departure in a row would, and leave no snapshot a corruption could
        be rolled back to."""
        infos = self.infos()
        return min(range(SLOTS), key=lambda i: (
            infos[i] is not None, infos[i] is not None and not infos[i].departure,  # type: ignore[union-attr]
            infos[i].seq if infos[i] is not None else -1, i))  # type: ignore[union-attr]

    def newest(self, step: int | None = None) -> tuple[int, shm.SlotInfo] | None:
        found = [(info.seq, i, info) for i, info in enumerate(self.infos())
                 if info is not None and self.writing[i] is None
                 and (step is None or info.step == step)]
        if not found:
            return None
        _, i, info = max(found)
        return i, info

    def ensure(self, i: int, size: int) -> tuple[int, bool]:
        """The slot's descriptor, at least ``size`` bytes; and whether it was just made or grown.
        New memory is allocated here, at once (``fallocate``), rather than page by page under
        the first copy into it: a fresh gigabyte costs ~1.3 s faulted in, ~0.3 s allocated."""
        fd = self.fds[i]
        if fd is not None and os.fstat(fd).st_size >= size:
            return fd, False
        if fd is None:
            fd = self.fds[i] = shm.create(f"{self.name}.{i}", size)
        else:
            os.ftruncate(fd, size)  # grows in place; readers re-map when they see a new size
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:
            pass  # not enough memory now: the pages come one by one, or the copy fails loudly
        return fd, True


class Slots:
    """Every holder of the node, by name, and the lock they are used under."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.holders: dict[str, Holder] = {}

    def holder(self, name: str) -> Holder:
        """The holder of that name, made (with no slots yet) if there is none."""
        h = self.holders.get(name)
        if h is None:
            h = self.holders[name] = Holder(name)
        return h

    def give_back(self, who: Any) -> None:
        """Everything ``who`` (a client that went away) was writing or leasing is free again.
        Called with the lock held."""
        for h in self.holders.values():
            for i in range(SLOTS):
                if h.writing[i] == who:
                    h.writing[i] = None
                h.leases[i].pop(who, None)
        self.changed.notify_all()

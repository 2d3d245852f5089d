"""A rank's view of its node's memory (the keeper): slots to write snapshots into, and the
snapshots and replicas the node holds. Slots are mapped once and reused: fresh shared memory
costs a page fault per page on its first write, a mapped slot only the copy."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

from . import shm, wire


def own(rank: int) -> str:
    """The holder of a rank's own snapshots."""
    return f"r{rank}"


def replica(rank: int) -> str:
    """The holder of the replicas of a rank's snapshots on its buddy node."""
    return f"rep{rank}"


class NodeMemory:
    def __init__(self, name: str, timeout_s: float = 120.0):
        self.name = name
        self.timeout_s = timeout_s
        self._client: wire.Client | None = None
        self._mapped: dict[tuple[str, int], shm.Slot] = {}

    @property
    def client(self) -> wire.Client:
        if self._client is None:
            self._client = wire.Client(self.name, self.timeout_s)
        return self._client

    @property
    def keeper_pid(self) -> int:
        return self.client.pid

    def _call(self, msg: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        try:
            return self.client.call(msg)
        except (OSError, ConnectionError):
            self.reset()
            raise

    def reset(self) -> None:
        """The keeper went away: forget the connection (and the slots of a memory that is gone)."""
        if self._client is not None:
            self._client.close()
        self._client = None
        self._mapped.clear()

    def _slot(self, holder: str, i: int, fd: int, populate: bool = False) -> tuple[shm.Slot, bool]:
        """The slot mapped in this process (mapped now if it was not, or changed): and whether
        it was mapped just now."""
        try:
            st = os.fstat(fd)
            slot = self._mapped.get((holder, i))
            if slot is not None and slot.inode == st.st_ino and slot.size == st.st_size:
                return slot, False
            slot = self._mapped[(holder, i)] = shm.Slot(fd, populate)
            return slot, True
        finally:
            os.close(fd)

    # -- writing ------------------------------------------------------------------------------
    def alloc(self, holder: str, size: int) -> tuple[int, int, shm.Slot, dict[str, Any]]:
        """A slot to write the next snapshot into: (slot, seq, mapped slot, the keeper's reply,
        whose ``fresh`` says the memory is new here: this snapshot's time is not a steady cost).
        Blocks while the keeper keeps the older slot (being read, or its newer twin not yet on
        the buddy node)."""
        reply, fds = self._call({"op": "alloc", "holder": holder, "size": size})
        slot, mapped = self._slot(holder, reply["slot"], fds[0], populate=True)
        reply["fresh"] = bool(reply.get("fresh")) or mapped
        return reply["slot"], reply["seq"], slot, reply

    def commit(self, holder: str, slot: int, persist: dict[str, Any] | None = None) -> None:
        self.client.tell({"op": "commit", "holder": holder, "slot": slot, "persist": persist})

    def corrupt(self, holder: str) -> dict[str, Any]:
        return self._call({"op": "corrupt", "holder": holder})[0]

    # -- reading ------------------------------------------------------------------------------
    def listing(self) -> dict[str, Any]:
        return self._call({"op": "list"})[0]["holders"]

    def steps(self, holder: str, listing: dict[str, Any] | None = None) -> list[int]:
        """Steps of the holder's complete snapshots, newest first (not yet verified)."""
        entry = (listing if listing is not None else self.listing()).get(holder)
        if not entry:
            return []
        infos = [s for s in entry["slots"] if s is not None]
        return [s["step"] for s in sorted(infos, key=lambda s: -s["seq"])]

    @contextlib.contextmanager
    def lease(self, holder: str, step: int | None = None) -> Iterator[tuple[shm.SlotInfo, shm.Slot] | None]:
        """The holder's snapshot of ``step`` (or its newest), kept from being overwritten until
        the block ends; None if there is none."""
        reply, fds = self._call({"op": "lease", "holder": holder, "step": step})
        if reply.get("slot") is None:
            yield None
            return
        i = reply["slot"]
        try:
            yield shm.SlotInfo(**reply["info"]), self._slot(holder, i, fds[0])[0]
        finally:
            try:
                self.client.tell({"op": "release", "holder": holder, "slot": i})
            except OSError:
                self.reset()

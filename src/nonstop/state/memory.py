"""A rank's view of its node's memory (the keeper): slots to write snapshots into, and the
snapshots and replicas the node holds. Slots are mapped once and reused: fresh shared memory
costs a page fault per page on its first write, a mapped slot only the copy."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from typing import Any, Iterator

from ..protocol import keeper_messages as km
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
        self._lock = threading.Lock()
        self._warm: Any = None  # memory made ready for a restore (see ``prepare``)
        self._preparing = False
        # a snapshot whose replicas agreed that the node's memory could not take (it died, and
        # a new one is not up yet): (step, rank, world, meta, data), kept in this process until
        # the memory takes a newer one - so that a corruption found meanwhile has a certified
        # step to go back to (``Snapshots.keep``; offered by a restore as ``kept``)
        self.kept: tuple[int, int, int, bytes, Any] | None = None

    def keep(self, state: Any, step: int, rank: int, world: int, sharded: bool,
             gen: int) -> None:
        """Keep a copy of ``state`` (at ``step``) in this process, where a restore offers it as
        ``kept``: while this memory is out (``Snapshots``), or as a sharded step whose commit
        failed is taken on the rank's own verdict (the state before it). Raises when no copy
        can be made."""
        from . import packing

        meta, data = packing.pack(state.state_dict(), {"step": step, "rank": rank,
                                                       "world": world, "sharded": sharded,
                                                       "gen": gen})
        self.kept = (step, rank, world, meta, data)

    @property
    def client(self) -> wire.Client:
        if self._client is None:
            self._client = wire.Client(self.name, self.timeout_s)
        return self._client

    def twin(self) -> "NodeMemory":
        """The same node's memory over a connection of its own (for another thread: a
        connection answers one call at a time)."""
        return NodeMemory(self.name, self.timeout_s)

    @property
    def keeper_pid(self) -> int:
        return self.client.pid

    def _call(self, request: km.Request) -> tuple[Any, list[int]]:
        """The answer to ``request`` (its own record: ``request.answer``), and its descriptors."""
        try:
            return self.client.call(request)
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

    # -- memory for a restore ----------------------------------------------------------------
    def prepare(self, until: Any, every_s: float = 5.0) -> None:
        """Keep memory ready, in the background, for the biggest snapshot this node holds, until
        ``until()`` is true: a warm spare then restores a rank by a copy into memory already in
        place, not into memory that first pays a page fault per page (the larger part of a
        restore from memory, measured here)."""
        with self._lock:
            if self._preparing:
                return
            self._preparing = True
        threading.Thread(target=self._prepare, args=(until, every_s), name="nonstop-prepare",
                         daemon=True).start()

    def _prepare(self, until: Any, every_s: float) -> None:
        import torch

        try:
            while not until():
                need = self._largest()
                with self._lock:
                    have = self._warm.numel() if self._warm is not None else 0
                if need > have:
                    buf = torch.empty(need, dtype=torch.uint8)
                    buf.zero_()  # every page touched now
                    with self._lock:
                        self._warm = buf
                time.sleep(every_s)
        finally:
            with self._lock:
                self._preparing = False

    def _largest(self) -> int:
        """The largest rank snapshot on this node (0: none yet, or the keeper is gone)."""
        try:
            client = wire.Client(self.name, timeout_s=10.0)  # its own: calls are one at a time
            try:
                listing = client.call(km.ListHolders())[0]
            finally:
                client.close()
        except (OSError, ConnectionError, wire.KeeperError):
            return 0
        return max((s.data_len for name, e in listing.holders.items() if name.startswith("r")
                    and not name.startswith("rep") for s in e.slots if s), default=0)

    def buffer(self, nbytes: int) -> Any:
        """Memory for ``nbytes`` of restored state, to keep (the state loaded from it may alias
        it): the prepared memory if it is big enough, else new."""
        import torch

        with self._lock:
            warm, self._warm = self._warm, None
        if warm is not None and warm.numel() >= nbytes:
            return warm[:nbytes]
        return torch.empty(nbytes, dtype=torch.uint8)

    # -- writing ------------------------------------------------------------------------------
    def alloc(self, holder: str, size: int) -> tuple[int, int, shm.Slot, km.Allocated]:
        """A slot to write the next snapshot into: (slot, seq, mapped slot, the keeper's answer,
        whose ``fresh`` says the memory is new here - to the keeper or mapped in this process
        just now: this snapshot's time is not a steady cost). Blocks while the keeper keeps the
        older slot (being read, or its newer twin not yet on the buddy node)."""
        reply, fds = self._call(km.Alloc(holder=holder, size=size))
        slot, mapped = self._slot(holder, reply.slot, fds[0], populate=True)
        if mapped and not reply.fresh:
            reply = dataclasses.replace(reply, fresh=True)
        return reply.slot, reply.seq, slot, reply

    def commit(self, holder: str, slot: int, persist: km.DiskPart | None = None) -> None:
        self.client.tell(km.Commit(holder=holder, slot=slot, persist=persist))

    def persist(self, part: km.DiskPart) -> None:
        """Write a part of a disk checkpoint from a snapshot committed before (answered at once:
        the write itself is not waited for)."""
        self._call(km.Persist(part=part))

    def corrupt(self, holder: str) -> km.Corrupted:
        return self._call(km.Corrupt(holder=holder))[0]

    # -- reading ------------------------------------------------------------------------------
    def listing(self) -> dict[str, km.HolderEntry]:
        return self._call(km.ListHolders())[0].holders

    def steps(self, holder: str, listing: dict[str, km.HolderEntry] | None = None) -> list[int]:
        """Steps of the holder's complete snapshots, newest first (not yet verified)."""
        entry = (listing if listing is not None else self.listing()).get(holder)
        if not entry:
            return []
        infos = [s for s in entry.slots if s is not None]
        return [s.step for s in sorted(infos, key=lambda s: -s.seq)]

    @contextlib.contextmanager
    def lease(self, holder: str, step: int | None = None) -> Iterator[tuple[shm.SlotInfo, shm.Slot] | None]:
        """The holder's snapshot of ``step`` (or its newest), kept from being overwritten until
        the block ends; None if there is none."""
        reply, fds = self._call(km.Lease(holder=holder, step=step))
        if reply.slot is None:
            yield None
            return
        i = reply.slot
        try:
            yield reply.info, self._slot(holder, i, fds[0])[0]
        finally:
            try:
                self.client.tell(km.Release(holder=holder, slot=i))
            except OSError:
                self.reset()

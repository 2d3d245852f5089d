"""A snapshot slot's header as the processes that share the slot read it - the rank that writes
it, the keeper that holds and replicates it, the checkpoint writer - and the layout the header
fixes (``state/shm.py`` reads and writes it)."""

from __future__ import annotations

import dataclasses
from typing import Any

HEADER = 4096  # the header has a page of its own: the data after it stays aligned
DATA_ALIGN = 64


@dataclasses.dataclass(frozen=True)
class SlotInfo:
    """What a valid slot's header says."""

    seq: int  # grows with every snapshot of one holder: the newest slot has the largest
    step: int
    meta_len: int
    data_len: int
    checksum: int
    written_at: float
    rank: int
    gen: int
    # taken as its rank left a failed generation (``Snapshots.depart``), not after a step's
    # check: its replicas were never compared (``detect.sdc``), so a corruption is never rolled
    # back to it, and a new snapshot takes its slot before a periodic one's
    departure: bool = False

    @property
    def total(self) -> int:
        """Bytes of the slot in use: header, metadata, padding and data."""
        return data_offset(self.meta_len) + self.data_len

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def data_offset(meta_len: int) -> int:
    return (HEADER + meta_len + DATA_ALIGN - 1) // DATA_ALIGN * DATA_ALIGN

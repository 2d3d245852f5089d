"""Snapshot slots in shared memory: a memfd per slot, a header written last, a checksum over the rest.

A slot outlives the process that wrote it for as long as the node's keeper holds its descriptor,
a crash in the middle of a write leaves the slot marked invalid (never torn), and a bit flip or a
truncation is caught by the checksum before anything is loaded.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from typing import Any, Iterable

import xxhash

from ..protocol.slots import DATA_ALIGN, HEADER, SlotInfo, data_offset

MAGIC = b"NSSNAP03"
# magic, seq, step, meta_len, data_len, checksum, written_at, rank, valid, gen, departure
_FMT = "<8sQQQQQdiiqi"
_HEADER_LEN = struct.calcsize(_FMT)
_VALID = struct.calcsize("<8sQQQQQdi")  # offset of the valid flag: set last, cleared first
CHUNK = 4 << 20  # copy and hash in chunks that stay in the cache between the two


def parse_header(raw: bytes) -> SlotInfo | None:
    """The header's contents if it marks a complete snapshot, else None."""
    if len(raw) < _HEADER_LEN:
        return None
    magic, seq, step, meta_len, data_len, checksum, written_at, rank, valid, gen, departure = \
        struct.unpack_from(_FMT, raw)
    if magic != MAGIC or valid != 1:
        return None
    return SlotInfo(seq, step, meta_len, data_len, checksum, written_at, rank, gen,
                    bool(departure))


def pack_header(info: SlotInfo, valid: bool) -> bytes:
    return struct.pack(_FMT, MAGIC, info.seq, info.step, info.meta_len, info.data_len,
                       info.checksum, info.written_at, info.rank, int(valid), info.gen,
                       int(info.departure))


def read_header(fd: int) -> SlotInfo | None:
    """The header of a slot by its descriptor, without mapping it."""
    try:
        return parse_header(os.pread(fd, _HEADER_LEN, 0))
    except OSError:
        return None


def create(name: str, size: int) -> int:
    """A new slot of ``size`` bytes (zero-filled: its header is invalid). Only descriptors reach
    it: nothing on a file system, so only the processes it is handed to can read it."""
    fd = os.memfd_create(f"nonstop-{name}", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return fd


def hasher() -> Any:
    return xxhash.xxh3_64()


class Slot:
    """A slot mapped in this process. The mapping is kept for the life of the object (a tensor
    viewing it may outlive any call), so a slot is mapped once and reused."""

    def __init__(self, fd: int, populate: bool = False):
        self.size = os.fstat(fd).st_size
        self.inode = os.fstat(fd).st_ino
        # populate: map every page now, not one fault at a time under the first copy
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        self._mm = mmap.mmap(fd, self.size, flags=flags) if self.size else None

    @property
    def buffer(self) -> memoryview:
        return memoryview(self._mm) if self._mm is not None else memoryview(b"")

    def info(self) -> SlotInfo | None:
        return parse_header(bytes(self.buffer[:_HEADER_LEN])) if self.size >= HEADER else None

    # -- writing ------------------------------------------------------------------------------
    def begin(self, meta: bytes, data_len: int) -> Any:
        """Invalidate the slot, write the metadata; returns a hasher already fed the metadata.
        The data goes to ``data_view`` next, then ``commit``."""
        if data_offset(len(meta)) + data_len > self.size:
            raise ValueError(f"slot of {self.size} bytes cannot hold {data_offset(len(meta)) + data_len}")
        self.invalidate()  # while it is being written
        buf = self.buffer
        buf[HEADER:HEADER + len(meta)] = meta
        h = hasher()
        h.update(buf[HEADER:HEADER + len(meta)])
        return h

    def data_view(self, meta_len: int, data_len: int) -> Any:
        """A writable uint8 tensor over the data area (no copy)."""
        import torch

        if not data_len:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self._mm, dtype=torch.uint8, count=data_len,
                                offset=data_offset(meta_len))

    def commit(self, info: SlotInfo) -> None:
        """Write the header and mark the slot valid, last: a crash before this leaves the slot
        invalid, and the holder's other slot in force."""
        buf = self.buffer
        buf[:_HEADER_LEN] = pack_header(info, valid=False)
        buf[_VALID:_VALID + 4] = struct.pack("<i", 1)

    def invalidate(self) -> None:
        self.buffer[_VALID:_VALID + 4] = struct.pack("<i", 0)

    # -- reading ------------------------------------------------------------------------------
    def verify(self, info: SlotInfo) -> bool:
        """Whether the slot still holds what its header says, bit for bit."""
        if info.total > self.size:
            return False  # truncated
        return checksum(self.buffer, info) == info.checksum

    def read(self, info: SlotInfo) -> tuple[bytes, Any]:
        """(metadata, data) of a snapshot; the data is a uint8 tensor viewing the slot (no copy:
        copy what must outlive the next write into this slot)."""
        import torch

        meta = bytes(self.buffer[HEADER:HEADER + info.meta_len])
        if not info.data_len:
            return meta, torch.empty(0, dtype=torch.uint8)
        return meta, torch.frombuffer(self._mm, dtype=torch.uint8, count=info.data_len,
                                      offset=data_offset(info.meta_len))

    def flip_bit(self, info: SlotInfo, where: float = 0.5) -> int:
        """Flip one bit of the data (fault injection: a memory error). Returns its offset."""
        off = data_offset(info.meta_len) + int(info.data_len * where) if info.data_len else HEADER
        self.buffer[off] ^= 0x10
        return off


def checksum(buf: memoryview, info: SlotInfo) -> int:
    h = hasher()
    h.update(buf[HEADER:HEADER + info.meta_len])
    off = data_offset(info.meta_len)
    h.update(buf[off:off + info.data_len])
    return h.intdigest()


def write_tensors(slot: Slot, meta: bytes, tensors: Iterable[Any], specs: list[tuple],
                  data_len: int, step: int, rank: int, gen: int, seq: int,
                  midway: Any = None, departure: bool = False) -> SlotInfo:
    """Copy a packed state (``transfer.layout``) into the slot and commit it. Each chunk is hashed
    right after it is copied, while it is still in the cache: the checksum costs little more
    than the copy. ``midway`` is called once, half-way through (fault injection);
    ``departure``: the header says so (``SlotInfo.departure``)."""
    import torch

    h = slot.begin(meta, data_len)
    view = slot.data_view(len(meta), data_len)
    raw = slot.buffer
    base = data_offset(len(meta))
    done, half, fired = 0, data_len // 2, midway is None
    pos = 0
    for t, (_, _, off, nbytes) in zip(tensors, specs):
        if off > pos:  # alignment padding: hashed as written (zeros)
            view[pos:off].zero_()
            h.update(raw[base + pos:base + off])
        src = t.detach()
        if src.device.type != "cpu" or not src.is_contiguous():
            src = src.cpu().contiguous()
        flat = src.reshape(-1).view(torch.uint8) if nbytes else None
        for start in range(0, nbytes, CHUNK):
            end = min(nbytes, start + CHUNK)
            view[off + start:off + end].copy_(flat[start:end])
            h.update(raw[base + off + start:base + off + end])
            done += end - start
            if not fired and done >= half:
                fired = True
                midway()
        pos = off + nbytes
    if data_len > pos:
        view[pos:data_len].zero_()
        h.update(raw[base + pos:base + data_len])
    info = SlotInfo(seq, step, len(meta), data_len, h.intdigest(), time.time(), rank, gen,
                    departure)
    slot.commit(info)
    return info

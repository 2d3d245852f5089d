"""Snapshot slots in shared memory: header written last, chunked copy + checksum, torn writes,
bit flips and truncation caught."""

from __future__ import annotations

import os

import pytest
import torch

from nonstop.state import packing, shm


def write(slot: shm.Slot, sd: dict, step: int, seq: int, midway=None) -> shm.SlotInfo:
    lay = packing.layout(sd, {"step": step})
    return shm.write_tensors(slot, lay.meta, lay.tensors, lay.specs, lay.nbytes, step, 0, 0, seq,
                             midway)


def state() -> dict:
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.BatchNorm1d(5))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 7)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "big": torch.randn(3 * shm.CHUNK // 4 + 5), "half": torch.randn(3).half()}


def new_slot(size: int = 1 << 24) -> shm.Slot:
    fd = shm.create("test", size)
    try:
        return shm.Slot(fd)
    finally:
        os.close(fd)


def test_a_written_slot_reads_back_bit_for_bit():
    sd = state()
    slot = new_slot()
    info = write(slot, sd, step=7, seq=3)
    assert slot.info() == info and info.step == 7 and info.seq == 3
    assert slot.verify(info)
    meta, data = slot.read(info)
    out, extra = packing.unpack_with_info(meta, data)
    assert extra == {"step": 7}
    for k, v in sd["model"].items():
        assert torch.equal(out["model"][k], v)
    assert torch.equal(out["big"], sd["big"]) and out["half"].dtype == torch.float16
    assert out["optimizer"]["state"][0]["exp_avg"].shape == sd["optimizer"]["state"][0]["exp_avg"].shape


def test_the_chunked_checksum_is_the_checksum_of_the_slot():
    slot = new_slot()
    info = write(slot, state(), step=1, seq=1)
    assert shm.checksum(slot.buffer, info) == info.checksum


def test_a_write_cut_short_leaves_the_slot_invalid():
    slot = new_slot()
    write(slot, state(), step=1, seq=1)

    class Died(Exception):
        pass

    def die():
        raise Died

    with pytest.raises(Died):  # the process dies half-way through the next snapshot
        write(slot, state(), step=2, seq=2, midway=die)
    assert slot.info() is None  # invalid, not torn: the holder's other slot stays in force


def test_bit_flip_and_truncation_are_caught():
    slot = new_slot()
    info = write(slot, state(), step=1, seq=1)
    off = slot.flip_bit(info, 0.3)
    assert not slot.verify(info)
    slot.buffer[off] ^= 0x10
    assert slot.verify(info)
    short = shm.SlotInfo(**{**info.to_wire(), "data_len": slot.size})  # claims more than there is
    assert not slot.verify(short)


def test_header_is_read_without_mapping():
    fd = shm.create("hdr", 1 << 20)
    try:
        slot = shm.Slot(fd)
        assert shm.read_header(fd) is None
        info = write(slot, {"x": torch.ones(3)}, step=4, seq=9)
        assert shm.read_header(fd) == info
        slot.invalidate()
        assert shm.read_header(fd) is None
    finally:
        os.close(fd)


def test_a_slot_too_small_is_refused():
    slot = new_slot(shm.HEADER + 64)
    with pytest.raises(ValueError):
        write(slot, {"x": torch.ones(1000)}, step=1, seq=1)


def test_a_departure_snapshot_says_so_and_never_takes_the_newest_periodic_ones_slot():
    """A departure snapshot (taken as its rank left a failed generation, never compared with its
    replicas) is marked in its header. A holder's next snapshot goes to the invalid slot, else
    to a departure snapshot's, else to the older: after two recoveries in a row the periodic
    snapshot - the step a corruption goes back to - is still there."""
    from nonstop.keeper.slots import Holder

    h = Holder("r0")
    for i in range(2):
        h.fds[i] = shm.create(f"test{i}", 1 << 16)

    def put(step: int, departure: bool) -> int:
        i = h.older()
        slot = shm.Slot(h.fds[i])
        seq = 1 + max((x.seq for x in h.infos() if x is not None), default=0)
        lay = packing.layout({"w": torch.full((3,), float(step))}, {"step": step})
        info = shm.write_tensors(slot, lay.meta, lay.tensors, lay.specs, lay.nbytes, step, 0, 0,
                                 seq, departure=departure)
        assert slot.info() == info and info.departure is departure
        return i

    def steps() -> list:
        return [(x.step, x.departure) if x else None for x in h.infos()]

    try:
        assert put(5, False) == 0 and put(10, False) == 1
        assert put(12, True) == 0  # the older periodic one
        assert steps() == [(12, True), (10, False)]
        assert put(13, True) == 0  # again: the departure's slot, not the periodic of 10
        assert steps() == [(13, True), (10, False)]
        assert put(15, False) == 0  # a periodic one takes the departure's slot first
        assert steps() == [(15, False), (10, False)]
    finally:
        for fd in h.fds:
            os.close(fd)

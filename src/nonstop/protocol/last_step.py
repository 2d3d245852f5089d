"""The last step a rank completed, in a small file it maps and its agent reads once it is gone.

A rank publishes its progress at most every few tens of milliseconds (``runtime.monitor``): a
rank killed between two publishes leaves the steps since unseen, and an incident would count
fewer steps lost than there were. So each step is also written here, at the cost of a few
stores into mapped memory, and the agent that reaped the process reads the file: what a
SIGKILL cannot erase, since the page belongs to the file, not to the process.

Two records alternate, each written whole before the header names it, so a process killed in
the middle of a write leaves the one before intact.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import struct
from typing import Any

from .records import Reader

ENV = "NONSTOP_LAST_STEP"  # the file's path, given to the rank by its agent
_HEAD = struct.Struct("<q")  # the count of records written; the newest is in slot count % 2
_REC = struct.Struct("<qqddd")  # gen, step, t (completed, the rank's clock), busy, stall
SIZE = _HEAD.size + 2 * _REC.size


def create(path: str) -> None:
    """An empty file for a rank about to start (no step completed)."""
    with open(path, "wb") as f:
        f.write(bytes(SIZE))


class Writer:
    """The rank's side; every error disables it (the file is a help, not a need)."""

    def __init__(self, path: str | None):
        self._mm: mmap.mmap | None = None
        self._n = 0
        if not path:
            return
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return
        try:
            if os.fstat(fd).st_size >= SIZE:
                self._mm = mmap.mmap(fd, SIZE)
                self._n = _HEAD.unpack_from(self._mm, 0)[0]
        except (OSError, ValueError):
            self._mm = None
        finally:
            os.close(fd)

    def write(self, gen: int, step: int, t: float, busy: float, stall: float) -> None:
        mm = self._mm
        if mm is None:
            return
        n = self._n + 1
        _REC.pack_into(mm, _HEAD.size + (n % 2) * _REC.size, gen, step, t, busy, stall)
        _HEAD.pack_into(mm, 0, n)
        self._n = n


@dataclasses.dataclass(frozen=True, kw_only=True)
class LastStep:
    """The last step a rank completed, as its file holds it (``t``: the rank's clock)."""

    gen: int
    step: int
    t: float
    busy: float | None  # None: a rank that steps outside ctx.steps
    stall: float | None


_READ = Reader()


def decode(raw: Any) -> LastStep:
    """A record relayed from another host (``plain(record)``, its time shifted); BadRecord for
    one that is not."""
    return _READ.record(LastStep, raw, "last step")


def read(path: str, remove: bool = True) -> LastStep | None:
    """The newest record, or None when no step was written; the file is removed with
    ``remove``."""
    try:
        with open(path, "rb") as f:
            data = f.read(SIZE)
        if remove:
            os.unlink(path)
    except OSError:
        return None
    if len(data) < SIZE:
        return None
    (n,) = _HEAD.unpack_from(data, 0)
    if n <= 0:
        return None
    gen, step, t, busy, stall = _REC.unpack_from(data, _HEAD.size + (n % 2) * _REC.size)
    return LastStep(gen=gen, step=step, t=t, busy=None if math.isnan(busy) else busy,
                    stall=None if math.isnan(stall) else stall)

"""What a rank publishes about itself between its events (``runtime/monitor.py``, a few times a
second): its heartbeat, where its main thread is, its newest step. The controller reads each
rank's newest record (``controller/workers.py``) and decodes it strictly (``records.py``): a
record that is not one is refused there, like a rank's event.

Across hosts the host's agent relays the records as they are (its times turned onto the
controller's clock by ``protocol.hosts.shift_times``: the fields named ``t``, ``hb`` or ``t_*``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from .records import BadRecord, Reader


@dataclasses.dataclass(frozen=True, kw_only=True)
class SnapshotNumbers:
    """Rank 0's snapshots: the interval agreed, what one costs, the newest taken."""

    every: int
    cost_s: float | None
    step_s: float | None
    last: int | None
    repl_s: float | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Progress:
    """A rank's newest progress record."""

    hb: float  # its heartbeat: when the record was written (the rank's clock)
    pid: int
    where: Literal["torch", "nonstop", "python", ""]  # where its main thread is...
    loc: str  # ...file:line in function
    same_s: float  # ...for how long
    paused: str | None  # busy with something long that is not a step
    max_step_s: float  # its slowest step since the last record
    compute_s: float | None  # forward time per step, smoothed
    life_gen: int | None = None  # a sign of life from its collectives in this generation...
    t_life: float | None = None  # ...and when
    snap: SnapshotNumbers | None = None  # rank 0's snapshots
    # its newest step (none before its first)
    gen: int | None = None
    rank: int | None = None
    step: int | None = None
    t: float | None = None  # when it was completed
    loss: float | Literal["nan", "inf", "-inf"] | None = None
    busy: float | None = None  # seconds in completed steps, over the process's life
    stall: float | None = None  # seconds it waited for its input
    step_s: float | None = None  # how long the step took


class BadProgress(BadRecord):
    """A progress record that is not one as this version of nonstop writes it."""


_OPTIONAL = tuple(f.name for f in dataclasses.fields(Progress)
                  if f.default is not dataclasses.MISSING)
_OPTIONAL_SET = frozenset(_OPTIONAL)
_read = Reader().reader(Progress, "progress", may_lack=_OPTIONAL)


def encode(rec: Progress) -> dict[str, Any]:
    """The JSON object of a record (optional fields at None left out: most of them, most of
    the time)."""
    out = {k: v for k, v in rec.__dict__.items() if v is not None or k not in _OPTIONAL_SET}
    if rec.snap is not None:
        out["snap"] = dict(rec.snap.__dict__)
    return out


def decode(raw: Any) -> Progress:
    """The record a JSON object holds; BadProgress for one that is not."""
    try:
        return _read(raw)
    except BadRecord as exc:
        raise BadProgress(str(exc)) from None

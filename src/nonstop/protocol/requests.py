"""Requests to a running job from outside it (``nonstop drain``), typed: each is a JSON object
with its ``op`` and the fields of its record, written by the command into the run directory's
``control/`` folder (``controller/requests.py``) and read back strictly by the controller (a field
missing, unknown or of the wrong type, or an unknown ``op``, is refused: ``BadRecord``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Union

from .records import BadRecord, Reader, plain


@dataclasses.dataclass(frozen=True)
class DrainRequest:
    """Move these ranks, or every rank of this node, to warm spares at a step boundary."""

    op: ClassVar[str] = "drain"
    ranks: list[int]
    node: int | None
    why: str  # the reason, for the event log


Request = Union[DrainRequest]
_BY_OP: dict[str, type] = {DrainRequest.op: DrainRequest}
_READ = Reader()


def encode(req: Request) -> dict[str, Any]:
    return {"op": req.op, **plain(req)}


def decode(raw: Any) -> Request:
    """The request ``raw`` holds; BadRecord says what is wrong with one that is not."""
    if type(raw) is not dict:
        raise BadRecord(f"{raw!r:.80} is not an object")
    op = raw.get("op")
    cls = _BY_OP.get(op) if type(op) is str else None
    if cls is None:
        raise BadRecord(f"unknown request {op!r:.80}")
    return _READ.record(cls, raw, "request", skip=("op",))

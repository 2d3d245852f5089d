"""The policy as a rank process reads it: the parts it acts on, as frozen records.

The launcher validates the user's policy against its schema (``nonstop.policy``) and hands every
rank the result, every field with its value, defaults included (``Policy.model_dump``, in the
job's settings). The rank reads it into these records strictly (``records.py``): a field missing
or of another type is an error, never filled in, so no default is restated here and none can
differ from the schema's. The rank does not import the schema itself: its validation library costs
a rank process about 85 ms of CPU at start-up (measured with ``python -X importtime``), paid by
every rank not forked from a warm zygote. Records and fields are named as in the schema
(tests/test_rank_policy.py checks the rank's view of a policy against the schema's, field by
field, the allowed values of each choice included).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from .records import Reader


@dataclasses.dataclass(frozen=True)
class RankNan:
    enabled: bool  # non-finite gradients are looked for (each optimizer step)


@dataclasses.dataclass(frozen=True)
class RankSdc:
    enabled: bool
    action: Literal["replace", "report"]
    max_overhead_pct: float
    replay_every: int  # a step run twice, in place, every this many steps (0: never)


@dataclasses.dataclass(frozen=True)
class RankLossRule:
    name: str
    operator: Literal[">", ">=", "<", "<="]
    threshold: float
    data_points: int
    action: Literal["report", "restart", "fail"]


@dataclasses.dataclass(frozen=True)
class RankDetect:
    nan: RankNan
    sdc: RankSdc
    loss_rules: tuple[RankLossRule, ...]


@dataclasses.dataclass(frozen=True)
class RankScaleIn:
    batch: Literal["keep", "scale_lr"]


@dataclasses.dataclass(frozen=True)
class RankLevels:
    scale_in: RankScaleIn


@dataclasses.dataclass(frozen=True)
class RankTimeouts:
    abort_s: float


@dataclasses.dataclass(frozen=True)
class RankRecover:
    levels: RankLevels
    timeouts: RankTimeouts


@dataclasses.dataclass(frozen=True)
class RankSnapshot:
    enabled: bool
    every_steps: int | Literal["auto"]
    max_overhead_pct: float


@dataclasses.dataclass(frozen=True)
class RankCheckpoint:
    dir: str | None
    every_steps: int
    at_end: bool


@dataclasses.dataclass(frozen=True)
class RankState:
    snapshot: RankSnapshot
    checkpoint: RankCheckpoint


@dataclasses.dataclass(frozen=True)
class RankPolicy:
    detect: RankDetect
    recover: RankRecover
    state: RankState


_READ = Reader(open=True)  # the rank reads part of the policy: the rest is passed over


def read(dump: Any) -> RankPolicy:
    """The rank's view of a validated policy (``Policy.model_dump()``); BadRecord, with the path
    to it, for a field missing or of another type."""
    return _READ.record(RankPolicy, dump, "policy")

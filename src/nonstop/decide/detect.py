"""Grey-failure detection as pure logic: auto-tuned hang timeouts, hung-rank identification,
stragglers and loss rules. Numbers in, verdicts out; no clocks, processes or store."""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:  # (the rank evaluates loss rules: it must not pay for the schema's import)
    from ..policy import Hang, HangTuning, Straggler
    from ..protocol.rank_policy import RankLossRule


def _clamp(value: float, tuning: HangTuning) -> float:
    return min(tuning.ceiling_s, max(tuning.floor_s, value))


class HangTimer:
    """How long a step may take before the job counts as hung.

    Steady state: ``multiplier`` x the slowest step seen recently on any rank, clamped to the
    policy's floor and ceiling. The first step of a generation (a new DDP, a cold process, the
    state transfer) is timed separately, from the slowest first step seen so far, and the next
    ones until ``settle_steps`` are done may take as long as that slowest first step.
    """

    def __init__(self, policy: Hang):
        self.policy = policy
        self._steps: collections.deque[float] = collections.deque(maxlen=policy.window)
        self._seen = 0
        self._first: list[float] = []

    def observe_step(self, seconds: float) -> None:
        if seconds > 0 and math.isfinite(seconds):
            self._steps.append(seconds)
            self._seen += 1

    def observe_first_step(self, seconds: float) -> None:
        if seconds > 0 and math.isfinite(seconds):
            self._first.append(seconds)

    def slowest_step(self) -> float:
        """The slowest step seen recently (0 before any)."""
        return max(self._steps, default=0.0)

    def steady_timeout(self) -> float:
        p = self.policy
        if not p.auto:
            return p.timeout_s
        if self._seen < p.warmup_steps:
            return _clamp(p.steady.initial_s, p.steady)
        return _clamp(p.steady.multiplier * max(self._steps), p.steady)

    def settling_timeout(self) -> float:
        """A step after the first of a generation, while the rank settles (``settle_steps``):
        the steady timeout, or the slowest first step seen if that is longer (auto off: the
        fixed timeout, as set)."""
        if not self.policy.auto:
            return self.policy.timeout_s
        return max(self.steady_timeout(), max(self._first, default=0.0))

    def first_step_timeout(self) -> float:
        p = self.policy
        if not p.auto or not self._first:
            return _clamp(p.first_step.initial_s, p.first_step)
        return _clamp(p.first_step.multiplier * max(self._first), p.first_step)


@dataclasses.dataclass(frozen=True)
class RankView:
    """What the controller knows of one rank while the job looks hung."""

    rank: int
    heartbeat_age_s: float  # since the rank's background thread last reported
    where: str  # its main thread: "torch" (in torch, e.g. a collective), "python" (user code), ""
    location: str = ""  # file:line of the innermost frame of the main thread
    same_place_s: float = 0.0  # how long the main thread has been at that location


def hung_ranks(views: Iterable[RankView], heartbeat_s: float) -> dict[int, str]:
    """The ranks that are frozen (no heartbeat from their background thread: stopped,
    deadlocked holding the GIL): they can be ended at once. A rank stuck in its own code is
    found by the abort that follows: the others, blocked in collectives, leave at once and it
    does not. Where each main thread was is kept for the diagnosis."""
    return {v.rank: f"frozen (no heartbeat for {v.heartbeat_age_s:.1f} s)"
            for v in views if v.heartbeat_age_s > heartbeat_s}


def describe_stall(views: Iterable[RankView]) -> str:
    """Where every rank's main thread was, for the diagnosis of a hang."""
    return "; ".join(f"rank {v.rank} in {v.where or '?'} at {v.location or '?'}" for v in views)


class StragglerWatch:
    """A rank whose compute time stays above ``factor`` x the median of the others for
    ``window`` consecutive observations is a straggler (reported once until it recovers)."""

    def __init__(self, policy: Straggler):
        self.policy = policy
        self._streak: dict[int, int] = collections.defaultdict(int)
        self._flagged: set[int] = set()

    def reset(self) -> None:
        self._streak.clear()
        self._flagged.clear()

    def observe(self, compute_s: dict[int, float]) -> list[tuple[int, float]]:
        """One observation of every rank's recent compute time; returns new stragglers as
        (rank, ratio to the median of the others)."""
        if not self.policy.enabled or len(compute_s) < 2:
            return []
        found = []
        for rank, mine in compute_s.items():
            others = [v for r, v in compute_s.items() if r != rank]
            median = statistics.median(others)
            ratio = mine / median if median > 0 else 0.0
            if ratio > self.policy.factor:
                self._streak[rank] += 1
            else:
                self._streak[rank] = 0
                self._flagged.discard(rank)
            if self._streak[rank] >= self.policy.window and rank not in self._flagged:
                self._flagged.add(rank)
                found.append((rank, ratio))
        return found


_OPS = {">": lambda a, b: a > b, ">=": lambda a, b: a >= b,
        "<": lambda a, b: a < b, "<=": lambda a, b: a <= b}


class LossRules:
    """Loss rules evaluated on every reported loss of one rank: a rule fires when its condition
    holds for ``data_points`` consecutive losses, then re-arms once it stops holding."""

    def __init__(self, rules: Iterable[RankLossRule]):
        self.rules = list(rules)
        self._streak = [0] * len(self.rules)
        self._fired = [False] * len(self.rules)

    def observe(self, loss: float) -> list[RankLossRule]:
        fired = []
        for i, rule in enumerate(self.rules):
            if math.isfinite(loss) and _OPS[rule.operator](loss, rule.threshold):
                self._streak[i] += 1
            else:
                self._streak[i] = 0
                self._fired[i] = False
            if self._streak[i] >= rule.data_points and not self._fired[i]:
                self._fired[i] = True
                fired.append(rule)
        return fired

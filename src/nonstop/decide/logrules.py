"""Log-pattern rules on the ranks' output: trigger rules (a matching line is a fault) and liveness
rules (a line that must appear soon after each start, then keep appearing). Pure logic, no I/O."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from ..policy import LogRule

LINE_MAX = 300  # a Match keeps at most this much of the line: event logs stay small
_SHOWN_MAX = 80  # and its message quotes at most this much: one readable line


@dataclass(frozen=True)
class Match:
    rule: str
    kind: str  # "match": a trigger rule matched; "missing": a liveness rule's line did not come
    action: str  # the rule's action: fault | hang | slow | report
    code: str
    rank: int | None
    t: float
    line: str | None  # the matching line (truncated to LINE_MAX), None for "missing"
    message: str  # one line for humans


def default_code(name: str) -> str:
    """LOG_<NAME>: upper-cased, each run of non-alphanumerics one underscore (codes stay ASCII)."""
    return "LOG_" + (re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_").upper() or "RULE")


@dataclass(frozen=True)
class _Rule:
    """A LogRule prepared once: the regex compiled, the code derived, the kind decided."""

    name: str
    pattern: str
    regex: re.Pattern[str]
    action: str
    code: str
    within: float | None
    every: float | None

    @classmethod
    def of(cls, r: LogRule) -> _Rule:
        return cls(r.name, r.pattern, re.compile(r.pattern), r.action, r.code or default_code(r.name),
                   r.expected_within_s, r.expected_every_s)


class _Clock:
    """One rank's clock for one liveness rule."""

    __slots__ = ("since", "matched", "reported")

    def __init__(self, t: float) -> None:
        self.since = t  # the (re)start, then the last matching line
        self.matched = False  # the first matching line came: expected_every_s applies from now on
        self.reported = False  # "missing" already fired: not again until the next match


class LogWatch:
    """Checks every line a rank prints against the rules; ``tick`` reports expected lines missing."""

    def __init__(self, rules: Sequence[LogRule]) -> None:
        prepared = [_Rule.of(r) for r in rules]
        self._triggers = [r for r in prepared if r.within is None and r.every is None]
        self._liveness = [r for r in prepared if r.within is not None or r.every is not None]
        # (index into _liveness, rank) -> clock. start() swaps in a new dict rather than mutating
        # this one: output readers may feed lines while the main loop ticks.
        self._clocks: dict[tuple[int, int], _Clock] = {}

    @property
    def active(self) -> bool:
        return bool(self._triggers or self._liveness)

    def start(self, t: float, ranks: Iterable[int]) -> None:
        """A generation started: these ranks' clocks restart at t; every other rank is forgotten."""
        ranks = list(ranks)  # iterated once per rule: a generator would only serve the first
        self._clocks = {(i, rank): _Clock(t) for i in range(len(self._liveness)) for rank in ranks}

    def feed(self, rank: int | None, line: str, t: float) -> list[Match]:
        """One line a process printed (rank None: not a rank, e.g. a warm spare)."""
        if not self._triggers and not self._liveness:
            return []
        out: list[Match] = []
        for r in self._triggers:
            if r.regex.search(line):
                kept = line.rstrip("\r\n")[:LINE_MAX]
                shown = kept.strip()
                if len(shown) > _SHOWN_MAX:
                    shown = shown[:_SHOWN_MAX] + "..."
                who = "a spare" if rank is None else f"rank {rank}"
                out.append(Match(r.name, "match", r.action, r.code, rank, t, kept,
                                 f"{who} printed {shown!r} (rule {r.name})"))
        if rank is not None:
            clocks = self._clocks
            for i, r in enumerate(self._liveness):
                clock = clocks.get((i, rank))
                # a rank not started has no clock: don't spend a regex search on it
                if clock is not None and r.regex.search(line):
                    clock.since = max(clock.since, t)  # lines may arrive slightly out of order
                    clock.matched = True
                    clock.reported = False  # re-armed: the next silence is reported again
        return out

    def tick(self, now: float) -> list[Match]:
        """Liveness rules whose line is overdue, once per rank and rule until it matches again."""
        out: list[Match] = []
        for (i, rank), clock in self._clocks.items():
            if clock.reported:
                continue
            r = self._liveness[i]
            # before the first match the start cut-off applies; without one, the recurring
            # frequency runs from the start too
            limit = r.every if clock.matched or r.within is None else r.within
            if limit is None or now - clock.since <= limit:  # None: only a cut-off, and it was met
                continue
            clock.reported = True
            out.append(Match(r.name, "missing", r.action, r.code, rank, now, None,
                             f"rank {rank}: no line matching {r.pattern!r} for {limit:g} s "
                             f"(rule {r.name})"))
        return out

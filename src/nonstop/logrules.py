"""Log-pattern rules on the ranks' output: trigger rules (a matching line is a fault) and liveness
rules (a line that must appear soon after a start, and then keep appearing). Pure logic."""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Sequence

from .policy import LogRule


@dataclasses.dataclass(frozen=True)
class Match:
    rule: str
    kind: str  # "match": a trigger rule matched; "missing": a liveness rule's line did not come
    action: str  # the rule's action: fault | hang | slow | report
    code: str
    rank: int | None
    t: float
    line: str | None  # the matching line (truncated), None for "missing"
    message: str


def default_code(name: str) -> str:
    return "LOG_" + re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_").upper()


class _Rule:
    def __init__(self, rule: LogRule):
        self.rule = rule
        self.regex = re.compile(rule.pattern)
        self.code = rule.code or default_code(rule.name)
        self.liveness = rule.expected_within_s is not None or rule.expected_every_s is not None


class LogWatch:
    def __init__(self, rules: Sequence[LogRule]):
        self._rules = [_Rule(r) for r in rules]
        # per (rule index, rank): when the clock started, whether the rank matched since, whether
        # the missing line was already reported
        self._since: dict[tuple[int, int], float] = {}
        self._matched: dict[tuple[int, int], bool] = {}
        self._reported: set[tuple[int, int]] = set()

    @property
    def active(self) -> bool:
        return bool(self._rules)

    def start(self, t: float, ranks: Iterable[int]) -> None:
        """A generation started: the liveness clocks of these ranks restart; others are forgotten."""
        self._since.clear()
        self._matched.clear()
        self._reported.clear()
        for i, r in enumerate(self._rules):
            if r.liveness:
                for rank in ranks:
                    self._since[(i, rank)] = t
                    self._matched[(i, rank)] = False

    def feed(self, rank: int | None, line: str, t: float) -> list[Match]:
        if not self._rules:
            return []
        out = []
        for i, r in enumerate(self._rules):
            if not r.regex.search(line):
                continue
            if r.liveness:
                key = (i, rank)
                if rank is not None and key in self._since:
                    self._since[key] = t
                    self._matched[key] = True
                    self._reported.discard(key)  # re-armed
                continue
            who = f"rank {rank}" if rank is not None else "a spare"
            shown = line.strip()[:300]
            out.append(Match(r.rule.name, "match", r.rule.action, r.code, rank, t, shown,
                             f"{who} printed {shown[:120]!r} (rule {r.rule.name})"))
        return out

    def tick(self, now: float) -> list[Match]:
        out = []
        for (i, rank), since in self._since.items():
            r = self._rules[i]
            key = (i, rank)
            if key in self._reported:
                continue
            matched = self._matched[key]
            limit = (r.rule.expected_every_s if matched or r.rule.expected_within_s is None
                     else r.rule.expected_within_s)
            if limit is None:  # only expected_within, and it came: nothing more to expect
                continue
            if now - since > limit:
                self._reported.add(key)
                out.append(Match(r.rule.name, "missing", r.rule.action, r.code, rank, now, None,
                                 f"rank {rank}: no line matching {r.rule.pattern!r} for "
                                 f"{limit:g} s (rule {r.rule.name})"))
        return out

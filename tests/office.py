"""The office a cluster of hosts reports to (``controller/ports.Office``), as a test holds it:
whether it may give orders, whether the job is ending, when etcd last answered - each a field
the test sets - and what the cluster reported to it."""

from __future__ import annotations

import dataclasses
import time


@dataclasses.dataclass
class Office:
    held: bool = True  # its lease is confirmed
    done: bool = False  # training complete for every rank
    heard: float | None = None  # when etcd's newest answer was asked (None: just now)
    period: float = 1.0  # how often etcd is asked
    lost: list[int] = dataclasses.field(default_factory=list)
    lines: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    ticks: int = 0
    notices: list = dataclasses.field(default_factory=list)  # (notice, the thread it came in)

    def in_office(self) -> bool:
        return self.held

    def completed(self) -> bool:
        return self.done

    def store_heard(self) -> float:
        return time.monotonic() if self.heard is None else self.heard

    def store_period(self) -> float:
        return self.period

    def node_lost(self, node: int) -> None:
        self.lost.append(node)

    def output(self, wid: int, line: str) -> None:
        self.lines.append((wid, line))

    def tick(self) -> None:
        self.ticks += 1

    def notice(self, notice) -> None:
        import threading

        self.notices.append((notice, threading.get_ident()))

"""The facts of the job the controller's collaborators judge against (``exits.py``,
``worker_events.py``): read, never changed by them.

``JobView`` is what they may read. The controller itself is one (they read its own fields, live:
nothing is copied for each of the thousands of events a big job's ranks send at once); a test
gives them a ``JobNow``, the same facts frozen.
"""

from __future__ import annotations

import dataclasses
from typing import Container, Mapping, Protocol

from ..observe.incidents import Incident
from .machine import JobState
from .phase import Phase


class JobView(Protocol):
    """The job as the controller holds it now."""

    @property
    def state(self) -> JobState: ...  # the machine's: phase, generation, isolated nodes

    @property
    def plan(self) -> Mapping[int, int]: ...  # rank -> wid, this generation's

    @property
    def managed(self) -> bool: ...

    @property
    def max_step(self) -> int: ...

    @property
    def total_nodes(self) -> int: ...

    @property
    def leaving(self) -> Container[int]: ...  # nodes whose hosts were told to stop

    @property
    def incident(self) -> Incident | None: ...  # the open one

    @property
    def over(self) -> bool: ...  # the job's exit code is known: it is ending

    @property
    def phase(self) -> Phase: ...

    @property
    def gen(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class JobNow:
    """A ``JobView`` frozen (the plan and the nodes leaving as given, not copied)."""
    state: JobState  # the machine's: phase, generation, isolated nodes
    plan: Mapping[int, int]  # rank -> wid, this generation's
    managed: bool
    max_step: int
    total_nodes: int
    leaving: Container[int] = frozenset()  # nodes whose hosts were told to stop (preempted)
    incident: Incident | None = None  # the open one
    over: bool = False  # the job's exit code is known: it is ending

    @property
    def phase(self) -> Phase:
        return self.state.phase

    @property
    def gen(self) -> int:
        return self.state.gen

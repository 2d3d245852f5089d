"""The facts of the job the controller's collaborators judge against (``exits.py``,
``worker_events.py``): read, never changed by them."""

from __future__ import annotations

import dataclasses
from typing import Container, Mapping

from ..observe.incidents import Incident
from .machine import JobState
from .phase import Phase


@dataclasses.dataclass(frozen=True)
class JobNow:
    """The job as the controller holds it now. The plan and the nodes leaving are the
    controller's own, not copies (a job restart of 16,384 ranks is as many exits, each judged
    against them)."""
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

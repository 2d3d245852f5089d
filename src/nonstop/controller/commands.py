"""What the state machine (``machine.py``) tells the controller to carry out: its commands
(``AbortGeneration``, ``Kill``, ``Decide``, ``Publish``...), each a frozen record the executor
turns into signals, messages and processes."""

from __future__ import annotations

import dataclasses
from typing import Union

from ..decide.ladder import Decision, Fault

# == what to carry out ==========================================================================


@dataclasses.dataclass(frozen=True)
class Raise:
    """A fault taken in: open the incident (or add to it), log it, show it."""
    fault: Fault
    t_fault: float | None = None


@dataclasses.dataclass(frozen=True)
class Ignore:
    """A fault after training ended: logged, nothing else."""
    fault: Fault


@dataclasses.dataclass(frozen=True)
class Interrupt:
    """The open incident's recovery attempt ends here, in ``phase``."""
    phase: str


@dataclasses.dataclass(frozen=True)
class AbortGeneration:
    """The survivors leave generation ``gen`` (managed); a plain script's ranks are ended."""
    gen: int
    managed: bool


@dataclasses.dataclass(frozen=True)
class Kill:
    """End a rank's process; with ``dump`` its stacks are written first. ``fault``: the fault it
    is ended for, logged with the kill (``late_s``: how long it was given)."""
    wid: int
    why: str
    dump: bool = False
    fault: Fault | None = None
    late_s: float | None = None


@dataclasses.dataclass(frozen=True)
class Probe:
    """Ask the memory of these nodes whether it still answers (before the decision)."""
    nodes: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Decide:
    """The ladder's decision about generation ``gen``, to log; ``escalated_from``: the level
    that did not work; ``step``: the step a retry is about."""
    decision: Decision
    gen: int
    escalated_from: str | None = None
    step: int | None = None


@dataclasses.dataclass(frozen=True)
class CarryOut:
    """Move ranks as decided (``placement``: rank -> node), start the processes needed and
    publish generation ``gen``."""
    decision: Decision
    placement: dict[int, int]
    gen: int


@dataclasses.dataclass(frozen=True)
class Regroup:
    """The ranks of ``gen`` leave it at their next step boundary (no fault): capacity came back
    and a larger generation can form, or (``drain``) ranks move to spares."""
    gen: int
    drain: str | None = None  # what is drained, and why


@dataclasses.dataclass(frozen=True)
class DrainRefused:
    """A drain that cannot be done now: said, nothing changes."""
    asked: str
    why: str


@dataclasses.dataclass(frozen=True)
class Publish:
    """Send every rank its assignment for ``gen``."""
    gen: int
    initial: bool
    level: str


@dataclasses.dataclass(frozen=True)
class Formed:
    """Every rank entered generation ``gen``: it trains."""
    gen: int


@dataclasses.dataclass(frozen=True)
class RetryOpened:
    """Non-finite gradients: an incident opens, the ranks wait for the decision."""
    step: int


@dataclasses.dataclass(frozen=True)
class RedoStep:
    """Every rank waits at ``step``: redo (or skip) it in place."""
    decision: Decision
    step: int


@dataclasses.dataclass(frozen=True)
class WaitForHosts:
    """The healthy hosts cannot hold the ranks (``decision``: the failure it would be now): the
    job waits up to ``limit_s`` for hosts to join; the newest state is saved meanwhile."""
    decision: Decision
    limit_s: float


@dataclasses.dataclass(frozen=True)
class Fail:
    """Give up: the diagnosis, the emergency save, the hook, the end."""
    decision: Decision


@dataclasses.dataclass(frozen=True)
class Finish:
    """Training completed: the ranks are told, the spares sent away."""


@dataclasses.dataclass(frozen=True)
class JobOver:
    """Everything ended and settled: the job is over."""


@dataclasses.dataclass(frozen=True)
class Overdue:
    """Ranks (``wids``) still alive, or the last checkpoint unwritten, past the finish deadline."""
    wids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Missed:
    """A deadline fired: logged as a ``deadline`` event (what waited, its limit, for whom)."""
    what: str
    limit_s: float | None
    gen: int
    ranks: tuple[int, ...] = ()
    detail: str = ""


Command = Union[Raise, Ignore, Interrupt, AbortGeneration, Kill, Probe, Decide, CarryOut, Regroup,
                Publish, Formed, RetryOpened, RedoStep, WaitForHosts, Fail, Finish, JobOver, Overdue,
                DrainRefused, Missed]

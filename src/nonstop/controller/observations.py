"""What the controller saw, as the state machine (``machine.py``) takes it: the job at one moment
(``Seen``, a ``RankSeen`` per rank) and the observations that carry it (``Tick``, ``Faulted``...)."""

from __future__ import annotations

import dataclasses
from typing import Any, Union

from ..decide.ladder import Fault

# == what the controller saw ======================================================================


@dataclasses.dataclass(slots=True)
class RankSeen:
    """One rank's process as the controller knows it (generations are the newest it reached).
    Never changed once made (not frozen only because a frozen one takes 3x as long to make, and
    a view of 16,384 ranks is made whole after a teardown). ``Controller._seen`` makes it by
    position, in this order (tests/test_machine.py holds it)."""

    rank: int
    wid: int
    node: int
    dead: bool = False
    joining: int = -1  # started to join
    entered: int = -1  # entered the training function (its group formed, its state restored)
    left: int = -1
    done: int = -1
    retry_step: int | None = None  # waits to redo this step (non-finite gradients)
    retry_loss: Any = None
    warm: bool = False  # already running when its generation was published
    stopped: bool = False  # the kernel says it is stopped (asked only while a group forms)
    own_code_s: float = 0.0  # how long its main thread has stayed at one place of its own code
    loc: str = ""  # ...that place


@dataclasses.dataclass(frozen=True)
class Seen:
    """The job at one moment: the time, the ranks of the plan, the nodes."""

    now: float
    ranks: tuple[RankSeen, ...] = ()
    managed: bool = True  # the ranks run inside nonstop.wrap (they can leave a collective)
    total_nodes: int = 1
    slots: int = 1  # ranks per node
    lost_memory: frozenset[int] = frozenset()  # nodes whose memory died, not ended by nonstop
    slowest_step_s: float = 0.0
    abort_s: float = 0.0  # what an abort of the ranks' communicators may take (NCCL's)
    target_world: int = 0  # the world the job was started with (0: the ranks seen)
    ready_spares: dict[int, int] = dataclasses.field(default_factory=dict)  # node -> warm, ready
    # a sharded job's replica groups (rank -> its group's ranks), as the ranks said; read only
    replica_groups: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    # a mesh sharded along its first dimension: the ranks per index of it (-1: its size fixed)
    regrid_unit: int = 0
    # node -> the nodes its ranks' snapshots are copied to (a lost node's ranks go to a spare
    # node among them, where one is: their restore is local there)
    replicas_on: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    # nodes without ranks whose host has been silent for over a second, not yet known lost (a
    # host killed with its neighbour, whose lease has not expired yet): spare nodes of last resort
    away: frozenset[int] = frozenset()
    hosts_join: bool = False  # new hosts can join the job (across hosts): capacity can come back

    @property
    def target(self) -> int:
        return self.target_world or len(self.ranks)

    @property
    def node_of(self) -> dict[int, int]:
        return {r.rank: r.node for r in self.ranks}


# observations: one of these, with what was seen
@dataclasses.dataclass(frozen=True)
class Tick:
    seen: Seen


@dataclasses.dataclass(frozen=True)
class Start:
    """The first generation is published (its processes are started)."""
    seen: Seen


@dataclasses.dataclass(frozen=True)
class Faulted:
    """A fault found outside the machine: an exit, a report, a detector, a lost host."""
    seen: Seen
    fault: Fault
    t_fault: float | None = None  # when it began, where known better than now (a hang)


# what the ranks' reports say (controller/worker_events.py finds them, without a ``seen``: the
# controller adds what it sees as it steps the machine with them)
@dataclasses.dataclass(frozen=True)
class Entered:
    """Every rank entered the training function of the current generation."""
    seen: Seen | None = dataclasses.field(default=None, kw_only=True)


@dataclasses.dataclass(frozen=True)
class RetryAsked:
    """A rank skipped its optimizer step (non-finite gradients) and waits."""
    seen: Seen | None = dataclasses.field(default=None, kw_only=True)


@dataclasses.dataclass(frozen=True)
class Attributed:
    """A replay named the rank a silent corruption came from (``fault``, of kind ``sdc``),
    once its rollback recovered: it counts against the rank's node like any fault, and is a
    fault of the job only when that makes the rules isolate the node."""
    fault: Fault
    seen: Seen | None = dataclasses.field(default=None, kw_only=True)


RankFact = Entered | RetryAsked | Attributed  # stepped with what the controller sees then


@dataclasses.dataclass(frozen=True)
class Isolate:
    """A node that holds no rank failed (a health check, its host lost): never used again."""
    seen: Seen
    node: int


@dataclasses.dataclass(frozen=True)
class Drain:
    """Move ``ranks`` (or every rank of ``node``, which is then released) to warm spares at the
    ranks' next step boundary: a planned migration, no fault."""
    seen: Seen
    ranks: tuple[int, ...] = ()
    node: int | None = None
    why: str = "asked"
    # a node whose host must go (preempted, its grace running out): a spare node takes its ranks
    # even without a warm spare for each (the others start cold there), and with no spare node
    # the world goes on without them (scale-in)
    pressed: bool = False


@dataclasses.dataclass(frozen=True)
class Recovered:
    """Every rank stepped again: the open incident is closed (``progressed``: steps were seen)."""
    seen: Seen
    progressed: bool = True


@dataclasses.dataclass(frozen=True)
class Completed:
    """Every rank finished training."""
    seen: Seen
    finish_s: float


@dataclasses.dataclass(frozen=True)
class Settled:
    """While finishing: whether every rank ended and the last checkpoint is written."""
    seen: Seen
    settled: bool


@dataclasses.dataclass(frozen=True)
class Over:
    """The exit code is known."""


@dataclasses.dataclass(frozen=True)
class Heard:
    """The controller hears the job again after ``unheard_s`` seconds in which it could not
    prove it did (``Cluster.deaf``), and judged nothing."""
    seen: Seen
    unheard_s: float


Observation = Union[Tick, Start, Faulted, Entered, RetryAsked, Attributed, Isolate, Recovered,
                    Completed, Settled, Over, Drain, Heard]

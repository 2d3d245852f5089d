"""What a rank process reports to the controller, typed: one frozen record per kind of event.

The rank writes each ``encode``d (a JSON object: its ``type``, a top-level ``t`` that a relay
across hosts moves onto the controller's clock, ``wid``, its fields) to its host's store; the
controller reads it back with ``decode``, which refuses (``BadEvent``) an unknown type, a field
missing or not known, or a value of the wrong type. A record that is ``logged`` goes to the event
log as ``rank_<type>`` (``observe/event_types.py`` takes the list from here).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

from .cuda import CudaFault
from .records import BadRecord, Reader, plain

KINDS: dict[str, type[RankEvent]] = {}  # type -> its record

# where a rank was in a generation when it failed: joining its group, agreeing on the state,
# running the training function, or waiting to retry a step
# where a rank was when it left: forming the group (and a mesh's groups), building a mesh's
# sharded model (the script's build function, once per process), restoring, training
Phase = Literal["rendezvous", "build", "restore", "train", "retry"]
# a copy of the state: the rank's own in its process, its node's memory, the certified copy the
# process keeps, a replica on the buddy node, a checkpoint on disk
Source = Literal["live", "memory", "kept", "node", "buddy", "disk"]


class BadEvent(BadRecord):
    """A rank's event that is not one of these, or not as it should be."""


# == what events carry ===============================================================================
@dataclasses.dataclass(frozen=True, kw_only=True)
class SkippedCopy:
    """A copy of the state a restore did not use, and why (``cause``, for decisions; ``why``,
    for people)."""

    # sdc: the rank's live state differed from its replicas' at the same step (silent
    # corruption); bad_copy: missing or failed its checksum when read; memory_unreachable: the
    # node's memory did not answer when the rank listed what it holds
    cause: Literal["sdc", "bad_copy", "memory_unreachable"]
    source: Source
    rank: int | None  # whose state (None: a shard's, after a reshard)
    step: int | None
    why: str
    offered_by: int | None = None  # the rank that offered the copy
    shard: int | None = None  # a reshard's: the old shard, and the rank that held it
    holder: int | None = None
    # sdc: the digest of every rank compared with this one (its twins: the ranks that hold the
    # same part, at the same step)
    digests: dict[str, int] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class DigestChecks:
    """A rank's comparisons of the replicas' parameters (``detect.sdc``) so far."""

    checks: int
    first_step: int | None
    last_step: int | None
    chain: str  # a digest of every agreeing comparison, in order
    cost_s: float | None
    certified: int | None  # the newest snapshot committed of a step whose check agreed
    certified_t: float | None  # ...and when (wall clock)
    uncompared: str | None = None  # why the replicas' parameters could not be compared
    # the replay checks of the policy (detect.sdc.replay_every): how many, the seconds they
    # added (the copy, the digests, the steps run again), and the seconds of the steps they
    # were made among (their share)
    replays: int = 0
    replay_s: float = 0.0
    stepped_s: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayEvidence:
    """One rank's two passes over the same steps, from the same state and inputs (its first,
    and a replay): where they first differ (decide/sdc.py, ``attribute``)."""

    rank: int
    compared: int  # points compared (0: no record of the first pass - a new process)
    step: int | None = None  # the first step where they differ (None: they agree throughout)
    point: Literal["start", "output", "end"] | None = None  # ...and where in it
    first: int | None = None  # the first pass's digest there
    second: int | None = None  # ...and the replay's


# == the events ======================================================================================
@dataclasses.dataclass(frozen=True, kw_only=True)
class RankEvent:
    type: ClassVar[str] = ""
    logged: ClassVar[bool] = True  # written to the event log, as rank_<type>

    wid: int = -1  # the process (stamped by WorkerRuntime.emit)
    t: float = 0.0  # when it happened (0: when it is emitted)
    replay: bool = False  # relayed again to a controller taking over: its predecessor logged it

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.type:
            KINDS[cls.type] = cls


@dataclasses.dataclass(frozen=True, kw_only=True)
class Started(RankEvent):
    """The process is up (bootstrap), before its slow imports."""

    type: ClassVar[str] = "hello"
    logged: ClassVar[bool] = False
    pid: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Ready(RankEvent):
    """A process without a rank is warm: it waits for one (a spare)."""

    type: ClassVar[str] = "ready"
    pid: int
    mode: Literal["script", "import"]  # ran the script up to nonstop.wrap, or imported only
    warm_s: float | None = None  # import: how long its imports took


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prewarmed(RankEvent):
    """A warm spare of a mesh job made DTensor's sharding decisions its host's ranks recorded
    (runtime/propagation.py): its first step as a rank finds them made."""

    type: ClassVar[str] = "prewarmed"
    records: int  # records read so far (one per rank of the first generation on this host)
    decided: int  # decisions made ahead, in all
    took_s: float  # how long this look took
    refused: list[str]  # records refused since the last look, and why


@dataclasses.dataclass(frozen=True, kw_only=True)
class Wrapped(RankEvent):
    """The script reached ``nonstop.wrap`` (once in the process's life)."""

    type: ClassVar[str] = "wrapped"
    pid: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Joining(RankEvent):
    type: ClassVar[str] = "joining"
    gen: int
    rank: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnteredGeneration(RankEvent):
    """The rank's group formed and its state was agreed: it runs the training function. A
    plain script's rank (``plain``) says only when it was assigned: the rest is None."""

    type: ClassVar[str] = "entered"
    gen: int
    rank: int
    step: int | None
    t_assigned: float
    plain: bool = False
    source: str | None = None  # a Source, or how a reshard merged them ("live+memory, resharded")
    holder: int | None = None  # the rank its state came from
    receivers: list[int] | None = None  # ranks whose state moved or was read
    sources: dict[str, str] | None = None  # every rank's source
    skipped: list[SkippedCopy] = dataclasses.field(default_factory=list)
    nbytes: int | None = None
    restore_s: float | None = None
    restore_phases: dict[str, float] | None = None
    sharded: bool | None = None
    # a mesh's replicated dimension (HSDP): the ranks of this rank's replica group (a whole
    # copy of the model, one shard each), itself included
    replica_group: list[int] | None = None
    # a mesh whose first dimension shards the state and none replicates it (plain FSDP, FSDP x
    # TP): the ranks per index of that dimension. The world changes by whole such blocks, every
    # rank a new process resharding the state (its processes cannot be sharded again); -1: a
    # mesh with no replicated dimension that cannot change size at all
    regrid_unit: int | None = None
    nccl: bool | None = None
    # how the ranks agree to take each step of a sharded state, whose gradients each rank sees
    # a part of: "commit", one flag all-reduced after the gradient reductions; "reduction", the
    # NaN verdict carried by FSDP2's own reduce-scatter (no twin: runtime/verdict.py); None:
    # nothing to agree on (the gradients are every rank's, or no NaN check and no twin)
    agreement: Literal["commit", "reduction"] | None = None
    t_pg: float | None = None  # its group formed
    t_restored: float | None = None
    fds: int | None = None  # its open files, threads and memory (leaks across generations)
    threads: int | None = None
    rss_mb: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class FirstStep(RankEvent):
    """The first step the rank completed in a generation (``t``: when). A function without
    ``ctx.steps`` reports its first progress instead (``steps`` false, ``via`` what it was)."""

    type: ClassVar[str] = "first_step"
    gen: int
    rank: int
    step: int
    steps: bool = True
    via: Literal["optimizer", "report", "progress"] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class LeftGeneration(RankEvent):
    """The rank left a generation: it failed there (or a peer did), or it was done and was
    given another place (``reassigned``)."""

    type: ClassVar[str] = "left"
    gen: int
    rank: int
    step: int
    dirty: bool  # its state is mid-step: not to be offered
    reason: Literal["regroup", "sdc", "abort", "no_state", "cuda_oom", "peer", "exception",
                    "reassigned", "internal", "setup"]
    t_caught: float
    phase: Phase | None = None
    error: str | None = None
    traceback: str | None = None  # a user exception's, or an out-of-memory's
    t_pg: float | None = None  # left while restoring: when its group had formed
    destroy_s: float | None = None  # its group's teardown
    collected: int | None = None
    sockets_shut: int | None = None
    sdc_step: int | None = None  # sdc: where the replicas' parameters differed...
    suspects: list[int] | None = None  # ...which ranks differ from the others
    digests: list[int] | None = None  # ...every rank's digest
    # ...the part each rank holds (a sharded or pipelined job's shard or stage): digests are
    # compared, and judged, among the ranks of one part only (its twins); None: every rank holds
    # the same state
    twins: list[int] | None = None
    # ...found at a replay of the steps: where each rank's passes first differ (a comparison
    # redone after a rollback, or a replay check of the policy's: ``sdc_scheduled``)
    sdc_evidence: list[ReplayEvidence] | None = None
    sdc_scheduled: bool = False
    cuda: CudaFault | None = None
    sdc: DigestChecks | None = None
    # the step it keeps in its node's memory as it leaves (a departure snapshot), if any
    departure: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Done(RankEvent):
    """The training function returned."""

    type: ClassVar[str] = "done"
    gen: int
    rank: int
    step: int
    busy: float  # seconds in completed steps, over the process's life
    unfired: list[str]  # injected faults keyed to steps it never reached
    steps: bool  # it iterated ctx.steps
    sdc: DigestChecks | None
    final_persist: int | None  # the last step it sent to disk


@dataclasses.dataclass(frozen=True, kw_only=True)
class NanFound(RankEvent):
    """Non-finite gradients at ``step``: the rank waits to be told to retry or skip it."""

    type: ClassVar[str] = "nan"
    logged: ClassVar[bool] = False
    gen: int
    rank: int
    step: int
    output: float | Literal["nan"] | None  # this rank's forward output: 1.0 finite, or not


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossRuleFired(RankEvent):
    """A loss rule of the policy held on this rank (logged by the controller as
    ``loss_rule_fired``)."""

    type: ClassVar[str] = "loss_rule"
    logged: ClassVar[bool] = False
    gen: int
    rank: int
    step: int
    rule: str
    action: Literal["report", "restart", "fail"]
    loss: float | Literal["nan", "inf", "-inf"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoSteps(RankEvent):
    """The training function runs without ``ctx.steps``: its progress is its marks."""

    type: ClassVar[str] = "no_steps"
    gen: int | None
    rank: int
    via: Literal["optimizer", "report", "progress", "returned", "plain"]  # plain: no wrap
    registered: bool  # it registered a nonstop.State
    function: str | None
    faults: list[str]  # injected faults keyed to steps: they cannot fire


@dataclasses.dataclass(frozen=True, kw_only=True)
class StateNotKept(RankEvent):
    """A ``nonstop.State`` made once the training function was wrapped, other than the one a
    ``Mesh``'s build function returns: nothing keeps it across a restart (said once per
    process)."""

    type: ClassVar[str] = "state_not_kept"
    gen: int | None
    rank: int
    function: str | None
    names: list[str]  # the objects it holds


@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultFired(RankEvent):
    """An injected fault fired (``--inject``)."""

    type: ClassVar[str] = "inject"
    fault: str  # as it was given
    kind: str
    rank: int  # -1: every rank
    step: int  # -1: a recovery point's
    gen: int | None
    pid: int
    index: int | None  # its place in the list: fired once in the job


@dataclasses.dataclass(frozen=True, kw_only=True)
class Exiting(RankEvent):
    """The process's last words, as it ends on its own: an error in the script (at import, or
    in the training function of a plain script), a sticky CUDA error, communicators that would
    not abort."""

    type: ClassVar[str] = "exit"
    code: int
    error: str
    assigned: bool  # it held a rank when it ran the script (a spare may run it without)
    traceback: str | None = None
    import_error: bool = False  # it failed before reaching its training function
    abort_hung: bool = False
    collective: bool = False  # the error looks like a failed collective (a peer's fault)
    cuda: CudaFault | None = None
    gen: int | None = None
    rank: int | None = None
    phase: Phase | None = None
    step: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class SnapshotInterval(RankEvent):
    """Rank 0: the agreed snapshot interval changed."""

    type: ClassVar[str] = "snapshot_interval"
    gen: int
    step: int
    every: int
    cost_s: float | None
    step_s: float | None
    repl_s: float | None
    last: int | None
    taken: int
    spent_s: float
    error: str | None
    staged: bool
    write_s: float | None
    skipped: int  # snapshots not taken: the one before was still being written
    # steps between the replicas' comparisons (detect.sdc) where no snapshot is due (None:
    # compared at snapshots only)
    check_every: int | None = None
    slot_bytes: int | None = None  # what one snapshot of rank 0 takes in its node's memory


@dataclasses.dataclass(frozen=True, kw_only=True)
class SnapshotFailed(RankEvent):
    type: ClassVar[str] = "snapshot_failed"
    gen: int
    rank: int
    step: int
    error: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupKept(RankEvent):
    """An aborted generation's process group was still busy after its release budget: kept,
    to be destroyed later (``times``: tried so far)."""

    type: ClassVar[str] = "group_kept"
    gen: int
    times: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class BitFlipped(RankEvent):
    """An injected bit flip struck the rank's parameters."""

    type: ClassVar[str] = "bitflip"
    gen: int
    rank: int
    step: int
    where: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class SdcMismatch(RankEvent):
    """The replicas' digests disagreed at a comparison, and the policy only reports it."""

    type: ClassVar[str] = "sdc_mismatch"
    gen: int
    rank: int
    step: int
    suspects: list[int]
    digests: list[int]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SdcReplayed(RankEvent):
    """Rank 0: the steps to a comparison were replayed from the same state and the replay
    agreed - after a corruption's rollback, the twins again (the corruption happened in the
    first pass); at a replay check of the policy's (``scheduled``), a majority of three passes
    (one pass differed). ``evidence``: where each rank's passes first differ, gathered from
    every rank (the controller names the faulty rank from it: ``sdc_attributed``)."""

    type: ClassVar[str] = "sdc_replayed"
    logged: ClassVar[bool] = False  # (the controller logs its verdict: sdc_attributed)
    gen: int
    rank: int
    step: int
    evidence: list[ReplayEvidence]
    digests: list[int]  # every rank's digest of its parameters after the replay
    scheduled: bool = False
    struck: int | None = None  # scheduled: the pass the other two outvoted (1, or 2: the replay)


# == on the wire =====================================================================================
_READ = Reader()
_SCALARS = (int, float, str, bool, type(None))
_LAYOUT: dict[type, tuple[tuple[str, Any], ...]] = {}
_OPTIONAL: dict[type, tuple[str, ...]] = {}
_REQUIRED = object()


def encode(ev: RankEvent) -> dict[str, Any]:
    """The JSON object of an event: its ``type``, then its fields - a field at its default left
    out (a plain script's entry says little; a big job's controller reads, relays and logs
    tens of thousands of these in a recovery)."""
    layout = _LAYOUT.get(type(ev))
    if layout is None:
        layout = _LAYOUT[type(ev)] = _layout(type(ev))
    out: dict[str, Any] = {"type": ev.type}
    for name, default in layout:
        value = getattr(ev, name)
        if default is not _REQUIRED and (value is default or value == default):
            continue
        out[name] = value if type(value) in _SCALARS else plain(value)
    return out


def _layout(cls: type) -> tuple[tuple[str, Any], ...]:
    """Each field's name and its default (``_REQUIRED``: none)."""
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else \
            f.default_factory() if f.default_factory is not dataclasses.MISSING else _REQUIRED
        out.append((f.name, default))
    return tuple(out)


def _optional(cls: type) -> tuple[str, ...]:
    """The fields an encoded event may leave out: those with a default."""
    names = _OPTIONAL.get(cls)
    if names is None:
        layout = _LAYOUT.get(cls) or _LAYOUT.setdefault(cls, _layout(cls))
        names = _OPTIONAL[cls] = tuple(n for n, default in layout if default is not _REQUIRED)
    return names


_READERS: dict[type, Any] = {}  # each kind's reader, made once


def decode(raw: Any) -> RankEvent:
    """The event a JSON object holds; BadEvent for one that is not a rank event as this version
    of nonstop writes it."""
    kind = raw.get("type") if type(raw) is dict else None
    cls = KINDS.get(kind) if type(kind) is str else None
    if cls is None:
        raise BadEvent(f"unknown rank event {_short(kind if type(raw) is dict else raw)}")
    read = _READERS.get(cls)
    if read is None:
        read = _READERS[cls] = _READ.reader(cls, cls.type, ("type",), _optional(cls))
    try:
        return read(raw)
    except BadEvent:
        raise
    except BadRecord as exc:
        raise BadEvent(str(exc)) from None


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."

"""What crosses a process to and from a node's memory (``keeper/server.py``), typed: the clients'
requests and their answers, the keeper's reports to its subscribers, its checkpoint writer's
messages, and the header and ack of a replica between two keepers.

Each is a frozen record; ``encode`` makes the JSON object sent (a request's ``op``, a report's
``ev``, a message to or from the writer its ``op``; an answer and a replica's frames are known
from what was asked and carry no type), and the ``decode_*`` functions read one back strictly
(``records.Reader``): an unknown type, a field missing, unknown or of the wrong type is refused
(``BadKeeperMessage``). Both ends are the same version of nonstop, so nothing is filled in.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal, Union

from .slots import SlotInfo
from .records import BadRecord, Reader, plain


class BadKeeperMessage(BadRecord):
    """A message to or from a keeper that is not one of these, or not as it should be."""


# == what messages carry ===========================================================================
@dataclasses.dataclass(frozen=True, kw_only=True)
class DiskPart:
    """One part of a disk checkpoint to write: the snapshot it is made from (the holder's, of
    ``step``), the checkpoint directory, and whose part it is."""

    holder: str
    step: int
    root: str
    rank: int  # the part: the rank whose state it is (sharded), else 0
    world: int
    sharded: bool
    reason: str  # "periodic", "final", or what an emergency save was for
    node: int | None = None  # the node whose memory it is written from (an emergency's)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FileWritten:
    bytes: int
    xxh3: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class PartWritten:
    """A part on disk, as ``state.checkpoint.write_part`` describes it (its manifest entry)."""

    dir: str
    files: dict[str, FileWritten]
    bytes: int
    seconds: float
    info: dict[str, str | int | bool | None]
    # sharded state: each shard's DCP name -> [the whole tensor's shape, the shard's offset]
    dtensors: dict[str, list[list[int]]] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class HolderEntry:
    """One holder in a keeper's listing: its complete snapshots (None: a slot empty or being
    written) and how its replication to the buddy nodes goes."""

    slots: list[SlotInfo | None]
    replicated_step: int | None  # the newest step every buddy holds
    repl_s: float | None
    repl_error: str | None  # why writes no longer wait for one buddy or more (behind, failed)
    buddies: list[str]  # "host:port" of the keepers its snapshots are copied to


# == requests, and their answers ===================================================================
@dataclasses.dataclass(frozen=True, kw_only=True)
class Answer:
    """What a keeper answers a request (the request says which answer it gets)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Allocated(Answer):
    """The slot to write into (its descriptor comes with the answer)."""

    slot: int
    seq: int
    size: int
    repl_s: float | None  # how long copying it to the buddy may take, if known
    fresh: bool  # the slot's memory was just allocated: this snapshot's time is no steady cost


@dataclasses.dataclass(frozen=True, kw_only=True)
class Leased(Answer):
    """The snapshot leased, its descriptor with the answer; None and None: there is none."""

    slot: int | None
    info: SlotInfo | None

    def __post_init__(self) -> None:
        if (self.slot is None) != (self.info is None):
            raise ValueError("a lease names both its slot and its snapshot, or neither")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Listing(Answer):
    holders: dict[str, HolderEntry]
    node: int
    tcp: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Configured(Answer):
    tcp: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Persisting(Answer):
    """The part is on its way to disk (``kept``: written again from the copy kept after it
    failed)."""

    kept: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class Forgotten(Answer):
    pass


@dataclasses.dataclass(frozen=True, kw_only=True)
class Corrupted(Answer):
    step: int
    offset: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Subscribed(Answer):
    tcp: str
    node: int
    pid: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pong(Answer):
    pid: int
    tcp: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Refused(Answer):
    """The keeper would not or could not do what was asked: why, in one line."""

    error: str


REQUESTS: dict[str, type[Request]] = {}  # op -> its record


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request:
    """A client's request to its node's keeper. ``answer``: the record it is answered with
    (None: it is told, never answered)."""

    op: ClassVar[str] = ""
    answer: ClassVar[type[Answer] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.op:
            REQUESTS[cls.op] = cls


@dataclasses.dataclass(frozen=True, kw_only=True)
class Alloc(Request):
    """A slot to write the holder's next snapshot into, of at least ``size`` bytes."""

    op: ClassVar[str] = "alloc"
    answer: ClassVar[type[Answer] | None] = Allocated
    holder: str
    size: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Commit(Request):
    """The slot is written: its snapshot is the holder's newest (and goes to disk as
    ``persist``, if given)."""

    op: ClassVar[str] = "commit"
    holder: str
    slot: int
    persist: DiskPart | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Lease(Request):
    """The holder's snapshot of ``step`` (None: its newest), kept from being written over until
    it is released."""

    op: ClassVar[str] = "lease"
    answer: ClassVar[type[Answer] | None] = Leased
    holder: str
    step: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Release(Request):
    op: ClassVar[str] = "release"
    holder: str
    slot: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class ListHolders(Request):
    op: ClassVar[str] = "list"
    answer: ClassVar[type[Answer] | None] = Listing


@dataclasses.dataclass(frozen=True, kw_only=True)
class Configure(Request):
    """Where each holder's snapshots are copied from now on (holder -> the "host:port" of each
    buddy's keeper), how long a replica waits for a slot leased to a reader, whether the
    checkpoint writer runs: each None (False) left as it is."""

    op: ClassVar[str] = "configure"
    answer: ClassVar[type[Answer] | None] = Configured
    replicate: dict[str, list[str]] | None = None
    free_within_s: float | None = None
    writer: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class Persist(Request):
    """Write a part of a disk checkpoint from the snapshot it names (``again``: from the copy
    kept after it failed, if there is one)."""

    op: ClassVar[str] = "persist"
    answer: ClassVar[type[Answer] | None] = Persisting
    part: DiskPart
    again: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class Forget(Request):
    """The holder's part of ``step`` is given up: the copy kept for it is freed."""

    op: ClassVar[str] = "forget"
    answer: ClassVar[type[Answer] | None] = Forgotten
    holder: str
    step: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Corrupt(Request):
    """Fault injection: a bit flips in the holder's newest snapshot."""

    op: ClassVar[str] = "corrupt"
    answer: ClassVar[type[Answer] | None] = Corrupted
    holder: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Subscribe(Request):
    """This connection receives the keeper's reports from now on."""

    op: ClassVar[str] = "subscribe"
    answer: ClassVar[type[Answer] | None] = Subscribed


@dataclasses.dataclass(frozen=True, kw_only=True)
class Ping(Request):
    op: ClassVar[str] = "ping"
    answer: ClassVar[type[Answer] | None] = Pong


# == reports (the keeper to its subscribers) =======================================================
REPORTS: dict[str, type[Report]] = {}  # ev -> its record


@dataclasses.dataclass(frozen=True, kw_only=True)
class Report:
    """What a keeper tells its subscribers (the controller), unasked. Which node's keeper said
    it is known from the connection it came on."""

    ev: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.ev:
            REPORTS[cls.ev] = cls


@dataclasses.dataclass(frozen=True, kw_only=True)
class Replicated(Report):
    ev: ClassVar[str] = "replicated"
    holder: str
    step: int
    bytes: int
    seconds: float
    to: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicationFailed(Report):
    ev: ClassVar[str] = "replication_failed"
    holder: str
    step: int
    bytes: int
    seconds: float
    to: str
    error: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicationBehind(Report):
    """The buddy did not take a snapshot in time: snapshots go on without waiting for it."""

    ev: ClassVar[str] = "replication_behind"
    holder: str
    step: int
    to: str | None
    waited_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicasHeld(Report):
    """What this node's memory holds of other nodes' snapshots (both slots of each replica),
    said when it grew: the memory the replicas cost here."""

    ev: ClassVar[str] = "replicas_held"
    bytes: int
    holders: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerRefused(Report):
    """A connection to the replicas' listener was refused (no secret, a wrong token)."""

    ev: ClassVar[str] = "peer_refused"
    peer: str
    why: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaRefused(Report):
    """A replica that came in was dropped: its slot stayed leased to a reader."""

    ev: ClassVar[str] = "replica_refused"
    holder: str
    why: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class PartDone(Report):
    ev: ClassVar[str] = "part_done"
    job: DiskPart
    part: PartWritten


@dataclasses.dataclass(frozen=True, kw_only=True)
class PartFailed(Report):
    """A part was not written: why (``error``), and where the file system said so."""

    ev: ClassVar[str] = "part_failed"
    job: DiskPart
    error: str
    retryable: bool = True  # False: nothing is left to write it from
    errno: str | None = None  # a name ("ENOSPC"); None: not the file system's
    message: str | None = None
    path: str | None = None
    need: int | None = None  # bytes the part's tensors take
    traceback: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RequestFailed(Report):
    """A request nobody waited for failed (said by the agent that relayed it, across hosts)."""

    ev: ClassVar[str] = "keeper_error"
    op: str | None
    error: str


# == the keeper and its checkpoint writer ==========================================================
WRITER_MESSAGES: dict[str, type[WriterMessage]] = {}  # op -> its record


@dataclasses.dataclass(frozen=True, kw_only=True)
class WriterMessage:
    """Between a keeper and its writer process: one part to write (its copy's descriptor with
    it), and the writer's answer."""

    op: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.op:
            WRITER_MESSAGES[cls.op] = cls


@dataclasses.dataclass(frozen=True, kw_only=True)
class Write(WriterMessage):
    op: ClassVar[str] = "write"
    job: DiskPart
    info: SlotInfo


@dataclasses.dataclass(frozen=True, kw_only=True)
class WriteDone(WriterMessage):
    op: ClassVar[str] = "done"
    part: PartWritten


@dataclasses.dataclass(frozen=True, kw_only=True)
class WriteFailed(WriterMessage):
    """The cause of a failed write, passed on to the controller as it is (``PartFailed``)."""

    op: ClassVar[str] = "failed"
    error: str
    errno: str | None
    message: str
    path: str
    need: int
    traceback: str


# == keeper to keeper: a replica ===================================================================
@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaHeader:
    """What precedes a replica's bytes: whose snapshot (``owner``), its size, which, from which
    node; ``token``: the job's keeper token (one host), None on the authenticated channel."""

    owner: str
    total: int
    step: int
    seq: int
    node: int
    token: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaAck:
    """The buddy's answer on the channel: written into memory in place (``k``) or just allocated
    (``f``), or refused (its slot is leased to a reader)."""

    ack: Literal["k", "f", "refused"]


Tagged = Union[Request, Report, WriterMessage]

# == on the wire ===================================================================================
_READ = Reader()
_SCALARS = (int, float, str, bool, type(None))
_NAMES: dict[type, tuple[str, ...]] = {}


def encode(msg: Tagged | Answer | ReplicaHeader | ReplicaAck) -> dict[str, Any]:
    """The JSON object of a message: its type (``op`` or ``ev``, if it has one), then its
    fields."""
    names = _NAMES.get(type(msg))
    if names is None:
        names = _NAMES[type(msg)] = tuple(f.name for f in dataclasses.fields(msg))
    out: dict[str, Any] = {}
    if isinstance(msg, Report):
        out["ev"] = msg.ev
    elif isinstance(msg, (Request, WriterMessage)):
        out["op"] = msg.op
    for name in names:
        value = getattr(msg, name)
        out[name] = value if type(value) in _SCALARS else plain(value)
    return out


def decode_request(raw: Any) -> Request:
    """The request a JSON object holds; BadKeeperMessage for one that is not."""
    return _tagged(REQUESTS, "op", "request", raw)  # type: ignore[return-value]


def decode_report(raw: Any) -> Report:
    return _tagged(REPORTS, "ev", "report", raw)  # type: ignore[return-value]


def decode_writer(raw: Any) -> WriterMessage:
    return _tagged(WRITER_MESSAGES, "op", "writer message", raw)  # type: ignore[return-value]


def decode_answer(request: type[Request], raw: Any) -> Answer:
    """The answer to a request of type ``request``: its own record, or ``Refused`` (an object
    with only ``error``)."""
    cls = request.answer
    if cls is None:
        raise BadKeeperMessage(f"{request.op!r} is never answered")
    if type(raw) is dict and "error" in raw:
        cls = Refused
    return read(cls, raw, f"{request.op} answer")


def told(raw: Any) -> bool:
    """Whether a JSON object, well formed or not, names a request that is never answered."""
    kind = raw.get("op") if type(raw) is dict else None
    cls = REQUESTS.get(kind) if type(kind) is str else None
    return cls is not None and cls.answer is None


def read(cls: type, raw: Any, where: str | None = None) -> Any:
    """A record of ``cls`` (one without a type on the wire: an answer, a replica's frames)."""
    try:
        return _READ.record(cls, raw, where or cls.__name__)
    except BadKeeperMessage:
        raise
    except BadRecord as exc:
        raise BadKeeperMessage(str(exc)) from None


def _tagged(table: dict[str, type], key: str, what: str, raw: Any) -> Any:
    kind = raw.get(key) if type(raw) is dict else None
    cls = table.get(kind) if type(kind) is str else None
    if cls is None:
        raise BadKeeperMessage(f"unknown {what} {_short(kind if type(raw) is dict else raw)}")
    try:
        return _READ.record(cls, raw, kind, skip=(key,))
    except BadKeeperMessage:
        raise
    except BadRecord as exc:
        raise BadKeeperMessage(str(exc)) from None


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."

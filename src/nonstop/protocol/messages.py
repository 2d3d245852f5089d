"""The messages on the channel between the controller and the hosts' agents, typed.

Each is a frozen dataclass; ``encode`` makes the JSON object a channel carries, ``decode`` reads one
back and refuses (``BadMessage``) an unknown operation or a field of the wrong type, so a peer
with the job's secret but another version of nonstop is told apart from a valid order. Orders
(controller to agent) carry the controller's epoch (an agent refuses an older one) and, for a
request, an id its ``Reply`` repeats; reports (agent to controller) carry the sender's clock.

A field whose type is a frozen record (``ProcExit``, ``HostWorker``, ``MissedDeadline``,
``HealthCheck``), a list of them or one or None, travels as JSON values (``records.plain``) and is
read back strictly (``records.Reader``: a field missing, unknown or of the wrong type is refused,
as ``BadMessage`` naming the message and the field).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Callable, ClassVar, Union

from .last_step import LastStep
from .records import BadRecord, Reader, plain

_BY_OP: dict[str, type[Message]] = {}


class BadMessage(ValueError):
    """A message that is not one of these, or not as it should be."""


@dataclasses.dataclass(frozen=True)
class Message:
    op: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.op:
            _BY_OP[cls.op] = cls


# == controller -> agent ============================================================================
@dataclasses.dataclass(frozen=True)
class Order(Message):
    epoch: int = 0  # the controller's (the leader key's create revision): fencing
    id: int | None = None  # a request: the Reply says the same id


@dataclasses.dataclass(frozen=True)
class Hello(Order):
    """The controller in office from now on: the agent answers with its State."""

    op: ClassVar[str] = "hello"


@dataclasses.dataclass(frozen=True)
class Spawn(Order):
    op: ClassVar[str] = "spawn"
    wid: int = -1
    spare: bool = False
    mode: str | None = None  # a spare's: "script" | "import"
    node: int = 0
    keeper: str | None = None  # the name of its node's memory, if any


@dataclasses.dataclass(frozen=True)
class SpawnKeeper(Order):
    """The host's node memory."""

    op: ClassVar[str] = "spawn_keeper"
    wid: int = -1
    node: int = 0
    name: str = ""
    writer: bool = False


@dataclasses.dataclass(frozen=True)
class KeeperOpen(Order):
    """Reply {tcp} once the agent reaches its keeper, or {error}."""

    op: ClassVar[str] = "keeper_open"
    name: str = ""


@dataclasses.dataclass(frozen=True)
class KeeperCall(Order):
    """A request to the host's keeper: Reply {reply} or {error} (no id: nobody waits)."""

    op: ClassVar[str] = "keeper_call"
    name: str = ""
    msg: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Signal(Order):
    op: ClassVar[str] = "signal"
    wid: int = -1
    sig: int = 9


@dataclasses.dataclass(frozen=True)
class Send(Order):
    """A mailbox message for one process (its seq-th)."""

    op: ClassVar[str] = "send"
    wid: int = -1
    seq: int = 0
    msg: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Sends(Order):
    """Mailbox messages for many processes of the host, in order: each ``{wid, seq, msg}`` as in
    ``Send`` (a new generation's assignments: one frame per host, not one per rank), its
    message ``common``'s fields with its own over them (what a generation's assignments share
    goes once)."""

    op: ClassVar[str] = "sends"
    mails: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    common: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Abort(Order):
    op: ClassVar[str] = "abort"
    gen: int = 0
    wids: list[int] = dataclasses.field(default_factory=list)
    regroup: bool = False  # at the next step boundary, to grow the world


@dataclasses.dataclass(frozen=True)
class End(Order):
    """End every process and leave with this code."""

    op: ClassVar[str] = "end"
    code: int = 0
    grace_s: float = 0.0
    why: str | None = None
    released: bool = False  # the job goes on without this host (drained, preempted, isolated)


@dataclasses.dataclass(frozen=True)
class OpenStore(Order):
    """A fresh store for a plain script's generation: Reply {port}."""

    op: ClassVar[str] = "open_store"
    gen: int = 0


# == the records reports carry ======================================================================
@dataclasses.dataclass(frozen=True)
class ProcExit:
    """A process of the host that exited."""

    wid: int
    code: int | None  # its exit code (None: not known, taken as the host's loss)
    last: LastStep | None = None  # the last step it completed (on the sender's clock), if any


@dataclasses.dataclass(frozen=True)
class HostWorker:
    """A process a host runs, as its agent knows it (the answer to a new controller's hello)."""

    wid: int
    pid: int
    alive: bool
    code: int | None = None  # its exit code, once it exited
    spare: bool = False
    node: int | None = None  # the node it was started for (None: not known any more)
    keeper: str | None = None  # a node's memory: its name
    rank: int | None = None  # its rank in generation ``gen``, once assigned
    gen: int | None = None
    seq: int = 0  # the next mailbox message it is sent is the seq-th
    done: int | None = None  # the generation in which it said its training function returned


@dataclasses.dataclass(frozen=True)
class MissedDeadline:
    """A deadline that fired where something was waited on (an agent, a controller's request to
    a host): the controller logs it as a ``deadline`` event (docs/events.md, Deadlines)."""

    what: str
    limit_s: float | None
    detail: str | None = None
    node: int | None = None  # the host's node, filled in by the controller across hosts

    def fields(self) -> dict[str, Any]:
        """What the event says beside ``what`` and ``limit_s`` (only what is known)."""
        out: dict[str, Any] = {}
        if self.detail is not None:
            out["detail"] = self.detail
        if self.node is not None:
            out["node"] = self.node
        return out


@dataclasses.dataclass(frozen=True)
class HealthCheck:
    """The result of one of the host's health checks (``agent/health.py: HealthResult`` less its
    node and time, which the controller fills in)."""

    check: str  # the check's name, or "nvml"
    ok: bool
    code: int | None
    detail: str
    seconds: float
    limit_s: float | None = None


# == agent -> controller ============================================================================
@dataclasses.dataclass(frozen=True)
class Report(Message):
    now: float | None = None  # the sender's clock when it sent this (times move by the offset)


@dataclasses.dataclass(frozen=True)
class State(Report):
    """What the host runs: the answer to Hello."""

    op: ClassVar[str] = "state"
    host: str = ""
    incarnation: str = ""
    workers: list[HostWorker] = dataclasses.field(default_factory=list)
    takeover: bool = False


@dataclasses.dataclass(frozen=True)
class Exits(Report):
    op: ClassVar[str] = "exits"
    exits: list[ProcExit] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Events(Report):
    """The ranks' events, in order (replay: already in the log of the controller before)."""

    op: ClassVar[str] = "events"
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    replay: bool = False


@dataclasses.dataclass(frozen=True)
class Progress(Report):
    """The host's ranks' progress, aggregated (10 Hz)."""

    op: ClassVar[str] = "progress"
    recs: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # wid -> record
    stopped: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Output(Report):
    """A line a process printed (for the log rules)."""

    op: ClassVar[str] = "output"
    wid: int = -1
    line: str = ""


@dataclasses.dataclass(frozen=True)
class Health(Report):
    op: ClassVar[str] = "health"
    results: list[HealthCheck] = dataclasses.field(default_factory=list)
    nvml_status: str | None = None


@dataclasses.dataclass(frozen=True)
class KeeperEvents(Report):
    """What the host's keeper reported."""

    op: ClassVar[str] = "keeper_events"
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Preempted(Report):
    """The host was told to stop (SIGTERM: a scheduler's preemption notice): it stays up to
    ``grace_s`` for its ranks to move away, then ends."""

    op: ClassVar[str] = "preempted"
    grace_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Deadlines(Report):
    """Deadlines that fired on the host: the controller logs each."""

    op: ClassVar[str] = "deadlines"
    records: list[MissedDeadline] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Refused(Report):
    """An order the agent will not carry out (a stale epoch): its sender is deposed."""

    op: ClassVar[str] = "refused"
    why: str = ""


@dataclasses.dataclass(frozen=True)
class Reply(Report):
    op: ClassVar[str] = "reply"
    id: int | None = None
    port: int | None = None
    tcp: str | None = None
    reply: dict[str, Any] | None = None
    error: str | None = None


# == on the wire ====================================================================================
def encode(msg: Message) -> dict[str, Any]:
    out = {"op": msg.op}
    for name, _, _, read in _checks(type(msg)):
        value = getattr(msg, name)
        out[name] = value if read is None else plain(value)
    return out


def decode(raw: dict[str, Any]) -> Message:
    op = raw.get("op")
    cls = _BY_OP.get(op) if type(op) is str else None
    if cls is None:
        raise BadMessage(f"unknown operation {op!r:.80}")
    kwargs = {}
    for name, fits, hint, read in _checks(cls):
        if name in raw:
            value = raw[name]
            if read is not None:  # records: read strictly
                try:
                    value = read(value)
                except BadRecord as exc:
                    raise BadMessage(f"{cls.op}: {name}{exc.path}: {exc.problem}") from None
            elif not fits(value):
                raise BadMessage(f"{cls.op}: {name}={value!r:.80} is not {hint}")
            kwargs[name] = value
    return cls(**kwargs)


# Each field of a message: its name, a test of a plain value against its type, the type, and for
# a field of records the reader of its JSON (None: the value is taken as it is)
_CHECKS: dict[type, list[tuple[str, Any, Any, Callable[[Any], Any] | None]]] = {}
_READ = Reader()  # strict: a nested record's unknown field is refused


def _checks(cls: type) -> list[tuple[str, Any, Any, Callable[[Any], Any] | None]]:
    """Made once per class: a controller of 2,048 hosts decodes every frame they send."""
    checks = _CHECKS.get(cls)
    if checks is None:
        hints = typing.get_type_hints(cls)
        checks = _CHECKS[cls] = [(f.name, _checker(hints[f.name]), hints[f.name],
                                  _nested(hints[f.name], f"{cls.__name__}.{f.name}"))
                                 for f in dataclasses.fields(cls)]
    return checks


def _is_record(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _nested(hint: Any, field: str) -> Callable[[Any], Any] | None:
    """The reader of a field of records (``R``, ``list[R]``, ``R | None``), raising BadRecord
    with the path to what is wrong; None for a field of plain values."""
    if not any(_is_record(a) for a in _walk(hint)):
        return None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    alts = [a for a in args if a is not type(None)]
    if _is_record(hint) or (origin is list and args and _is_record(args[0])) or (
            origin in (Union, types.UnionType) and len(args) == 2 and len(alts) == 1
            and _is_record(alts[0])):
        return _READ.value_reader(hint, field)
    raise TypeError(f"{field}: records travel as R, list[R] or R | None, not {hint!r}")


def _walk(hint: Any) -> list[Any]:
    """Every type a type is made of."""
    out = [hint]
    for a in typing.get_args(hint):
        out += _walk(a)
    return out


def _checker(hint: Any) -> typing.Callable[[Any], bool]:
    """A test of a decoded JSON value against a field's type, built once per type (a controller
    of 2,048 hosts checks thousands of events a second: the type is not taken apart each time)."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return lambda v: True
    if origin in (Union, types.UnionType):
        alts = [_checker(h) for h in typing.get_args(hint)]
        return lambda v: any(fits(v) for fits in alts)
    if hint is type(None):
        return lambda v: v is None
    if hint is float:
        return lambda v: (type(v) is float or type(v) is int
                          or (isinstance(v, (int, float)) and not isinstance(v, bool)))
    if hint is int:
        return lambda v: type(v) is int or (isinstance(v, int) and not isinstance(v, bool))
    if origin is list:
        (item,) = typing.get_args(hint)
        if item is Any:
            return lambda v: isinstance(v, list)
        each = _checker(item)
        return lambda v: isinstance(v, list) and all(map(each, v))
    if origin is dict:
        key, item = typing.get_args(hint)
        keys, values = _checker(key), _checker(item)
        if key is str and item is Any:  # the common case: a record (an event, a progress)
            return lambda v: isinstance(v, dict) and all(type(k) is str for k in v)
        return lambda v: isinstance(v, dict) and all(keys(k) and values(x) for k, x in v.items())
    return lambda v: isinstance(v, hint)

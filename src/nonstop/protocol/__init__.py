"""The contract between the launcher (controller and agent) and the rank processes.

Key names in the coordination store, environment variable names, and message shapes live here so
that both sides agree by construction. Every key a generation writes is under ``g/<gen>/``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar, Union

# -- environment variables (one prefix) ---------------------------------------------------------
ENV_STORE = "NONSTOP_STORE"  # host:port of the coordination store
ENV_WORKER_ID = "NONSTOP_WORKER_ID"  # the process's worker id (stable for its life)
ENV_LAUNCHER_PID = "NONSTOP_LAUNCHER_PID"  # parent to watch; the worker dies with it
ENV_RUN_DIR = "NONSTOP_RUN_DIR"
ENV_SPARE_MODE = "NONSTOP_SPARE_MODE"  # "script" | "import"
ENV_GENERATION = "NONSTOP_GENERATION"
ENV_ENTRIES = "NONSTOP_ENTRIES"  # times this process has entered the training function
ENV_REPLACEMENTS = "NONSTOP_REPLACEMENTS"  # times this rank has been replaced
ENV_INJECT = "NONSTOP_INJECT"  # JSON list of fault specs, see inject.py
ENV_NODE = "NONSTOP_NODE"  # the node (agent group) the process belongs to
ENV_KEEPER = "NONSTOP_KEEPER"  # the abstract socket name of the node's keeper (its memory)

# -- exit codes of a rank process that ends itself so that its rank gets a new process ----------
EXIT_CUDA = 86  # a sticky CUDA error: its CUDA context is unusable
EXIT_ABORT_HUNG = 87  # its NCCL communicators would not abort in time

# -- store keys ---------------------------------------------------------------------------------
JOB_KEY = "job"  # JSON: settings the runtime needs
EVENT_COUNT_KEY = "ev/n"  # a doorbell: a worker adds 1 after writing an event


def event_key(worker_id: int, seq: int) -> str:
    """The seq-th event of one worker: each worker numbers its own, so one writer delayed
    (stopped, descheduled) delays only its own events, and none is ever skipped."""
    return f"ev/{worker_id}/{seq}"


def mailbox_key(worker_id: int, seq: int) -> str:
    """The seq-th message from the controller to one worker; each key is written once."""
    return f"w/{worker_id}/m/{seq}"


def progress_key(worker_id: int) -> str:
    return f"p/{worker_id}"


def abort_key(gen: int, worker_id: int) -> str:
    """Set by the controller to abort a generation (one key per worker, so each worker can also
    wake its own watcher when it leaves normally)."""
    return f"g/{gen}/abort/{worker_id}"


ABORT = b"abort"
REGROUP = b"regroup"  # leave the generation at the next step boundary (it grows)
SELF_WAKE = b"self"


def pg_prefix(gen: int) -> str:
    return f"g/{gen}/pg"


def inject_key(index: int) -> str:
    return f"inj/{index}"


# -- messages: controller -> worker (its mailbox) -------------------------------------------------
# Typed here, written to the mailbox as ``mail_record`` (JSON), read back by ``mail_from``: a
# message of an unknown type, or with a field this side does not know, is refused.
# worker -> controller (events): typed records, one per type of event, in events.py.
ASSIGN = "assign"
COMPLETE = "complete"
EXIT = "exit"
RETRY = "retry"  # re-enter the same generation and redo (or skip) the step


@dataclasses.dataclass(frozen=True)
class Assign:
    """A rank's assignment for one generation, with the torchrun view of where it runs."""

    gen: int
    rank: int
    world: int
    full_world: int = 0  # the world the job was started with (0: the same as world)
    reshard_from: int = 0  # sharded state was last trained at this other world size (0: same)
    # the mesh is laid out over this world, not the full one: its first dimension shards the
    # state (plain FSDP, FSDP x TP), so the job changes size only by new processes resharding it
    regrid: bool = False
    worlds: dict[str, int] = dataclasses.field(default_factory=dict)  # recent gen -> world size
    replacements: int = 0  # times this rank was replaced
    initial: bool = False  # the job (re)starts: no rank holds state to agree on
    not_after: int | None = None  # state newer than this step is not to be trusted (a corruption)
    claimed: dict[str, int] = dataclasses.field(default_factory=dict)  # faults fired: index -> n
    local_rank: int | None = None  # None: the rank (one host)
    local_world: int | None = None  # None: the world
    group_rank: int = 0  # the index of its host among the hosts that hold ranks
    port: int | None = None  # MASTER_PORT: the store a plain script's group forms on
    master_addr: str | None = None  # across hosts: MASTER_ADDR (the host of rank 0)
    pg_addr: str | None = None  # across hosts: the store the group of nonstop.wrap forms on
    pg_port: int | None = None
    type: ClassVar[str] = ASSIGN


@dataclasses.dataclass(frozen=True)
class Complete:
    """Training finished on every rank: return from the training function."""

    type: ClassVar[str] = COMPLETE


@dataclasses.dataclass(frozen=True)
class Exit:
    """Leave now (a spare at the end of a job, a process no longer needed)."""

    type: ClassVar[str] = EXIT


@dataclasses.dataclass(frozen=True)
class Retry:
    """Redo the step in the same generation (``skip``: skip its batch instead)."""

    skip: bool = False
    type: ClassVar[str] = RETRY


Mail = Union[Assign, Complete, Exit, Retry]
_MAIL: dict[str, type] = {ASSIGN: Assign, COMPLETE: Complete, EXIT: Exit, RETRY: Retry}


_FIELDS: dict[type, tuple[str, ...]] = {}


def mail_record(msg: Mail) -> dict[str, Any]:
    """The JSON record of a mailbox message. Its fields as they are (plain values; a dict in
    one is shared, not copied: a generation's 16,384 assignments share one ``worlds``)."""
    names = _FIELDS.get(type(msg))
    if names is None:
        names = _FIELDS[type(msg)] = tuple(f.name for f in dataclasses.fields(msg))
    rec = {"type": msg.type}
    for name in names:
        rec[name] = getattr(msg, name)
    return rec


_MAIL_READERS: dict[type, Any] = {}  # each message type's strict reader, made once


def mail_from(rec: dict[str, Any]) -> Mail:
    """The message a mailbox record holds, read strictly (``records.Reader``): ValueError for a
    type this side does not know, or a field missing, unknown or of another type."""
    from .records import BadRecord, Reader

    kind = _MAIL.get(rec.get("type")) if type(rec) is dict else None  # type: ignore[arg-type]
    if kind is None:
        said = rec.get("type") if type(rec) is dict else rec
        raise ValueError(f"unknown mailbox message {said!r}")
    read = _MAIL_READERS.get(kind)
    if read is None:
        optional = tuple(f.name for f in dataclasses.fields(kind)
                         if f.default is not dataclasses.MISSING
                         or f.default_factory is not dataclasses.MISSING)
        read = _MAIL_READERS[kind] = Reader().reader(kind, f"mailbox message {kind.type!r}",
                                                     ("type",), optional)
    try:
        return read(rec)
    except BadRecord as exc:
        raise ValueError(str(exc)) from None


def dumps(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def loads(raw: bytes | str) -> dict[str, Any]:
    return json.loads(raw)

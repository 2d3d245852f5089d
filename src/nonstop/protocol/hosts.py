"""What lives in etcd for one job, under ``/nonstop/<job id>/`` (the messages on the channel
between the controller and the hosts' agents are in ``messages``).

etcd holds membership and decisions, never the hot path: a host's record (under its lease), the
job's settings, the elected controller (under its lease; its epoch is the key's create revision),
the controller's journal (written only while it holds that epoch) and the job's end.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from .records import BadRecord, Reader

JOB = "job"  # JobRecord: the settings every host must agree on (created by the first host)
HOSTS = "hosts/"  # hosts/<host id> -> HostRecord, under the host agent's lease
LEADER = "leader"  # the controller in office, under its lease; epoch = this key's create revision
JOURNAL = "journal"  # the controller's state: a standby continues from it
STATUS = "status"  # the controller in office's observe.status record, for nonstop status
DONE = "done"  # the job's end: {"code", "diagnosis"}; a host that joins later leaves at once
GONE = "gone/"  # gone/<host id>/<incarnation>: the job gave that host up (its ranks moved on)
VOTES = "votes/"  # votes/<host id>: the secret check of a host refused by the job's record


def host_key(host_id: str) -> str:
    return HOSTS + host_id


def vote_key(host_id: str) -> str:
    """Before the job has formed, a host whose secret differs from the job record's says which
    one it holds here (under its lease): outnumbered, the record's side gives way."""
    return VOTES + host_id


def gone_key(host_id: str, incarnation: str) -> str:
    """Written by the controller in office, in one transaction with the check that the host's
    record is absent, before it recovers from that host's loss; a host whose lease lapsed
    registers again only while this key is absent. One of the two wins, never both."""
    return f"{GONE}{host_id}/{incarnation}"


class _Record:
    """A record kept in etcd as JSON (never pickled: other hosts read it)."""

    def dumps(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))  # type: ignore[call-overload]

    @classmethod
    def loads(cls, raw: bytes | str) -> Any:
        """The record; one written by another version of nonstop (a field missing or unknown)
        is refused (ValueError)."""
        data = json.loads(raw)
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        if not isinstance(data, dict) or set(data) != set(names):
            raise ValueError(f"not a {cls.__name__} of this version of nonstop")
        return cls(**{n: data[n] for n in names})


_HOST_READER = Reader()


def _json(raw: bytes | str, what: str) -> Any:
    """``raw`` parsed; not JSON: a ValueError that names ``what`` was read."""
    try:
        return json.loads(raw)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{what}: not JSON: {exc}") from None


@dataclasses.dataclass
class HostRecord(_Record):
    """One host's agent, alive while its lease is."""

    host_id: str
    addr: str  # the host's address: every listener of the job on this host binds it
    ctl_port: int  # the agent's channel (the controller connects here)
    rdzv_port: int  # the store the generations whose rank 0 is here form their groups on
    pid: int
    slots: int  # ranks per host (--nproc-per-node)
    incarnation: str  # a new one each time the agent registers (after fencing itself)
    # its failure domain (--failure-domain: a rack, a switch): no two copies of a snapshot in
    # one where the labels allow. "" (a record of an older nonstop): the host itself
    domain: str = ""

    @classmethod
    def loads(cls, raw: bytes | str) -> "HostRecord":
        """The record, every field of its type; a record written before hosts had a failure
        domain is read (its own host is its domain), one with a field unknown, missing or of
        another type is refused (ValueError)."""
        try:
            return _HOST_READER.record(cls, json.loads(raw), "HostRecord", may_lack=("domain",))
        except BadRecord as exc:
            raise ValueError(f"not a HostRecord of this version of nonstop: {exc}") from None

    @property
    def failure_domain(self) -> str:
        return self.domain or self.host_id



@dataclasses.dataclass
class JobRecord(_Record):
    """The settings every host of the job must share: a host started with others is refused."""

    nnodes_min: int
    nnodes_max: int
    nproc_per_node: int
    spare_nodes: int
    script: str  # its file name: two different jobs under one id are told apart
    policy_digest: str
    secret_check: str  # an HMAC of a fixed text: a host with another secret is refused at once
    script_digest: str  # the script's bytes and its arguments: every host trains the same job
    versions: str  # nonstop's and torch's
    env_digest: str  # the variables in NUMERIC_ENV that this host sets, and their values

    #: what each field is called when a host is refused for it
    NAMES = {"nnodes_min": "--nnodes", "nnodes_max": "--nnodes",
             "nproc_per_node": "--nproc-per-node", "spare_nodes": "--spare-nodes",
             "script": "the script's name", "policy_digest": "the policy",
             "secret_check": "the secret", "script_digest": "the script or its arguments",
             "versions": "the nonstop or torch version",
             "env_digest": "the environment variables that change the numbers "
                           "(NUMERIC_ENV: see docs/deploy.md)"}

    def differs(self, other: "JobRecord") -> list[str]:
        return [f.name for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(other, f.name)]

    def describe(self, fields: list[str]) -> str:
        return ", ".join(dict.fromkeys(self.NAMES.get(f, f) for f in fields))


def _int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"journal: {what} is not a whole number: {v!r}")
    return v


def _int_map(d: Any, what: str) -> dict[int, int]:
    if not isinstance(d, dict):
        raise ValueError(f"journal: {what} is not a mapping")
    try:
        return {int(k): _int(v, what) for k, v in d.items()}
    except (TypeError, ValueError) as exc:
        raise ValueError(f"journal: {what}: {exc}") from None


def _ints(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise ValueError(f"journal: {what} is not a list")
    return tuple(_int(x, what) for x in v)


@dataclasses.dataclass(frozen=True)
class NodeHost:
    """A node's host as the journal keeps it: a successor finds it again by (host, incarnation)
    among the hosts registered, and asks it at (addr, port) whether it is only slow to do so."""

    host: str
    incarnation: str
    addr: str
    port: int


@dataclasses.dataclass(frozen=True)
class JournalRecord:
    """What a standby controller continues from (etcd ``journal``), written by the controller in
    office at every generation, incident closed, host joined or lost. Read back, a record with a
    field missing, unknown or of the wrong type is refused (ValueError)."""

    epoch: int = 0
    gen: int = -1
    plan: dict[int, int] = dataclasses.field(default_factory=dict)  # rank -> wid
    nodes: dict[int, NodeHost] = dataclasses.field(default_factory=dict)
    isolated: tuple[int, ...] = ()
    replacements: tuple[int, ...] = ()  # per rank: how many times it was given a new process
    max_step: int = 0
    node_of: dict[int, int] = dataclasses.field(default_factory=dict)  # rank -> node
    claimed: dict[str, int] = dataclasses.field(default_factory=dict)  # injected faults fired
    next_wid: int = 0
    worlds: dict[int, int] = dataclasses.field(default_factory=dict)  # generation -> world size
    trained_world: int = 0
    # a mesh sharded along its first dimension: the ranks per index of it (-1: its size fixed)
    regrid_unit: int = 0
    counters: dict[str, Any] | None = None  # ladder.Counters.record()
    incidents: int = 0  # closed, the predecessors' too
    job: dict[str, Any] | None = None  # the whole job's account so far (JobAccount.so_far)

    def dumps(self) -> str:
        rec = dataclasses.asdict(self)
        for key in ("plan", "nodes", "node_of", "worlds"):
            rec[key] = {str(k): v for k, v in rec[key].items()}
        return json.dumps(rec, separators=(",", ":"), default=str)

    @classmethod
    def loads(cls, raw: bytes | str) -> "JournalRecord":
        data = _json(raw, "journal")
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or set(data) != names:
            raise ValueError("not a JournalRecord of this version of nonstop")
        nodes = data["nodes"]
        if not isinstance(nodes, dict):
            raise ValueError("journal: nodes is not a mapping")
        try:
            hosts = {int(n): NodeHost(**h) for n, h in nodes.items()}
        except (TypeError, ValueError) as exc:
            raise ValueError(f"journal: nodes: {exc}") from None
        claimed = data["claimed"]
        if not isinstance(claimed, dict) or not all(isinstance(k, str) for k in claimed):
            raise ValueError("journal: claimed is not a mapping of fault to times")
        for key in ("counters", "job"):
            if data[key] is not None and not isinstance(data[key], dict):
                raise ValueError(f"journal: {key} is not a mapping")
        job = data["job"]
        if job is not None and not {"t_start", "t", "time_s"} <= set(job):
            raise ValueError("journal: job lacks t_start, t or time_s")
        return cls(epoch=_int(data["epoch"], "epoch"), gen=_int(data["gen"], "gen"),
                   plan=_int_map(data["plan"], "plan"), nodes=hosts,
                   isolated=_ints(data["isolated"], "isolated"),
                   replacements=_ints(data["replacements"], "replacements"),
                   max_step=_int(data["max_step"], "max_step"),
                   node_of=_int_map(data["node_of"], "node_of"),
                   claimed={k: _int(v, "claimed") for k, v in claimed.items()},
                   next_wid=_int(data["next_wid"], "next_wid"),
                   worlds=_int_map(data["worlds"], "worlds"),
                   trained_world=_int(data["trained_world"], "trained_world"),
                   regrid_unit=_int(data["regrid_unit"], "regrid_unit"),
                   counters=data["counters"], incidents=_int(data["incidents"], "incidents"),
                   job=job)


@dataclasses.dataclass(frozen=True)
class JobDone(_Record):
    """The job's end (etcd ``done``), written once by the controller in office: the job's exit
    code, and why it failed (None: it completed). A host that joins later leaves at once."""

    code: int
    diagnosis: str | None = None

    @classmethod
    def loads(cls, raw: bytes | str) -> "JobDone":
        """Refused (ValueError) unless a code and a diagnosis of the right types, and no more."""
        data = _json(raw, "done")
        if not isinstance(data, dict) or set(data) != {"code", "diagnosis"}:
            raise ValueError("done: not a job's end of this version of nonstop")
        code, why = data["code"], data["diagnosis"]
        if isinstance(code, bool) or not isinstance(code, int):
            raise ValueError(f"done: code is not an exit code: {code!r}")
        if why is not None and not isinstance(why, str):
            raise ValueError(f"done: diagnosis is not text: {why!r}")
        return cls(code=code, diagnosis=why)

    @classmethod
    def read(cls, raw: bytes | str) -> "JobDone":
        """The job's end as a reader acts on it: one written by another version of nonstop still
        ends the job, as a failure whose cause is unknown."""
        try:
            return cls.loads(raw)
        except ValueError as exc:
            return cls(code=1, diagnosis=f"unreadable end record ({exc})")


@dataclasses.dataclass(frozen=True)
class LastWord:
    """What a controller taking office reads of its predecessor's last status record (etcd
    ``status``, written twice a second while it was in office; the rest of it is for ``nonstop
    status``): when it was written, on the predecessor's clock, and the newest step any rank had
    completed then - what a takeover's incident counts its lost steps from, the journal being
    written only at generations."""

    t: float
    step: int

    @classmethod
    def loads(cls, raw: bytes | str) -> "LastWord":
        """Refused (ValueError) without a time and a step of the right types."""
        data = _json(raw, "status")
        if not isinstance(data, dict) or "t" not in data or "step" not in data:
            raise ValueError("status: no time or step")
        t, step = data["t"], data["step"]
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            raise ValueError(f"status: t is not a time: {t!r}")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"status: step is not a step: {step!r}")
        return cls(t=float(t), step=step)


#: Environment variables that change a job's numbers (reduction orders, math libraries' choices,
#: hash seeds): every host must set the same ones to the same values, or its ranks compute other
#: numbers than its peers' and a rank it takes over ends elsewhere.
NUMERIC_ENV = ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG", "NVIDIA_TF32_OVERRIDE",
               "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
               "MKL_CBWR", "NCCL_ALGO", "NCCL_PROTO", "CUDA_LAUNCH_BLOCKING",
               "TORCH_CUDNN_V8_API_DISABLED")


TIME_FIELDS = ("t", "hb")


def shift_times(obj: dict[str, Any], offset: float) -> dict[str, Any]:
    """A record from another host, with its times moved onto this host's clock (``offset`` =
    this host's clock minus the sender's, taken when the message arrived). No decision compares
    two hosts' clocks: the sender's times are only ever read relative to its own clock."""
    names = tuple(obj)
    times = _TIME_NAMES.get(names)
    if times is None:  # (records of one kind carry the same names: found once per kind)
        times = tuple(k for k in names if k in TIME_FIELDS or k.startswith("t_"))
        if len(_TIME_NAMES) < TIME_NAMES_KEPT:
            _TIME_NAMES[names] = times
    for key in times:
        value = obj[key]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            obj[key] = value + offset
    return obj


TIME_NAMES_KEPT = 1024  # the kinds of record whose time fields are remembered
_TIME_NAMES: dict[tuple[str, ...], tuple[str, ...]] = {}


PROGRESS_TIMES = ("hb", "t", "t_life")  # the times of a progress record (protocol.progress)


def shift_progress(rec: dict[str, Any], offset: float) -> dict[str, Any]:
    """``shift_times`` for a rank's progress record, whose time fields are known: 16,384 ranks
    report every second. A value that is not a number is left for the record's reader to refuse."""
    if rec.__class__ is not dict:
        return rec
    for key in PROGRESS_TIMES:
        value = rec.get(key)
        if value.__class__ is float or value.__class__ is int:
            rec[key] = value + offset
    return rec


PROGRESS_EVERY_S = 0.1  # a small job's hosts report their ranks' progress this often
PROGRESS_FRAMES_S = 200  # ...and a big job's all together at most this many times a second
PROGRESS_MAX_S = 1.0


def progress_every(hosts: int) -> float:
    """How often a host reports its ranks' progress (steps, heartbeats) to the controller: every
    0.1 s in a job of up to 20 hosts; in a bigger one the controller would receive more than it
    can read (2,048 hosts at 10 Hz are 20,480 frames a second), so the hosts together send about
    200 a second, each at least once a second. A fault or an event is never held back by it."""
    return min(PROGRESS_MAX_S, max(PROGRESS_EVERY_S, hosts / PROGRESS_FRAMES_S))

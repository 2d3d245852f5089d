"""Requests to a running job from outside it (``nonstop drain``): files dropped into the run
directory's ``control/`` folder, taken by the controller between its ticks.

A request is one JSON object, a typed record of ``protocol/requests.py``, written to a temporary
name and renamed into place (so it is read whole); taken, it is renamed to ``*.taken`` and read
strictly: one that is not a request this version of nonstop writes is passed over
(``request_refused``, with why). What came of one is in the event log (``regroup`` with
``drain``, then ``drain_done``; or ``drain_refused``), which the command follows.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from ..protocol import requests as rq

POLL_S = 0.2  # how often the folder is looked at
FOLDER = "control"


@dataclasses.dataclass(frozen=True)
class RefusedRequest:
    """A request that is not one: what it held (None: not JSON) and why it is refused."""

    request: Any
    why: str


class Requests:
    def __init__(self, run_dir: Any):
        self.folder = Path(run_dir) / FOLDER if run_dir is not None else None
        self._next = 0.0

    def poll(self, now: float) -> list[rq.Request | RefusedRequest]:
        """The requests that arrived since the last look, each read strictly (one that is not a
        request is a ``RefusedRequest``)."""
        if self.folder is None or now < self._next:
            return []
        self._next = now + POLL_S
        try:
            names = sorted(n for n in os.listdir(self.folder) if n.endswith(".json"))
        except OSError:
            return []
        out: list[rq.Request | RefusedRequest] = []
        for name in names:
            path = self.folder / name
            try:
                text = path.read_text()
                os.replace(path, path.with_suffix(".taken"))  # (taken once, even if malformed)
            except OSError as exc:
                out.append(RefusedRequest(None, f"{name}: {exc}"))
                continue
            try:
                raw = json.loads(text)
            except ValueError as exc:
                out.append(RefusedRequest(None, f"{name}: not JSON: {exc}"))
                continue
            try:
                out.append(rq.decode(raw))
            except ValueError as exc:  # (BadRecord)
                out.append(RefusedRequest(raw, f"{name}: {exc}"))
        return out


def send(run_dir: Path, req: rq.Request) -> Path:
    """Drop a request into a running job's folder; returns where."""
    folder = run_dir / FOLDER
    folder.mkdir(exist_ok=True)
    name = f"{req.op}-{time.time_ns()}-{os.getpid()}"
    tmp = folder / f".{name}.tmp"
    tmp.write_text(json.dumps(rq.encode(req)))
    final = folder / f"{name}.json"
    os.replace(tmp, final)
    return final


RETRY_S = 0.5  # a preemption the job was too busy to act on is tried again this often


class Preemptions:
    """Hosts a scheduler told to stop (SIGTERM to their ``nonstop run``, reported by their
    agents): each is acted on as soon as the job is not busy, until its grace is spent - its
    ranks drained to a spare node, or the world shrunk without them, at a step boundary. Then
    the host is released. A host with no spare node to go to and no scale-in allowed is left to
    the ladder when it leaves."""

    def __init__(self, log: Any):
        self.log = log
        self.pending: dict[int, float] = {}  # node -> when its grace ends
        self._grace: dict[int, float] = {}
        self._half: dict[int, float] = {}  # node -> half-way through its grace
        self._next: dict[int, float] = {}
        self.told: set[int] = set()  # every node ever told to stop: its leaving is planned

    def add(self, node: int, grace_s: float, now: float) -> None:
        self.told.add(node)
        if node not in self.pending:
            self.pending[node] = now + grace_s
            self._grace[node] = grace_s
            self._half[node] = now + grace_s / 2
            self.log.write("preempted", node=node, grace_s=round(grace_s, 3))

    def late(self, node: int, now: float) -> bool:
        """Half its grace is spent: no more waiting for a spare host to be ready."""
        return now >= self._half.get(node, 0.0)

    def due(self, now: float) -> list[int]:
        """The nodes to act on now (each at most every ``RETRY_S``); expired ones are dropped."""
        out = []
        for node, deadline in list(self.pending.items()):
            if now >= deadline:  # never acted on in its grace: the ladder has it when it leaves
                self.log.deadline("preemption_grace", self._grace.get(node), node=node,
                                  detail="no drain or scale-in was possible in the grace")
                self.done(node)
            elif now >= self._next.get(node, 0.0):
                self._next[node] = now + RETRY_S
                out.append(node)
        return out

    def done(self, node: int) -> None:
        self.pending.pop(node, None)
        self._half.pop(node, None)
        self._grace.pop(node, None)
        self._next.pop(node, None)

"""Fault injection: parse ``--inject`` specs and fire them inside rank processes.

A spec is ``kind:key=value,...``; several are joined by ``;`` or given as repeated flags, e.g.
``crash:rank=2,step=50;hang:rank=1,step=80``. Each fault fires once per job unless ``times`` says more.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from typing import Any, Callable

from .errors import UsageError

#: kind -> (what it does, extra keys it accepts)
KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "crash": ("the rank process is killed with SIGKILL", ()),
    "exit": ("the rank process exits at once with a non-zero code", ("code",)),
    "exception": ("the training function raises an exception (a user-level error)", ()),
    "hang": ("the rank's main thread stops making progress (blocks in Python, forever)", ()),
    "stop": ("the rank process is frozen with SIGSTOP", ()),
}
POINTS = ("start", "optimizer")
COMMON_KEYS = ("rank", "step", "at", "times")


class InjectedError(RuntimeError):
    """Raised in the training function by an ``exception`` fault."""


@dataclasses.dataclass(frozen=True)
class FaultSpec:
    kind: str
    rank: int
    step: int
    at: str = "start"  # "start" of the step, or right after the "optimizer" step
    times: int = 1  # how many times it fires in the whole job
    code: int = 1  # exit code for "exit"

    def describe(self) -> str:
        extra = "" if self.at == "start" else f",at={self.at}"
        return f"{self.kind}:rank={self.rank},step={self.step}{extra}"


def _int(kind: str, key: str, value: str, minimum: int) -> int:
    try:
        out = int(value)
    except ValueError:
        raise UsageError(f"fault '{kind}': {key}={value!r} is not an integer") from None
    if out < minimum:
        raise UsageError(f"fault '{kind}': {key} must be >= {minimum}, got {out}")
    return out


def parse_one(text: str) -> FaultSpec:
    text = text.strip()
    kind, sep, rest = text.partition(":")
    kind = kind.strip()
    if kind not in KINDS:
        known = ", ".join(sorted(KINDS))
        raise UsageError(f"unknown fault {kind!r} in --inject {text!r} (known: {known})")
    if not sep or not rest.strip():
        raise UsageError(f"fault {kind!r} needs rank= and step=, e.g. '{kind}:rank=1,step=50'")
    allowed = COMMON_KEYS + KINDS[kind][1]
    fields: dict[str, Any] = {}
    for part in rest.split(","):
        key, eq, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise UsageError(f"fault '{kind}': expected key=value, got {part.strip()!r}")
        if key not in allowed:
            raise UsageError(f"fault '{kind}': unknown key {key!r} (allowed: {', '.join(allowed)})")
        if key in fields:
            raise UsageError(f"fault '{kind}': {key} given twice")
        if key == "at":
            if value not in POINTS:
                raise UsageError(f"fault '{kind}': at={value!r} (expected one of {', '.join(POINTS)})")
            fields[key] = value
        else:
            fields[key] = _int(kind, key, value, 1 if key == "times" else 0)
    for needed in ("rank", "step"):
        if needed not in fields:
            raise UsageError(f"fault '{kind}': missing {needed}=")
    return FaultSpec(kind=kind, **fields)


def parse(specs: list[str] | str | None) -> list[FaultSpec]:
    """Parse one or more ``--inject`` values (each may hold several specs joined by ';')."""
    if not specs:
        return []
    if isinstance(specs, str):
        specs = [specs]
    out: list[FaultSpec] = []
    for value in specs:
        for piece in value.split(";"):
            if piece.strip():
                out.append(parse_one(piece))
    return out


def check_world(faults: list[FaultSpec], world: int) -> None:
    for f in faults:
        if f.rank >= world:
            raise UsageError(f"fault {f.describe()!r}: rank {f.rank} does not exist (world size {world})")


def to_env(faults: list[FaultSpec]) -> str:
    return json.dumps([dataclasses.asdict(f) for f in faults])


def from_env(raw: str | None) -> list[FaultSpec]:
    if not raw:
        return []
    return [FaultSpec(**d) for d in json.loads(raw)]


class Injector:
    """Fires faults in a rank process. ``claim(i)`` must return True for exactly ``times`` calls per
    fault across the whole job (the store arbitrates), so a replayed step does not fire twice."""

    def __init__(self, faults: list[FaultSpec], claim: Callable[[int, FaultSpec], bool],
                 announce: Callable[[FaultSpec, int], None]):
        self.faults = faults
        self._claim = claim
        self._announce = announce
        self._by_point = {p: [(i, f) for i, f in enumerate(faults) if f.at == p] for p in POINTS}

    def check(self, point: str, rank: int, step: int) -> None:
        for i, f in self._by_point.get(point, ()):
            if f.rank == rank and f.step == step and self._claim(i, f):
                self._announce(f, step)
                fire(f)


def fire(f: FaultSpec) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    if f.kind == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    elif f.kind == "exit":
        os._exit(f.code or 1)
    elif f.kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif f.kind == "exception":
        raise InjectedError(f"injected fault {f.describe()}")
    elif f.kind == "hang":
        while True:  # a real hang: nothing here returns or raises
            time.sleep(3600)

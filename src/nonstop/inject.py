"""Fault injection: parse ``--inject`` specs and fire them inside rank processes.

A spec is ``kind:key=value,...``; several are joined by ``;`` or given as repeated flags, e.g.
``crash:rank=2,step=50;hang:rank=1,step=80``. Each fault fires once per job unless ``times`` says more.
A fault can also fire inside a recovery
(``at=assigned|promoted|rendezvous|restore|restored|first_step|teardown``),
keyed by the generation instead of the step: a second fault while the first is being recovered.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
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
    "nan": ("the rank's forward output turns NaN at that step (its gradients, and so everyone's, "
            "are non-finite)", ()),
    "slow": ("the rank's forward pass takes `ms` longer at every step from `step` on (a straggler),"
             " for `steps` steps if given", ("ms", "steps")),
    "jitter": ("the forward pass takes a random extra time, `ms` on average, at every step from "
               "`step` on (rank=all: every rank), for `steps` steps if given", ("ms", "steps")),
    "corrupt": ("a bit flips in the rank's memory snapshot taken at the end of that step (once its "
                "replica is safe on the buddy node): the checksum must catch it", ()),
    "bitflip": ("a bit flips in one of the rank's parameters at the start of that step (silent "
                "data corruption: its replicas no longer agree)", ()),
    "node_crash": ("the rank's whole node dies: its keeper (the node's memory), then every process "
                   "of the node", ()),
    "keeper_crash": ("the rank's node memory (its keeper) is killed; the rank trains on", ()),
    "cuda_assert": ("a device-side assert fires in a kernel of the rank (an index out of range): "
                    "its CUDA context is unusable from then on", ()),
    "cuda_oom": ("the rank asks its GPU for more memory than it has (CUDA out of memory)", ()),
}
#: snapshot: half-way through writing the step's snapshot; commit: a sharded step's gradients
#: reduced, before its ranks agree to take it (in the optimizer step, before it updates)
STEP_POINTS = ("start", "optimizer", "snapshot", "commit")
#: points inside a recovery, keyed by generation: the new rank process holds its assignment
#: (replace; promoted: only a process that takes a place in a running job, a warm spare or a new
#: process, never a survivor), is forming the group (rendezvous), is receiving state (restore),
#: holds the state it received, before the ranks confirm the restore (restored: a rank whose
#: state moved), runs the first step of the generation (first_step), or is leaving a failed
#: generation (teardown)
PHASE_POINTS = ("assigned", "promoted", "rendezvous", "restore", "restored", "first_step",
                "teardown")
POINTS = STEP_POINTS + PHASE_POINTS
PHASE_KINDS = ("crash", "exit", "exception", "hang", "stop", "node_crash")
FIRST_RECOVERY = -1  # gen not given: the first generation after a failure (any, for teardown)
CLAIMED = ("corrupt", "bitflip")  # fired by the code that can do them, through Injector.claim_kind
COMMON_KEYS = ("rank", "step", "at", "times", "gen")
PERSISTENT = ("slow", "jitter")  # act at every step from `step` on; rank may be `all`
ALL_RANKS = -1


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
    ms: int = 0  # delay for "slow" and "jitter"
    steps: int = 0  # "slow" and "jitter" act at this many steps (0: every step to the end)
    gen: int = FIRST_RECOVERY  # for a recovery point: the generation it fires in

    def describe(self) -> str:
        rank = "all" if self.rank == ALL_RANKS else self.rank
        if self.at in PHASE_POINTS:
            gen = "" if self.gen == FIRST_RECOVERY else f",gen={self.gen}"
            return f"{self.kind}:rank={rank},at={self.at}{gen}"
        extra = "" if self.at == "start" else f",at={self.at}"
        if self.kind in PERSISTENT:
            extra += f",ms={self.ms}" + (f",steps={self.steps}" if self.steps else "")
        return f"{self.kind}:rank={rank},step={self.step}{extra}"

    def applies(self, rank: int) -> bool:
        return self.rank in (rank, ALL_RANKS)

    def fires_in(self, gen: int) -> bool:
        """For a recovery point: whether generation ``gen`` is the one it fires in."""
        if self.gen != FIRST_RECOVERY:
            return gen == self.gen
        return self.at == "teardown" or gen >= 1


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
        if key == "rank" and value == "all":
            if kind not in PERSISTENT:
                raise UsageError(f"fault '{kind}': rank=all is only for {', '.join(PERSISTENT)}")
            fields[key] = ALL_RANKS
        elif key == "at":
            if value not in POINTS:
                raise UsageError(f"fault '{kind}': at={value!r} (expected one of {', '.join(POINTS)})")
            fields[key] = value
        else:
            fields[key] = _int(kind, key, value, 1 if key in ("times", "steps") else 0)
    if kind in PERSISTENT:
        fields.setdefault("step", 0)
        if fields.get("ms", 0) < 1:
            raise UsageError(f"fault '{kind}': needs ms= (milliseconds, at least 1)")
    if fields.get("at") in PHASE_POINTS:
        at = fields["at"]
        if kind not in PHASE_KINDS:
            raise UsageError(f"fault '{kind}': at={at} is for {', '.join(PHASE_KINDS)}")
        if "step" in fields:
            raise UsageError(f"fault '{kind}': at={at} fires in a recovery, keyed by gen=, not step= "
                             f"(e.g. '{kind}:rank=1,at={at},gen=1')")
        fields["step"] = 0
    elif "gen" in fields:
        raise UsageError(f"fault '{kind}': gen= is only for faults inside a recovery "
                         f"(at={'|'.join(PHASE_POINTS)})")
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
        pieces = [piece for piece in value.split(";") if piece.strip()]
        if not pieces:  # a flag given without a fault: a mistake, not "no fault"
            raise UsageError(f"--inject {value!r}: no fault given (e.g. crash:rank=1,step=50)")
        out.extend(parse_one(piece) for piece in pieces)
    return out


def check_world(faults: list[FaultSpec], world: int) -> None:
    for f in faults:
        if f.rank != ALL_RANKS and f.rank >= world:
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
                 announce: Callable[..., None]):
        self.faults = faults
        self._claim = claim
        self._announce = announce
        forward = ("nan",) + PERSISTENT
        self._by_point = {p: [(i, f) for i, f in enumerate(faults)
                              if f.at == p and f.kind not in forward + CLAIMED] for p in STEP_POINTS}
        self._by_phase = {p: [(i, f) for i, f in enumerate(faults) if f.at == p] for p in PHASE_POINTS}
        self._claimed = [(i, f) for i, f in enumerate(faults) if f.kind in CLAIMED]
        self._forward = [(i, f) for i, f in enumerate(faults) if f.kind in forward]
        self._announced: set[int] = set()
        self._spent: set[int] = set()  # faults claimed as often as they fire: not asked again

    def check(self, point: str, rank: int, step: int) -> None:
        for i, f in self._by_point.get(point, ()):
            if f.rank == rank and self._due(i, f, step, point == "snapshot") \
                    and self._claim_once(i, f):
                self._announce(f, step, index=i)
                fire(f)

    def _due(self, i: int, f: FaultSpec, step: int, or_after: bool) -> bool:
        """At its step; for a snapshot's faults, at the first snapshot of that step or later
        (snapshots are spaced: the step named may have none). One spent elsewhere is not asked
        for again."""
        if i in self._spent:
            return False
        return f.step <= step if or_after else f.step == step

    def _claim_once(self, i: int, f: FaultSpec) -> bool:
        if self._claim(i, f):
            return True
        self._spent.add(i)
        return False

    def in_recovery(self, point: str, rank: int, gen: int) -> None:
        """Fire the faults of a recovery point (``PHASE_POINTS``) for this rank and generation."""
        for i, f in self._by_phase.get(point, ()):
            if f.rank == rank and f.fires_in(gen) and self._claim(i, f):
                self._announce(f, -1, index=i)
                fire(f)

    def has_point(self, point: str) -> bool:
        return bool(self._by_point.get(point) or self._by_phase.get(point))

    def need_steps(self, registered: bool) -> list[FaultSpec]:
        """The faults that cannot fire in a training function that does not iterate ctx.steps:
        its step index never leaves the step the generation resumed from (0), and without
        registered state there is no optimizer step or forward pass to act in. Recovery points
        are keyed by generation and fire anyway, except the first step's."""
        out = []
        for f in self.faults:
            if f.at in PHASE_POINTS:
                if f.at == "first_step":
                    out.append(f)
                continue
            in_hooks = f.at in ("optimizer", "commit") or f.kind in ("nan",) + PERSISTENT
            if not registered or f.step > 0 or not in_hooks:
                out.append(f)
        return out

    def unreached(self, rank: int, step: int) -> list[FaultSpec]:
        """This rank's step-keyed faults at or past ``step``, where its training ended: no step
        of the run reached them, so they never fired."""
        return [f for f in self.faults
                if f.at in STEP_POINTS and f.applies(rank) and f.step >= step]

    def claim_kind(self, kind: str, rank: int, step: int) -> bool:
        """Whether a fault of ``kind`` fires here (claimed and announced; the caller carries it
        out): for faults only the caller can do, such as corrupting a snapshot."""
        for i, f in self._claimed:
            if f.kind == kind and f.rank == rank and self._due(i, f, step, kind == "corrupt") \
                    and self._claim_once(i, f):
                self._announce(f, step, index=i)
                return True
        return False

    @property
    def has_forward(self) -> bool:
        return bool(self._forward)

    def forward(self, rank: int, step: int) -> tuple[float, bool]:
        """Faults acting in a forward pass: (seconds to sleep, whether to poison the output)."""
        delay, poison = 0.0, False
        for i, f in self._forward:
            if not f.applies(rank) or step < f.step or (f.steps and step >= f.step + f.steps):
                continue
            if f.kind == "nan":
                if step == f.step and self._claim(i, f):
                    self._announce(f, step, index=i)
                    poison = True
                continue
            if i not in self._announced:  # persistent faults are announced once per process
                self._announced.add(i)
                self._announce(f, step)
            if f.kind == "slow":
                delay += f.ms / 1000
            else:  # jitter: exponential, mean ms, capped: a realistic tail, repeatable per step
                u = random.Random(step * 1_000_003 + rank).random()
                delay += min(10.0, -math.log(1.0 - u)) * f.ms / 1000
        return delay, poison


def _keeper_pid() -> int | None:
    """The pid of this node's keeper, asked of the kernel (the peer of a connection to it). A
    keeper that does not take the connection at once (a loaded machine) is asked again for a few
    seconds; one that cannot be reached is said on stderr: the fault then kills less than the
    node, and the run must not look as if it had killed all of it."""
    from .protocol import ENV_KEEPER

    name = os.environ.get(ENV_KEEPER)
    if not name:
        return None
    from .state import wire

    deadline = time.monotonic() + 5.0
    while True:
        try:
            client = wire.Client(name, timeout_s=max(0.1, deadline - time.monotonic()))
            client.close()
            return client.pid
        except OSError as exc:
            if time.monotonic() > deadline:
                print(f"nonstop: fault injection could not reach the node's memory ({exc!r}): "
                      "it is not killed", file=sys.stderr, flush=True)
                return None
            time.sleep(0.05)


def fire(f: FaultSpec) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    if f.kind == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    elif f.kind == "node_crash":
        keeper = _keeper_pid()
        if keeper:  # the node's memory first: the node is gone, not just this process
            try:
                os.kill(keeper, signal.SIGKILL)
            except OSError:
                pass
        os.kill(os.getpid(), signal.SIGKILL)
    elif f.kind == "keeper_crash":
        keeper = _keeper_pid()
        if keeper:
            try:
                os.kill(keeper, signal.SIGKILL)
            except OSError:
                pass
    elif f.kind == "exit":
        os._exit(f.code or 1)
    elif f.kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif f.kind == "exception":
        raise InjectedError(f"injected fault {f.describe()}")
    elif f.kind == "hang":
        while True:  # a real hang: nothing here returns or raises
            time.sleep(3600)
    elif f.kind in ("cuda_assert", "cuda_oom"):
        _cuda_fault(f)


def _cuda_fault(f: FaultSpec) -> None:
    """The real error on the rank's GPU (an out-of-range index read by a kernel; an allocation
    larger than the device). Where the rank has no GPU (a CPU job, a machine without one), the
    exception PyTorch raises for it on a GPU, with its text: what nonstop reads is the same."""
    import torch

    on_gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    if f.kind == "cuda_oom":
        if on_gpu:
            free, total = torch.cuda.mem_get_info()
            torch.empty(total * 4, dtype=torch.uint8, device="cuda")
        raise torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate a tensor larger than the GPU "
            f"(injected fault {f.describe()})")
    if on_gpu:
        x = torch.zeros(4, device="cuda")
        x[torch.tensor([1 << 20], device="cuda")].sum().item()  # the assert fires here
        torch.cuda.synchronize()
    raise getattr(torch, "AcceleratorError", RuntimeError)(
        "CUDA error: device-side assert triggered\nSearch for `cudaErrorAssert' in "
        "https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more "
        f"information. (injected fault {f.describe()}, without a GPU)")

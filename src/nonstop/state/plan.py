"""Choosing the step every rank resumes from, and where each rank gets its state: pure logic.

Every rank says what it can offer: its live state (a clean step), snapshots in its node's
memory, replicas it holds for other ranks, checkpoints on disk. Replicated state (data parallel)
needs one copy of the newest step for everyone; sharded state needs every rank's own shard at one
common step, so the job rolls back to the newest step every shard has - unless the shard has
twins (HSDP: the rank at the same shard position in another replica group holds the same state),
which can send it live. Sources are preferred cheapest first: live, own memory, a buddy's memory,
a twin's live state, disk.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

SOURCES = ("live", "memory", "kept", "node", "buddy", "disk")  # cheapest first


class NoConsistentState(RuntimeError):
    """No step is held by every shard (or by anyone): the state cannot be brought together."""


@dataclasses.dataclass(frozen=True)
class Offer:
    """What one rank can provide."""

    live: int | None = None  # the clean step of the state it holds in memory
    memory: tuple[int, ...] = ()  # steps of its own snapshots in its node's memory
    replicas: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # for rank r
    disk: tuple[int, ...] = ()  # steps of its checkpoints on disk (any rank's, if replicated)
    # the step of a snapshot whose replicas agreed, kept in its own process while its node's
    # memory could not take it (the memory died, a new one is not up yet): a certified copy
    kept: int | None = None
    # steps of other ranks' own snapshots in its node's memory (ranks of its node; a lost one's
    # replacement may run on another node): rank r -> steps
    neighbours: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    # of the snapshots above, those taken as a rank left a failed generation (departure
    # snapshots: never compared with their replicas), by the rank whose state they hold
    unchecked: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {"live": self.live, "memory": list(self.memory),
                "replicas": {str(k): list(v) for k, v in self.replicas.items()},
                "neighbours": {str(k): list(v) for k, v in self.neighbours.items()},
                "disk": list(self.disk), "kept": self.kept,
                "unchecked": {str(k): list(v) for k, v in self.unchecked.items()}}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "Offer":
        return cls(d.get("live"), tuple(d.get("memory", ())),
                   {int(k): tuple(v) for k, v in d.get("replicas", {}).items()},
                   tuple(d.get("disk", ())), d.get("kept"),
                   {int(k): tuple(v) for k, v in d.get("neighbours", {}).items()},
                   {int(k): tuple(v) for k, v in d.get("unchecked", {}).items()})

    def checked(self, rank: int) -> "Offer":
        """This offer (rank ``rank``'s) without its departure snapshots."""
        if not self.unchecked:
            return self
        out = self.unchecked

        def keep(of: int, steps: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(s for s in steps if s not in out.get(of, ()))

        return dataclasses.replace(
            self, memory=keep(rank, self.memory), unchecked={},
            replicas={r: keep(r, v) for r, v in self.replicas.items()},
            neighbours={r: keep(r, v) for r, v in self.neighbours.items()})


@dataclasses.dataclass(frozen=True)
class Action:
    """How rank ``rank`` gets its state at the target step."""

    rank: int
    source: str  # one of SOURCES
    holder: int | None = None  # the rank that sends it (live: a peer; buddy: the replica holder)


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    step: int
    actions: tuple[Action, ...]  # one per rank
    fresh: bool = False  # nothing anywhere: everyone starts from its initial state at step 0

    def sources(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for a in self.actions:
            out[a.source] = out.get(a.source, 0) + 1
        return out


def _holders(offers: list[Offer], rank: int, step: int, sharded: bool,
             twins: tuple[int, ...] | None = None) -> list[tuple[str, int | None]]:
    """Where rank ``rank`` can get state at ``step``, cheapest first: what its process or its
    node holds, then a peer over the network (any peer for replicated state, a twin for sharded
    state: ``twins[r]`` names the shard rank r holds), then disk."""
    found: list[tuple[str, int | None]] = []
    me = offers[rank]
    if me.live == step:
        found.append(("live", None))
    if step in me.memory:
        found.append(("memory", None))
    if me.kept == step:
        found.append(("kept", None))
    if step in me.replicas.get(rank, ()):  # its replica is on the node it now runs on
        found.append(("buddy", None))
    if not sharded or twins is not None:  # any rank's copy will do, or any twin's: a peer sends it
        for r, o in enumerate(offers):
            if r != rank and (not sharded or twins[r] == twins[rank]) and (  # type: ignore[index]
                    o.live == step or step in o.memory or o.kept == step):
                found.append(("live", r))
                break
    for r, o in enumerate(offers):  # its own snapshot, on the node it ran on before
        if r != rank and step in o.neighbours.get(rank, ()):
            found.append(("node", r))
            break
    for r, o in enumerate(offers):
        if r != rank and step in o.replicas.get(rank, ()):
            found.append(("buddy", r))
            break
    if step in me.disk:
        found.append(("disk", None))
    return found


def plan(offers: list[Offer], sharded: bool, twins: tuple[int, ...] | None = None) -> RestorePlan:
    """The newest step every rank can reach, and how each gets there. ``twins`` (sharded state
    only): for each rank, which shard it holds; ranks that hold the same one are each other's
    copies."""
    world = len(offers)
    if twins is not None and len(twins) != world:
        raise ValueError(f"twins name the shards of {len(twins)} ranks, not of {world}")
    steps: set[int] = set()
    for o in offers:
        steps.update(([o.live] if o.live is not None else []) + list(o.memory) + list(o.disk)
                     + ([o.kept] if o.kept is not None else []))
        for held in o.replicas.values():
            steps.update(held)
    if not steps:
        return RestorePlan(0, tuple(Action(r, "live") for r in range(world)), fresh=True)
    for step in sorted(steps, reverse=True):
        ways = [_holders(offers, r, step, sharded, twins) for r in range(world)]
        if all(ways):
            return RestorePlan(step, tuple(_action(r, ways[r][0]) for r in range(world)))
    raise NoConsistentState(
        "no step is held for every rank "
        + ("(each shard exists only once)" if sharded and twins is None else "")
        + f"; offered: {[o.to_wire() for o in offers]}")


def _action(rank: int, way: tuple[str, int | None]) -> Action:
    source, holder = way
    if source == "live" and holder is None:
        return Action(rank, "live")
    return Action(rank, source, holder)


@dataclasses.dataclass(frozen=True)
class Route:
    """How a rank's state is brought back: from the step every rank agrees on at this world size
    (``plan``), or read from another world size's parts (``old_world``)."""

    old_world: int = 0  # the world size the state is read from; 0: this one
    regrid: bool = False  # a mesh's DTensor shards, cut from every old shard (no twin holds them)

    def resharded(self, world: int) -> bool:
        return bool(self.old_world) and self.old_world != world


def route(*, world: int, sharded: bool, meshed: bool, twins: bool, reshard_from: int,
          initial: bool, disk_world: Callable[[], int]) -> Route:
    """Which way a rank's restore goes. Replicated state, and a mesh whose twins hold each part
    whole (HSDP, a pipeline), restore at this world size (a twin's part where one is missing).
    ZeRO-1 state last trained at another size (``reshard_from``; a new job: its newest sharded
    checkpoint's size, ``disk_world``) is merged from every old shard; a mesh sharded along the
    dimension that changed (plain FSDP, FSDP x TP) is regridded - every rank a new process, its
    shards cut from every old one's."""
    zero = sharded and not meshed
    regridded = meshed and not twins
    old_world = reshard_from if zero or regridded else 0
    if zero and initial and not old_world:
        old_world = disk_world()
    return Route(old_world=old_world, regrid=regridded)

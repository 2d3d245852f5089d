"""Sharded state over another world size: every shard of the old world, merged, on every rank.

A sharded optimizer (ZeRO-1: each rank keeps the optimizer state of the parameters it owns) that
goes from ``old_world`` ranks to another number needs the state of every old shard at one step:
the survivors hold theirs live, a lost rank's comes from its snapshot in its node's memory, the
replica on its buddy node, or its part of a disk checkpoint. ``plan`` picks the newest step at
which every old shard can be had (pure); ``reshard`` then sends each shard from the rank that has
it to every rank, and every rank loads the shards merged: the objects every shard holds alike (the
model) from shard 0, and each optimizer's per-parameter state from whichever shard held it. The
new owners are the script's business: at the first optimizer step after a reshard, the state of
the parameters that get no gradient on this rank (another rank owns them now) is dropped, so each
rank keeps its new shard only. Transiently each rank holds every shard's optimizer state.

A copy that turns out to be of another world size or step, or fails its checksum, is excluded and
the plan made again, as in ``restore``; nothing received is unpickled.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from ..protocol.keeper_messages import HolderEntry
from . import checkpoint
from . import memory as mem
from . import packing, staging
from .plan import NoConsistentState
from ..protocol.events import SkippedCopy
from .restore import RestoreResult, _all_gather_json, _Bad, said, verified, without_departures

MAX_ATTEMPTS = 4
_SOURCES = ("live", "memory", "buddy", "disk")  # cheapest first


@dataclasses.dataclass(frozen=True)
class Source:
    shard: int  # the old rank whose state this is
    kind: str  # one of _SOURCES
    holder: int  # the (new) rank that reads it and sends it to all


def inventory_of(live: tuple[int, int, int] | None, listing: dict[str, HolderEntry] | None,
                 disk: dict[int, dict[int, list[int]]]) -> dict[str, Any]:
    """What one rank can offer: its live shard (old rank, step, world), every snapshot its node's
    memory holds (own snapshots and replicas: step and generation), and the parts of sharded disk
    checkpoints (world -> part -> steps)."""
    held: dict[str, list[list[int]]] = {}
    for name, entry in (listing or {}).items():
        if entry and (name.startswith("r") or name.startswith("rep")):
            held[name] = [[s.step, s.gen] for s in entry.slots if s is not None]
    return {"live": list(live) if live else None, "memory": held,
            "disk": {str(w): {str(k): v for k, v in parts.items()} for w, parts in disk.items()}}


def plan(inventories: list[dict[str, Any]], worlds: dict[int, int],
         excluded: set[tuple[int, str, int]], prefer: int = 0) -> tuple[int, int, list[Source]]:
    """The newest step at which every shard of one world size can be had, that size, and where
    each shard comes from. ``worlds``: generation -> its world size (a snapshot's size is its
    generation's); ``excluded``: (shard, kind, step) that failed; ``prefer``: the size to try
    first at a step. Raises NoConsistentState."""
    candidates: set[tuple[int, int]] = set()
    for inv in inventories:
        if inv["live"]:
            candidates.add((inv["live"][1], inv["live"][2]))
        for held in inv["memory"].values():
            candidates.update((step, worlds[gen]) for step, gen in held if gen in worlds)
        for w, parts in inv["disk"].items():
            candidates.update((step, int(w)) for steps in parts.values() for step in steps)
    for step, world in sorted(candidates, key=lambda c: (-c[0], c[1] != prefer, -c[1])):
        sources = [_source(inventories, worlds, k, step, world, excluded) for k in range(world)]
        if all(sources):
            return step, world, sources  # type: ignore[return-value]
    raise NoConsistentState("no step at which every shard of one world size is held (live, in "
                            "memory, on a buddy or on disk)")


def _source(inventories: list[dict[str, Any]], worlds: dict[int, int], shard: int, step: int,
            world: int, excluded: set[tuple[int, str, int]]) -> Source | None:
    def ok(kind: str) -> bool:
        return (shard, kind, step) not in excluded

    for r, inv in enumerate(inventories):
        if inv["live"] == [shard, step, world] and ok("live"):
            return Source(shard, "live", r)
    for kind, name in (("memory", mem.own(shard)), ("buddy", mem.replica(shard))):
        for r, inv in enumerate(inventories):
            if any(s == step and worlds.get(g) == world for s, g in inv["memory"].get(name, ())) \
                    and ok(kind):
                return Source(shard, kind, r)
    for r, inv in enumerate(inventories):
        if step in inv["disk"].get(str(world), {}).get(str(shard), ()) and ok("disk"):
            return Source(shard, "disk", r)
    return None


def merge(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """One state dict from every shard's: shard 0's objects, with each optimizer's per-parameter
    state taken from every shard (an optimizer's state dict: ``state`` and ``param_groups``)."""
    out = dict(shards[0])
    for name, value in shards[0].items():
        if isinstance(value, dict) and "state" in value and "param_groups" in value:
            state: dict[Any, Any] = {}
            for sd in shards:
                state.update(sd[name]["state"])
            out[name] = {**value, "state": state}
    return out


# == carrying it out over the new group ==========================================================
def reshard(state: Any, rank: int, world: int, worlds: dict[int, int],
            live: tuple[int, int, int] | None, where: Any, schedule: dict[str, Any] | None = None,
            prefer: int = 0, agreed: Any = None,
            load: Callable[[Any, list[dict[str, Any]]], Any] | None = None) -> Any:
    """Collective over the default group: every rank ends holding the merged shards of one step.
    ``live``: (old rank, step, world) of the clean shard this process holds, if any; ``worlds``:
    the world size of each recent generation (its snapshots'). ``load``: how this rank takes
    its state from every old shard's (a mesh's: ``regrid.load_boxes``); by default, ZeRO-1's
    merge, then the state of parameters this rank no longer owns dropped."""
    t0 = time.monotonic()
    listing = None
    if where.memory is not None:
        try:
            listing = where.memory.listing()
        except (OSError, ConnectionError):
            where.memory.reset()
    if listing is not None and where.not_after is not None:  # back from a corruption: only to
        listing = without_departures(listing)  # a snapshot whose replicas were compared
    gathered = _all_gather_json({"inv": inventory_of(live, listing, _disk_parts(where.checkpoint_root)),
                                 "schedule": schedule or {}}, world)
    inventories = [g["inv"] for g in gathered]
    t_gathered = time.monotonic()
    if agreed is not None:  # a fault injection point: the offers are known, nothing moved yet
        agreed()
    excluded: set[tuple[int, str, int]] = set()
    skipped: list[SkippedCopy] = []
    for _ in range(MAX_ATTEMPTS):
        step, old_world, sources = plan(inventories, worlds, excluded, prefer)
        shards, nbytes, failed = _exchange(state, rank, step, old_world, sources, where)
        if not failed:
            break
        for src in failed:
            excluded.add((src.shard, src.kind, step))
            skipped.append(SkippedCopy(cause="bad_copy", source=src.kind, rank=None, step=step,
                                       why="its holder could not read it, or it arrived broken",
                                       shard=src.shard, holder=src.holder))
    else:
        raise NoConsistentState(f"no good copy of every shard after {MAX_ATTEMPTS} attempts; "
                                f"failed: {said(skipped)}")
    t_moved = time.monotonic()
    if load is None:
        state.load_state_dict(staging.to_device(state, merge(shards)))
        state.prune_unowned()
    else:
        load(state, shards)
    state.step, state.dirty = step, False
    kinds = {s.kind for s in sources}
    how = "+".join(k for k in _SOURCES if k in kinds) + ", resharded"  # e.g. "live+memory, ..."
    return RestoreResult(step, how, None, {r: how for r in range(world)},
                         tuple(range(world)), nbytes, time.monotonic() - t0, skipped,
                         agreed={"schedules": [g["schedule"] for g in gathered],
                                 "disk": "disk" in kinds, "old_world": old_world},
                         phases={"agree": round(t_gathered - t0, 6),
                                 "move": round(t_moved - t_gathered, 6),
                                 "merge": round(time.monotonic() - t_moved, 6)})


def disk_world(root: Any, world: int) -> int:
    """The world size of the newest complete sharded checkpoint under ``root`` when it is not
    ``world`` (a job started again at another size), else 0."""
    for _, size, _ in checkpoint.sharded_steps(root):
        return size if size != world else 0
    return 0


def _disk_parts(root: Any) -> dict[int, dict[int, list[int]]]:
    """world -> part -> steps of the complete sharded checkpoints under ``root``."""
    out: dict[int, dict[int, list[int]]] = {}
    for step, size, manifest in checkpoint.sharded_steps(root):
        for part in manifest["parts"]:
            out.setdefault(size, {}).setdefault(int(part), []).append(step)
    return out


def _exchange(state: Any, rank: int, step: int, old_world: int, sources: list[Source],
              where: Any) -> tuple[list[dict[str, Any]], int, list[Source]]:
    """Each shard from its holder to every rank, in shard order. Returns the shards' state dicts
    (here), the bytes received, and the sources that failed (the same list on every rank)."""
    import torch
    import torch.distributed as dist

    shards, failed, nbytes = [], [], 0
    for src in sources:
        header = torch.zeros(3, dtype=torch.int64)
        meta, data = b"", None
        if rank == src.holder:
            try:
                meta, data = _read(state, src, step, old_world, where)
                header = torch.tensor([1, len(meta), data.numel()], dtype=torch.int64)
            except _Bad:
                pass
        dist.broadcast(header, src.holder)
        ok, meta_len, data_len = (int(x) for x in header.tolist())
        if not ok:
            failed.append(src)
            continue
        meta_t = (torch.frombuffer(bytearray(meta), dtype=torch.uint8) if rank == src.holder
                  else torch.empty(meta_len, dtype=torch.uint8))
        dist.broadcast(meta_t, src.holder)
        buf = data if rank == src.holder else torch.empty(data_len, dtype=torch.uint8)
        if data_len:
            dist.broadcast(buf, src.holder)
            nbytes += data_len if rank != src.holder else 0
        try:
            shards.append(packing.unpack(meta_t.numpy().tobytes(), buf))
        except packing.BadMeta:  # the holder checked it: only a broken transfer gets here
            failed.append(src)
    return shards, nbytes, failed


def _read(state: Any, src: Source, step: int, old_world: int, where: Any) -> tuple[bytes, Any]:
    """The packed shard from this rank's source, private to this rank (not a view of a slot)."""
    if src.kind == "live":
        meta, data = packing.pack(state.state_dict(), {"step": step, "rank": src.shard,
                                                       "world": old_world})
        return meta, data.clone()
    if src.kind in ("memory", "buddy"):
        holder = mem.own(src.shard) if src.kind == "memory" else mem.replica(src.shard)
        with verified(where, holder, step, src.kind) as (_, meta, data):
            meta, data = bytes(meta), data.clone()
    else:

        try:
            sd, _ = checkpoint.read_part(where.checkpoint_root, step, src.shard)
        except checkpoint.CorruptCheckpoint as exc:
            raise _Bad(str(exc)) from None
        meta, data = packing.pack(sd, {"step": step, "rank": src.shard, "world": old_world})
        return meta, data.clone()
    try:
        _, info = packing.unpack_with_info(meta, data)
    except packing.BadMeta as exc:
        raise _Bad(str(exc)) from None
    if info.get("world") != old_world or info.get("step") != step or info.get("rank") != src.shard:
        raise _Bad(f"{src.kind} copy of shard {src.shard} is of world {info.get('world')}, step "
                   f"{info.get('step')}, rank {info.get('rank')}")
    return meta, data

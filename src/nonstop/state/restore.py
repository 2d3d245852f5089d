"""Bring every rank of a new generation to one consistent step, each from its cheapest source.

Every rank offers what it can (its live state, its node's snapshots of it, the replicas its node
holds for other ranks, checkpoints on disk); ``plan`` picks the newest step every rank can reach
and a source for each. State then moves over the new group (a peer's live state or snapshot, a
buddy's replica) or is read locally (own node's memory, disk). A source that fails its checksum is
excluded and the plan made again: garbage is never loaded.

Nothing received from another rank is unpickled: offers and outcomes travel as JSON, state as
``packing``'s JSON skeleton and raw bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import struct
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from ..protocol.events import SkippedCopy
from . import memory as mem
from . import packing, staging
from . import plan as planning
from .plan import NoConsistentState, Offer

__all__ = ["NoConsistentState", "RestoreResult", "restore"]

MAX_ATTEMPTS = 4


@dataclasses.dataclass
class RestoreResult:
    step: int
    source: str  # how this rank got its state: live, memory, buddy, disk
    holder: int | None  # the rank it came from (live from a peer, buddy)
    sources: dict[int, str]  # every rank's source
    receivers: tuple[int, ...]  # ranks whose state moved or was read (not live in place)
    nbytes: int = 0
    seconds: float = 0.0
    skipped: list[SkippedCopy] = dataclasses.field(default_factory=list)  # copies not used, and why
    agreed: dict[str, Any] = dataclasses.field(default_factory=dict)  # schedule agreed by all
    phases: dict[str, float] = dataclasses.field(default_factory=dict)  # where the time went


@dataclasses.dataclass
class Where:
    """Where this rank's state can come from besides its own memory."""

    memory: mem.NodeMemory | None = None
    checkpoint_root: Path | None = None
    sharded: bool = False
    twins: tuple[int, ...] | None = None  # sharded: which shard each rank holds (HSDP's twins)
    world: int = 0  # sharded: a copy taken at another world size is no copy of this rank's shard
    # recent generations' world sizes (a snapshot's is its generation's): sharded, the copies
    # of another world are not offered (only a reshard reads them)
    worlds: dict[int, int] = dataclasses.field(default_factory=dict)
    not_after: int | None = None  # no state newer than this step is offered (silent corruption)
    compare: bool = False  # live states of one step are compared (digests) before one is copied
    # when no rank holds any state of this world (a fresh start): another source to try first,
    # collectively (a mesh job's checkpoint of another world size); None from it: start fresh
    on_fresh: Callable[[], "RestoreResult | None"] | None = None


def _offer(state: Any, rank: int, has_state: bool, where: Where) -> tuple[Offer, dict[str, Any]]:
    live = state.step if has_state and not state.dirty else None
    memory: tuple[int, ...] = ()
    replicas: dict[int, tuple[int, ...]] = {}
    neighbours: dict[int, tuple[int, ...]] = {}
    problems: dict[str, Any] = {}
    unchecked: dict[int, tuple[int, ...]] = {}
    if where.memory is not None:
        try:
            listing = where.memory.listing()
            if where.sharded and where.world and where.worlds:  # this world's copies only
                listing = _of_world(listing, where.worlds, where.world)
            if where.not_after is not None:
                # a corruption is rolled back to a snapshot whose replicas agreed: never to one
                # taken as a rank left, which no comparison saw
                listing = without_departures(listing)
            memory = tuple(where.memory.steps(mem.own(rank), listing))
            for name in listing:
                if name.startswith("rep"):
                    replicas[int(name[3:])] = tuple(where.memory.steps(name, listing))
                elif name.startswith("r") and name[1:].isdigit() and name != mem.own(rank):
                    neighbours[int(name[1:])] = tuple(where.memory.steps(name, listing))
            unchecked = _departures(listing)
        except (OSError, ConnectionError) as exc:  # the node's memory is gone: offer none of it
            where.memory.reset()
            problems["memory"] = f"{type(exc).__name__}: {exc}"
    disk: list[int] = []
    if where.checkpoint_root is not None:
        from . import checkpoint

        for step in checkpoint.complete_steps(where.checkpoint_root):
            try:
                manifest = checkpoint.read_manifest(where.checkpoint_root, step)
            except checkpoint.CorruptCheckpoint:
                continue
            if where.sharded and where.world and manifest.get("world") != where.world:
                continue  # another world's shards: only a reshard reads them
            if checkpoint.part_rank_for(manifest, rank) is not None:
                disk.append(step)
    kept = _kept(where, rank)
    kept_step = kept[0] if kept is not None else None
    if where.not_after is not None:  # newer state may hold the corruption: none of it
        cap = where.not_after
        live = live if live is not None and live <= cap else None
        memory = tuple(x for x in memory if x <= cap)
        replicas = {r: tuple(x for x in held if x <= cap) for r, held in replicas.items()}
        neighbours = {r: tuple(x for x in held if x <= cap) for r, held in neighbours.items()}
        disk = [x for x in disk if x <= cap]
        kept_step = kept_step if kept_step is not None and kept_step <= cap else None
    return Offer(live, memory, replicas, tuple(disk), kept_step, neighbours, unchecked), problems


def _holder_rank(name: str) -> int | None:
    """The rank whose state a holder of node memory keeps (``r3``, ``rep3``), if it is one."""
    digits = name[3:] if name.startswith("rep") else name[1:] if name.startswith("r") else ""
    return int(digits) if digits.isdigit() else None


def _departures(listing: dict[str, Any]) -> dict[int, tuple[int, ...]]:
    """The departure snapshots of a listing (``SlotInfo.departure``): rank -> their steps."""
    out: dict[int, set[int]] = {}
    for name, entry in listing.items():
        r = _holder_rank(name)
        for info in (entry.slots if entry else ()):
            if info is not None and info.departure and r is not None:
                out.setdefault(r, set()).add(info.step)
    return {r: tuple(sorted(steps)) for r, steps in out.items()}


def without_departures(listing: dict[str, Any]) -> dict[str, Any]:
    """A node memory's listing without its departure snapshots."""
    return {name: dataclasses.replace(entry, slots=[
        None if s is None or s.departure else s for s in entry.slots]) if entry else entry
        for name, entry in listing.items()}


def checked(offers: list[Offer]) -> list[Offer]:
    """The offers without the departure snapshots: those whose replicas were compared alone."""
    return [o.checked(r) for r, o in enumerate(offers)]


def _of_world(listing: dict[str, Any], worlds: dict[int, int], world: int) -> dict[str, Any]:
    """A node memory's listing without the snapshots taken at another world size (those of a
    generation too old to be known are kept: their check refuses them if they are)."""
    out = {}
    for name, entry in listing.items():
        if entry:
            slots = [s if s is None or worlds.get(s.gen, world) == world else None
                     for s in entry.slots]
            entry = dataclasses.replace(entry, slots=slots)
        out[name] = entry
    return out


def _kept(where: Where, rank: int) -> tuple[int, int, int, bytes, Any] | None:
    """The certified copy this process keeps (``NodeMemory.kept``), if it is one of this rank's
    state: any rank's will do for replicated state, only its own shard (of this world) else."""
    kept = getattr(where.memory, "kept", None) if where.memory is not None else None
    if kept is None:
        return None
    if where.sharded and (kept[1] != rank or (where.world and kept[2] != where.world)):
        return None
    return kept


def _agreeing(offers: list[Offer], digests: list[int | None],
              twins: tuple[int, ...] | None = None) -> tuple[list[Offer], list[dict[str, Any]]]:
    """The offers with no live state of a step at which live states disagree, and what was
    found: for each rank whose state differed, the step and every compared rank's digest (the
    controller tells a corruption from a divergence by them). Not only the odd ones are
    withdrawn: since the last comparison their gradients went into every replica's updates, so
    every live state of that step is off the fault-free run - the majority's too, bit for bit;
    the snapshots (each compared when taken) are not."""
    from .digest import odd_ones

    by_step: dict[tuple[int, int], list[int]] = {}  # (step, shard): twins compare with twins
    for r, (o, d) in enumerate(zip(offers, digests)):
        if o.live is not None and d is not None:
            by_step.setdefault((o.live, twins[r] if twins else 0), []).append(r)
    odd: list[dict[str, Any]] = []
    tainted: set[int] = set()
    for (step, _), ranks in by_step.items():
        found = [ranks[i] for i in odd_ones([digests[r] for r in ranks])] if len(ranks) > 1 else []
        if found:
            compared = {str(r): digests[r] for r in ranks}
            odd += [{"rank": r, "step": step, "digests": compared} for r in found]
            tainted.update(ranks)
    out = [dataclasses.replace(o, live=None) if r in tainted else o for r, o in enumerate(offers)]
    return out, sorted(odd, key=lambda f: f["rank"])


def held(offers: list[Offer], sharded: bool, cap: int,
         twins: tuple[int, ...] | None = None) -> int | None:
    """The newest step (at most ``cap``) every rank can be restored to from snapshots alone -
    its node's memory, a peer's, a buddy's replica - with no live state: what a corruption
    found from here on rolls back to at worst. None: no snapshot reaches every rank."""
    # (kept: certified; a departure snapshot is not, and a corruption never goes back to it)
    copies = [dataclasses.replace(o, live=None, disk=()) for o in checked(offers)]
    try:
        p = planning.plan(copies, sharded, twins)
    except NoConsistentState:
        return None
    return None if p.fresh else min(p.step, cap)


def restore(state: Any, rank: int, world: int, has_state: bool, where: Where,
            schedule: dict[str, Any] | None = None,
            agreed: Callable[[], None] | None = None,
            loaded: Callable[[int], None] | None = None) -> RestoreResult:
    """Collective over the default group: every rank ends holding the state of one step.

    ``schedule`` (this rank's snapshot schedule) is shared with the offers; the result's
    ``agreed`` holds what every rank received, so all can adopt the same. ``agreed`` (a fault
    injection point) is called once the offers are known, before any state moves. ``loaded``
    is called with the step once this rank's state was brought to it from a copy, before the
    ranks confirm: a restore cut short after that (a second fault) leaves the rank holding that
    step, clean, to offer to the next attempt."""
    t0 = time.monotonic()
    offer, problems = _offer(state, rank, has_state, where)
    t_offer = time.monotonic()
    mine_digest = None
    if where.compare and offer.live is not None and hasattr(state, "modules"):
        from .digest import digest, sharded

        # sharded: each rank's own part, compared with its twins' only (none: not compared)
        if where.twins is not None or not sharded(state.modules()):
            mine_digest = digest(state.modules())
    # a state this rank holds but may not offer (newer than the last snapshot that agreed)
    withheld = bool(has_state and where.not_after is not None and offer.live is None
                    and getattr(state, "step", 0) > where.not_after)
    gathered = _all_gather_json({"offer": offer.to_wire(), "schedule": schedule or {},
                                 "digest": mine_digest, "withheld": withheld}, world)
    offers = [Offer.from_wire(g["offer"]) for g in gathered]
    # a live state that differs from its replicas' at the same step (silent corruption since the
    # last check) must not be copied to anyone: it is not offered, and its rank is restored too
    before = offers
    offers, odd = _agreeing(offers, [g.get("digest") for g in gathered],
                            where.twins if where.sharded else None)
    if odd:  # the departure snapshots are copies of the live states found to differ
        offers = checked(offers)
    withheld_any = any(g.get("withheld") for g in gathered) or any(
        a.live is not None and b.live is None for a, b in zip(before, offers))
    if withheld_any and not any(o.live is not None or o.memory or o.disk or o.kept is not None
                                or any(o.replicas.values()) for o in offers):
        # nothing old enough anywhere: starting "fresh" would keep the trained, withheld
        # parameters at step 0 (a silent divergence): new processes must start instead
        raise NoConsistentState("every rank's state is newer than the last snapshot whose "
                                "replicas agreed, and no older one is left")
    t_gathered = time.monotonic()
    if agreed is not None:
        agreed()
    skipped = [SkippedCopy(cause="sdc", source="live", rank=f["rank"], step=f["step"],
                           why="its parameters differ from its replicas'", digests=f["digests"])
               for f in odd]
    if where.on_fresh is not None and not any(_steps_past_start(o) for o in offers):
        other = where.on_fresh()  # (the same offers on every rank: all take this way, or none)
        if other is not None:
            return other
    trained = any(_steps_past_start(o) for o in offers)
    for attempt in range(MAX_ATTEMPTS):
        p = planning.plan(offers, where.sharded, where.twins)
        if p.fresh and trained:
            # every copy of the trained state was refused: starting from step 0 would lose the
            # whole run without a word - new processes (a coarser level) must start instead
            raise NoConsistentState("every copy of the trained state was refused: "
                                    f"{said(skipped)}")
        nbytes, failure = _execute(p, offers, state, rank, where)
        if failure is None and _moved(p.actions[rank]):
            state.step, state.dirty = p.step, False
            if loaded is not None:
                loaded(p.step)
        t_moved = time.monotonic()
        statuses = _all_gather_json(failure, world)
        failed = [f for f in statuses if f is not None]
        if not failed:
            break
        skipped.extend(SkippedCopy(cause="bad_copy", source=f["source"], rank=f["rank"],
                                   step=f["step"], why=f["why"], offered_by=f["offered_by"])
                       for f in failed)
        offers = _holding(_without(offers, failed), p, failed)
    else:
        raise NoConsistentState(f"no good source after {MAX_ATTEMPTS} attempts; failed: "
                                f"{said(skipped)}")
    mine = p.actions[rank]
    state.step = p.step
    state.dirty = False
    receivers = tuple(a.rank for a in p.actions if not (a.source == "live" and a.holder is None))
    if problems:
        skipped.append(SkippedCopy(cause="memory_unreachable", source="memory", rank=rank,
                                   step=None, why=problems["memory"]))
    # (alike on every rank: the same offers, minus the same failed sources)
    newest = held(offers, where.sharded, p.step, where.twins)
    # the step where a mismatch was found (by the comparison before a snapshot: the step after
    # ``not_after``; or here, between live states) is compared again when the job gets back to
    # it: a corruption is gone then, a divergence comes out the same (decide/sdc.py)
    found = [f["step"] for f in odd] + (
        [where.not_after + 1] if where.not_after is not None else [])
    recheck = max(found) if found and max(found) > p.step else None
    t_end = time.monotonic()
    return RestoreResult(p.step, mine.source, mine.holder, {a.rank: a.source for a in p.actions},
                         receivers, nbytes, t_end - t0, skipped,
                         agreed={"schedules": [dict(g["schedule"], held=newest, recheck=recheck)
                                               if g["schedule"] else {} for g in gathered],
                                 "disk": any(a.source == "disk" for a in p.actions),
                                 "held": newest},
                         phases={"offer": round(t_offer - t0, 6),
                                 "agree": round(t_gathered - t_offer, 6),  # waits for the last rank
                                 "move": round(t_moved - t_gathered, 6),  # the final attempt
                                 "confirm": round(t_end - t_moved, 6)})


def _steps_past_start(o: Offer) -> bool:
    """Whether an offer holds any state past step 0 (a job's start holds its built state only)."""
    held = [*o.memory, *o.disk, *(s for steps in o.replicas.values() for s in steps),
            *(s for steps in o.neighbours.values() for s in steps)]
    return any(s > 0 for s in held) or bool(o.live) or bool(o.kept)


def said(skipped: list[SkippedCopy]) -> str:
    """The copies not used, for people: whose, from where, of which step, and why."""
    return "; ".join(f"{'rank ' + str(s.rank) if s.rank is not None else 'shard ' + str(s.shard)}"
                     f" {s.source} copy of step {s.step}: {s.why}" for s in skipped) or "none"


GATHER_BYTES = 4096  # a rank's JSON this long or shorter goes in the one all_gather


def _all_gather_json(obj: Any, world: int) -> list[Any]:
    """Every rank's ``obj`` (plain values), gathered as JSON text: like ``all_gather_object``,
    without its pickle. One collective when every rank's text fits ``GATHER_BYTES`` (each sends
    its length ahead of it), a second one with the longest length only when one does not: at 16
    ranks on few cores each collective is a good part of a restore."""
    import torch
    import torch.distributed as dist

    data = json.dumps(obj, separators=(",", ":")).encode()
    head = 8
    buf = torch.zeros(head + GATHER_BYTES, dtype=torch.uint8)
    buf[:head] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    first = data[:GATHER_BYTES]
    if first:
        buf[head:head + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
    out = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(out, buf)
    lengths = [int(t[:head].view(torch.int64)) for t in out]
    if max(lengths) <= GATHER_BYTES:
        return [json.loads(t[head:head + n].numpy().tobytes()) for t, n in zip(out, lengths)]
    padded = torch.zeros(max(lengths), dtype=torch.uint8)  # a long one: all again, whole
    padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    whole = [torch.empty(max(lengths), dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(whole, padded)
    return [json.loads(t[:n].numpy().tobytes()) for t, n in zip(whole, lengths)]


def _moved(action: planning.Action) -> bool:
    """Whether a plan's action brings a copy into its rank's state (it is not live in place)."""
    return not (action.source == "live" and action.holder is None)


def _holding(offers: list[Offer], p: planning.RestorePlan, failed: list[dict[str, Any]]) -> list[Offer]:
    """The offers for the next attempt at a plan: a rank whose copy arrived holds the plan's
    step live now (it was loaded), whatever it held before - offered as it was, a rank brought
    to a newer step and then given an older plan's "live" would keep the newer one's tensors."""
    bad = {f["rank"] for f in failed}
    return [dataclasses.replace(o, live=p.step) if _moved(a) and a.rank not in bad else o
            for o, a in zip(offers, p.actions)]


def _without(offers: list[Offer], failed: list[dict[str, Any]]) -> list[Offer]:
    """The offers minus the sources that failed (by who offered them, what, and which step)."""
    out = list(offers)
    for f in failed:
        r, step, source = f["offered_by"], f["step"], f["source"]
        o = out[r]
        # "live" that failed was a peer's snapshot sent in its place: live state cannot fail
        if source == "kept" or (source == "live" and o.kept == step and o.live != step):
            out[r] = dataclasses.replace(o, kept=None)
        elif source in ("live", "memory"):
            out[r] = dataclasses.replace(o, memory=tuple(s for s in o.memory if s != step))
        elif source == "buddy":  # the replica, wherever it was read
            reps = dict(o.replicas)
            reps[f["rank"]] = tuple(s for s in reps.get(f["rank"], ()) if s != step)
            out[r] = dataclasses.replace(o, replicas=reps)
        elif source == "node":  # the lost rank's own snapshot, read on its old node
            near = dict(o.neighbours)
            near[f["rank"]] = tuple(s for s in near.get(f["rank"], ()) if s != step)
            out[r] = dataclasses.replace(o, neighbours=near)
        elif source == "disk":
            out = [dataclasses.replace(x, disk=tuple(s for s in x.disk if s != step)) for x in out]
    return out


# == carrying out a plan ==========================================================================
def _execute(p: planning.RestorePlan, offers: list[Offer], state: Any, rank: int, where: Where
             ) -> tuple[int, dict[str, Any] | None]:
    """This rank's part of the plan: every transfer in one global order (so no two ranks wait on
    each other), then its own local read. Returns (bytes received, failure or None)."""
    nbytes, failure = 0, None
    live_packed: Any = None
    for a in p.actions:
        if a.holder is None:
            continue
        if rank == a.holder:
            live_packed = _send(a, p.step, offers[rank], state, rank, where, live_packed)
        elif rank == a.rank:
            try:
                nbytes += _receive(a, state, where)
            except _Bad as exc:
                failure = {"rank": rank, "source": a.source, "offered_by": a.holder,
                           "step": p.step, "why": str(exc)}
    mine = p.actions[rank]
    if failure is None and mine.holder is None and mine.source in ("memory", "kept", "buddy",
                                                                   "disk"):
        try:
            nbytes += _load_local(mine.source, p.step, state, rank, where)
        except _Bad as exc:
            failure = {"rank": rank, "source": mine.source, "offered_by": rank, "step": p.step,
                       "why": str(exc)}
    return nbytes, failure


class _Bad(Exception):
    """A source did not deliver good state (missing, or failed its checksum)."""


_HEADER = 4  # int64s: ok, meta bytes, data bytes, checksum (its 64 bits; 0: not checksummed)


def _header(ok: bool, meta_len: int = 0, data_len: int = 0, checksum: int = 0) -> Any:
    import torch

    signed = struct.unpack("<q", struct.pack("<Q", checksum))[0]
    return torch.tensor([int(ok), meta_len, data_len, signed], dtype=torch.int64)


def _send(a: planning.Action, step: int, me: Offer, state: Any, rank: int, where: Where,
          live_packed: Any) -> Any:
    """Send rank ``a.rank`` its state at ``step``: our live state, our snapshot, or the replica of
    its snapshot our node holds. Returns the packed live state, to reuse for the next receiver."""
    import torch.distributed as dist

    if a.source == "live" and me.live == step:
        if live_packed is None:
            live_packed = packing.pack(state.state_dict())
        meta, buf = live_packed
        _send_parts(a.rank, _header(True, len(meta), buf.numel()), meta, buf)
        return live_packed
    if a.source == "live" and me.kept == step:  # the certified copy this process keeps
        kept = _kept(where, rank)
        if kept is not None and kept[0] == step:
            _send_parts(a.rank, _header(True, len(kept[3]), kept[4].numel()), kept[3], kept[4])
            return live_packed
    holder = (mem.own(rank) if a.source == "live" else mem.own(a.rank) if a.source == "node"
              else mem.replica(a.rank))
    try:
        with where.memory.lease(holder, step) as found:  # type: ignore[union-attr]
            if found is None:
                raise _Bad(f"{holder} has no snapshot of step {step}")
            info, slot = found
            meta, data = slot.read(info)
            _send_parts(a.rank, _header(True, len(meta), info.data_len, info.checksum), meta, data)
    except (_Bad, OSError, ConnectionError, AttributeError):
        dist.send(_header(False), a.rank)
    return live_packed


def _send_parts(dst: int, header: Any, meta: bytes, data: Any) -> None:
    import torch
    import torch.distributed as dist

    dist.send(header, dst)
    dist.send(torch.frombuffer(bytearray(meta), dtype=torch.uint8), dst)
    if data.numel():
        dist.send(data, dst)


def _receive(a: planning.Action, state: Any, where: Where) -> int:
    import torch
    import torch.distributed as dist

    header = torch.zeros(_HEADER, dtype=torch.int64)
    dist.recv(header, a.holder)
    ok, meta_len, data_len, signed = (int(x) for x in header.tolist())
    if not ok:
        raise _Bad(f"rank {a.holder} could not send its {a.source} copy")
    if not (0 <= meta_len <= packing.MAX_META and data_len >= 0):
        raise _Bad(f"rank {a.holder} announced {meta_len} bytes of metadata, {data_len} of data")
    meta_t = torch.empty(meta_len, dtype=torch.uint8)
    dist.recv(meta_t, a.holder)
    data = (where.memory.buffer(data_len) if where.memory is not None
            else torch.empty(data_len, dtype=torch.uint8))
    if data_len:
        dist.recv(data, a.holder)
    meta = meta_t.numpy().tobytes()
    checksum = struct.unpack("<Q", struct.pack("<q", signed))[0]
    if checksum and _checksum(meta, data) != checksum:
        raise _Bad(f"the {a.source} copy from rank {a.holder} fails its checksum")
    _load(state, _unpack(meta, data, f"the {a.source} copy from rank {a.holder}", where))
    return data_len


def _unpack(meta: bytes, data: Any, what: str, where: Where | None = None) -> dict[str, Any]:
    """The state dict of a copy (JSON skeleton + bytes); one that does not parse is a bad source,
    and so is a sharded copy taken at another world size (its shard is another)."""
    try:
        sd, info = packing.unpack_with_info(meta, data)
    except packing.BadMeta as exc:
        raise _Bad(f"{what}: {exc}") from None
    if where is not None and where.sharded and where.world and info.get("world") not in (
            None, where.world):
        raise _Bad(f"{what} is a shard of a {info.get('world')}-rank world, not of {where.world}")
    return sd


def load_into(state: Any, sd: dict[str, Any]) -> None:
    """Load a state dict read from disk into the live state (a GPU's share through bounce
    buffers)."""
    _load(state, sd)


def _load(state: Any, sd: dict[str, Any], where: Where | None = None) -> None:
    """Load ``sd`` into the live state: what goes to a GPU through pinned bounce buffers first
    (``staging.to_device``); given ``where``, ``sd`` views a leased slot (``_private``)."""
    state.dirty = True  # half loaded, it is a copy of nothing until its step is set
    sd = staging.to_device(state, sd)
    if where is not None:
        sd = _private(sd, state, where)
    state.load_state_dict(sd)


def _private(sd: dict[str, Any], state: Any, where: Where) -> dict[str, Any]:
    """``sd`` (viewing a slot, held by a lease) made safe to load: what a module copies into its
    parameters may stay a view; what an optimizer (or a dict, a tensor) would keep is copied into
    memory of this process - prepared ahead by a warm spare - or the next snapshot into that slot
    would write into the live state. (What is already on a GPU is the process's own.)"""
    kept = {name: value for name, value in sd.items() if not state.copies_on_load(name)}
    if not kept:
        return sd
    nbytes = packing.tensor_bytes(kept, aligned=True, select=_on_host)
    buf = where.memory.buffer(nbytes)  # type: ignore[union-attr]
    return {**sd, **packing.copy_into(kept, buf, select=_on_host)}


def _on_host(t: Any) -> bool:
    return t.device.type == "cpu"


def _checksum(meta: bytes, data: Any) -> int:
    from . import shm

    h = shm.hasher()
    h.update(meta)
    h.update(memoryview(data.numpy()))
    return h.intdigest()


@contextlib.contextmanager
def verified(where: Where, holder: str, step: int, what: str) -> Iterator[tuple[Any, bytes, Any]]:
    """``holder``'s snapshot of ``step`` in this node's memory, checked against its checksum:
    (info, meta, data), leased (not overwritten) while the block runs. Raises ``_Bad``."""
    try:
        with where.memory.lease(holder, step) as found:  # type: ignore[union-attr]
            if found is None:
                raise _Bad(f"{holder} has no snapshot of step {step}")
            info, slot = found
            if not slot.verify(info):
                raise _Bad(f"the {what} snapshot of step {step} fails its checksum")
            meta, data = slot.read(info)
            yield info, meta, data
    except (OSError, ConnectionError, AttributeError) as exc:
        raise _Bad(f"node memory: {type(exc).__name__}: {exc}") from None


def _load_local(source: str, step: int, state: Any, rank: int, where: Where) -> int:
    if source == "kept":
        kept = _kept(where, rank)
        if kept is None or kept[0] != step:
            raise _Bad(f"no copy of step {step} kept in this process")
        meta, data = kept[3], kept[4]
        _load(state, _unpack(meta, data, f"the copy of step {step} kept in this process", where),
              where)
        return int(data.numel())
    if source in ("memory", "buddy"):  # own snapshot, or its replica held on this node
        holder = mem.own(rank) if source == "memory" else mem.replica(rank)
        with verified(where, holder, step, source) as (info, meta, data):
            sd = _unpack(meta, data, f"the {source} snapshot of step {step}", where)
            _load(state, sd, where)
            return info.data_len
    from . import checkpoint

    root = where.checkpoint_root
    try:
        manifest = checkpoint.read_manifest(root, step)  # type: ignore[arg-type]
        part = checkpoint.part_rank_for(manifest, rank)
        if part is None:
            raise _Bad(f"the checkpoint of step {step} has no part for rank {rank}")
        sd, _ = checkpoint.read_part(root, step, part)  # type: ignore[arg-type]
    except checkpoint.CorruptCheckpoint as exc:
        raise _Bad(str(exc)) from None
    nbytes = packing.tensor_bytes(sd)
    _load(state, sd)
    return nbytes

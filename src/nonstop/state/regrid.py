"""A mesh job started again at another world size, from its newest checkpoint on disk.

A job declared with ``nonstop.Mesh`` writes, at each checkpoint, one DCP metadata file for the
whole step: every rank's local shards as chunks of their whole tensors. Started again with
another number of ranks (``nonstop run --nproc 2`` on a checkpoint of 4), the mesh's free
dimension takes the new size, ``build`` shards the model over it, and each rank reads what its
new shards cover from the old parts, wherever they lie: DCP's own resharding (its planner over
the global offsets), without a process group (each rank reads alone). What the step holds beside
the shards (the optimizer's step counters and hyperparameters, other registered objects) is read
whole, as written by the first part.

Every part's files are checked against their checksums first, shared out over the ranks; a step
that fails is passed over for the next older one. A pipeline's stages are plain tensors, each
whole in every data-parallel group: a rank reads its stage from the part of an old rank that held
the same stage. What fits neither (a pipeline whose stages are sharded too) stops the job with
one line, rather than let it train from scratch beside its checkpoint.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Iterator

from ..errors import ScriptSetupError
from . import checkpoint, packing, shards
from .restore import RestoreResult, _all_gather_json, load_into


def candidates(root: Path | None, world: int) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """(step, world size, manifest) of the complete sharded checkpoints under ``root`` from the
    newest, as long as they are of another world size than ``world`` (one of this size ends
    them: the ordinary restore reads it)."""
    for step, size, manifest in checkpoint.sharded_steps(root):
        if size == world:
            return
        yield step, size, manifest


def resume(state: Any, rank: int, world: int, root: Path | None,
           schedule: dict[str, Any] | None = None) -> RestoreResult | None:
    """Collective over the default group. When the newest checkpoint under ``root`` is of another
    world size, every rank loads its new shards from it (or an older one of another size, if it
    fails its checks) and the result says so; None when there is none (the ordinary restore
    then runs). Raises ScriptSetupError for a checkpoint no rank of this mesh can read."""
    t0 = time.monotonic()
    manifests = {step: manifest for step, _, manifest in candidates(root, world)}
    found = [[step, manifest["world"]] for step, manifest in manifests.items()]
    gathered = _all_gather_json({"found": found, "schedule": schedule or {}}, world)
    if any(g["found"] != found for g in gathered):  # another disk, or one written meanwhile
        views = sorted({str(g["found"][:1]) for g in gathered})
        raise ScriptSetupError(f"the ranks see different checkpoints under {root}: {views} (a "
                               "checkpoint directory must be the same for every rank)")
    if not found:
        return None
    assert root is not None
    skipped: list[str] = []
    for step, size in found:
        manifest = manifests[step]
        part = _stage_part(state, rank, step, size, world, manifest, root)
        failure = _verify_share(root, step, manifest, rank, world)
        t_checked = time.monotonic()
        nbytes = 0
        # until every rank has its part, what this one holds is no copy of anything: a fault
        # here must not leave it offered as live state of step 0 (it is the checkpoint's, or
        # half of it)
        state.dirty = True
        if failure is None:
            try:
                if part is None:
                    nbytes = _load(state, root, step)
                else:  # this rank's stage, as a rank that held it wrote it
                    sd, _ = checkpoint.read_part(root, step, part, verify=False)
                    nbytes = packing.tensor_bytes(sd)
                    load_into(state, sd)
            except (checkpoint.CorruptCheckpoint, shards.ShardMismatch) as exc:
                failure = str(exc)
        failures = [f for f in _all_gather_json(failure, world) if f is not None]
        if not failures:
            state.step, state.dirty = step, False
            return RestoreResult(
                step, "disk, resharded", None, {r: "disk, resharded" for r in range(world)},
                tuple(range(world)), nbytes, time.monotonic() - t0, [],
                agreed={"schedules": [g["schedule"] for g in gathered], "disk": True,
                        "old_world": size},
                phases={"check": round(t_checked - t0, 6),
                        "read": round(time.monotonic() - t_checked, 6)})
        skipped.append(f"step {step}: {failures[0]}")
    if _has_own_size(root, world):  # an older one of this size: the ordinary restore reads it
        print(f"nonstop: rank {rank}: passed over the checkpoints of another world size: "
              + "; ".join(skipped), file=sys.stderr, flush=True)
        return None
    raise ScriptSetupError(f"no checkpoint under {root} could be read at {world} ranks: "
                           + "; ".join(skipped))


def _has_own_size(root: Path, world: int) -> bool:
    return any(size == world for _, size, _ in checkpoint.sharded_steps(root))


def _stage_part(state: Any, rank: int, step: int, size: int, world: int,
                manifest: dict[str, Any], root: Path) -> int | None:
    """For a pipeline's mesh, the part of a rank of the old job that held this rank's stage
    (the stages are plain tensors: a data-parallel size that changed leaves each stage whole);
    None for a mesh of DTensor shards (DCP reads them). Raises ScriptSetupError for a state of
    neither kind."""
    stage_twins = state.stage_twins
    if stage_twins is None:
        if manifest.get("dcp"):
            return None
        why = "its parts are neither DTensor shards nor a pipeline's stages"
    elif manifest.get("dcp"):
        why = "a pipeline whose stages are sharded too cannot be read at another size yet"
    else:
        old, new = stage_twins(size), state.twins
        if old is not None and new is not None and new[rank] in old:
            return old.index(new[rank])
        why = "no rank of its mesh held this rank's stage"
    raise ScriptSetupError(
        f"the newest checkpoint under {root} (step {step}) was written by a job of {size} ranks "
        f"and this one has {world}: {why}; start the job with {size} ranks")


def _verify_share(root: Path, step: int, manifest: dict[str, Any], rank: int,
                  world: int) -> str | None:
    """This rank's share of the checksums: parts ``rank``, ``rank + world``, ..."""
    parts = sorted(int(p) for p in manifest["parts"])
    for part in parts[rank::world]:
        try:
            checkpoint.verify_part(root, step, part)
        except checkpoint.CorruptCheckpoint as exc:
            return str(exc)
    return None


def _load(state: Any, root: Path, step: int) -> int:
    """Read this rank's new shards of step ``step`` (and the rest whole) into ``state``.
    Returns the bytes read into tensors."""
    skeleton, recorded = checkpoint.shard_layout(root, step)
    old_paths = shards.check_paths(recorded)
    templates = _templates(state, old_paths)
    try:
        flat = checkpoint.read_entries(
            root / checkpoint.step_dir_name(step),
            like=lambda fqn, md: _empty_like(templates[fqn], fqn, md) if fqn in templates else None)
    except shards.ShardMismatch:
        raise
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise checkpoint.unreadable(f"step {step} at this world size", exc) from exc
    missing = sorted(set(templates) - set(flat))
    if missing:
        raise shards.ShardMismatch(f"the checkpoint of step {step} holds no {missing[0]!r}")
    new_paths = {name: [[path, list(templates[_fqn(name, path)].shape),
                         list(shards._offset(flat[_fqn(name, path)]))] for path in paths]
                 for name, paths in old_paths.items()}
    local = {fqn: shards.local(v) for fqn, v in flat.items()}
    sd = checkpoint.rebuild(skeleton, local)
    sd[shards.KEY] = new_paths
    load_into(state, sd)
    return packing.tensor_bytes(local)


def load_boxes(state: Any, parts: list[dict[str, Any]]) -> None:
    """Load into ``state`` this rank's new shards, cut from ``parts``: the state dicts of every
    rank of the old world at one step (from node memory, a buddy, a disk part). Each new local
    shard is the box of the whole tensor its DTensor covers, filled from the old shards' boxes
    that overlap it; what is not sharded (step counters, hyperparameters) is the first part's.
    Raises ShardMismatch when the old shards do not cover a new one exactly."""
    first = parts[0]
    if shards.KEY not in first:
        raise shards.ShardMismatch(f"the old shards hold no {shards.KEY!r}: not a mesh's state")
    old_paths = shards.check_paths(first[shards.KEY])
    templates = _templates(state, old_paths)
    pieces: dict[str, list[tuple[list[int], Any]]] = {}
    for part in parts:
        lay = shards.layout(part)
        for name, paths in shards.check_paths(part[shards.KEY]).items():
            for path in paths:
                fqn = _fqn(name, path)
                shape, offset = lay[fqn]
                template = templates.get(fqn)
                if template is not None and list(template.shape) != list(shape):
                    raise shards.ShardMismatch(f"{fqn}: {tuple(shape)} in the old shards, "
                                               f"{tuple(template.shape)} in this model")
                pieces.setdefault(fqn, []).append((offset,
                                                   shards.value_at(part[name], path, fqn)))
    state.dirty = True  # half loaded, it is a copy of nothing
    new_paths: dict[str, list[list[Any]]] = {}
    for name, paths in old_paths.items():
        for path in paths:
            fqn = _fqn(name, path)
            template = templates[fqn]
            at = shards._offset(template)
            new = cut(fqn, tuple(template._local_tensor.shape), at, pieces.get(fqn, []))
            shards.replace_at(first[name], path, lambda _, v=new: v, fqn)
            new_paths.setdefault(name, []).append([path, list(template.shape), list(at)])
    first[shards.KEY] = new_paths
    load_into(state, first)


def twin_loader(rank: int) -> Any:
    """How rank ``rank`` of a mesh with twins (HSDP's replicas, a pipeline's data-parallel
    groups) takes its state from every old rank's, of another world size: whole, from an old
    rank that held the same part (the same coordinates along the dimensions that split it)."""
    def load(state: Any, parts: list[dict[str, Any]]) -> None:
        old, new = state.twins_at(len(parts)), state.twins
        if old is None or new is None or new[rank] not in old:
            raise shards.ShardMismatch(f"no rank of the old world of {len(parts)} held rank "
                                       f"{rank}'s part")
        state.dirty = True  # half loaded, it is a copy of nothing
        load_into(state, parts[old.index(new[rank])])

    return load


def cut(fqn: str, shape: tuple[int, ...], at: tuple[int, ...] | list[int],
        pieces: list[tuple[list[int], Any]]) -> Any:
    """The box of a whole tensor at offset ``at`` of ``shape`` (this rank's new local shard),
    copied from the old shards (``pieces``: each one's offset in the whole tensor and its local
    tensor) that overlap it. Copies of one shard (a dimension that replicates it) count once;
    raises ShardMismatch unless the old shards cover the box exactly."""
    import math

    import torch

    if not pieces:
        raise shards.ShardMismatch(f"{fqn}: in no old shard")
    out = torch.empty(shape, dtype=pieces[0][1].dtype)
    covered, seen = 0, set()
    for offset, piece in pieces:
        box = (tuple(offset), tuple(piece.shape))
        if box in seen:  # a copy of the same shard (a dimension that replicates it)
            continue
        seen.add(box)
        lo = [max(a, o) for a, o in zip(at, offset)]
        hi = [min(a + n, o + m) for a, n, o, m in zip(at, shape, offset, piece.shape)]
        if any(low >= high for low, high in zip(lo, hi)):
            continue
        out[tuple(slice(low - a, high - a) for low, high, a in zip(lo, hi, at))] = \
            piece[tuple(slice(low - o, high - o) for low, high, o in zip(lo, hi, offset))]
        covered += math.prod(high - low for low, high in zip(lo, hi))
    if covered != out.numel():
        raise shards.ShardMismatch(f"{fqn}: the old shards cover {covered} of the {out.numel()} "
                                   "elements of this rank's new shard")
    return out


def _fqn(name: str, path: list[Any]) -> str:
    return ".".join(str(k) for k in [name, *path])


def _templates(state: Any, paths: dict[str, list[list[Any]]]) -> dict[str, Any]:
    """DCP name -> the live DTensor each old shard's new one is shaped like: a module's own
    entry, or the parameter an optimizer's state belongs to."""
    import torch

    objects = state.objects()
    out: dict[str, Any] = {}
    for name, entries in paths.items():
        obj = objects.get(name)
        if obj is None:
            raise shards.ShardMismatch(f"{shards.KEY}: {name!r} is not a registered object")
        live = obj.state_dict() if isinstance(obj, torch.nn.Module) else None
        for path in entries:
            what = _fqn(name, path)
            if isinstance(obj, torch.optim.Optimizer):
                out[what] = shards.state_param(obj, path, what)
            elif live is not None and len(path) == 1 and shards.is_dtensor(live.get(path[0])):
                out[what] = live[path[0]]
            else:
                raise shards.ShardMismatch(f"{what}: a shard in the checkpoint, no sharded entry "
                                           f"of this {type(obj).__name__}")
    return out


def _empty_like(template: Any, fqn: str, md: Any) -> Any:
    """A DTensor with ``template``'s mesh, placements and global shape, its local tensor empty
    (nothing live is written before the whole step is read)."""
    import torch
    from torch.distributed.tensor import DTensor

    if tuple(getattr(md, "size", ())) != tuple(template.shape):
        raise shards.ShardMismatch(f"{fqn}: {tuple(getattr(md, 'size', ()))} in the checkpoint, "
                                   f"{tuple(template.shape)} in this model")
    dtype = md.properties.dtype
    local = torch.empty(template._local_tensor.shape, dtype=dtype,
                        device=template._local_tensor.device)
    return DTensor.from_local(local, template.device_mesh, template.placements, run_check=False,
                              shape=template.shape, stride=template.stride())


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
import warnings
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
    found = [[step, size] for step, size, _ in candidates(root, world)]
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
        manifest = checkpoint.read_manifest(root, step)
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
                    nbytes = _load(state, root, step, manifest)
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
    stage_twins = getattr(state, "stage_twins", None)
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


def _load(state: Any, root: Path, step: int, manifest: dict[str, Any]) -> int:
    """Read this rank's new shards of step ``step`` (and the rest whole) into ``state``.
    Returns the bytes read into tensors."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    step_dir = root / checkpoint.step_dir_name(step)
    skeleton, old_paths = _first_part_layout(step_dir, manifest)
    templates = _templates(state, old_paths)
    reader = FileSystemReader(step_dir)
    metadata = reader.read_metadata()
    flat: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if fqn == checkpoint._ENTRY:
            continue
        if fqn in templates:
            flat[fqn] = _empty_like(templates[fqn], fqn, md)
        elif isinstance(md, TensorStorageMetadata):
            flat[fqn] = _empty(md)
        else:  # bytes: DCP puts the unpickled value in place of this
            flat[fqn] = None
    missing = sorted(set(templates) - set(flat))
    if missing:
        raise shards.ShardMismatch(f"the checkpoint of step {step} holds no {missing[0]!r}")
    try:
        with warnings.catch_warnings():
            checkpoint._quiet()
            load(flat, storage_reader=reader, no_dist=True)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise checkpoint.CorruptCheckpoint(
            f"step {step}: unreadable at this world size ({checkpoint._line(exc)})") from exc
    new_paths = {name: [[path, list(templates[_fqn(name, path)].shape),
                         list(shards._offset(flat[_fqn(name, path)]))] for path in paths]
                 for name, paths in old_paths.items()}
    local = {fqn: shards.local(v) for fqn, v in flat.items()}
    sd = checkpoint._rebuild(skeleton, local)
    sd[shards.KEY] = new_paths
    nbytes = sum(int(t.numel() * t.element_size()) for t in local.values()
                 if hasattr(t, "element_size"))
    load_into(state, sd)
    return nbytes


def _fqn(name: str, path: list[Any]) -> str:
    return ".".join(str(k) for k in [name, *path])


def _first_part_layout(step_dir: Path, manifest: dict[str, Any]) -> tuple[Any, dict[str, list]]:
    """The first part's skeleton (the state dict's nesting, each leaf its DCP name), and where
    its shards were: {object name: [path, ...]} (every part has the same ones)."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader, load

    first = manifest["parts"][str(min(int(p) for p in manifest["parts"]))]
    part_dir = step_dir / first["dir"]
    entry: dict[str, Any] = {checkpoint._ENTRY: None}
    with warnings.catch_warnings():
        checkpoint._quiet()
        load(entry, storage_reader=FileSystemReader(part_dir), no_dist=True)
    ours = pickle.loads(entry[checkpoint._ENTRY])
    skeleton = ours["skeleton"]
    names = skeleton.pop(shards.KEY, None)
    if not isinstance(names, dict):
        raise shards.ShardMismatch(f"{part_dir}: no record of its shards")
    raw: dict[str, Any] = {str(v): None for v in names.values()}
    with warnings.catch_warnings():
        checkpoint._quiet()
        load(raw, storage_reader=FileSystemReader(part_dir), no_dist=True)
    recorded = {name: raw[str(leaf)] for name, leaf in names.items()}
    return skeleton, shards.check_paths(recorded)


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
        if isinstance(obj, torch.nn.Module):
            live = obj.state_dict()
            for path in entries:
                key = path[0] if len(path) == 1 else None
                if key not in live or not shards.is_dtensor(live[key]):
                    raise shards.ShardMismatch(f"{_fqn(name, path)}: a shard in the checkpoint, "
                                               "no sharded entry of the model")
                out[_fqn(name, path)] = live[key]
        elif isinstance(obj, torch.optim.Optimizer):
            params = [p for group in obj.param_groups for p in group["params"]]
            for path in entries:
                if len(path) != 3 or path[0] != "state" or not isinstance(path[1], int) \
                        or not 0 <= path[1] < len(params) or not shards.is_dtensor(params[path[1]]):
                    raise shards.ShardMismatch(f"{_fqn(name, path)}: a shard in the checkpoint, "
                                               "not the state of a sharded parameter")
                out[_fqn(name, path)] = params[path[1]]
        else:
            raise shards.ShardMismatch(f"{name}: a {type(obj).__name__} holding shards")
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


def _empty(md: Any) -> Any:
    import torch

    return torch.empty(md.size, dtype=md.properties.dtype)

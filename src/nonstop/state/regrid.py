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
           schedule: dict[str, Any] | None = None, agreed: Any = None) -> RestoreResult | None:
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
    if agreed is not None:  # a fault injection point: the checkpoint is known, nothing read yet
        agreed()
    assert root is not None
    skipped: list[str] = []
    for step, size in found:
        manifest = checkpoint.read_manifest(root, step)
        part = _stage_part(state, rank, step, size, world, manifest, root)
        failure = _verify_share(root, step, manifest, rank, world)
        t_checked = time.monotonic()
        nbytes = 0
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

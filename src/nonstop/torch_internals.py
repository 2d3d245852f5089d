"""The private names of torch that nonstop uses, behind one door.

torch promises nothing about a name that starts with an underscore: a release may move or drop
it. Each one nonstop uses is declared here once - where it lives, what nonstop reads or writes
on it, and what for - and reached only through ``get``, which resolves it on first use (torch is
never imported with nonstop) and, where the installed torch has no such name or attribute,
raises ``TorchInternalsChanged`` naming it, the torch version and what needed it: a feature is
never switched off without a word. ``tests/test_torch_internals.py`` resolves every name in
every suite (a canary each), so a torch release that changes one fails the suite, not a job.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

#: the torch releases nonstop is tested on (pyproject.toml declares the same range): the whole
#: suite runs on 2.13 (the only release with a CPU build this project's CI can install; any
#: other is a CUDA build of several GB)
TESTED = ("2.13",)


class TorchInternalsChanged(RuntimeError):
    """The installed torch lacks a private name nonstop needs."""


@dataclasses.dataclass(frozen=True)
class Internal:
    module: str
    path: str  # inside the module: an attribute, or a dotted path of them
    why: str  # what nonstop needs it for
    attributes: tuple[str, ...] = ()  # what nonstop reads or writes on it
    # ...on its instances (a class's), and the keywords it makes them with: the canary test
    # makes one and looks
    on_instances: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()


_C10D = "torch.distributed.distributed_c10d"
_FSDP = "torch.distributed.fsdp._fully_shard"

NAMES: dict[str, Internal] = {
    "c10d.world": Internal(
        _C10D, "_world", "the process-group registry: a generation's groups are forgotten when "
        "it ends (never shut down on the recovery path), a mesh's are registered as new_group "
        "registers them, the NCCL groups are found to abort",
        ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag", "tags_to_pg",
         "pg_coalesce_state", "group_count")),
    "c10d.get_default_group": Internal(
        _C10D, "_get_default_group", "the generation's default group, kept until released"),
    "c10d.update_default_pg": Internal(
        _C10D, "_update_default_pg", "a generation's default group forgotten as it ends"),
    "c10d.register_process_group": Internal(
        _C10D, "_register_process_group", "a mesh's groups found by name (DTensor's functional "
        "collectives)"),
    "c10d.unregister_all_process_groups": Internal(
        _C10D, "_unregister_all_process_groups", "every group of a generation forgotten by name"),
    "foreach_norm": Internal(
        "torch", "_foreach_norm", "the gradients checked for a non-finite value in one pass"),
    "fsdp.ReduceScatter": Internal(
        f"{_FSDP}._fsdp_api", "ReduceScatter", "FSDP2's reduce-scatter, wrapped to carry the "
        "ranks' non-finite verdict (no extra collective)"),
    "fsdp.FSDPMeshInfo": Internal(
        f"{_FSDP}._fsdp_common", "FSDPMeshInfo", "which FSDP2 units can carry the verdict"),
    "fsdp.HSDPMeshInfo": Internal(
        f"{_FSDP}._fsdp_common", "HSDPMeshInfo", "which FSDP2 units can carry the verdict"),
    "fsdp.TrainingState": Internal(
        f"{_FSDP}._fsdp_common", "TrainingState", "an FSDP2 module set back to rest after an "
        "aborted step", ("IDLE",)),
    "dcp.traverse_state_dict": Internal(
        "torch.distributed.checkpoint._traverse", "traverse_state_dict",
        "a checkpoint's structure named as DCP names its leaves"),
    # a warm spare's sharding decisions made ahead (runtime/propagation.py)
    "dtensor.op_dispatcher": Internal(
        "torch.distributed.tensor", "DTensor._op_dispatcher", "a warm spare's sharding decisions "
        "made ahead: the path a native-cache miss takes is recorded by a first generation's "
        "rank, and in a spare that warmed up, asks the Python cache first",
        ("_propagate_op_sharding_dispatch_slow_path", "sharding_propagator")),
    "dtensor.propagate_op_sharding": Internal(
        "torch.distributed.tensor", "DTensor._op_dispatcher.sharding_propagator."
        "propagate_op_sharding", "a warm spare's sharding decisions made into DTensor's Python "
        "cache", ("cache_info",)),
    "dtensor.OpSchema": Internal(
        "torch.distributed.tensor._op_schema", "OpSchema", "a recorded operation read back (a "
        "pickle of DTensor's own spec types) and keyed anew in the spare",
        ("_recompute_comparison_key",)),
    "dtensor.DTensorSpec": Internal(
        "torch.distributed.tensor._dtensor_spec", "DTensorSpec", "a recorded spec's cached hash "
        "(the recording process's) dropped in the spare", on_instances=("_hash",)),
    "dtensor.pointwise_ops": Internal(
        "torch.distributed.tensor._ops", "_pointwise_ops", "which operations are pointwise: their "
        "decision for one float operand holds for every other (an optimizer's step-dependent "
        "scalars)"),
    "ops.OpOverload": Internal(
        "torch._ops", "OpOverload", "an operation recorded by its name and overload, and known "
        "as one in a recorded schema", on_instances=("_schema", "_overloadname")),
    "mesh.DeviceMesh": Internal(
        "torch.distributed.device_mesh", "DeviceMesh", "a spare's mesh equal to the job's, made "
        "from a recorded layout without a process group, then seen from the rank it takes",
        ("_compute_coordinate_on_dim", "_get_mesh_tensor_from_full_mesh"),
        on_instances=("_layout", "_rank_map", "_flatten_rank_map", "_dim_group_names", "_rank",
                      "_coordinate_on_dim"),
        keywords=("_layout", "_rank_map", "_init_backend", "_rank")),
    "mesh.MeshLayout": Internal(
        "torch.distributed._mesh_layout", "_MeshLayout", "a recorded mesh's layout made again"),
    "mesh.FlatLayout": Internal(
        "torch.distributed._mesh_layout", "_FlatLayout", "a recorded mesh's layout made again"),
    "dtensor.compute_local_shape_and_global_offset": Internal(
        "torch.distributed.tensor._utils", "compute_local_shape_and_global_offset",
        "where a rank's shard of a DTensor starts (snapshots and their restore)"),
}

_resolved: dict[str, Any] = {}


def get(name: str) -> Any:
    """The torch object declared as ``name`` (resolved once per process)."""
    found = _resolved.get(name)
    if found is None:
        found = _resolved[name] = resolve(NAMES[name])
    return found


def resolve(spec: Internal) -> Any:
    """``spec``'s object in the installed torch; ``TorchInternalsChanged`` where there is none."""
    where = f"{spec.module}.{spec.path}"
    try:
        obj: Any = importlib.import_module(spec.module)
        for part in spec.path.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise TorchInternalsChanged(_changed(where, spec, f"{type(exc).__name__}: {exc}")) from None
    missing = [a for a in spec.attributes if not hasattr(obj, a)]
    if spec.keywords:
        import inspect

        takes = inspect.signature(obj).parameters
        missing += [f"keyword {k}" for k in spec.keywords if k not in takes]
    if missing:
        raise TorchInternalsChanged(_changed(where, spec, f"it has no {', '.join(missing)}"))
    return obj


def _changed(where: str, spec: Internal, detail: str) -> str:
    try:
        import torch

        version = torch.__version__
    except ImportError:  # (the caller's import would have failed first)
        version = "not installed"
    return (f"torch {version} has no {where} as nonstop knows it ({detail}): nonstop needs it "
            f"for {spec.why}; it is tested on torch {', '.join(TESTED)}")


def untested(version: str | None = None) -> str | None:
    """A warning when the installed torch (``version``: as pip has it) is not a release nonstop
    is tested on - torch is not imported to find out - else None. Its private names are still
    checked as they are used: what changed fails loudly there, never silently."""
    if version is None:
        from importlib import metadata

        try:
            version = metadata.version("torch")
        except metadata.PackageNotFoundError:
            return None  # (the script's own import says so)
    release = ".".join(version.split("+")[0].split(".")[:2])
    if release in TESTED:
        return None
    return (f"torch {version} is not a release nonstop is tested on ({', '.join(TESTED)}): the "
            "internals it reaches into are checked as they are used, and one that changed stops "
            "the job with its name")

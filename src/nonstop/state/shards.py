"""DTensors in a state dict: kept, moved and stored as this rank's local shards.

A sharded model's (FSDP2, tensor parallel) parameters and its optimizer's state are DTensors: a
global shape, a mesh, placements, and this rank's local tensor. What nonstop keeps of them is the
local tensor only (a snapshot, a replica, a checkpoint part, a copy sent to a replacement), beside
the path of each one in the state dict. Loading puts each back as a DTensor with the spec of the
live tensor it goes into (a module's parameter, or the parameter an optimizer's state belongs to),
so the copy is only ever loaded at the same mesh coordinates and with the same shapes, and a
mismatch is refused naming the tensor.
"""

from __future__ import annotations

from collections import OrderedDict
import weakref
from typing import Any

from ..errors import ScriptSetupError
from ..torch_internals import get as torch_private

# in State.state_dict(): {object name: [[path, global shape, global offset], ...]}: where each
# local shard is, and what of the whole tensor it is (a disk checkpoint's DCP metadata says so)
KEY = "nonstop.shards"


class ShardMismatch(ValueError):
    """A kept shard does not fit the live tensor it should be loaded into."""


MESH_ADVICE = ("declare the mesh with nonstop.Mesh(dims, shape, build) and shard the model in its "
               "build function, so that nonstop keeps the mesh's groups across restarts (docs/"
               "usage.md, Sharded training)")


def unmanaged_mesh(state: Any) -> ScriptSetupError | None:
    """The error to raise when a registered module or optimizer holds DTensors of a mesh the
    script built itself: that mesh's groups were those of the generation that built it, and are
    gone in any later one."""
    for name, obj in state.objects().items():
        if sharded_object(obj):
            return ScriptSetupError(f"{name!r} is sharded over a DeviceMesh built by the script, "
                                    f"whose groups ended with their generation: {MESH_ADVICE}")
    return None


def applied_twice(exc: BaseException) -> bool:
    """Whether ``exc`` is PyTorch refusing a composable API (``fully_shard``, ``replicate``) on a
    module that already has it: FSDP2 shards a module once per process."""
    return isinstance(exc, AssertionError) and "can only be applied to a module once" in str(exc)


def is_dtensor(value: Any) -> bool:
    cls = type(value)
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed.tensor")


def local(value: Any) -> Any:
    """The local tensor of a DTensor (no copy), else the value itself."""
    return value._local_tensor.detach() if is_dtensor(value) else value


def localize(sd: Any) -> tuple[Any, list[list[Any]]]:
    """``sd`` with each DTensor replaced by its local tensor (no copy), and for each of those
    ``[path, global shape, global offset of the local shard]`` (a path: a list of keys and
    indices)."""
    paths: list[list[Any]] = []

    def walk(node: Any, path: list[Any]) -> Any:
        if is_dtensor(node):
            paths.append([list(path), list(node.shape), list(_offset(node))])
            return local(node)
        if isinstance(node, dict):
            out = OrderedDict() if type(node) is OrderedDict else {}
            for k, v in node.items():
                out[k] = walk(v, path + [k])
            if getattr(node, "__dict__", None):
                out.__dict__.update(node.__dict__)
            return out
        if isinstance(node, list):
            return [walk(v, path + [i]) for i, v in enumerate(node)]
        if type(node) is tuple:
            return tuple(walk(v, path + [i]) for i, v in enumerate(node))
        return node

    return walk(sd, []), paths


# mesh -> (this rank's coordinate, global shape, placements) -> its shard's global offset: the same for every snapshot
# of a generation, and half of a small model's layout to compute (0.5 ms a snapshot of 18
# DTensors here); kept no longer than the mesh
_OFFSETS: "weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], tuple[int, ...]]]" = \
    weakref.WeakKeyDictionary()


def _offset(dt: Any) -> tuple[int, ...]:
    """The global offset of this rank's shard of DTensor ``dt``."""
    compute_local_shape_and_global_offset = torch_private(
        "dtensor.compute_local_shape_and_global_offset")
    mesh = dt.device_mesh
    # (meshes of the same layout are equal keys: this process's place in it is part of the key)
    key = (tuple(mesh.get_coordinate() or ()), tuple(dt.shape), tuple(dt.placements))
    try:
        known = _OFFSETS.setdefault(mesh, {})
    except TypeError:  # a mesh that cannot be referred to weakly: computed each time
        known = {}
    offset = known.get(key)
    if offset is None:
        _, at = compute_local_shape_and_global_offset(dt.shape, mesh, dt.placements)
        offset = known[key] = tuple(int(o) for o in at)
    return offset


def sharded_object(obj: Any) -> bool:
    """Whether a registered module or optimizer holds DTensor parameters."""
    import torch

    if isinstance(obj, torch.nn.Module):
        return any(is_dtensor(p) for p in obj.parameters())
    if isinstance(obj, torch.optim.Optimizer):
        return any(is_dtensor(p) for g in obj.param_groups for p in g["params"])
    return False


def _like(value: Any, template: Any, what: str) -> Any:
    """``value`` (a local tensor) as a DTensor with ``template``'s mesh, placements and global
    shape; refused when it is not this rank's shard of such a tensor."""
    import torch
    from torch.distributed.tensor import DTensor

    if not isinstance(value, torch.Tensor):
        raise ShardMismatch(f"{what}: a shard was kept, but what came back is a "
                            f"{type(value).__name__}")
    want = template._local_tensor
    if tuple(value.shape) != tuple(want.shape) or value.dtype != want.dtype:
        raise ShardMismatch(f"{what}: the kept shard is {value.dtype} {tuple(value.shape)}, this "
                            f"rank's shard is {want.dtype} {tuple(want.shape)} (another mesh or "
                            "another model)")
    return DTensor.from_local(value, template.device_mesh, template.placements, run_check=False,
                              shape=template.shape, stride=template.stride())


def replace_at(root: Any, path: list[Any], fn: Any, what: str) -> Any:
    """``root`` with the value at ``path`` replaced by ``fn(value)`` (containers rebuilt along
    the path only: the loaded tree is ours to change)."""
    if not path:
        return fn(root)
    _check_key(root, path[0], what)
    root[path[0]] = replace_at(root[path[0]], path[1:], fn, what)
    return root


def value_at(root: Any, path: list[Any], what: str) -> Any:
    """The value at ``path`` of a state dict (a shard kept there)."""
    for key in path:
        _check_key(root, key, what)
        root = root[key]
    return root


def _check_key(root: Any, key: Any, what: str) -> None:
    if isinstance(root, dict) and key in root:
        return
    if isinstance(root, list) and isinstance(key, int) and 0 <= key < len(root):
        return
    raise ShardMismatch(f"{what}: no {key!r} where a shard was kept")


def settle(state: Any) -> int:
    """Bring every FSDP2 module of ``state`` back to rest after a generation that failed in the
    middle of a step: its in-flight collectives dropped (their group is gone), its parameters
    sharded again, its per-step bookkeeping cleared (``reset_iter_state``), so that the next
    generation's first forward starts as on a fresh process - a survivor that still believed its
    parameters gathered would skip an all-gather its new peers make. Returns how many roots were
    reset."""
    import torch

    done = 0
    for obj in state.objects().values():
        if not isinstance(obj, torch.nn.Module):
            continue
        for module in obj.modules():
            fsdp = getattr(module, "_get_fsdp_state", None)
            if fsdp is None:
                continue
            st = fsdp()
            if st._is_root is not True:  # not a root, or never ran forward: nothing to reset
                continue
            for group in st._state_ctx.all_states:
                for pg in _param_groups(group):
                    pg._all_gather_result = None  # works of the dead group: not waited for
                    for param in pg.fsdp_params:
                        # the failed step's gradients that never reached their reduction: the
                        # next backward would add to them
                        unsharded = getattr(param, "_unsharded_param", None)
                        if unsharded is not None:
                            unsharded.grad = None
                        param.unsharded_accumulated_grad = None
            if callable(getattr(module, "reset_iter_state", None)):
                module.reset_iter_state()
            else:
                _reset_iter_state(st)
            done += 1
    return done


def _param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups: a list since torch 2.12, at most one before."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        one = getattr(state, "_fsdp_param_group", None)
        return [] if one is None else [one]
    return list(groups)


def _reset_iter_state(root: Any) -> None:
    """FSDP2's ``reset_iter_state`` for a torch that has none (before 2.12), from its private
    state: every parameter group sharded again and at rest, the root's per-step trackers and the
    events of its last collectives dropped. No event is waited for: they belong to collectives
    of the aborted generation. (Found on a GPU with torch 2.11: a survivor left gathered skipped
    its first all-gather of the next generation, and its peers waited for it.)"""
    TrainingState = torch_private("fsdp.TrainingState")  # noqa: N806 - torch's class

    ctx = root._comm_ctx
    ctx.all_gather_state = None
    for name in ("reduce_scatter_states", "post_forward_order"):
        getattr(ctx, name, []).clear()
    if hasattr(ctx, "reduce_scatter_state"):
        ctx.reduce_scatter_state = None
    getattr(ctx, "_last_post_reduce_events", {}).clear()
    for st in root._state_ctx.all_states:
        getattr(st, "_modules_to_run_forward", set()).clear()
        st._training_state = TrainingState.IDLE
        for group in _param_groups(st):
            for name in ("_all_gather_result", "_post_reduce_event", "_all_reduce_state",
                         "_reshard_after_forward_event", "_partial_reduce_output"):
                if hasattr(group, name):
                    setattr(group, name, None)
            getattr(group, "_post_forward_indices", []).clear()
            group._training_state = TrainingState.IDLE
            group._to_sharded()
    root._state_ctx.iter_forward_root = None
    root._state_ctx.post_backward_final_callback_queued = False


def load_in_place(name: str, module: Any, part: Any, paths: list[list[Any]]) -> None:
    """Load ``part`` (local tensors where the module's state holds DTensors) into a sharded
    module by copying each tensor into the live one, in place: the module keeps its own storage
    (FSDP2 frees and re-gathers it) and its hooks are not run."""
    import torch

    live = module.state_dict()
    sharded_keys = {p[0] for p in paths if len(p) == 1}
    if len(sharded_keys) != len(paths):
        raise ShardMismatch(f"{name}: malformed shard paths {paths!r}")
    if set(live) != set(part):
        missing, extra = sorted(set(live) - set(part)), sorted(set(part) - set(live))
        raise ShardMismatch(f"{name}: the copy's keys differ from the model's (missing "
                            f"{missing[:5]}, unexpected {extra[:5]})")
    with torch.no_grad():
        for key, dst in live.items():
            src, what = part[key], f"{name}.{key}"
            if is_dtensor(dst) != (key in sharded_keys):
                raise ShardMismatch(f"{what}: sharded in {'the model' if is_dtensor(dst) else 'the copy'}"
                                    " only")
            if not isinstance(dst, torch.Tensor):
                raise ShardMismatch(f"{what}: a {type(dst).__name__} in a sharded model's state "
                                    "cannot be kept yet")
            target = dst._local_tensor if is_dtensor(dst) else dst
            if not isinstance(src, torch.Tensor) or tuple(src.shape) != tuple(target.shape) \
                    or src.dtype != target.dtype:
                raise ShardMismatch(f"{what}: the kept copy is "
                                    f"{getattr(src, 'dtype', type(src).__name__)} "
                                    f"{tuple(getattr(src, 'shape', ()))}, this rank's is "
                                    f"{target.dtype} {tuple(target.shape)} (another mesh or "
                                    "another model)")
            target.copy_(src)


def globalize(name: str, obj: Any, part: Any, paths: list[list[Any]]) -> Any:
    """``part`` (the loaded state dict of the optimizer ``obj``, registered as ``name``) with
    the local tensors at ``paths`` made DTensors again, each like the parameter it belongs to. A
    module holding shards loads them in place instead (``load_in_place``); an unsharded one is
    refused them."""
    import torch

    if not paths:
        return part
    if isinstance(obj, torch.nn.Module):  # (a sharded module loads in place: load_in_place)
        what = f"{name}.{'.'.join(str(p) for p in paths[0])}"
        raise ScriptSetupError(f"{what}: the copy received is a shard, but this process's model "
                               f"is not sharded: {MESH_ADVICE}")
    if isinstance(obj, torch.optim.Optimizer):
        for path in paths:
            what = f"{name}.{'.'.join(str(p) for p in path)}"
            template = state_param(obj, path, what)
            part = replace_at(part, path, lambda v, t=template, w=what: _like(v, t, w), what)
        return part
    raise ShardMismatch(f"{name}: a {type(obj).__name__} holding DTensors cannot be kept yet "
                        "(only modules and optimizers can)")


def state_param(optimizer: Any, path: list[Any], what: str) -> Any:
    """The sharded parameter whose optimizer state a kept shard at ``path`` (``["state", index,
    name]``) is: the DTensor its shard is laid out like. Raises ShardMismatch."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(path) != 3 or path[0] != "state" or not isinstance(path[1], int) \
            or not 0 <= path[1] < len(params) or not is_dtensor(params[path[1]]):
        raise ShardMismatch(f"{what}: kept as a shard, but it is not the state of a sharded "
                            "parameter of this optimizer")
    return params[path[1]]


def _ints(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                       for i in x)


def check_paths(value: Any) -> dict[str, list[list[Any]]]:
    """The ``KEY`` entry of a loaded state dict, checked: {name: [path, ...]}, each path a list
    of str and int (the shapes and offsets beside them checked, and left out)."""
    if not isinstance(value, dict):
        raise ShardMismatch(f"{KEY}: not a dict of paths")
    out: dict[str, list[list[Any]]] = {}
    for name, entries in value.items():
        if not isinstance(name, str) or not isinstance(entries, list) or not all(
                isinstance(e, list) and len(e) == 3 and isinstance(e[0], list) and e[0]
                and all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in e[0])
                and _ints(e[1]) and _ints(e[2]) and len(e[1]) == len(e[2]) for e in entries):
            raise ShardMismatch(f"{KEY}: malformed entries for {name!r}")
        out[name] = [e[0] for e in entries]
    return out


def layout(sd: Any) -> dict[str, tuple[list[int], list[int]]]:
    """For a state dict with a ``KEY`` entry: each shard's name as DCP flattens it (``"model.
    blocks.0.weight"``) -> (the whole tensor's shape, the shard's offset in it)."""
    value = sd.get(KEY) if isinstance(sd, dict) else None
    if value is None:
        return {}
    check_paths(value)
    return {".".join(str(k) for k in [name, *e[0]]): (list(e[1]), list(e[2]))
            for name, entries in value.items() for e in entries}

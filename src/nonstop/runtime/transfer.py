"""Bring every rank of a new generation to one consistent step.

A collective can complete on some ranks and fail on others, so survivors may disagree on the step
they finished. Every rank shares (has state, step, dirty); the newest clean step wins; ranks that
are behind, dirty or new receive the state from the lowest clean rank at that step, bit for bit.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import time
from collections import OrderedDict
from typing import Any

ALIGN = 16  # every tensor starts at an aligned offset so a byte view can be reinterpreted


class NoConsistentState(RuntimeError):
    """No rank holds a clean copy of the newest state (all are dirty): recovery needs a snapshot."""


@dataclasses.dataclass(frozen=True)
class SyncPlan:
    step: int
    source: int | None
    receivers: tuple[int, ...]


@dataclasses.dataclass
class SyncResult:
    step: int
    source: int | None
    receivers: tuple[int, ...]
    nbytes: int = 0
    seconds: float = 0.0


def plan_sync(rows: list[tuple[int, int, int]]) -> SyncPlan:
    """Pure decision. ``rows[r] = (has_state, step, dirty)`` for each rank r."""
    clean = [(step, r) for r, (has, step, dirty) in enumerate(rows) if has and not dirty]
    if not clean:
        if any(has for has, _, _ in rows):
            raise NoConsistentState(
                "every rank that holds state is dirty (it failed after its optimizer step): "
                "no clean copy of the newest step exists in memory")
        return SyncPlan(step=0, source=None, receivers=())
    target = max(step for step, _ in clean)
    source = min(r for step, r in clean if step == target)
    receivers = tuple(r for r, (has, step, dirty) in enumerate(rows)
                      if r != source and not (has and not dirty and step == target))
    return SyncPlan(step=target, source=source, receivers=receivers)


class _Ref:
    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


def _map_dict(obj: dict, fn) -> dict:
    out = type(obj)() if type(obj) in (dict, OrderedDict) else {}
    for k, v in obj.items():
        out[k] = fn(v)
    if getattr(obj, "__dict__", None):  # a module state dict's _metadata (version info)
        out.__dict__.update(obj.__dict__)
    return out


def _map_tree(obj: Any, is_leaf: Any, fn: Any) -> Any:
    """Rebuild dicts, lists and tuples, replacing each leaf by ``fn(leaf)``."""
    if is_leaf(obj):
        return fn(obj)
    if isinstance(obj, dict):
        return _map_dict(obj, lambda v: _map_tree(v, is_leaf, fn))
    if isinstance(obj, list):
        return [_map_tree(v, is_leaf, fn) for v in obj]
    if type(obj) is tuple:
        return tuple(_map_tree(v, is_leaf, fn) for v in obj)
    return obj


def _flatten(obj: Any, tensors: list) -> Any:
    import torch

    def ref(t: Any) -> _Ref:
        tensors.append(t)
        return _Ref(len(tensors) - 1)

    return _map_tree(obj, lambda x: isinstance(x, torch.Tensor), ref)


def _unflatten(obj: Any, tensors: list) -> Any:
    return _map_tree(obj, lambda x: isinstance(x, _Ref), lambda r: tensors[r.i])


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def pack(sd: dict[str, Any]) -> tuple[bytes, Any]:
    """State dict -> (pickled structure, one uint8 buffer holding every tensor's bytes)."""
    import torch

    tensors: list = []
    structure = _flatten(sd, tensors)
    specs, total = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        specs.append((t.dtype, tuple(t.shape), total, nbytes))
        total += _aligned(nbytes)
    buf = torch.empty(total, dtype=torch.uint8)
    for t, (_, _, off, nbytes) in zip(tensors, specs):
        if nbytes:
            buf[off:off + nbytes].copy_(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8))
    meta = io.BytesIO()
    pickle.dump((structure, specs), meta, protocol=pickle.HIGHEST_PROTOCOL)
    return meta.getvalue(), buf


def unpack(meta: bytes, buf: Any) -> dict[str, Any]:
    import torch

    structure, specs = pickle.loads(meta)
    tensors = []
    for dtype, shape, off, nbytes in specs:
        if nbytes:
            tensors.append(buf[off:off + nbytes].view(dtype).reshape(shape))
        else:
            tensors.append(torch.empty(shape, dtype=dtype))
    return _unflatten(structure, tensors)


def sync(state: Any, rank: int, world: int, has_state: bool) -> SyncResult:
    """Collective over the default group: every rank ends holding the state of one step."""
    import torch
    import torch.distributed as dist

    t0 = time.monotonic()
    mine = torch.tensor([int(has_state), int(state.step), int(state.dirty)], dtype=torch.int64)
    table = [torch.zeros(3, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(table, mine)
    plan = plan_sync([tuple(int(x) for x in row.tolist()) for row in table])  # type: ignore[misc]
    nbytes = 0
    if plan.source is not None and plan.receivers:
        if rank == plan.source:
            meta, buf = pack(state.state_dict())
            header = torch.tensor([len(meta), buf.numel()], dtype=torch.int64)
            meta_t = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
            for dst in plan.receivers:
                dist.send(header, dst)
                dist.send(meta_t, dst)
                dist.send(buf, dst)
            nbytes = buf.numel() * len(plan.receivers)
        elif rank in plan.receivers:
            header = torch.zeros(2, dtype=torch.int64)
            dist.recv(header, plan.source)
            meta_t = torch.empty(int(header[0]), dtype=torch.uint8)
            dist.recv(meta_t, plan.source)
            buf = torch.empty(int(header[1]), dtype=torch.uint8)
            dist.recv(buf, plan.source)
            state.load_state_dict(unpack(bytes(meta_t.tolist()), buf))
            nbytes = buf.numel()
    state.step = plan.step
    state.dirty = False
    return SyncResult(plan.step, plan.source, plan.receivers, nbytes, time.monotonic() - t0)

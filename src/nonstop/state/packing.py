"""A state dict as (pickled structure, one flat byte buffer): the form state takes in a memory
snapshot, on the wire between ranks, and on the way to disk.

Every tensor starts at an aligned offset, so a byte view of the buffer can be reinterpreted as the
tensor without a copy.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from collections import OrderedDict
from typing import Any

ALIGN = 16


class _Ref:
    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


@dataclasses.dataclass
class Layout:
    """Where each tensor of a state dict goes in the flat buffer."""

    meta: bytes  # pickled (structure, specs, info)
    tensors: list[Any]
    specs: list[tuple[Any, tuple[int, ...], int, int]]  # (dtype, shape, offset, nbytes)
    nbytes: int


def _map_dict(obj: dict, fn: Any) -> dict:
    out = type(obj)() if type(obj) in (dict, OrderedDict) else {}
    for k, v in obj.items():
        out[k] = fn(v)
    if getattr(obj, "__dict__", None):  # a module state dict's _metadata (version info)
        out.__dict__.update(obj.__dict__)
    return out


def map_tree(obj: Any, is_leaf: Any, fn: Any) -> Any:
    """Rebuild dicts, lists and tuples, replacing each leaf by ``fn(leaf)``."""
    if is_leaf(obj):
        return fn(obj)
    if isinstance(obj, dict):
        return _map_dict(obj, lambda v: map_tree(v, is_leaf, fn))
    if isinstance(obj, list):
        return [map_tree(v, is_leaf, fn) for v in obj]
    if type(obj) is tuple:
        return tuple(map_tree(v, is_leaf, fn) for v in obj)
    return obj


def tensor_bytes(sd: Any, aligned: bool = False) -> int:
    """Bytes of every tensor in a state dict (each rounded up as ``copy_into`` places them)."""
    import torch

    total = 0

    def count(t: Any) -> Any:
        nonlocal total
        n = t.numel() * t.element_size()
        total += _aligned(n) if aligned else n
        return t

    map_tree(sd, lambda x: isinstance(x, torch.Tensor), count)
    return total


def copy_into(tree: Any, buf: Any) -> Any:
    """``tree`` with every tensor copied into ``buf`` (a uint8 tensor large enough: see
    ``tensor_bytes``), aligned, one after the other."""
    import torch

    pos = 0

    def place(t: Any) -> Any:
        nonlocal pos
        nbytes = t.numel() * t.element_size()
        if not nbytes:
            return t.clone()
        out = buf[pos:pos + nbytes].view(t.dtype).reshape(t.shape).copy_(t)
        pos += _aligned(nbytes)
        return out

    return map_tree(tree, lambda x: isinstance(x, torch.Tensor), place)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout(sd: dict[str, Any], info: dict[str, Any] | None = None) -> Layout:
    """Plan the flat form of ``sd`` without copying anything; ``info`` rides in the metadata."""
    import torch

    tensors: list[Any] = []

    def ref(t: Any) -> _Ref:
        tensors.append(t)
        return _Ref(len(tensors) - 1)

    structure = map_tree(sd, lambda x: isinstance(x, torch.Tensor), ref)
    specs, total = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        specs.append((t.dtype, tuple(t.shape), total, nbytes))
        total += _aligned(nbytes)
    meta = io.BytesIO()
    pickle.dump((structure, specs, info or {}), meta, protocol=pickle.HIGHEST_PROTOCOL)
    return Layout(meta.getvalue(), tensors, specs, total)


def pack(sd: dict[str, Any], info: dict[str, Any] | None = None) -> tuple[bytes, Any]:
    """State dict -> (metadata, one uint8 buffer holding every tensor's bytes)."""
    import torch

    lay = layout(sd, info)
    buf = torch.empty(lay.nbytes, dtype=torch.uint8)
    for t, (_, _, off, nbytes) in zip(lay.tensors, lay.specs):
        if nbytes:
            buf[off:off + nbytes].copy_(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8))
    return lay.meta, buf


def unpack(meta: bytes, buf: Any) -> dict[str, Any]:
    """The state dict back; its tensors view ``buf`` (no copy)."""
    return unpack_with_info(meta, buf)[0]


def unpack_with_info(meta: bytes, buf: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch

    structure, specs, info = pickle.loads(meta)
    tensors = []
    for dtype, shape, off, nbytes in specs:
        if nbytes:
            tensors.append(buf[off:off + nbytes].view(dtype).reshape(shape))
        else:
            tensors.append(torch.empty(shape, dtype=dtype))
    return map_tree(structure, lambda x: isinstance(x, _Ref), lambda r: tensors[r.i]), info

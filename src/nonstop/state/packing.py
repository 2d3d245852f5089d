"""A state dict as (JSON skeleton, one flat byte buffer): the form state takes in a memory
snapshot, on the wire between ranks and hosts, and on the way to disk.

Nothing here is pickled. The metadata is JSON: the nesting of the state dict with an explicit tag
for every node (so key types, tuples and lists come back as they were), the plain values
themselves, and for each tensor its dtype (by name, from a fixed list), shape and place in the
buffer. Decoding builds nothing but dicts, lists, tuples, plain values and tensors viewing the
buffer, and refuses anything it does not know: a peer, a buddy node or a corrupted slot can make
unpacking fail, never run code or allocate more than the buffer it sent.

Every tensor starts at an aligned offset, so a byte view of the buffer can be reinterpreted as the
tensor without a copy.

The skeleton, node by node (``[key, value]`` pairs keep int keys int)::

    {"d": [[key, value], ...]}   dict           {"o": [...], "a": [[name, value], ...]}  OrderedDict
    {"l": [...]}  list           {"t": [...]}   tuple          (and its attributes, e.g. _metadata)
    {"T": i}      tensor i       {"N": i}       numpy array    {"G": i}  numpy scalar (0-dim)
    {"i": 1}  {"f": 1.5 | "nan" | "inf" | "-inf"}  {"b": true}  {"n": null}  {"s": "x"}
    {"S": [2, 3]} torch.Size     {"B": "base64"} bytes         {"Y": "base64"}  bytearray

Anything else in a state dict (a user's object, a namedtuple, a set...) is refused when it is
packed, with the path of the value: give it as tensors or plain values.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import math
import sys
from collections import OrderedDict
from typing import Any

ALIGN = 16
FORMAT = "nonstop-state/2"  # /1 was the pickled form, never read
MAX_META = 64 << 20  # bytes of metadata accepted (a model with 1000s of tensors needs ~100 KB)
MAX_DEPTH = 200  # nesting of containers
MAX_NDIM = 64
MAX_EMPTY_EXTENT = 1 << 48  # an empty tensor's shape: the product of its non-zero dimensions
_MAX_INT_BITS = 14_000  # an int JSON can write and read back (Python's 4300-digit limit)

# The dtypes a tensor may have, by name: the only names decoding looks up.
DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32",
               "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool",
               "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
               "float8_e8m0fnu")
# numpy arrays travel as tensors: the dtypes torch.from_numpy takes and .numpy() gives back alike
_NUMPY_DTYPES = frozenset(("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                           "uint64", "float16", "float32", "float64", "complex64", "complex128"))
_FLOAT_WORDS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_PLAIN = {"s": str, "i": int, "b": bool, "n": type(None)}
_ATTR_TYPES = (OrderedDict,)  # containers whose attributes ride along (a module's _metadata)

_by_name: dict[str, Any] | None = None
_name_of: dict[Any, str] = {}


class UnsupportedState(TypeError):
    """A state dict holds a value nonstop cannot move without pickle (raised when packing)."""


class BadMeta(ValueError):
    """Metadata that is not a well-formed nonstop skeleton for its buffer: nothing is loaded."""


def _dtypes() -> dict[str, Any]:
    global _by_name
    if _by_name is None:
        import torch

        found = {n: getattr(torch, n, None) for n in DTYPE_NAMES}
        by = {n: d for n, d in found.items() if isinstance(d, torch.dtype)}
        _name_of.update({d: n for n, d in by.items()})
        _by_name = by
    return _by_name


@dataclasses.dataclass
class Layout:
    """Where each tensor of a state dict goes in the flat buffer."""

    meta: bytes  # the JSON skeleton (format, tree, specs, info)
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


def tensor_bytes(sd: Any, aligned: bool = False, select: Any = None) -> int:
    """Bytes of every tensor in a state dict (each rounded up as ``copy_into`` places them);
    ``select``: of those tensors only for which it is true."""
    import torch

    total = 0

    def count(t: Any) -> Any:
        nonlocal total
        n = t.numel() * t.element_size()
        total += _aligned(n) if aligned else n
        return t

    map_tree(sd, lambda x: isinstance(x, torch.Tensor) and (select is None or select(x)), count)
    return total


def copy_into(tree: Any, buf: Any, select: Any = None) -> Any:
    """``tree`` with every tensor copied into ``buf`` (a uint8 tensor large enough: see
    ``tensor_bytes``), aligned, one after the other; ``select``: only those for which it is
    true (the others stay as they are)."""
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

    return map_tree(tree, lambda x: isinstance(x, torch.Tensor) and (select is None or select(x)),
                    place)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# == encoding ======================================================================================
def path_str(path: Any) -> str:
    """``("state", "a", 3)`` as ``state['a'][3]`` (a path is a chain of (parent, step) pairs)."""
    parts = []
    while isinstance(path, tuple):
        path, step = path
        parts.append(step)
    out = str(path)
    for step in reversed(parts):
        out += step if isinstance(step, _Attr) else f"[{step!r}]"
    return out


class _Attr(str):
    """A path step that is an attribute (``._metadata``), not a key."""


def _refuse(path: Any, value: Any, why: str = "") -> UnsupportedState:
    kind = type(value)
    name = kind.__qualname__
    if kind.__module__ != "builtins":
        name = f"{kind.__module__}.{name}"
    return UnsupportedState(
        f"{path_str(path)} is a {name}{why}: nonstop moves state between processes without "
        "pickle; give it as tensors or plain values (int, float, bool, None, str, bytes, and "
        "dicts, lists and tuples of them)")


class _Encoder:
    def __init__(self, tensors_ok: bool = True):
        import torch

        self.torch = torch
        self.Tensor = torch.Tensor
        self.Size = torch.Size
        self.strided = torch.strided
        self.np = sys.modules.get("numpy")
        _dtypes()
        self.names = _name_of
        self.tensors_ok = tensors_ok
        self.tensors: list[Any] = []
        self.specs: list[tuple[Any, tuple[int, ...], int, int]] = []
        self.wire: list[list[Any]] = []
        self.total = 0

    def tensor(self, t: Any, path: Any) -> int:
        if not self.tensors_ok:
            raise _refuse(path, t, " (only plain values go here)")
        name = self.names.get(t.dtype)
        if name is None:
            raise _refuse(path, t, f" of dtype {t.dtype}, which nonstop does not move")
        if t.layout is not self.strided or t.is_meta:
            raise _refuse(path, t, f" ({t.layout}{', on the meta device' if t.is_meta else ''}; "
                          "only dense tensors with data are moved)")
        nbytes = t.nbytes
        shape = t.shape  # a torch.Size: a tuple, written as a JSON list
        self.tensors.append(t)
        self.specs.append((t.dtype, shape, self.total, nbytes))
        self.wire.append([name, shape, self.total, nbytes])
        self.total += _aligned(nbytes)
        return len(self.tensors) - 1

    def numpy(self, x: Any, path: Any) -> int:
        np = self.np
        arr = np.asarray(x)
        if arr.dtype.name not in _NUMPY_DTYPES or not arr.dtype.isnative:
            raise _refuse(path, x, f" of dtype {arr.dtype}, which nonstop does not move")
        if not (arr.flags.c_contiguous and arr.flags.writeable):
            arr = arr.copy(order="C")
        return self.tensor(self.torch.from_numpy(arr), path)

    def key(self, k: Any, path: Any) -> Any:
        """A key: a str as itself (most keys), anything else tagged."""
        tk = type(k)
        if tk is str:
            return k
        if tk is int or tk is float or tk is bool or k is None or tk is bytes:
            return self.value(k, path, 0)
        if tk is tuple:
            return {"t": [self.key(v, path) for v in k]}
        raise _refuse(path, k, " used as a key")

    def value(self, x: Any, path: Any, depth: int) -> Any:
        tx = type(x)
        if tx is str:
            return {"s": x}
        if tx is int:
            if x.bit_length() > _MAX_INT_BITS:
                raise _refuse(path, x, f" of {x.bit_length()} bits")
            return {"i": x}
        if tx is float:
            return {"f": x if math.isfinite(x) else repr(x)}
        if tx is bool:
            return {"b": x}
        if x is None:
            return {"n": None}
        if isinstance(x, self.Tensor):
            return {"T": self.tensor(x, path)}
        if depth >= MAX_DEPTH:
            raise _refuse(path, x, f" nested deeper than {MAX_DEPTH}")
        if isinstance(x, dict):
            key, value, down = self.key, self.value, depth + 1
            items = [[k if type(k) is str else key(k, (path, k)), value(v, (path, k), down)]
                     for k, v in x.items()]
            attrs = getattr(x, "__dict__", None)
            if not isinstance(x, _ATTR_TYPES):
                if attrs:
                    raise _refuse(path, x, " with attributes")
                return {"d": items}
            node: dict[str, Any] = {"o": items}
            if attrs:
                node["a"] = [[_attr_name(name, path, x),
                              self.value(v, (path, _Attr("." + name)), depth + 1)]
                             for name, v in attrs.items()]
            return node
        if isinstance(x, list) or tx is tuple:
            value, down = self.value, depth + 1
            return {"l" if tx is not tuple else "t":
                    [value(v, (path, i), down) for i, v in enumerate(x)]}
        if tx is self.Size:
            return {"S": list(x)}
        if tx is bytes:
            return {"B": base64.b64encode(x).decode("ascii")}
        if tx is bytearray:
            return {"Y": base64.b64encode(x).decode("ascii")}
        np = self.np
        if np is not None:
            if tx is np.ndarray:
                return {"N": self.numpy(x, path)}
            if isinstance(x, np.generic):
                return {"G": self.numpy(x, path)}
        raise _refuse(path, x)


def _attr_name(name: Any, path: Any, owner: Any) -> str:
    if not (isinstance(name, str) and name.isidentifier() and not name.startswith("__")):
        raise _refuse(path, owner, f" with an attribute named {name!r}")
    return name


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("ascii")


def layout(sd: dict[str, Any], info: dict[str, Any] | None = None) -> Layout:
    """Plan the flat form of ``sd`` without copying anything; ``info`` (plain values) rides in
    the metadata. Raises ``UnsupportedState`` for a value that cannot be moved without pickle."""
    enc = _Encoder()
    tree = enc.value(sd, "state", 0)
    info_node = _Encoder(tensors_ok=False).value(dict(info or {}), "info", 0)
    meta = _dumps({"format": FORMAT, "tree": tree, "specs": enc.wire, "info": info_node})
    if len(meta) > MAX_META:  # a receiver would refuse it
        raise UnsupportedState(f"the state's skeleton takes {len(meta)} bytes, more than "
                               f"{MAX_META}: {len(enc.tensors)} tensors; fewer, larger ones")
    return Layout(meta, enc.tensors, enc.specs, enc.total)


def pack(sd: dict[str, Any], info: dict[str, Any] | None = None) -> tuple[bytes, Any]:
    """State dict -> (metadata, one uint8 buffer holding every tensor's bytes)."""
    import torch

    lay = layout(sd, info)
    buf = torch.empty(lay.nbytes, dtype=torch.uint8)
    for t, (_, _, off, nbytes) in zip(lay.tensors, lay.specs):
        if nbytes:
            buf[off:off + nbytes].copy_(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8))
    return lay.meta, buf


# == decoding ======================================================================================
def unpack(meta: bytes, buf: Any) -> dict[str, Any]:
    """The state dict back; its tensors view ``buf`` (no copy). Raises ``BadMeta``."""
    return unpack_with_info(meta, buf)[0]


def unpack_with_info(meta: bytes, buf: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch

    if not (isinstance(buf, torch.Tensor) and buf.dtype == torch.uint8 and buf.dim() == 1):
        raise TypeError("unpack needs the flat buffer as a 1-D uint8 tensor")
    doc = parse_meta(meta)
    tensors = _views(doc["specs"], buf)
    used = bytearray(len(tensors))
    tree = _Decoder(tensors, used).value(doc["tree"], 0)
    if not all(used):
        raise BadMeta(f"malformed state metadata: tensor {used.index(0)} is never used")
    info = _Decoder([], bytearray()).value(doc["info"], 0)
    if type(info) is not dict:
        raise BadMeta("malformed state metadata: info is not a dict")
    return tree, info


def _bad(why: str) -> BadMeta:
    return BadMeta(f"malformed state metadata: {why}")


def _no_constant(word: str) -> Any:
    raise _bad(f"bare {word} (non-finite floats are tagged strings)")


def parse_meta(meta: bytes) -> dict[str, Any]:
    """The metadata's JSON document, its format checked (``BadMeta`` if anything is off)."""
    if isinstance(meta, (bytearray, memoryview)):
        meta = bytes(meta)
    if type(meta) is not bytes:
        raise TypeError(f"state metadata is bytes, not {type(meta).__name__}")
    if len(meta) > MAX_META:
        raise _bad(f"{len(meta)} bytes, more than {MAX_META}")
    if not meta.startswith(b"{"):
        raise BadMeta("state metadata is not nonstop's JSON skeleton (an older nonstop's pickled "
                      "form? it is never unpickled): refused")
    try:
        doc = json.loads(meta, parse_constant=_no_constant)
    except RecursionError:
        raise _bad("nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int too long
        if isinstance(exc, BadMeta):
            raise
        raise _bad(f"not JSON ({exc})") from None
    if type(doc) is not dict:
        raise _bad("not a JSON object")
    fmt = doc.get("format")
    if fmt != FORMAT:
        raise BadMeta(f"unknown state format {fmt!r}: this nonstop reads {FORMAT!r} only")
    if set(doc) != {"format", "tree", "specs", "info"}:
        raise _bad(f"fields {sorted(doc)}, expected format, tree, specs, info")
    if type(doc["specs"]) is not list:
        raise _bad("specs is not a list")
    return doc


def _int(x: Any, what: str, top: int | None = None) -> int:
    if type(x) is not int or x < 0 or (top is not None and x > top):
        raise _bad(f"{what} is {x!r}")
    return x


def _views(specs: list[Any], buf: Any) -> list[Any]:
    """A tensor viewing ``buf`` for each spec, every spec checked first against the buffer."""
    import torch

    dtypes = _dtypes()
    size = buf.numel()
    checked = []
    end = 0
    for i, spec in enumerate(specs):
        if type(spec) is not list or len(spec) != 4:
            raise _bad(f"tensor {i}: spec {str(spec)[:80]}")
        name, shape, off, nbytes = spec
        dtype = dtypes.get(name) if type(name) is str else None
        if dtype is None:
            raise _bad(f"tensor {i}: unknown dtype {str(name)[:40]!r}")
        if type(shape) is not list or len(shape) > MAX_NDIM:
            raise _bad(f"tensor {i}: shape {str(shape)[:80]}")
        numel = extent = 1
        for d in shape:
            if type(d) is not int or not 0 <= d <= MAX_EMPTY_EXTENT:
                raise _bad(f"tensor {i}: a dimension is {str(d)[:40]}")
            numel *= d
            extent *= d or 1
        if extent > MAX_EMPTY_EXTENT:
            raise _bad(f"tensor {i}: shape {shape} too large")
        if type(off) is not int or type(nbytes) is not int:
            raise _bad(f"tensor {i}: offset {str(off)[:40]}, bytes {str(nbytes)[:40]}")
        itemsize = dtype.itemsize
        if numel * itemsize != nbytes:
            raise _bad(f"tensor {i}: shape {shape} of {name} is not {nbytes} bytes")
        if off < end or off + nbytes > size:
            raise _bad(f"tensor {i}: bytes {off}..{off + nbytes} outside the buffer "
                       f"({size} bytes) or overlapping the previous tensor")
        if off % itemsize:
            raise _bad(f"tensor {i}: offset {off} not aligned for {name}")
        end = off + nbytes
        checked.append((dtype, shape, off, end))
    return [buf[off:end].view(dtype).reshape(shape) if end > off
            else torch.empty(shape, dtype=dtype) for dtype, shape, off, end in checked]


class _Decoder:
    def __init__(self, tensors: list[Any], used: bytearray):
        self.tensors = tensors
        self.used = used

    def index(self, i: Any) -> Any:
        if type(i) is not int or not 0 <= i < len(self.tensors):
            raise _bad(f"tensor reference {str(i)[:40]}")
        if self.used[i]:
            raise _bad(f"tensor {i} referenced twice")
        self.used[i] = 1
        return self.tensors[i]

    def value(self, node: Any, depth: int) -> Any:
        if type(node) is not dict:
            raise _bad(f"a node is a {type(node).__name__}, not a tagged object")
        if len(node) == 1:
            ((tag, v),) = node.items()
        elif len(node) == 2 and "o" in node and "a" in node:
            tag, v = "o", node["o"]
        else:
            raise _bad(f"a node has tags {sorted(node)[:4]}")
        tv = type(v)
        if tag == "T":
            return self.index(v)
        if tag in _PLAIN:
            if tv is _PLAIN[tag]:
                return v
        elif tag == "f":
            if tv is float and math.isfinite(v):
                return v
            if tv is str and v in _FLOAT_WORDS:
                return _FLOAT_WORDS[v]
        elif tag in ("d", "o", "l", "t"):
            if tv is not list:
                raise _bad(f"a {tag!r} node holds a {tv.__name__}")
            if depth >= MAX_DEPTH:
                raise _bad(f"nested deeper than {MAX_DEPTH}")
            value, down = self.value, depth + 1
            if tag == "l":
                return [value(x, down) for x in v]
            if tag == "t":
                return tuple([value(x, down) for x in v])
            key = self.key
            out: dict[Any, Any] = {} if tag == "d" else OrderedDict()
            for pair in v:
                if type(pair) is not list or len(pair) != 2:
                    raise _bad("a dict entry is not a [key, value] pair")
                k = pair[0]
                out[k if type(k) is str else key(k, 0)] = value(pair[1], down)
            if len(out) != len(v):
                raise _bad("a dict has a key twice")
            if tag == "o" and "a" in node:
                self.attrs(out, node["a"], depth)
            return out
        elif tag == "S" and tv is list:
            return _size(v)
        elif tag in ("B", "Y") and tv is str:
            try:
                raw = base64.b64decode(v, validate=True)
            except (binascii.Error, ValueError):
                raise _bad("bytes that are not base64") from None
            return raw if tag == "B" else bytearray(raw)
        elif tag in ("N", "G"):
            t = self.index(v)
            if str(t.dtype).removeprefix("torch.") not in _NUMPY_DTYPES:
                raise _bad(f"a numpy value of dtype {t.dtype}")
            if tag == "G":
                if t.dim():
                    raise _bad(f"numpy scalar {v} has shape {list(t.shape)}")
                return t.numpy()[()]
            return t.numpy().copy()  # its own memory, as an unpickled array had
        else:
            raise _bad(f"unknown tag {str(tag)[:20]!r}")
        raise _bad(f"a {tag!r} node holds a {tv.__name__}")

    def key(self, node: Any, depth: int) -> Any:
        if type(node) is str:
            return node
        if type(node) is dict and len(node) == 1:
            ((tag, v),) = node.items()
            if tag == "t" and type(v) is list:
                if depth >= MAX_DEPTH:
                    raise _bad(f"nested deeper than {MAX_DEPTH}")
                return tuple(self.key(x, depth + 1) for x in v)
            if tag in ("i", "f", "b", "n", "B", "s"):
                return self.value(node, depth)
        raise _bad(f"a key is {str(node)[:80]}")

    def attrs(self, out: Any, pairs: Any, depth: int) -> None:
        if type(pairs) is not list:
            raise _bad("attributes are not a list")
        for pair in pairs:
            if (type(pair) is not list or len(pair) != 2 or type(pair[0]) is not str
                    or not pair[0].isidentifier() or pair[0].startswith("__")):
                raise _bad(f"an attribute {str(pair)[:80]}")
            out.__dict__[pair[0]] = self.value(pair[1], depth + 1)


def _size(v: list[Any]) -> Any:
    import torch

    if len(v) > MAX_NDIM:
        raise _bad(f"a torch.Size of {len(v)} dimensions")
    return torch.Size([_int(d, "a torch.Size dimension", 1 << 62) for d in v])

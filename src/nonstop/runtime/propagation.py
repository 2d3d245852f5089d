"""DTensor's sharding decisions, made ahead by a warm spare.

A DTensor operation first decides how its output is sharded (DTensor's sharding propagation); the
decision is cached, so a rank pays for it once per kind of operation, in its first step. A
replacement is a new process: its first step makes every decision again - for Adam on a small 2-D
model, 55 strategy expansions, most of its first step - while every peer waits for it.

The decisions depend on the operation, the global shapes, dtypes and placements, and on the mesh
as a layout (its ranks, dimension names), never on which rank asks. So the job's ranks record the
operations they met the first time (``Recorder``: the first steps of the first generation), each
publishes them once in its host's store, and a warm spare on the host makes those decisions while
it waits (``Warmth``), on meshes equal to the job's. Once it takes a rank, its first step finds
them made.

It reaches into DTensor's internals (every name through ``torch_internals``): a torch without one
says so once, loudly, and its spares are not warmed ahead (``supported``).

What stands in the way, and how it is met (torch 2.13):
- DTensor's native (C++) cache keys a decision by the identity of the specs it was asked for;
  only its Python cache keys it by value. A spare that warmed its Python cache asks that cache
  whenever the native one misses (``_ask_python_cache``).
- A decision holds the mesh it was made on, and the DTensors it makes carry it. The spare's meshes
  are made from the recorded layouts with the job's group names (``nonstop:<dim>``, the lasting
  groups every generation registers), so their collectives go to the generation's groups; the
  rank each is seen from is set when the spare takes its rank (``Warmth.adopt``).
- Specs cache their hash, which depends on the process (string hashing): dropped on the way in.

A record is a pickle read by an unpickler that makes only DTensor's spec types, torch's sizes and
dtypes, and the operations by name; anything else refuses the record. A record of another torch
version is refused whole. Any failure here only costs the warm-up: a decision not made ahead is
made in the step, as without it.
"""

from __future__ import annotations

import io
import pickle
import sys
from collections import deque
from typing import Any, Callable

from ..torch_internals import NAMES as TORCH_NAMES, TorchInternalsChanged
from ..torch_internals import get as torch_private

RECORD_STEPS = 2  # steps of the first generation whose new decisions a rank records
MAX_RECORD_BYTES = 4 << 20  # a record above this is not published (a spare would take too long)
CALLED_OFF_EVERY = 4  # a spare making decisions looks whether it was given a rank this often
COUNT_KEY = "propagation/n"  # records published on this host's store so far


def record_key(n: int) -> str:
    return f"propagation/{n}"


SLOW_PATH = "_propagate_op_sharding_dispatch_slow_path"  # where DTensor's native cache misses go
OURS = "nonstop:"  # the prefix of the lasting groups' names (runtime/mesh.py)
# what a record may make (module -> names): DTensor's spec types, and torch's own values
_ALLOWED = {
    TORCH_NAMES["dtensor.DTensorSpec"].module: {"DTensorSpec", "TensorMeta", "ShardOrderEntry"},
    TORCH_NAMES["dtensor.OpSchema"].module: {"OpSchema", "RuntimeSchemaInfo"},
    "torch.distributed.tensor.placement_types": {"Shard", "Replicate", "Partial",
                                                 "_StridedShard", "MaskPartial"},
    # (where torch 2.13 pickles its MaskPartial from)
    f"{TORCH_NAMES['dtensor.pointwise_ops'].module}._embedding_ops": {"MaskPartial"},
    "torch": {"Size"},
    "builtins": {"slice", "complex", "frozenset", "set"},
}
#: the internals the warm-up needs, each resolved by ``supported``
NEEDS = ("dtensor.op_dispatcher", "dtensor.propagate_op_sharding", "dtensor.OpSchema",
         "dtensor.DTensorSpec", "dtensor.pointwise_ops", "ops.OpOverload", "mesh.DeviceMesh",
         "mesh.MeshLayout", "mesh.FlatLayout")
_verdict: list[bool] = []  # supported's answer, found once a process


class BadRecord(ValueError):
    """A record that is not what a rank publishes (another torch, or not a record at all)."""


def supported() -> bool:
    """Whether this torch has what the warm-up reaches into. Where it has not, the process says
    which name and why once, on stderr (the job's output), and records and warms nothing: the
    job runs as without it, a replacement's first step slower."""
    if not _verdict:
        try:
            for name in NEEDS:
                torch_private(name)
            _verdict.append(True)
        except TorchInternalsChanged as exc:
            print(f"nonstop: warning: a warm spare will not make DTensor's sharding decisions "
                  f"ahead: {exc}", file=sys.stderr, flush=True)
            _verdict.append(False)
    return _verdict[0]


class _NotOurs(Exception):
    """An operation on a mesh that is not the job's (the script's own): not recorded."""


def _dumps(schema: Any) -> bytes:
    import torch

    DeviceMesh, OpOverload = torch_private("mesh.DeviceMesh"), torch_private("ops.OpOverload")

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            if isinstance(obj, DeviceMesh):
                names = tuple(getattr(obj, "_dim_group_names", ()) or ())
                if not names or not all(n.startswith(OURS) for n in names):
                    raise _NotOurs()
                axes = tuple((tuple(a.shape), tuple(a.stride)) for a in obj._layout.axes)
                return ("mesh", names, axes, tuple(obj._flatten_rank_map), obj.device_type,
                        tuple(obj.mesh_dim_names or ()))
            if isinstance(obj, OpOverload):
                return ("op", obj._schema.name, obj._overloadname)
            if isinstance(obj, torch.dtype):
                return ("dtype", str(obj).removeprefix("torch."))
            if isinstance(obj, torch.memory_format):
                return ("format", str(obj).removeprefix("torch."))
            return None

    buf = io.BytesIO()
    Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(schema)
    return buf.getvalue()


class Recorder:
    """In a rank of a mesh job's first generation: the operations whose sharding DTensor decided
    for the first time (its native cache missed), from the mesh's forming until
    ``RECORD_STEPS`` steps are done; then published once (``stepped``)."""

    def __init__(self) -> None:
        self.schemas: list[Any] = []
        self.steps = 0
        self._disp = torch_private("dtensor.op_dispatcher")
        original = self._disp._propagate_op_sharding_dispatch_slow_path
        self._original = original
        self._own = SLOW_PATH in vars(self._disp)  # a wrapper of ours was there already

        def recording(op_call: Any, args: Any, kwargs: Any, op_info: Any, try_cache: bool) -> Any:
            if op_info.schema is not None:
                self.schemas.append(op_info.schema)
            return original(op_call, args, kwargs, op_info, try_cache)

        self._disp._propagate_op_sharding_dispatch_slow_path = recording

    def stop(self) -> None:
        """What was there before is put back."""
        if self._own:
            setattr(self._disp, SLOW_PATH, self._original)
        else:
            vars(self._disp).pop(SLOW_PATH, None)

    def stepped(self, store: Any) -> bool:
        """A step is done; after the last recorded one the record is published. True once
        finished (the recorder can go)."""
        self.steps += 1
        if self.steps < RECORD_STEPS:
            return False
        self.stop()
        record = self.dumps()
        if record is not None:
            n = store.add(COUNT_KEY, 1)
            store.set(record_key(n - 1), record)
        return True

    def dumps(self) -> bytes | None:
        """The record: torch's version and each recorded operation (those on the job's meshes
        only), None when none is."""
        import torch

        parts = []
        for schema in self.schemas:
            try:
                parts.append(_dumps(schema))
            except _NotOurs:
                continue
            except Exception:  # noqa: BLE001 - one that cannot be written: made in the step
                continue
        if not parts:
            return None
        out = pickle.dumps((str(torch.__version__), parts), protocol=pickle.HIGHEST_PROTOCOL)
        return out if len(out) <= MAX_RECORD_BYTES else None


class Warmth:
    """In a warm spare of a mesh job: the decisions of the records its host's ranks published,
    made while it waits (``take``), and the meshes they were made on, set to the rank it takes
    (``adopt``)."""

    def __init__(self) -> None:
        self.meshes: dict[tuple, Any] = {}
        self.read: set[int] = set()  # the records read so far (their numbers)
        self.decided = 0  # decisions made ahead
        self.refused: list[str] = []  # why records were refused
        self._made: set[Any] = set()
        self._pending: deque[Any] = deque()  # operations read, not decided yet
        self._asking = False
        # pointwise decisions by their operands' specs alone, the floats' values aside: the
        # step-dependent scalars of an optimizer (Adam's bias corrections) key DTensor's cache
        self.valueless: dict[Any, Any] = {}

    def take(self, store: Any, called_off: Callable[[], bool] = lambda: False) -> int:
        """Read the records published since the last look and make their decisions, until
        ``called_off()`` (a rank for this spare: it goes at once, the rest is left for later).
        Returns how many were made now. A store that fails raises (the caller looks again
        later)."""
        count = int(store.add(COUNT_KEY, 0))
        for n in range(count):
            # a number is taken before its record is written: one not there yet (or whose
            # writer died between the two) is looked for again next time, never waited for
            if n in self.read or not store.check([record_key(n)]):
                continue
            raw = store.get(record_key(n))
            self.read.add(n)
            try:
                self._pending.extend(self.loads(raw))
            except BadRecord as exc:
                self.refused.append(str(exc))
        made = self.decide(called_off)
        if made and not self._asking:
            _ask_python_cache(self.valueless)
            self._asking = True
        return made

    def loads(self, raw: bytes) -> list[Any]:
        """The operations of a record, on this spare's meshes. BadRecord if it is not one."""
        import torch

        try:
            version, parts = _Unpickler(io.BytesIO(raw), self).load()
        except BadRecord:
            raise
        except Exception as exc:  # noqa: BLE001 - truncated, or not a pickle
            raise BadRecord(f"unreadable record ({type(exc).__name__}: {exc})") from None
        if version != str(torch.__version__):
            raise BadRecord(f"a record of torch {version}, not {torch.__version__}")
        if not isinstance(parts, list) or not all(isinstance(p, bytes) for p in parts):
            raise BadRecord("a record is a list of operations")
        out = []
        for part in parts:
            try:
                schema = _Unpickler(io.BytesIO(part), self).load()
            except BadRecord:
                raise
            except Exception as exc:  # noqa: BLE001
                raise BadRecord(f"unreadable operation ({type(exc).__name__}: {exc})") from None
            out.append(_rehash(schema))
        return out

    def decide(self, called_off: Callable[[], bool] = lambda: False) -> int:
        """Make the pending operations' decisions into DTensor's (Python) cache, on this thread
        (the cache is per thread: the one that trains), until ``called_off()`` (asked every
        few). Those that fail are left to the step."""
        propagate = torch_private("dtensor.propagate_op_sharding")
        made = tried = 0
        while self._pending:
            schema = self._pending.popleft()
            if schema in self._made:  # (the ranks of a host meet mostly the same ones)
                continue
            if tried % CALLED_OFF_EVERY == 0 and called_off():
                self._pending.appendleft(schema)
                break
            tried += 1
            self._made.add(schema)
            try:
                out = propagate(schema)
                made += 1
            except Exception:  # noqa: BLE001 - made in the step, as without the warm-up
                continue
            key = _valueless(schema)
            if key is not None and not out.needs_redistribute:
                self.valueless[key] = out
        self.decided += made
        return made

    def mesh(self, names: tuple, axes: tuple, ranks: tuple, device: str, dims: tuple) -> Any:
        """The spare's mesh equal to a recorded one (made once)."""
        key = (names, axes, ranks, device, dims)
        mesh = self.meshes.get(key)
        if mesh is None:
            import torch

            flat, layout_type = torch_private("mesh.FlatLayout"), torch_private("mesh.MeshLayout")
            layout = layout_type([flat(shape, stride) for shape, stride in axes])
            mesh = _spare_mesh_type()(device, _layout=layout,
                              _rank_map=torch.tensor(ranks, dtype=torch.int),
                              mesh_dim_names=dims or None, _init_backend=False,
                              _rank=0)  # (the rank it takes is set by ``adopt``)
            mesh._dim_group_names = list(names)
            self.meshes[key] = mesh
        return mesh

    def adopt(self, rank: int) -> None:
        """The spare took ``rank`` (its global rank in the generation): each mesh is seen from
        it, as the job's meshes are."""
        for mesh in self.meshes.values():
            mesh._rank = rank
            mesh._coordinate_on_dim = mesh._compute_coordinate_on_dim()


_spare_mesh: Any = None


def _spare_mesh_type() -> Any:
    """A DeviceMesh that knows its rank without a process group (a spare has none yet): the
    slice of the full mesh it shows is the one holding ``_rank`` until a default group exists
    (torch's always asks the default group). Equal to the job's mesh of the same layout, as
    torch compares meshes."""
    global _spare_mesh
    if _spare_mesh is None:
        DeviceMesh = torch_private("mesh.DeviceMesh")

        class SpareMesh(DeviceMesh):  # type: ignore[misc,valid-type]
            _rank = 0  # (until __init__ sets the one given: it reads ``mesh`` before)

            @property
            def mesh(self) -> Any:
                import torch.distributed as dist

                # (within a generation, its rank there, as torch's meshes read it)
                rank = dist.get_rank() if dist.is_initialized() else self._rank
                full = self._layout.remap_to_tensor(self._rank_map)
                return self._get_mesh_tensor_from_full_mesh(full, rank)

        _spare_mesh = SpareMesh
    return _spare_mesh


class _Unpickler(pickle.Unpickler):
    def __init__(self, f: Any, warmth: Warmth):
        super().__init__(f)
        self._warmth = warmth

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise BadRecord(f"a record may not make {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        import torch

        try:
            kind = pid[0]
            if kind == "mesh":
                names, axes, ranks, device, dims = pid[1:]
                if not all(isinstance(n, str) and n.startswith(OURS) for n in names):
                    raise BadRecord("a record's mesh has groups that are not the job's")
                return self._warmth.mesh(tuple(names), tuple(axes), tuple(ranks), str(device),
                                         tuple(dims))
            if kind == "op":
                ns, _, op = str(pid[1]).partition("::")
                packet = getattr(getattr(torch.ops, ns), op)
                return getattr(packet, pid[2] or "default")
            if kind in ("dtype", "format"):
                value = getattr(torch, str(pid[1]))
                want = torch.dtype if kind == "dtype" else torch.memory_format
                if isinstance(value, want):
                    return value
        except BadRecord:
            raise
        except Exception as exc:  # noqa: BLE001 - an operation this torch does not have
            raise BadRecord(f"a record names what this torch has not: {pid!r} ({exc})") from None
        raise BadRecord(f"a record holds an unknown reference {pid!r}")


def _rehash(schema: Any) -> Any:
    """A schema read from a record, its specs' cached hashes dropped (they were the recording
    process's) and its comparison key made anew."""
    DTensorSpec, OpSchema = torch_private("dtensor.DTensorSpec"), torch_private("dtensor.OpSchema")
    if not isinstance(schema, OpSchema):
        raise BadRecord(f"a record holds a {type(schema).__name__}, not an operation")

    def walk(value: Any) -> None:
        if isinstance(value, DTensorSpec):
            object.__setattr__(value, "_hash", None)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)

    walk(schema.args_schema)
    walk(schema.kwargs_schema)
    schema._recompute_comparison_key()
    return schema


def _ask_python_cache(valueless: dict[Any, Any]) -> None:
    """From now on in this process, a decision DTensor's native cache misses is looked up in
    its Python cache (where the spare made them) before it is made anew; a pointwise one with
    float operands, by its operands' specs (``valueless``)."""
    disp = torch_private("dtensor.op_dispatcher")
    original: Callable[..., Any] = disp._propagate_op_sharding_dispatch_slow_path

    def asking(op_call: Any, args: Any, kwargs: Any, op_info: Any, try_cache: bool) -> Any:
        if valueless and op_info.schema is not None:
            key = _valueless(op_info.schema)
            found = valueless.get(key) if key is not None else None
            if found is not None:
                return found
        return original(op_call, args, kwargs, op_info, True)

    disp._propagate_op_sharding_dispatch_slow_path = asking


_POINTWISE: set[Any] = set()
_FLOAT = 1.0  # what every float operand is taken to be in a valueless key


def _valueless(schema: Any) -> Any:
    """``schema`` with each float operand the same (a key), when its operation is one of
    DTensor's pointwise ones and has one; else None. A pointwise operation's sharding rules
    depend on which operands are tensors and which are scalars, never on a scalar's value
    (torch/distributed/tensor/_ops/_pointwise_ops.py): its decision for one float holds for
    every other - where it moves no operand (one that does carries the values it moves with)."""
    import dataclasses

    if not _POINTWISE:
        OpOverload = torch_private("ops.OpOverload")
        _POINTWISE.update(op for value in vars(torch_private("dtensor.pointwise_ops")).values()
                          if isinstance(value, list) for op in value
                          if isinstance(op, OpOverload))
    if schema.op not in _POINTWISE or not any(type(a) is float for a in schema.args_schema):
        return None
    key = dataclasses.replace(schema, args_schema=tuple(
        _FLOAT if type(a) is float else a for a in schema.args_schema))
    key._recompute_comparison_key()
    return key

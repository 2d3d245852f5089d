"""A job's device mesh that outlives its generations.

An FSDP2 or tensor-parallel model holds DTensor parameters bound to a ``DeviceMesh``, and the mesh
holds the process groups of its dimensions. nonstop forms a new process group every generation; a
mesh built on one generation's groups would be dead in the next. So the mesh is built once per
process, on *lasting* groups: one ``ProcessGroup`` object per mesh dimension that forwards every
collective to the group of the current generation, put inside it when the generation forms. The
mesh, the DTensors and FSDP2's state all keep their references; only what is inside changes. A rank
keeps its coordinates across generations (a replacement takes the rank, so the coordinates, of the
process it replaces), so its shards stay valid in its memory.

``Mesh`` is what a script declares: the names and shape of the mesh, and its own function that
parallelises the model over it (``fully_shard``...) and returns the ``nonstop.State`` to keep. The
function runs once per process, when the first generation's groups exist, before any state is
restored: a replacement builds its shards' structure, then receives their contents.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from ..errors import ScriptSetupError
from ..torch_internals import get as torch_private
from .lasting import lasting_group_type, never, register

class MeshError(ValueError):
    """The declared mesh does not fit the job (a shape that is not the world's size...)."""


class Mesh:
    """A device mesh for a sharded or model-parallel job, and the script's own way to parallelise
    its model over it. Give it to ``nonstop.wrap`` in place of a ``State``.

    ``dims``: the names of the mesh's dimensions, outermost first (``("dp_replicate",
    "dp_shard")``). ``shape``: their sizes; one may be -1 (the rest of the world). ``build``: a
    function of the ``DeviceMesh`` that applies ``fully_shard`` (or ``parallelize_module``) to
    the model, creates the optimizer, and returns the ``nonstop.State`` of what to keep. It runs
    once per process; in every later generation the same mesh (``ctx.mesh``) and the same sharded
    objects are used again, with the new generation's groups inside.

    ``stages``: the name of a dimension whose ranks hold different state that is no DTensor - a
    pipeline's stages (``torch.distributed.pipelining``), one per rank along it. nonstop finds the
    dimensions that DTensors are sharded along by itself; it cannot tell that two plain tensors
    of the same name are two stages' different weights. The ranks that differ only along the
    other dimensions (data parallel) hold the same state: twins, each other's copies.

    Example::

        def parallelize(mesh):
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            return nonstop.State(model=model, optimizer=torch.optim.AdamW(model.parameters()))

        @nonstop.wrap(nonstop.Mesh(("dp_shard",), (-1,), parallelize))
        def train(ctx):
            optimizer = ctx.state["optimizer"]
            ...
    """

    def __init__(self, dims: tuple[str, ...] | list[str], shape: tuple[int, ...] | list[int],
                 build: Callable[[Any], Any], device_type: str = "cpu",
                 stages: str | None = None):
        dims, shape = tuple(dims), tuple(shape)
        if not dims or not all(isinstance(d, str) and d for d in dims) or len(set(dims)) != len(dims):
            raise MeshError(f"nonstop.Mesh: dims must be distinct non-empty names, not {dims!r}")
        if len(shape) != len(dims):
            raise MeshError(f"nonstop.Mesh: {len(dims)} dims {dims!r} but a shape of "
                            f"{len(shape)} {shape!r}")
        if not all(isinstance(n, int) and not isinstance(n, bool) and (n > 0 or n == -1)
                   for n in shape) or shape.count(-1) > 1:
            raise MeshError(f"nonstop.Mesh: shape must be positive sizes, at most one of them -1, "
                            f"not {shape!r}")
        if not callable(build):
            raise MeshError("nonstop.Mesh: build must be a function of the mesh that returns a "
                            "nonstop.State")
        if device_type not in ("cpu", "cuda"):
            raise MeshError(f"nonstop.Mesh: device_type is 'cpu' or 'cuda', not {device_type!r}")
        if stages is not None and stages not in dims:
            raise MeshError(f"nonstop.Mesh: stages names one of the dims {dims!r}, not {stages!r}")
        self.dims, self.shape, self.build, self.device_type = dims, shape, build, device_type
        self.stages = stages

    def sizes(self, world: int) -> tuple[int, ...]:
        """The shape for a world of ``world`` ranks (-1 filled in)."""
        known = math.prod(n for n in self.shape if n != -1)
        if -1 in self.shape:
            if world % known:
                raise MeshError(f"a mesh {dict(zip(self.dims, self.shape))} needs a multiple of "
                                f"{known} ranks; the job has {world}")
            return tuple(world // known if n == -1 else n for n in self.shape)
        if known != world:
            raise MeshError(f"a mesh {dict(zip(self.dims, self.shape))} needs {known} ranks; "
                            f"the job has {world}")
        return self.shape

    def __repr__(self) -> str:
        return f"nonstop.Mesh({self.dims!r}, {self.shape!r})"


def coordinates(rank: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
    """The mesh coordinates of ``rank`` (row-major, as ``init_device_mesh`` lays ranks out)."""
    out = []
    for n in reversed(sizes):
        rank, i = divmod(rank, n)
        out.append(i)
    return tuple(reversed(out))


def group_ranks(rank: int, sizes: tuple[int, ...], dim: int) -> list[int]:
    """The ranks of ``rank``'s group along mesh dimension ``dim``: its coordinates with that one
    running over its size, in order."""
    coord = list(coordinates(rank, sizes))
    out = []
    for i in range(sizes[dim]):
        coord[dim] = i
        flat = 0
        for c, n in zip(coord, sizes):
            flat = flat * n + c
        out.append(flat)
    return out


def stale_optimizer(state: Any) -> str | None:
    """The name of a registered optimizer none of whose parameters is a registered sharded
    module's: one made before ``fully_shard`` replaced the module's parameters (it would step
    tensors the model no longer uses, and the model would not train). None if none."""
    import torch

    from ..state.shards import is_dtensor

    params = [p for m in state.modules() for p in m.parameters()]
    if not any(is_dtensor(p) for p in params):
        return None
    ids = {id(p) for p in params}
    for name, obj in state.objects().items():
        if isinstance(obj, torch.optim.Optimizer):
            held = [p for g in obj.param_groups for p in g["params"]]
            if held and not any(id(p) in ids for p in held):
                return name
    return None


class JobMesh:
    """This process's mesh: its lasting groups, the ``DeviceMesh`` over them, and the state the
    script's ``build`` returned. ``form`` puts each new generation's groups inside."""

    def __init__(self, spec: Mesh):
        self.spec = spec
        self.sizes: tuple[int, ...] | None = None
        self.rank: int | None = None
        self.groups: list[Any] = []  # one lasting group per dimension: this rank's
        self.ranks: list[list[int]] = []  # their members (global ranks)
        self.device_mesh: Any = None
        self.state: Any = None
        self.gen: int | None = None
        self.logical: tuple[int, ...] | None = None  # the full mesh's sizes (sizes: this world's)
        self.split: set[int] | None = None  # dimensions some tensor is sharded along

    def form(self, gen: int, rank: int, world: int, full_world: int = 0,
             aborted: Callable[[], bool] = never, abandoned: list | None = None) -> None:
        """Put generation ``gen``'s groups inside the lasting ones (creating them, and the mesh,
        the first time). Called by every rank of the generation, right after its default group
        formed: every subgroup is formed by its own members (in the same order on each).

        The mesh is the job's full one (``full_world`` ranks). A world that shrank by whole
        replica groups (HSDP) has fewer along the first dimension: the same logical mesh, its
        first dimension's groups smaller (a lasting group says its current size), every rank
        keeping its coordinates along the others (its shard)."""
        import torch.distributed as dist

        logical = self.spec.sizes(full_world or world)
        current = self._current(logical, world)
        coord = coordinates(rank, current)
        if self.sizes is None:
            self.logical = logical
            lasting = lasting_group_type()
            self.groups = [lasting(coord[d], logical[d], f"nonstop:{name}")
                           for d, name in enumerate(self.spec.dims)]
        elif logical != self.logical or coord[1:] != coordinates(self.rank, self.sizes)[1:]:
            raise MeshError(f"rank {self.rank} of a mesh {dict(zip(self.spec.dims, self.sizes))} "
                            f"was assigned rank {rank} of a mesh "
                            f"{dict(zip(self.spec.dims, current))}: a sharded job keeps its "
                            "shard (only whole replica groups may leave and come back)")
        self.sizes, self.rank = current, rank
        self.ranks = [group_ranks(rank, current, d) for d in range(len(current))]
        default = torch_private("c10d.get_default_group")()
        formed: dict[tuple[int, ...], Any] = {tuple(range(world)): default}
        for lasting, members in zip(self.groups, self.ranks):
            key = tuple(members)
            if key not in formed:
                formed[key] = dist.new_group(members, use_local_synchronization=True)
            lasting.inner = formed[key]
            lasting.aborted = aborted
            lasting.abandoned = abandoned if abandoned is not None else []
            lasting.gloo = formed[key]._get_backend_name() == "gloo"
            register(lasting, lasting.group_name, members, formed[key])
        self.gen = gen
        if self.device_mesh is None:
            self.device_mesh = self._device_mesh()

    def _current(self, logical: tuple[int, ...], world: int) -> tuple[int, ...]:
        """The mesh of a world of ``world`` ranks: the logical one, with fewer along the first
        dimension when whole replica groups are away (only along a replicated one)."""
        total = math.prod(logical)
        if world == total:
            return logical
        rest = math.prod(logical[1:])
        if len(logical) < 2 or world % rest or not 0 < world < total:
            raise MeshError(f"a mesh {dict(zip(self.spec.dims, logical))} cannot run on {world} "
                            f"ranks: only whole replica groups ({rest} ranks each) may leave")
        if self.split is not None and 0 in self.split:
            raise MeshError(f"the mesh's first dimension ({self.spec.dims[0]!r}) shards tensors: "
                            f"the job cannot run on {world} of its {total} ranks")
        return (world // rest,) + logical[1:]

    def _device_mesh(self) -> Any:
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        assert self.logical is not None
        layout = torch.arange(math.prod(self.logical), dtype=torch.int).reshape(self.logical)
        if len(self.groups) == 1:
            return DeviceMesh.from_group(self.groups[0], self.spec.device_type,
                                         mesh_dim_names=self.spec.dims)
        return DeviceMesh.from_group(self.groups, self.spec.device_type, mesh=layout,
                                     mesh_dim_names=self.spec.dims)

    def twins(self, state: Any) -> tuple[int, ...] | None:
        """For each rank of this generation's mesh, which shard of ``state`` it holds: its
        coordinates along the dimensions some sharded tensor is split over. Ranks that differ
        only along the rest (HSDP's replica dimension, where every tensor is replicated) hold the
        same state: twins. None when every rank holds its own (no dimension is replicated)."""
        assert self.sizes is not None
        if self.split is None:
            self.split = self._split(state)
        return self._twins(self.sizes)

    def twins_at(self, world: int) -> tuple[int, ...] | None:
        """``twins`` of the full mesh of a job of ``world`` ranks (its free dimension taking the
        rest): which shard each of its ranks held - a checkpoint's, written at another size."""
        assert self.split is not None, "twins_at before twins"
        return self._twins(self.spec.sizes(world))

    def _twins(self, sizes: tuple[int, ...]) -> tuple[int, ...] | None:
        assert self.split is not None
        if len(self.split) == len(sizes):
            return None
        out = []
        for rank in range(math.prod(sizes)):
            coord = coordinates(rank, sizes)
            shard = 0
            for d in sorted(self.split):
                shard = shard * sizes[d] + coord[d]
            out.append(shard)
        return tuple(out)

    def _split(self, state: Any) -> set[int]:
        """The dimensions some sharded parameter of ``state`` is split along, and the pipeline's
        (all of them when a parameter's mesh is not this one's)."""
        import torch

        from ..state.shards import is_dtensor

        split: set[int] = set() if self.spec.stages is None else {
            self.spec.dims.index(self.spec.stages)}
        for obj in state.objects().values():
            if not isinstance(obj, torch.nn.Module):
                continue
            for p in obj.parameters():
                if not is_dtensor(p):
                    continue
                names = p.device_mesh.mesh_dim_names
                if not names or any(n not in self.spec.dims for n in names):
                    return set(range(len(self.spec.dims)))  # flattened or foreign: no twins
                for name, placement in zip(names, p.placements):
                    if not placement.is_replicate():
                        split.add(self.spec.dims.index(name))
        return split

    def check_twins(self, state: Any) -> None:
        """At the job's first generation, where every rank built its state from the script and
        none was restored: the ranks this mesh makes copies of each other (twins) must hold the
        same parameters - shapes and values - or a lost rank would be given a twin's wrong ones.
        A collective of the whole world. Raises ``ScriptSetupError`` saying what to declare."""
        twins = state.twins
        if twins is None:
            return
        import xxhash

        from ..state.digest import digest, gather_words

        layout = xxhash.xxh3_64()
        for m in state.modules():
            for name, p in m.named_parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                layout.update(f"{name}:{tuple(local.shape)}:{local.dtype};".encode())
        rows = gather_words([layout.intdigest() - 2**63, digest(state.modules())], len(twins))
        for r, part in enumerate(twins):
            first = twins.index(part)
            if rows[r] == rows[first]:
                continue
            a, b = coordinates(first, self.sizes), coordinates(r, self.sizes)
            along = [n for n, x, y in zip(self.spec.dims, a, b) if x != y]
            what = "parameters of other names or shapes" if rows[r][0] != rows[first][0] else \
                "other parameter values"
            raise ScriptSetupError(
                f"ranks {first} and {r} hold {what}, but the mesh makes them copies of each other "
                f"(they differ only along {', '.join(map(repr, along))}): declare a dimension "
                "whose ranks hold different plain tensors - a pipeline's stages - with "
                "nonstop.Mesh(..., stages=NAME), and build copies from the same seed")

    def regrid_unit(self, twins: tuple[int, ...] | None) -> int | None:
        """For a mesh whose first dimension is the free one (-1) and shards the state, with no
        dimension that replicates it: the ranks per index of that dimension (the block a
        shrink drops and a growth adds). -1 for a mesh with no replicated dimension that
        cannot change size (no free dimension, or another one is free). None when the world
        changes by whole replica groups whose survivors go on live."""
        if twins is not None or self.split is None or self.sizes is None:
            return None
        if 0 not in self.split or self.spec.shape[0] != -1 or self.spec.stages is not None:
            return -1
        return math.prod(self.sizes[1:])

    def replica_group(self, twins: tuple[int, ...] | None) -> list[int] | None:
        """The ranks of this rank's replica group: those holding one shard each of a whole copy
        (the same coordinates along the dimensions its twins differ in - those every tensor is
        replicated along). None without twins (every rank's state is its own)."""
        if twins is None or self.rank is None or self.sizes is None:
            return None
        sizes, me = self.sizes, self.rank
        mine = coordinates(me, sizes)
        copies = [coordinates(r, sizes) for r in range(len(twins)) if twins[r] == twins[me]]
        replicated = [d for d in range(len(sizes)) if len({c[d] for c in copies}) > 1]
        return [r for r in range(len(twins))
                if all(coordinates(r, sizes)[d] == mine[d] for d in replicated)]

    def misbuilt(self, state: Any) -> str | None:
        """What is wrong with the state the build function returned, in one line saying what to
        change: a module sharded over a mesh of its own, an optimizer made before the sharding
        (None: nothing found)."""
        stray = self.foreign(state)
        if stray is not None:
            return (f"{stray} is sharded over a mesh other than the one nonstop.Mesh gives the "
                    "build function (fully_shard without mesh= builds its own, on groups that "
                    "end with their generation): pass it the build function's mesh")
        stale = stale_optimizer(state)
        if stale is not None:
            return (f"the optimizer {stale!r} holds none of the sharded model's parameters: it "
                    "was made before fully_shard replaced them, and would train nothing - make "
                    "it in the build function, after the sharding")
        return None

    def foreign(self, state: Any) -> str | None:
        """The first sharded parameter of ``state`` whose mesh is not built on this job's lasting
        groups (``fully_shard`` given no mesh builds its own on the generation's default group,
        which ends with it), as ``"name.param"``; None when all are."""
        import torch

        from ..state.shards import is_dtensor

        ours = {g.group_name for g in self.groups}
        for name, obj in state.objects().items():
            if not isinstance(obj, torch.nn.Module):
                continue
            for pname, p in obj.named_parameters():
                if not is_dtensor(p):
                    continue
                names = getattr(p.device_mesh, "_dim_group_names", None) or []
                if not names or any(n not in ours for n in names):
                    return f"{name}.{pname}"
        return None

    def leave(self) -> None:
        """The generation ended: nothing is inside the lasting groups until the next forms."""
        for lasting in self.groups:
            lasting.inner, lasting.aborted, lasting.abandoned = None, never, []

    def coordinates(self) -> dict[str, int]:
        assert self.sizes is not None and self.rank is not None
        return dict(zip(self.spec.dims, coordinates(self.rank, self.sizes)))

"""The parallel layouts the benchmark jobs train a ``torch.nn.Sequential`` in (bench/job.py,
bench/elastic_job.py): the mesh of each, and what a rank does for one over it - FSDP2 / HSDP
sharding, tensor parallel, a pipeline stage and its schedule. Imported by the jobs (rank
processes): torch is imported inside the functions."""

from __future__ import annotations

from typing import Any, Callable

# layout -> (the mesh's dimensions, its shape, the data-parallel dimensions)
MESH = {
    "fsdp": (("dp_shard",), (-1,), ("dp_shard",)),
    "hsdp": (("dp_replicate", "dp_shard"), (2, -1), ("dp_replicate", "dp_shard")),
    "2d": (("dp_shard", "tp"), (-1, 2), ("dp_shard",)),
    "3d": (("dp_replicate", "dp_shard", "tp"), (2, -1, 2), ("dp_replicate", "dp_shard")),
    "pp": (("dp", "pp"), (-1, 2), ("dp",)),
}


def sizes(layout: str, world: int) -> tuple[int, ...]:
    """The layout's mesh shape for ``world`` ranks (-1 filled in)."""
    shape = MESH[layout][1]
    known = 1
    for n in shape:
        known *= n if n != -1 else 1
    return tuple(world // known if n == -1 else n for n in shape)


def shard(model: Any, mesh: Any, layout: str) -> None:
    """Tensor parallel first (2d, 3d: the first Linear by columns, the second by rows), then
    FSDP2 over the data-parallel dimensions, each Linear a unit, then the root."""
    from torch.distributed.fsdp import fully_shard

    if layout in ("2d", "3d"):
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)

        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()},
                           src_data_rank=None)
    dims = MESH[layout][2]
    dp = mesh if len(dims) == len(mesh.mesh_dim_names) else mesh[dims] if len(dims) > 1 \
        else mesh[dims[0]]
    import torch

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)


def stage(model: Any, mesh: Any) -> Any:
    """pp: this rank's stage - the model with the other stages' layers replaced by Identity, so
    that its parameters keep the whole model's names (unique to a stage)."""
    import torch

    s, n = mesh["pp"].get_local_rank(), mesh["pp"].size()
    children = list(model)
    per = -(-len(children) // n)
    return torch.nn.Sequential(*[c if s * per <= i < (s + 1) * per else torch.nn.Identity()
                                 for i, c in enumerate(children)])


def dp_position(mesh: Any, layout: str) -> tuple[int, int]:
    """This rank's data-parallel group and how many there are now (the groups' own rank and
    size: a mesh's are the full mesh's, and a shrunk job's groups are fewer)."""
    index, size = 0, 1
    for name in MESH[layout][2]:
        group = mesh[name].get_group()
        index, size = index * group.size() + group.rank(), size * group.size()
    return index, size


def average(params: Any, group: Any) -> None:
    """The mean over ``group`` of each parameter's gradient (one flat all-reduce: the same bits
    on every rank of the group)."""
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    if group.size() == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= group.size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


class Pipeline:
    """pp: this generation's ``PipelineStage`` and GPipe schedule over ``mesh["pp"]`` (they hold
    a step's buffers: made again for each generation), and a step through them, the stage's
    gradients then averaged over the data-parallel groups."""

    def __init__(self, module: Any, mesh: Any, loss_fn: Callable[..., Any],
                 microbatches: int = 2):
        import torch
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        self.module, self.mesh = module, mesh
        self.s, self.n = mesh["pp"].get_local_rank(), mesh["pp"].size()
        st = PipelineStage(module, self.s, self.n, torch.device("cpu"),
                           group=mesh["pp"].get_group())
        self.schedule = ScheduleGPipe(st, n_microbatches=microbatches, loss_fn=loss_fn)

    def step(self, x: Any, y: Any) -> None:
        if self.s == 0:
            self.schedule.step(x)
        elif self.s == self.n - 1:
            self.schedule.step(target=y)
        else:
            self.schedule.step()
        average(self.module.parameters(), self.mesh["dp"].get_group())


def gathered(model: Any, mesh: Any, layout: str, module: Any = None) -> dict[str, Any]:
    """The full parameters (a collective: every rank calls it): DTensors gathered, or every
    pipeline stage's (``module``: this rank's) from the ranks of its ``pp`` group."""
    import torch.distributed as dist

    if layout != "pp":
        return {k: v.full_tensor() for k, v in model.state_dict().items()}
    every: list[Any] = [None] * mesh["pp"].size()
    dist.all_gather_object(every, module.state_dict(), group=mesh["pp"].get_group())
    return {k: v for part in every for k, v in part.items()}

"""FSDP2 with tensor parallelism (a 2-D mesh ``(dp_shard, tp)``) made restartable with nonstop.

    nonstop run --nproc 4 --spares 1 examples/train_2d.py --steps 100 --save final.pt

Each block's MLP is split across the ``tp`` dimension (``parallelize_module``: the first Linear
by columns, the second by rows), then each block is sharded with FSDP2 across ``dp_shard``. The
ranks of one ``tp`` group see the same data; the ``dp_shard`` groups see different parts of the
global batch. A lost rank's replacement builds the same structure at the same coordinates, alone
(its peers wait in the restore), then receives its part.

With ``--replicas R`` (examples/train_3d.py: 2) the mesh is 3-D, ``(dp_replicate, dp_shard, tp)`` =
``(R, -1, tp)``: HSDP across the two data-parallel dimensions, tensor parallel within ``tp``. A
lost rank's twin - the same ``(dp_shard, tp)`` position in another replica group - holds its
part, and sends it live.

The build function must not communicate: ``parallelize_module`` sends rank 0's weights to the
other ranks of each ``tp`` group unless given ``src_data_rank=None``, and a replacement's peers
are not there to receive them. With ``src_data_rank=None`` each rank keeps its part of the
weights it built itself, the same on every rank (one seed); nonstop refuses a build that
communicates, at the job's start, with this advice.
"""

import argparse

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import nonstop
from nonstop.examples import pace

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--dim", type=int, default=16)
parser.add_argument("--blocks", type=int, default=2)
parser.add_argument("--tp", type=int, default=2, help="the tensor-parallel degree")
parser.add_argument("--replicas", type=int, default=1,
                    help="replica groups (HSDP): above 1, a 3-D mesh (dp_replicate, dp_shard, tp)")
pace.add_arguments(parser)
parser.add_argument("--save", help="rank 0 writes the final (full) parameters here")
parser.add_argument("--device", default="cpu", help="cpu, or cuda (the parts live on the GPU)")
parser.add_argument("--backend", default="gloo", help="gloo, or nccl (with --device cuda)")
args = parser.parse_args()


class Block(torch.nn.Module):
    """A residual MLP block, its two Linears split across the tensor-parallel ranks."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(torch.nn.Module):
    def __init__(self, dim: int, blocks: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(dim) for _ in range(blocks))
        self.head = torch.nn.Linear(dim, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


torch.manual_seed(args.seed)
model = Model(args.dim, args.blocks)  # the same initial weights on every rank (one seed)


DP = ("dp_replicate", "dp_shard") if args.replicas > 1 else ("dp_shard",)


def parallelize(mesh):
    """Tensor parallel within ``tp``, then FSDP2 across ``dp_shard`` (HSDP with ``dp_replicate``
    too). Runs once per process."""
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    dp = mesh[DP] if len(DP) > 1 else mesh["dp_shard"]
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], plan, src_data_rank=None)
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return nonstop.State(model=model, optimizer=optimizer)


def batch(step, ctx):
    """This data-parallel group's part of the step's global batch (8 samples per group of the
    full mesh: the same global batch while a replica group is away)."""
    g = torch.Generator().manual_seed(nonstop.step_seed(args.seed, step, 0))
    x = torch.randn(8 * (ctx.full_world_size // args.tp), args.dim, generator=g)
    index, size = dp_position(ctx.mesh)
    share = len(x) // size
    x = x[share * index:share * (index + 1)]
    x = x.to(args.device)
    return x, x.sum(dim=1, keepdim=True).sin()


MESH = (nonstop.Mesh(("dp_shard", "tp"), (-1, args.tp), parallelize, device_type=args.device)
        if args.replicas == 1 else
        nonstop.Mesh(DP + ("tp",), (args.replicas, -1, args.tp), parallelize,
                     device_type=args.device))


def dp_position(mesh):
    """This rank's data-parallel group and how many there are (over both dimensions of HSDP)."""
    index, size = 0, 1
    for name in DP:  # this generation's groups (a mesh's own sizes are the full mesh's)
        group = mesh[name].get_group()
        index, size = index * group.size() + group.rank(), size * group.size()
    return index, size


@nonstop.wrap(MESH, backend=args.backend)
def train(ctx):
    optimizer = ctx.state["optimizer"]
    for step in ctx.steps(args.steps):
        x, y = batch(step, ctx)
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ctx.report(loss)
        pace.pause(args)
        if ctx.rank == 0 and step % 25 == 0:
            print(f"step {step} loss {loss.item():.4f} (generation {ctx.generation})")
    # every rank takes part in gathering the full parameters (rank 0 keeps them)
    full = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
    return full if ctx.rank == 0 else None


full = train()
if full is not None and args.save:
    torch.save(full, args.save)

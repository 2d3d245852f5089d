"""FSDP2 (``fully_shard``) made restartable with nonstop; HSDP with ``--replicas R``.

    nonstop run --nproc 4 --spares 1 examples/train_fsdp.py --steps 100 --save final.pt

With ``--replicas R`` (examples/train_hsdp.py: 2) the mesh is ``(dp_replicate, dp_shard)`` =
``(R, world / R)``: R replica groups of sharded ranks (HSDP). Each rank then has a twin, the rank
at the same shard position in another replica group, that holds the same shard: a lost rank's
replacement receives its shard live from it, peer to peer, checked by digest - nothing is lost
even without a snapshot at every step. Plain FSDP has no twin: every rank resumes from the newest
snapshot all shards have.

The change from a plain FSDP2 script: the sharding and the optimizer move into a function of the
mesh, given to ``nonstop.wrap`` with the mesh's names and shape (``nonstop.Mesh``). nonstop runs
it once per process, on a mesh whose groups it renews every generation: after a failure the
survivors keep their shards and their optimizer state in memory, and a replacement builds the same
structure at the same mesh coordinates before its shard is restored into it. The same script runs
under torchrun or plain python (a plain ``init_device_mesh`` then).
"""

import argparse

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import nonstop
from nonstop.examples import pace

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--dim", type=int, default=32)
parser.add_argument("--blocks", type=int, default=2)
parser.add_argument("--replicas", type=int, default=1,
                    help="replica groups (HSDP's dp_replicate); 1: plain FSDP over every rank")
pace.add_arguments(parser)
parser.add_argument("--save", help="rank 0 writes the final (full) parameters here")
parser.add_argument("--device", default="cpu", help="cpu, or cuda (the shards live on the GPU)")
parser.add_argument("--backend", default="gloo", help="gloo, or nccl (with --device cuda)")
args = parser.parse_args()


class Block(torch.nn.Module):
    """A small transformer block: self-attention and an MLP, each with a residual."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        # (no projection biases: the keys' bias gets no gradient but rounding noise, which Adam
        # would amplify into steps of the learning rate's size)
        self.attn = torch.nn.MultiheadAttention(dim, num_heads=4, batch_first=True, bias=False)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                       torch.nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Model(torch.nn.Module):
    def __init__(self, dim: int, blocks: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(dim) for _ in range(blocks))
        self.head = torch.nn.Linear(dim, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).mean(dim=1)


torch.manual_seed(args.seed)
model = Model(args.dim, args.blocks)  # the same initial weights on every rank (one seed)


def parallelize(mesh):
    """The script's own FSDP2 (HSDP on a 2-D mesh): each block a unit, then the root. Runs once
    per process."""
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return nonstop.State(model=model, optimizer=optimizer)


def batch(step, ctx):
    """This rank's share of the step's global batch (8 samples per rank of the full world): the
    same global batch whatever the world, should a replica group be away (HSDP)."""
    g = torch.Generator().manual_seed(nonstop.step_seed(args.seed, step, 0))
    x = torch.randn(8 * ctx.full_world_size, 6, args.dim, generator=g)
    mine = ctx.share(len(x))
    x = x[mine.start:mine.stop]
    return x.to(args.device), x.sum(dim=(1, 2)).sin().unsqueeze(1).to(args.device)


MESH = (nonstop.Mesh(("dp_shard",), (-1,), parallelize, device_type=args.device)
        if args.replicas == 1 else
        nonstop.Mesh(("dp_replicate", "dp_shard"), (args.replicas, -1), parallelize,
                     device_type=args.device))


@nonstop.wrap(MESH, backend=args.backend)
def train(ctx):
    optimizer = ctx.state["optimizer"]
    for step in ctx.steps(args.steps):
        x, y = batch(step, ctx)
        # the summed loss weighted so that the gradient FSDP2 averages over the ranks is the
        # global batch's mean, however the batch splits (a world that shrank by one rank)
        weight = ctx.world_size / (8 * ctx.full_world_size)
        loss = F.mse_loss(model(x), y, reduction="sum") * weight
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

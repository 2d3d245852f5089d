"""Sharded optimizer state (ZeRO-1 style) made restartable with nonstop.

    nonstop run --nproc 4 --nodes 2 examples/train_sharded.py --steps 200 --save final.pt

Each rank keeps Adam's state only for the parameters it owns (the parameters are dealt out so
that every rank owns about as many numbers): after the gradients are reduced, each rank updates its
own parameters and sends them to the others. A rank's optimizer state exists nowhere else, so ``State(..., sharded=True)`` tells
nonstop to restore each rank from its own snapshot (its node's memory, the replica on its buddy
node, or its part of a disk checkpoint), every rank at one common step.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import nonstop
from nonstop.examples import pace

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--hidden", type=int, default=64)
pace.add_arguments(parser)
parser.add_argument("--save", help="rank 0 writes the final parameters here")
parser.add_argument("--device", default="cpu", help="cpu, or cuda (the state lives on the GPU; "
                    "snapshots copy it to host memory)")
parser.add_argument("--backend", default="gloo", help="gloo, or nccl (with --device cuda)")
args = parser.parse_args()

torch.manual_seed(args.seed)
model = torch.nn.Sequential(torch.nn.Linear(16, args.hidden), torch.nn.Tanh(),
                            torch.nn.Linear(args.hidden, args.hidden), torch.nn.Tanh(),
                            torch.nn.Linear(args.hidden, 1)).to(args.device)
params = list(model.parameters())
optimizer = torch.optim.Adam(params, lr=1e-2)  # holds state only for the parameters it updates
state = nonstop.State(model=model, optimizer=optimizer, sharded=True)


def batch(step, rank):
    g = torch.Generator().manual_seed(nonstop.step_seed(args.seed, step, rank))
    x = torch.randn(32, 16, generator=g)
    return x.to(args.device), x.sum(dim=1, keepdim=True).sin().to(args.device)


def owners(world):
    """Who owns each parameter: the largest first, each to the rank that owns the fewest numbers."""
    load, owner = [0] * world, [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):
        owner[i] = min(range(world), key=lambda r: load[r])
        load[owner[i]] += params[i].numel()
    return owner


@nonstop.wrap(state, backend=args.backend)
def train(ctx):
    ddp = nonstop.reproducible(DDP(model))
    owner = owners(ctx.world_size)
    for step in ctx.steps(args.steps):
        x, y = batch(step, ctx.rank)
        loss = F.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        for p, o in zip(params, owner):
            if o != ctx.rank:
                p.grad = None  # not ours: Adam neither updates it nor keeps state for it
        optimizer.step()
        with torch.no_grad():
            for p, o in zip(params, owner):
                dist.broadcast(p.data, src=o)
        ctx.report(loss)
        pace.pause(args)
        if ctx.rank == 0 and step % 50 == 0:
            print(f"step {step} loss {loss.item():.4f} (generation {ctx.generation})")
    return ctx.rank


rank = train()
if rank == 0 and args.save:
    torch.save({k: v.cpu().clone() for k, v in model.state_dict().items()}, args.save)

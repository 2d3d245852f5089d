"""A DDP training loop made restartable with nonstop.

    nonstop run --nproc 4 --spares 1 examples/train_ddp.py --steps 200 --save final.pt

Build what survives restarts (model, optimizer, data) outside the wrapped function; build what
depends on the process group (DDP) inside it. Batches are a function of (step, rank), so no sample
is skipped or seen twice whatever happens. The same script runs under torchrun or plain python.
"""

import argparse

import torch
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
args = parser.parse_args()

torch.manual_seed(args.seed)
model = torch.nn.Sequential(torch.nn.Linear(16, args.hidden), torch.nn.Tanh(),
                            torch.nn.Linear(args.hidden, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
state = nonstop.State(model=model, optimizer=optimizer)


def batch(step, rank):
    g = torch.Generator().manual_seed(nonstop.step_seed(args.seed, step, rank))
    x = torch.randn(32, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


@nonstop.wrap(state)
def train(ctx):
    # reproducible(): gradients reduced independently of DDP's bucket layout, so the run ends
    # bit-for-bit where an uninterrupted run would (see docs/usage.md).
    ddp = nonstop.reproducible(DDP(model))
    for step in ctx.steps(args.steps):
        x, y = batch(step, ctx.rank)
        loss = F.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ctx.report(loss)
        pace.pause(args)
        if ctx.rank == 0 and step % 50 == 0:
            print(f"step {step} loss {loss.item():.4f} (generation {ctx.generation})")
    return ctx.rank


rank = train()
if rank == 0 and args.save:
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.save)

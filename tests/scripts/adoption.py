"""One training loop for each step of the adoption path (docs/usage.md), 2 ranks, a tiny model.

    adoption.py [--state] [--ctx-steps] [--report] [--steps N] [--sleep S] [--die-at I]
                [--hang-at I --hang-gen G] [--save PATH]

--state registers the model and optimizer in nonstop.State; --ctx-steps iterates ctx.steps instead
of range(). --die-at: rank 1 kills itself at iteration I in generation 0; --hang-at: rank 1 blocks
forever in its own code at iteration I in generation G. Neither needs nonstop's --inject (which
needs ctx.steps) nor tells nonstop anything. Rank 0 writes the final weights to PATH and the
optimizer steps its process did to PATH.json: the number the adoption tests count.
"""

import argparse
import json
import os
import signal
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import nonstop

parser = argparse.ArgumentParser()
parser.add_argument("--state", action="store_true")
parser.add_argument("--state-inside", action="store_true",
                    help="make the nonstop.State inside the training function, and give it to "
                         "nothing (a first draft's mistake)")
parser.add_argument("--ctx-steps", action="store_true")
parser.add_argument("--report", action="store_true")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--die-at", type=int)
parser.add_argument("--hang-at", type=int)
parser.add_argument("--hang-gen", type=int, default=0)
parser.add_argument("--save")
args = parser.parse_args()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
stepped = [0]  # optimizer steps this process did, whatever nonstop thinks
optimizer.register_step_post_hook(lambda *_: stepped.__setitem__(0, stepped[0] + 1))
state = nonstop.State(model=model, optimizer=optimizer) if args.state else None


def batch(i, rank):
    g = torch.Generator().manual_seed(nonstop.step_seed(0, i, rank))
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


@nonstop.wrap(state)
def train(ctx):
    if args.state_inside:
        nonstop.State(model=model, optimizer=optimizer)
    ddp = nonstop.reproducible(DDP(model))
    for i in (ctx.steps(args.steps) if args.ctx_steps else range(args.steps)):
        if ctx.rank == 1 and ctx.generation == 0 and i == args.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if ctx.rank == 1 and ctx.generation == args.hang_gen and i == args.hang_at:
            while True:
                time.sleep(1)
        x, y = batch(i, ctx.rank)
        loss = F.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if args.report:
            ctx.report(loss)
        if args.sleep:
            time.sleep(args.sleep)
    return ctx.rank


if train() == 0 and args.save:
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.save)
    with open(args.save + ".json", "w") as fh:
        json.dump({"optimizer_steps": stepped[0]}, fh)

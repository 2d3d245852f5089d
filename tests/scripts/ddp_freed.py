"""Checks that the DDP object (and with it the old process group) of a failed generation is freed
by the time the training function is entered again."""

import gc
import sys
import weakref

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import nonstop

model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
state = nonstop.State(model=model, optimizer=opt)
previous = []


@nonstop.wrap(state)
def train(ctx):
    alive = [r for r in previous if r() is not None]
    was_collectable = len(alive) > 0 and (gc.collect() or True) and all(r() is None for r in alive)
    if alive:
        print(f"LEAK generation {ctx.generation}: {len(alive)} old DDP object(s) alive at entry"
              f"{' (freed by a collection)' if was_collectable else ''}", flush=True)
    ddp = nonstop.reproducible(DDP(model))
    previous.append(weakref.ref(ddp))
    for step in ctx.steps(int(sys.argv[1])):
        x = torch.full((4, 8), 0.1 + 0.001 * step)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


train()

"""A sharded script whose build function has a bug of its own: a wrong argument to fully_shard
(``--mistake argument``), or no mesh given to it (``--mistake no_mesh``: fully_shard then builds
its own mesh, on groups that end with their generation), or the optimizer made before the
sharding (``--mistake stale_optimizer``: it holds the parameters fully_shard replaced)."""

import argparse

import torch
from torch.distributed.fsdp import fully_shard

import nonstop

p = argparse.ArgumentParser()
p.add_argument("--mistake", choices=["argument", "no_mesh", "stale_optimizer"],
               default="argument")
args = p.parse_args()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
early = torch.optim.Adam(model.parameters()) if args.mistake == "stale_optimizer" else None


def parallelize(mesh):
    if args.mistake == "no_mesh":
        fully_shard(model)
    elif args.mistake == "stale_optimizer":
        fully_shard(model, mesh=mesh)
        return nonstop.State(model=model, optimizer=early)
    else:
        fully_shard(model, mesh=mesh, reshard_after_forward="sometimes")  # not a bool or an int
    return nonstop.State(model=model)


@nonstop.wrap(nonstop.Mesh(("dp_shard",), (-1,), parallelize))
def train(ctx):
    for step in ctx.steps(5):
        model(torch.ones(2, 4)).sum().backward()


train()

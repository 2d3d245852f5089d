"""An FSDP2 script written as a new user first writes it: the mesh and fully_shard inside the
wrapped function, the module registered with nonstop.State. It trains, but its mesh's groups end
with their generation: after a fault nonstop must say what to change (nonstop.Mesh). With
``--unguarded`` a survivor's second entry meets FSDP2's refusal to shard a module twice first."""

import argparse

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import nonstop

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=20)
p.add_argument("--unguarded", action="store_true",
               help="shard at every entry of the wrapped function, as a first draft would")
args = p.parse_args()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
state = nonstop.State(model=model)


@nonstop.wrap(state)
def train(ctx):
    if args.unguarded or not getattr(model, "_sharded_by_script", False):  # (fully_shard takes
        # a module once per process)
        fully_shard(model, mesh=init_device_mesh("cpu", (ctx.world_size,)))
        model._sharded_by_script = True
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in ctx.steps(args.steps):
        g = torch.Generator().manual_seed(step * 100 + ctx.rank)
        x = torch.randn(8, 16, generator=g)
        loss = F.mse_loss(model(x), x.sum(1, keepdim=True).sin())
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.report(loss)
    return ctx.rank


train()

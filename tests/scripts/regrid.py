"""A small FSDP2 job (FSDP2 x tensor parallel with ``--tp 2``) that saves, at its end, the whole
of its state - every parameter and every optimizer state tensor gathered - so that a job started
again at another world size can be compared with the one that wrote the checkpoint, tensor by
tensor. Usage: regrid.py --steps N --save OUT [--tp 2]"""

import argparse

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import nonstop

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--tp", type=int, default=1)
parser.add_argument("--save", required=True)
args = parser.parse_args()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8),
                            torch.nn.LayerNorm(8))


def build(mesh):
    dp = mesh["dp_shard"]
    if args.tp > 1:
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()},
                           src_data_rank=None)
    fully_shard(model, mesh=dp)
    return nonstop.State(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))


MESH = (nonstop.Mesh(("dp_shard",), (-1,), build) if args.tp == 1 else
        nonstop.Mesh(("dp_shard", "tp"), (-1, args.tp), build))


def whole(value):
    return value.full_tensor() if hasattr(value, "full_tensor") else value


@nonstop.wrap(MESH)
def train(ctx):
    optimizer = ctx.state["optimizer"]
    for step in ctx.steps(args.steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 8, generator=g)
        loss = F.mse_loss(model(x), x.flip(1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ctx.report(loss)
    # every rank takes part in gathering (rank 0 keeps the whole)
    params = {k: whole(v) for k, v in model.state_dict().items()}
    moments = {f"{i}.{k}": whole(v) for i, s in optimizer.state_dict()["state"].items()
               for k, v in s.items()}
    return {"params": params, "optimizer": moments} if ctx.rank == 0 else None


out = train()
if out is not None:
    torch.save(out, args.save)

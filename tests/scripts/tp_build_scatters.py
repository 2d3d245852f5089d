"""A tensor-parallel script whose build function communicates: ``parallelize_module`` left at its
default ``src_data_rank=0`` scatters rank 0's weights over the ``tp`` group - which a replacement,
building alone, would wait on forever."""

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import nonstop

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8))


def parallelize(mesh):
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
    return nonstop.State(model=model)


@nonstop.wrap(nonstop.Mesh(("tp",), (-1,), parallelize))
def train(ctx):
    for step in ctx.steps(3):
        model(torch.ones(2, 4)).sum().backward()


train()

"""A DDP job whose replicas do not compute the same thing: the ranks named in
NONSTOP_TEST_DIVERGE_RANKS (comma-separated) take their learning rate from NONSTOP_TEST_DIVERGE_LR
from step NONSTOP_TEST_DIVERGE_FROM on - an argument that differs between ranks, as a
misconfigured host would. Their parameters then differ from the others' at every comparison,
whatever rank is replaced and however far the job rolls back: a divergence, not a corruption.

    nonstop run --nproc 3 tests/scripts/sdc_diverge.py --steps 20
"""

import argparse
import os

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import nonstop

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--save")
args = parser.parse_args()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
state = nonstop.State(model=model, optimizer=optimizer)
ODD = {int(r) for r in os.environ.get("NONSTOP_TEST_DIVERGE_RANKS", "").split(",") if r}
FROM = int(os.environ.get("NONSTOP_TEST_DIVERGE_FROM", "0"))
LR = float(os.environ.get("NONSTOP_TEST_DIVERGE_LR", "0.1"))


@nonstop.wrap(state)
def train(ctx):
    ddp = nonstop.reproducible(DDP(model))
    for step in ctx.steps(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = LR if ctx.rank in ODD and step >= FROM else 0.05
        g = torch.Generator().manual_seed(nonstop.step_seed(0, step, ctx.rank))
        x = torch.randn(16, 16, generator=g)
        loss = F.mse_loss(ddp(x), x.sum(dim=1, keepdim=True).sin())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ctx.report(loss)
    return ctx.rank


rank = train()
if rank == 0 and args.save:
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.save)

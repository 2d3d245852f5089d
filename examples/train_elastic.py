"""Data-parallel training whose world may shrink and grow back, with the same global batch.

    nonstop run --nproc 4 --policy examples/policies/elastic.yaml examples/train_elastic.py --steps 200

Each step trains on one global batch of ``--global-batch`` samples, drawn by
``nonstop.GlobalBatchSampler`` from one seeded stream: every sample of an epoch once, in the same
order, whatever the number of ranks. Each rank takes its share (``ctx.share``: sizes differ by at
most one sample) and weights its summed loss by ``world / global_batch``, so the averaged gradient
is the global batch's mean at any world size. With ``--log-samples DIR`` each rank appends the
sample ids of every step it completes to ``DIR/samples.<pid>.jsonl`` (how the tests check that every
sample was seen exactly once).

``--sharded`` keeps the optimizer's state ZeRO-1 style, as examples/train_sharded.py does (each
rank owns some parameters, for the current world size): after a change of world size nonstop
merges every old shard and each rank keeps the state of the parameters it owns now.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import nonstop
from nonstop.examples import pace

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--samples", type=int, default=1024, help="dataset size")
parser.add_argument("--global-batch", type=int, default=48)
parser.add_argument("--hidden", type=int, default=32)
parser.add_argument("--optim", choices=["sgd", "adam"], default="sgd")
parser.add_argument("--sharded", action="store_true", help="ZeRO-1: optimizer state sharded")
pace.add_arguments(parser)
parser.add_argument("--save", help="rank 0 writes the final parameters here")
parser.add_argument("--log-samples", help="a directory: each rank logs the samples of its steps")
args = parser.parse_args()

torch.manual_seed(args.seed)
x = torch.randn(args.samples, 16, generator=torch.Generator().manual_seed(args.seed + 1))
dataset = TensorDataset(torch.arange(args.samples), x, x.sum(dim=1, keepdim=True).sin())
model = torch.nn.Sequential(torch.nn.Linear(16, args.hidden), torch.nn.Tanh(),
                            torch.nn.Linear(args.hidden, 1))
optimizer = (torch.optim.SGD(model.parameters(), lr=0.05) if args.optim == "sgd"
             else torch.optim.Adam(model.parameters(), lr=1e-2))
sampler = nonstop.GlobalBatchSampler(len(dataset), global_batch=args.global_batch, seed=args.seed)
state = nonstop.State(model=model, optimizer=optimizer, sampler=sampler, sharded=args.sharded)
params = list(model.parameters())


def owners(world):
    """Who owns each parameter: the largest first, each to the rank that owns the fewest numbers."""
    load, owner = [0] * world, [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):
        owner[i] = min(range(world), key=lambda r: load[r])
        load[owner[i]] += params[i].numel()
    return owner
log = None
if args.log_samples:
    os.makedirs(args.log_samples, exist_ok=True)
    log = open(os.path.join(args.log_samples, f"samples.{os.getpid()}.jsonl"), "a")


@nonstop.wrap(state)
def train(ctx):
    ddp = nonstop.reproducible(DDP(model))
    owner = owners(ctx.world_size) if args.sharded else None
    loader = DataLoader(dataset, batch_sampler=sampler.for_rank(ctx))
    for step, (ids, xb, yb) in zip(ctx.steps(args.steps), loader):
        optimizer.zero_grad()
        if len(ids):
            # the summed loss of this rank's share, weighted so that the gradient DDP averages
            # over the ranks is the mean over the whole global batch
            loss = F.mse_loss(ddp(xb), yb, reduction="sum") * ctx.world_size / args.global_batch
        else:  # a world larger than the batch: this rank has no sample, but joins the reduction
            loss = ddp(x[:1]).sum() * 0.0
        loss.backward()
        if owner is None:
            optimizer.step()
        else:  # only our parameters get a gradient (and optimizer state); then we send them
            for p, o in zip(params, owner):
                if o != ctx.rank:
                    p.grad = None
            optimizer.step()
            with torch.no_grad():
                for p, o in zip(params, owner):
                    dist.broadcast(p.data, src=o)
        ctx.report(loss)
        if log is not None:
            log.write(json.dumps({"step": step, "gen": ctx.generation, "rank": ctx.rank,
                                  "world": ctx.world_size, "ids": ids.tolist()}) + "\n")
            log.flush()
        pace.pause(args)
        if ctx.rank == 0 and step % 50 == 0:
            print(f"step {step} loss {loss.item():.4f} world {ctx.world_size} "
                  f"(generation {ctx.generation})")
    return ctx.rank


rank = train()
if rank == 0 and args.save:
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.save)

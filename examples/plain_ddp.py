"""A plain torchrun-style DDP script with no nonstop code in it.

    nonstop run --nproc 4 examples/plain_ddp.py --steps 100

nonstop runs it unchanged and recovers it the coarse way: on any failure every rank is restarted
(in a fresh store namespace). It resumes from its own checkpoint if it writes one; wrapping the
training function with nonstop.wrap (see train_ddp.py) is the next step of adoption.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--save", help="rank 0 writes the final parameters here")
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(args.steps):
    g = torch.Generator().manual_seed(step * world + rank)
    x = torch.randn(32, 16, generator=g)
    loss = F.mse_loss(model(x), x.sum(dim=1, keepdim=True))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if rank == 0 and step % 25 == 0:
        print(f"step {step} loss {loss.item():.4f} (restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')})")
if rank == 0 and args.save:
    torch.save(model.module.state_dict(), args.save)
dist.destroy_process_group()

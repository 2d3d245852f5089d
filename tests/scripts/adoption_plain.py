"""Step 1 of the adoption path: a torchrun-style script, unchanged (no nonstop in it).

    adoption_plain.py [--steps N] [--sleep S] [--die-at I] [--save PATH]

--die-at: rank 1 kills itself at iteration I in the first generation only. Rank 0 writes the final
weights to PATH and the optimizer steps its process did to PATH.json.
"""

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--die-at", type=int)
parser.add_argument("--save")
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
stepped = 0
for i in range(args.steps):
    if rank == 1 and first_attempt and i == args.die_at:
        os.kill(os.getpid(), signal.SIGKILL)
    g = torch.Generator().manual_seed(i * world + rank)
    x = torch.randn(16, 8, generator=g)
    loss = F.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    stepped += 1
    if args.sleep:
        time.sleep(args.sleep)
if rank == 0 and args.save:
    torch.save({k: v.clone() for k, v in model.module.state_dict().items()}, args.save)
    with open(args.save + ".json", "w") as fh:
        json.dump({"optimizer_steps": stepped}, fh)
dist.destroy_process_group()

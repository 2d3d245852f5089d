"""One rank of a gloo group: the averaged gradients of the same inputs under several DDP bucket
layouts, with and without nonstop.reproducible, saved by rank 0.

    python ddp_layouts.py RANK WORLD STORE_FILE OUT_DIR
"""

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import nonstop



def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 80),
                               torch.nn.Tanh(), torch.nn.Linear(80, 3))


def grads(rank, bucket_mb, reproducible, iterations, fixed_mb=25.0):
    """The gradients of the last of ``iterations`` backward passes (the first DDP iteration
    runs with the initial buckets, later ones with the rebuilt layout)."""
    m = model()
    ddp = DDP(m, bucket_cap_mb=bucket_mb)
    if reproducible:
        nonstop.reproducible(ddp, bucket_mb=fixed_mb)
    for i in range(iterations):
        g = torch.Generator().manual_seed(1000 * rank + i % 1)  # the same batch every time
        x = torch.randn(32, 64, generator=g) * (10.0 ** (rank - 1))  # magnitudes differ by rank
        m.zero_grad()
        ddp(x).pow(2).sum().backward()
    return {n: p.grad.clone() for n, p in m.named_parameters()}


def main(rank, world, store, out):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    results = {}
    for kind in ("plain", "repro", "repro_small"):  # repro_small: several fixed buckets of its own
        for mb, iters in ((25.0, 1), (25.0, 3), (0.01, 1), (0.01, 3)):
            results[f"{kind}-{mb}-{iters}"] = grads(rank, mb, kind != "plain", iters,
                                                    0.01 if kind == "repro_small" else 25.0)
    if rank == 0:
        torch.save(results, f"{out}/grads.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])

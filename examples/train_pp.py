"""Pipeline parallel (``torch.distributed.pipelining``) with data parallel, made restartable with
nonstop: a 2-D mesh ``(dp, pp)``.

    nonstop run --nproc 4 --spares 1 examples/train_pp.py --steps 100 --save final.pt

The model's blocks are split into ``--pp`` stages (2 by default); the ranks of one ``pp`` group
each hold one stage and pass activations forward and gradients back (a GPipe schedule over
``--microbatches``); the ``dp`` groups each run the whole pipeline on their part of the global
batch and average their stages' gradients with the other ``dp`` groups. Every stage thus has a
twin in each other ``dp`` group: a lost rank's replacement builds its stage (alone, its peers
waiting in the restore) and receives its weights and optimizer state live from its twin.

What nonstop needs to know that it cannot see in the tensors: the ranks along ``pp`` hold
different state (``stages="pp"``); ranks that differ only along ``dp`` hold the same.

The schedule and its stage are made again in each generation (inside the training function):
they hold the buffers of a step in flight, which a failed generation leaves half used; the model,
the optimizer and the mesh stay.
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import nonstop

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--dim", type=int, default=16)
parser.add_argument("--blocks", type=int, default=2, help="blocks per stage")
parser.add_argument("--pp", type=int, default=2, help="pipeline stages")
parser.add_argument("--microbatches", type=int, default=2)
parser.add_argument("--sleep-ms", type=float, default=0.0, help="stand-in for accelerator work")
parser.add_argument("--save", help="rank 0 writes the final parameters of every stage here")
parser.add_argument("--device", default="cpu", help="cpu, or cuda (the parts live on the GPU)")
parser.add_argument("--backend", default="gloo", help="gloo, or nccl (with --device cuda)")
args = parser.parse_args()

BATCH = 8  # samples per data-parallel group of the full mesh, per step


class Block(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Stage(torch.nn.Module):
    """One stage: its blocks, and the head on the last."""

    def __init__(self, blocks: list, head: torch.nn.Module | None):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)
        self.head = head

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


# the whole model, the same on every rank (one seed); each rank keeps its stage
torch.manual_seed(args.seed)
BLOCKS = [Block(args.dim) for _ in range(args.blocks * args.pp)]
HEAD = torch.nn.Linear(args.dim, 1)
stage_module: Stage | None = None


def build(mesh):
    """This rank's stage of the model and its optimizer. Runs once per process."""
    global stage_module
    s, n = mesh["pp"].get_local_rank(), mesh["pp"].size()
    stage_module = Stage(BLOCKS[s * args.blocks:(s + 1) * args.blocks],
                         HEAD if s == n - 1 else None).to(args.device)
    optimizer = torch.optim.AdamW(stage_module.parameters(), lr=1e-3)
    return nonstop.State(model=stage_module, optimizer=optimizer)


def batch(step, ctx):
    """This data-parallel group's part of the step's global batch: the same global batch
    whatever the world, should a data-parallel group be away (the job shrunk)."""
    g = torch.Generator().manual_seed(nonstop.step_seed(args.seed, step, 0))
    x = torch.randn(BATCH * (ctx.full_world_size // args.pp), args.dim, generator=g)
    # the data-parallel groups of this generation: the group's own rank and size (the mesh's
    # get_local_rank() and size() are the full mesh's, fixed when it was built)
    dp = ctx.mesh["dp"].get_group()
    share = len(x) // dp.size()
    x = x[share * dp.rank():share * (dp.rank() + 1)].to(args.device)
    return x, x.sum(dim=1, keepdim=True).sin()


def average_gradients(module, group):
    """The data-parallel groups' mean gradient of this stage (the same bits on every twin)."""
    size = group.size()  # this generation's groups (fewer while the job is shrunk)
    if size == 1:
        return
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= size
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


@nonstop.wrap(nonstop.Mesh(("dp", "pp"), (-1, args.pp), build, stages="pp",
                           device_type=args.device), backend=args.backend)
def train(ctx):
    optimizer = ctx.state["optimizer"]
    pp, dp = ctx.mesh["pp"], ctx.mesh["dp"]
    s, n = pp.get_local_rank(), pp.size()
    # a stage and a schedule for this generation (their buffers are a step's)
    stage = PipelineStage(stage_module, s, n, torch.device(args.device),
                          group=pp.get_group())
    # (every stage is given the loss: a schedule without one runs no backward)
    schedule = ScheduleGPipe(stage, n_microbatches=args.microbatches, loss_fn=F.mse_loss)
    for step in ctx.steps(args.steps):
        x, y = batch(step, ctx)
        optimizer.zero_grad()
        if s == 0:
            schedule.step(x)
        elif s == n - 1:
            losses = []
            schedule.step(target=y, losses=losses)
            ctx.report(torch.stack(losses).mean())
        else:
            schedule.step()
        average_gradients(stage_module, dp.get_group())
        optimizer.step()
        if args.sleep_ms:
            time.sleep(args.sleep_ms / 1000)
        if s == n - 1 and dp.get_group().rank() == 0 and step % 25 == 0:
            print(f"step {step} loss {torch.stack(losses).mean().item():.4f} "
                  f"(generation {ctx.generation})")
    # rank 0 gathers every stage's parameters (the first data-parallel group's)
    mine = {f"stage{s}.{k}": v.cpu() for k, v in stage_module.state_dict().items()}
    every = [None] * n
    dist.all_gather_object(every, mine, group=pp.get_group())
    return {k: v for part in every for k, v in part.items()} if ctx.rank == 0 else None


full = train()
if full is not None and args.save:
    torch.save(full, args.save)

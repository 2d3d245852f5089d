"""The job of ``nonstop bench elastic``: data-parallel training on one global batch per step, the
same for every system, whatever the world size.

Each step trains on the next ``--global-batch`` samples of one seeded stream
(``nonstop.GlobalBatchSampler``), split over the ranks of the current world; each rank's summed
loss is weighted by ``world / global_batch`` so that the averaged gradient is the global batch's
mean. Every process appends, per completed step, ``<steps done> <time> <generation> <world>`` to
``steps-p<pid>.txt`` and the sample ids it trained on to ``samples-p<pid>.jsonl``.

``--parallel`` (nonstop mode) lays the model out over a ``nonstop.Mesh`` (``bench/layouts.py``):
``fsdp`` and ``hsdp`` shard it (every rank a data-parallel rank: the batch split over the world,
as with DDP); ``2d`` adds tensor parallel of degree 2 (the batch split over the data-parallel
groups, whose tensor-parallel rank 0 logs the group's share); ``pp`` splits it into 2 pipeline
stages over ``(dp, pp)`` (the batch split over the pipelines, whose first stage logs). ``hsdp``
and ``pp`` shrink by a whole replica group or pipeline, the survivors going on live; ``fsdp`` and
``2d`` have no such copy, and change size by new processes that cut their shards from the old.

``--mode torchrun`` is a careful torchrun user's loop: a checkpoint (model, optimizer, step: the
data position) every ``--ckpt-every`` steps, resumed on restart, a fresh store prefix per restart.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import nonstop
from nonstop_bench import layouts

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=["nonstop", "torchrun"], required=True)
p.add_argument("--steps", type=int, default=300)
p.add_argument("--out", required=True)
p.add_argument("--samples", type=int, default=4096)
p.add_argument("--global-batch", type=int, default=64)
p.add_argument("--hidden", type=int, default=256)
p.add_argument("--sleep-ms", type=float, default=20.0)
p.add_argument("--ckpt-every", type=int, default=20)
p.add_argument("--kill-rank", type=int, default=-1, help="torchrun mode: SIGKILL this rank...")
p.add_argument("--kill-step", type=int, default=-1, help="...at the start of this step, first attempt")
p.add_argument("--parallel", choices=["ddp", "fsdp", "hsdp", "2d", "pp"], default="ddp",
               help="nonstop mode: DDP, FSDP2, HSDP (2 replica groups), FSDP2 x tensor parallel "
                    "(degree 2) or 2 pipeline stages")
args = p.parse_args()
if args.parallel != "ddp" and args.mode != "nonstop":
    p.error("--parallel fsdp/hsdp/2d/pp: nonstop mode only")

torch.manual_seed(0)
x_all = torch.randn(args.samples, 32, generator=torch.Generator().manual_seed(1))
y_all = x_all.sum(dim=1, keepdim=True).sin()
model = torch.nn.Sequential(torch.nn.Linear(32, args.hidden), torch.nn.Tanh(),
                            torch.nn.Linear(args.hidden, args.hidden), torch.nn.Tanh(),
                            torch.nn.Linear(args.hidden, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
sampler = nonstop.GlobalBatchSampler(args.samples, global_batch=args.global_batch, seed=0)
pid = os.getpid()
steps_log = open(os.path.join(args.out, f"steps-p{pid}.txt"), "a")
samples_log = open(os.path.join(args.out, f"samples-p{pid}.jsonl"), "a")


def one_step(ddp, step, rank, world, gen):
    ids = sampler.share(step, rank, world)
    optimizer.zero_grad()
    if ids:
        idx = torch.tensor(ids)
        loss = F.mse_loss(ddp(x_all[idx]), y_all[idx], reduction="sum") * world / args.global_batch
    else:
        loss = ddp(x_all[:1]).sum() * 0.0
    loss.backward()
    optimizer.step()
    finish(step, gen, world, rank, world, ids)


def finish(step, gen, world, group, groups, ids):
    """After a step: the stand-in for accelerator work, then the logs (``ids``: None for a
    process that logs no samples - a pipeline's later stages)."""
    if args.sleep_ms:
        time.sleep(args.sleep_ms / 1000)  # stand-in for accelerator work
    steps_log.write(f"{step + 1} {time.time():.6f} {gen} {world}\n")
    steps_log.flush()
    if ids is not None:
        samples_log.write(json.dumps({"step": step, "gen": gen, "rank": group, "world": groups,
                                      "ids": ids}) + "\n")
        samples_log.flush()


def pipeline_step(pipe, opt, step, ctx):
    """One step of a pipeline: this data-parallel group's share of the global batch through
    the stages, in 2 micro-batches (the schedule's loss weighted so that the gradient averaged
    over the groups is the global batch's mean)."""
    group, groups = layouts.dp_position(ctx.mesh, "pp")
    ids = sampler.share(step, group, groups)
    idx = torch.tensor(ids)
    opt.zero_grad()
    pipe.step(x_all[idx], y_all[idx])
    opt.step()
    finish(step, ctx.generation, ctx.world_size, group, groups, ids if pipe.s == 0 else None)


def sharded_step(step, ctx, opt):
    """One step of a sharded layout: this data-parallel group's share of the global batch (the
    loss weighted by the groups' number: FSDP2 averages the gradients over them); a group's
    tensor-parallel ranks see the same samples, its first one logs them."""
    group, groups = layouts.dp_position(ctx.mesh, args.parallel)
    ids = sampler.share(step, group, groups)
    idx = torch.tensor(ids)
    opt.zero_grad()
    loss = F.mse_loss(model(x_all[idx]), y_all[idx], reduction="sum") * groups / args.global_batch
    loss.backward()
    opt.step()
    first = args.parallel != "2d" or ctx.mesh["tp"].get_local_rank() == 0
    finish(step, ctx.generation, ctx.world_size, group, groups, ids if first else None)


def run_nonstop_mesh():
    """A layout declared with nonstop.Mesh; rank 0 gathers the final parameters."""
    parts = {}

    def build(mesh):
        if args.parallel == "pp":
            parts["module"] = module = layouts.stage(model, mesh)
        else:
            layouts.shard(model, mesh, args.parallel)
            parts["module"] = module = model
        opt = torch.optim.SGD(module.parameters(), lr=0.02, momentum=0.9)
        return nonstop.State(model=module, optimizer=opt, sampler=sampler)

    dims, shape, _ = layouts.MESH[args.parallel]

    @nonstop.wrap(nonstop.Mesh(dims, shape, build, stages="pp" if args.parallel == "pp" else None))
    def train(ctx):
        opt = ctx.state["optimizer"]
        if args.parallel == "pp":
            groups = layouts.dp_position(ctx.mesh, "pp")[1]
            micro = 2

            def loss_fn(out, y):  # the schedule divides each micro-batch's gradient by 2
                return F.mse_loss(out, y, reduction="sum") * groups * micro / args.global_batch

            pipe = layouts.Pipeline(parts["module"], ctx.mesh, loss_fn, micro)
        for step in ctx.steps(args.steps):
            if args.parallel == "pp":
                pipeline_step(pipe, opt, step, ctx)
            else:
                sharded_step(step, ctx, opt)
        full = layouts.gathered(model, ctx.mesh, args.parallel, parts["module"])
        return ctx.rank, full

    rank, full = train()
    if rank == 0:
        torch.save(full, os.path.join(args.out, "final.pt"))


def save_final(rank):
    if rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()},
                   os.path.join(args.out, "final.pt"))


def run_nonstop():
    state = nonstop.State(model=model, optimizer=optimizer, sampler=sampler)

    @nonstop.wrap(state)
    def train(ctx):
        ddp = nonstop.reproducible(DDP(model))
        for step in ctx.steps(args.steps):
            one_step(ddp, step, ctx.rank, ctx.world_size, ctx.generation)
        return ctx.rank

    save_final(train())


def run_torchrun():
    from nonstop_bench import torchrun_side as tr

    attempt, rank, world = tr.join_group(1800.0)
    ckpt = os.path.join(args.out, "ckpt.pt")
    ddp = nonstop.reproducible(DDP(model))
    for step in range(tr.resume(ckpt, model, optimizer), args.steps):
        if attempt == 0 and rank == args.kill_rank and step == args.kill_step:
            tr.kill_self(args.out)
        one_step(ddp, step, rank, world, attempt)
        if rank == 0 and (step + 1) % args.ckpt_every == 0:
            tr.save(ckpt, model, optimizer, step + 1)
    save_final(rank)
    dist.destroy_process_group()


if args.mode == "nonstop":
    run_nonstop() if args.parallel == "ddp" else run_nonstop_mesh()
else:
    run_torchrun()

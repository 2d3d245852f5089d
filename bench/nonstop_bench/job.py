"""The training job every benchmark system runs: the same model, data and DDP reduction.

``--mode nonstop`` wraps the loop with nonstop (state in memory, no checkpoint). ``--mode torchrun``
is what a careful torchrun user writes: a checkpoint every N steps, resume from it on restart, and a
fresh store prefix per restart (on torch 2.13 a restarted gloo group otherwise reads stale keys).
Every rank appends ``<steps done> <time> <generation>`` to ``steps-r<rank>.txt`` when a step
completes (the generation: nonstop's, or torchrun's restart count).

The model: ``--input`` -> ``--hidden``, ``--layers`` hidden Linear(hidden, hidden) layers, -> 1
(``--hidden 4096 --layers 6``: 100.8M parameters). ``--sharded`` (nonstop mode) keeps Adam's state
ZeRO-1 style, as examples/train_sharded.py does: each parameter is owned by one rank (dealt out so
that every rank owns about as many numbers), which alone updates it and then broadcasts it;
``State(..., sharded=True)``.

``--parallel fsdp`` shards the same model with FSDP2 over all ranks, ``--parallel hsdp`` over a
mesh of 2 replica groups (``fully_shard`` on each layer, then the root; Adam). ``--parallel 2d``
adds tensor parallelism (degree 2: the first Linear split by columns, the second by rows) under
FSDP2 (``(dp_shard, tp)``), ``--parallel 3d`` under HSDP (``(dp_replicate, dp_shard, tp)`` =
``(2, -1, 2)``); ``--parallel pp`` splits the model into 2 pipeline stages (a GPipe schedule of 2
micro-batches, ``(dp, pp)``; each stage's gradients averaged over ``dp``). The ranks of one
tensor-parallel or pipeline group see the same data. nonstop mode declares the mesh with
``nonstop.Mesh``; torchrun mode builds it with ``init_device_mesh`` and checkpoints with DCP
(``get_state_dict``), as a user of torchrun does.
"""

import argparse
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
p.add_argument("--steps", type=int, default=100)
p.add_argument("--out", required=True)
p.add_argument("--hidden", type=int, default=256)
p.add_argument("--layers", type=int, default=1, help="hidden Linear(hidden, hidden) layers")
p.add_argument("--input", type=int, default=32, help="input features")
p.add_argument("--batch", type=int, default=64, help="samples per rank and step")
p.add_argument("--sharded", action="store_true", help="nonstop mode: ZeRO-1 sharded optimizer")
p.add_argument("--parallel", choices=["ddp", "fsdp", "hsdp", "2d", "3d", "pp"], default="ddp",
               help="the layout: DDP, FSDP2, HSDP (2 replica groups), FSDP2 or HSDP with tensor "
                    "parallel (2d, 3d), pipeline parallel with data parallel (pp)")
p.add_argument("--sleep-ms", type=float, default=20.0)
p.add_argument("--ckpt-every", type=int, default=20, help="torchrun mode (0: never)")
p.add_argument("--ddp", choices=["reproducible", "plain"], default="reproducible",
               help="the gradient reduction: nonstop.reproducible's, or DDP's own buckets")
p.add_argument("--kill-rank", type=int, default=-1, help="torchrun mode: SIGKILL this rank...")
p.add_argument("--kill-step", type=int, default=-1, help="...at the start of this step, first attempt")
p.add_argument("--kill-steps", default="",
               help="torchrun mode: several faults, comma-separated steps: the k-th fires in "
                    "attempt k (its restart count) on --kill-rank")
p.add_argument("--kill-signal", default="SIGKILL", help="torchrun mode: the signal (SIGSTOP: a hang)")
p.add_argument("--collective-timeout", type=float, default=1800.0,
               help="torchrun mode: the process group timeout (how a hang is noticed there)")
args = p.parse_args()
if args.sharded and args.mode != "nonstop":
    p.error("--sharded needs --mode nonstop")
if args.sharded and args.parallel != "ddp":
    p.error("--sharded is DDP's ZeRO-1 optimizer: leave it out with --parallel fsdp/hsdp")
torch.manual_seed(0)
_layers = [torch.nn.Linear(args.input, args.hidden), torch.nn.Tanh()]
for _ in range(args.layers):
    _layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.Tanh()]
model = torch.nn.Sequential(*_layers, torch.nn.Linear(args.hidden, 1))
params = list(model.parameters())
optimizer = torch.optim.Adam(params, lr=1e-3)


def batch(step, rank):
    g = torch.Generator().manual_seed(nonstop.step_seed(0, step, rank))
    x = torch.randn(args.batch, args.input, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def owners(world):
    """The largest parameter first, each to the rank that owns the fewest numbers so far."""
    load, owner = [0] * world, [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):
        owner[i] = min(range(world), key=lambda r: load[r])
        load[owner[i]] += params[i].numel()
    return owner


def one_step(ddp, step, rank, owner=None):
    x, y = batch(step, rank)
    loss = F.mse_loss(ddp(x), y)
    optimizer.zero_grad()
    loss.backward()
    if owner is None:
        optimizer.step()
    else:  # sharded: update only our parameters, then send them to the others
        for param, o in zip(params, owner):
            if o != rank:
                param.grad = None  # not ours: Adam neither updates it nor keeps state for it
        optimizer.step()
        with torch.no_grad():
            for param, o in zip(params, owner):
                dist.broadcast(param.data, src=o)
    if args.sleep_ms:
        time.sleep(args.sleep_ms / 1000)  # stand-in for accelerator work
    return loss


def log_step(fh, step, gen):
    fh.write(f"{step} {time.time():.6f} {gen}\n")
    fh.flush()


def save_final(rank, full=None):
    if rank == 0:
        full = full if full is not None else {k: v.clone() for k, v in model.state_dict().items()}
        torch.save(full, os.path.join(args.out, "final.pt"))


def shard(mesh):
    """The layout's parallelisation over the job's full ``mesh`` (bench/layouts.py); pp: this
    rank's stage. Returns the optimizer."""
    global stage_module
    if args.parallel == "pp":
        stage_module = layouts.stage(model, mesh)
        return torch.optim.Adam(stage_module.parameters(), lr=1e-3)
    layouts.shard(model, mesh, args.parallel)
    return torch.optim.Adam(model.parameters(), lr=1e-3)


stage_module = None  # pp: this rank's stage


def pipeline(mesh):
    return layouts.Pipeline(stage_module, mesh, F.mse_loss) if args.parallel == "pp" else None


def run_nonstop_sharded():
    def build(mesh):
        optimizer = shard(mesh)
        return nonstop.State(model=stage_module if args.parallel == "pp" else model,
                             optimizer=optimizer)

    stages = "pp" if args.parallel == "pp" else None
    dims, shape, _ = layouts.MESH[args.parallel]

    @nonstop.wrap(nonstop.Mesh(dims, shape, build, stages=stages))
    def train(ctx):
        opt = ctx.state["optimizer"]
        pipe = pipeline(ctx.mesh)
        with open(os.path.join(args.out, f"steps-r{ctx.rank}.txt"), "a") as fh:
            for step in ctx.steps(args.steps):
                sharded_step(opt, step, layouts.dp_position(ctx.mesh, args.parallel)[0], pipe)
                log_step(fh, step + 1, ctx.generation)
        return ctx.rank, layouts.gathered(model, ctx.mesh, args.parallel, stage_module)

    rank, full = train()
    save_final(rank, full)


def sharded_step(opt, step, position, pipe=None):
    x, y = batch(step, position)
    opt.zero_grad()
    if pipe is not None:
        pipe.step(x, y)
    else:
        F.mse_loss(model(x), y).backward()
    opt.step()
    if args.sleep_ms:
        time.sleep(args.sleep_ms / 1000)  # stand-in for accelerator work


def _ddp():
    return nonstop.reproducible(DDP(model)) if args.ddp == "reproducible" else DDP(model)


def run_nonstop():
    state = nonstop.State(model=model, optimizer=optimizer, sharded=args.sharded)

    @nonstop.wrap(state)
    def train(ctx):
        ddp = _ddp()
        owner = owners(ctx.world_size) if args.sharded else None
        with open(os.path.join(args.out, f"steps-r{ctx.rank}.txt"), "a") as fh:
            for step in ctx.steps(args.steps):
                one_step(ddp, step, ctx.rank, owner)
                log_step(fh, step + 1, ctx.generation)
        return ctx.rank

    save_final(train())


def run_torchrun_sharded():
    """FSDP2 or HSDP under torchrun: a DCP checkpoint every --ckpt-every steps, resumed from."""
    from torch.distributed.device_mesh import init_device_mesh

    from nonstop_bench import torchrun_side as tr

    attempt, rank, world = tr.join_group(args.collective_timeout)
    mesh = init_device_mesh("cpu", layouts.sizes(args.parallel, world),
                            mesh_dim_names=layouts.MESH[args.parallel][0])
    opt = shard(mesh)
    pipe = pipeline(mesh)
    mine = stage_module if pipe is not None else model
    # DCP for DTensors; a pipeline stage is plain tensors, each rank's own file (DCP's optimizer
    # state dict of a stage did not load back here: KeyError 'betas')
    ckpt = os.path.join(args.out, "dcp" if pipe is None else f"stage-r{rank}.pt")
    resume = tr.resume_dcp if pipe is None else tr.resume
    with open(os.path.join(args.out, f"steps-r{rank}.txt"), "a") as fh:
        for step in range(resume(ckpt, mine, opt), args.steps):
            if rank == args.kill_rank and attempt == 0 and step == args.kill_step:
                tr.kill_self(args.out, args.kill_signal)
            sharded_step(opt, step, layouts.dp_position(mesh, args.parallel)[0], pipe)
            log_step(fh, step + 1, attempt)
            if args.ckpt_every and (step + 1) % args.ckpt_every == 0:
                if pipe is None:
                    tr.save_dcp(ckpt, mine, opt, step + 1)
                else:
                    tr.save(ckpt, mine, opt, step + 1)
                    dist.barrier()
    save_final(rank, layouts.gathered(model, mesh, args.parallel, stage_module))
    dist.destroy_process_group()


def run_torchrun():
    from nonstop_bench import torchrun_side as tr

    kills = [int(x) for x in args.kill_steps.split(",") if x.strip()]

    attempt, rank, world = tr.join_group(args.collective_timeout)
    ckpt = os.path.join(args.out, "ckpt.pt")
    ddp = _ddp()
    with open(os.path.join(args.out, f"steps-r{rank}.txt"), "a") as fh:
        for step in range(tr.resume(ckpt, model, optimizer), args.steps):
            if rank == args.kill_rank and ((attempt == 0 and step == args.kill_step)
                                           or (attempt < len(kills) and step == kills[attempt])):
                tr.kill_self(args.out, args.kill_signal)
            one_step(ddp, step, rank)
            log_step(fh, step + 1, attempt)
            if rank == 0 and args.ckpt_every and (step + 1) % args.ckpt_every == 0:
                tr.save(ckpt, model, optimizer, step + 1)
    save_final(rank)
    dist.destroy_process_group()


if args.mode == "nonstop":
    run_nonstop() if args.parallel == "ddp" else run_nonstop_sharded()
else:
    run_torchrun() if args.parallel == "ddp" else run_torchrun_sharded()

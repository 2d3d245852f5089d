"""train_ddp.py's job, timed from inside: the same model, data, optimizer and reduction (so the
final weights are bit-for-bit those of train_ddp.py with the same arguments), and rank 0 appends
one line per completed step to ``--step-times FILE``::

    <steps done> <time.time()> <generation> <pid>

The file is opened in append mode by whichever process holds rank 0, so it survives a rank moving
to another host when the hosts share a filesystem (``nonstop bench hosts`` runs every test host on
one machine). The pid tells the process that completed the step: a step completed by a process
started after a fault is a step of the recovered job.

``--mode torchrun`` is the same job as a careful torchrun user writes it (no nonstop at run time):
``dist.init_process_group("gloo")`` from torchrun's environment, a checkpoint of the model and the
optimizer every ``--ckpt-every`` steps in ``--ckpt-dir`` (written atomically by rank 0), and a
restarted worker resumes from the newest one. Its generation column is torchrun's restart count.

    nonstop run --nproc 4 --spares 1 examples/train_timed.py --steps 200 --step-times t.txt
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import nonstop
from nonstop.examples import pace

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--hidden", type=int, default=64)
pace.add_arguments(parser)
parser.add_argument("--save", help="rank 0 writes the final parameters here")
parser.add_argument("--step-times", help="rank 0 appends '<steps done> <time> <gen> <pid>' here")
parser.add_argument("--print-every", type=int, default=50)
parser.add_argument("--mode", choices=["nonstop", "torchrun"], default="nonstop")
parser.add_argument("--ckpt-dir", help="torchrun mode: the checkpoint's directory (shared)")
parser.add_argument("--ckpt-every", type=int, default=20)
args = parser.parse_args()


torch.manual_seed(args.seed)
model = torch.nn.Sequential(torch.nn.Linear(16, args.hidden), torch.nn.Tanh(),
                            torch.nn.Linear(args.hidden, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)


def batch(step, rank):
    g = torch.Generator().manual_seed(nonstop.step_seed(args.seed, step, rank))
    x = torch.randn(32, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def one_step(ddp, step, rank):
    x, y = batch(step, rank)
    loss = F.mse_loss(ddp(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss


class Times:
    """Rank 0's step log (nothing on the other ranks, or without --step-times)."""

    def __init__(self, rank):
        self.fh = open(args.step_times, "a") if args.step_times and rank == 0 else None

    def done(self, steps_done, gen):
        if self.fh is not None:
            self.fh.write(f"{steps_done} {time.time():.6f} {gen} {os.getpid()}\n")
            self.fh.flush()

    def close(self):
        if self.fh is not None:
            self.fh.close()


def save(rank):
    if rank == 0 and args.save:
        tmp = args.save + ".tmp"
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, tmp)
        os.replace(tmp, args.save)


def run_nonstop():
    state = nonstop.State(model=model, optimizer=optimizer)

    @nonstop.wrap(state)
    def train(ctx):
        ddp = nonstop.reproducible(DDP(model))
        times = Times(ctx.rank)
        try:
            for step in ctx.steps(args.steps):
                loss = one_step(ddp, step, ctx.rank)
                ctx.report(loss)
                pace.pause(args)
                times.done(step + 1, ctx.generation)
                if ctx.rank == 0 and step % args.print_every == 0:
                    print(f"step {step} loss {loss.item():.4f} (generation {ctx.generation})",
                          flush=True)
        finally:
            times.close()
        return ctx.rank

    save(train())


def run_torchrun():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ckpt = os.path.join(args.ckpt_dir, "ckpt.pt") if args.ckpt_dir else None
    start = 0
    if ckpt and os.path.exists(ckpt):
        saved = torch.load(ckpt)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start = saved["step"]
    ddp = nonstop.reproducible(DDP(model))
    times = Times(rank)
    for step in range(start, args.steps):
        loss = one_step(ddp, step, rank)
        pace.pause(args)
        times.done(step + 1, attempt)
        if rank == 0 and step % args.print_every == 0:
            print(f"step {step} loss {loss.item():.4f} (restart {attempt})", flush=True)
        if ckpt and rank == 0 and (step + 1) % args.ckpt_every == 0:
            tmp = ckpt + ".tmp"
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": step + 1}, tmp)
            os.replace(tmp, ckpt)
    times.close()
    save(rank)
    dist.destroy_process_group()


if args.mode == "nonstop":
    run_nonstop()
else:
    run_torchrun()

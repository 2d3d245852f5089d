"""The crash benchmark's HSDP job written for torchft 0.2.0 (Meta's fault-tolerant training), so
that nonstop's recovery can be compared with torchft's (``nonstop bench crash --parallel hsdp``,
which starts it: ``torchft_run.py``). Not part of nonstop: it imports torchft, which nonstop does
not depend on. Install torchft into a directory of its own without letting pip touch torch, and
name that directory in ``NONSTOP_TORCHFT_PATH``::

    .venv/bin/pip install --target DIR --no-deps torchft==0.2.0 \\
        opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \\
        opentelemetry-exporter-otlp-proto-http==1.45.2 \\
        opentelemetry-exporter-otlp-proto-common==1.45.2 \\
        opentelemetry-proto==1.45.2 opentelemetry-semantic-conventions==0.66b2 \\
        'opentelemetry-exporter-http-transport[requests]==0.66b2' \\
        opentelemetry-exporter-otlp-common==0.66b2 'googleapis-common-protos~=1.52' protobuf

Layout, as torchft writes HSDP: one torchrun per replica group; inside a group FSDP2
(``fully_shard`` on each Linear, then the root) over the group's own gloo process group (the
``dp_shard`` mesh); across groups one torchft ``Manager`` per rank whose reconfigurable
``ProcessGroupGloo`` joins the ranks of equal group rank, and FSDP2's all-reduce hook averages each
reduce-scattered gradient shard over it (``dp_replicate``). A Lighthouse forms the quorum of live
replica groups every step; when a rank dies its group's torchrun restarts the group, the other
groups go on alone (a step whose collective failed is not committed and is retried), and the
restarted group heals: it fetches model and Adam state (its own shards) from a healthy group's
rank of the same group rank and joins at the current step. Steps taken while a group was down
average fewer replicas, so the final weights are not those of a fault-free run. The run must
outlast the restart: a group that comes back after the others have finished finds no quorum to
heal from and trains alone from step 0.

Every rank appends ``<steps done> <time> <attempt>`` to ``out/steps-r<global rank>.txt`` after
each committed step (global rank = replica group * group size + group rank; attempt: its
torchrun restart count); group 0's rank 0 saves the full parameters to ``out/final.pt`` (group
1's to ``out/final-g1.pt``). ``--kill-rank``/``--kill-step``: that global rank SIGKILLs itself at
the start of that step in its first attempt, its time in ``out/kill.txt``. Each rank also
appends ``<event> <time> <attempt>`` to ``out/timeline-r<global rank>.txt`` (start, imported,
manager, heal): where a restarted rank's recovery time goes.

Launch by hand (2 replica groups of 2 ranks, all on this host; ``torchft_run.py`` does this)::

    export PYTHONPATH=DIR
    python bench/nonstop_bench/torchft_lighthouse.py --bind [::]:29510 --min_replicas 1 \\
        --join_timeout_ms 5000 --heartbeat_timeout_ms 1000 --quorum_tick_ms 100 &
    for g in 0 1; do
      REPLICA_GROUP_ID=$g NUM_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=http://localhost:29510 \\
      python -m torch.distributed.run --standalone --nproc-per-node=2 --max-restarts=3 \\
          --monitor-interval=0.1 bench/nonstop_bench/torchft_job.py --out OUT --steps 300 \\
          --kill-rank 3 --kill-step 20 &
    done
"""

import time

T_START = time.time()  # before the imports: a restarted rank's start-up is part of its recovery

import argparse
import datetime
import os
import signal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ReduceOp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from torchft import Manager, ProcessGroupGloo

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--out", required=True)
p.add_argument("--hidden", type=int, default=64)
p.add_argument("--layers", type=int, default=1, help="hidden Linear(hidden, hidden) layers")
p.add_argument("--input", type=int, default=32, help="input features")
p.add_argument("--batch", type=int, default=64, help="samples per rank and step")
p.add_argument("--sleep-ms", type=float, default=20.0)
p.add_argument("--kill-rank", type=int, default=-1, help="SIGKILL this global rank...")
p.add_argument("--kill-step", type=int, default=-1,
               help="...at the start of this step, first attempt")
p.add_argument("--groups", type=int, default=int(os.environ.get("NUM_REPLICA_GROUPS", "2")),
               help="replica groups that start together (NUM_REPLICA_GROUPS)")
p.add_argument("--timeout", type=float, default=10.0, help="torchft's collective/RPC timeout (s)")
args = p.parse_args()

GROUP = int(os.environ.get("REPLICA_GROUP_ID", "0"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # inside the replica group
GLOBAL = GROUP * WORLD + RANK
TIMEOUT = datetime.timedelta(seconds=args.timeout)

torch.manual_seed(0)
_layers = [torch.nn.Linear(args.input, args.hidden), torch.nn.Tanh()]
for _ in range(args.layers):
    _layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.Tanh()]
model = torch.nn.Sequential(*_layers, torch.nn.Linear(args.hidden, 1))


def batch(step, rank):
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(args.batch, args.input, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def join_group():
    """The replica group's own gloo group (FSDP's), under a store prefix per torchrun restart:
    torchrun's store outlives a restart and a restarted group would read stale keys."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, wait_for_workers=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt-{ATTEMPT}", store),
                            rank=RANK, world_size=WORLD, timeout=TIMEOUT)


def start_together(groups, timeout_s=120.0):
    """Start-up only: wait until every replica group's manager is up (heartbeating to the
    Lighthouse), so that the first quorum holds them all; otherwise the first group up trains
    alone for a few steps and the others join by healing, and fault-free runs differ."""
    if RANK == 0:
        open(os.path.join(args.out, f"ready-g{GROUP}"), "w").close()
    deadline = time.time() + timeout_s
    while not all(os.path.exists(os.path.join(args.out, f"ready-g{g}")) for g in range(groups)):
        if time.time() > deadline:
            raise TimeoutError(f"not every replica group started within {timeout_s}s")
        time.sleep(0.05)


def local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


def mark(what):
    """``out/timeline-r<global rank>.txt``: ``<what> <time> <attempt>``: where recovery time
    goes."""
    with open(os.path.join(args.out, f"timeline-r{GLOBAL}.txt"), "a") as fh:
        fh.write(f"{what} {time.time():.6f} {ATTEMPT}\n")


def main():
    mark("imported")
    join_group()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp_shard",)))
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp_shard",)))
    params = list(model.parameters())
    optimizer = torch.optim.Adam(params, lr=1e-3)

    def state_dict():
        """This rank's shards (plain tensors, copied: served while training goes on)."""
        return {"params": [local(q).detach().clone() for q in params],
                "optim": [{k: local(v).clone() for k, v in optimizer.state[q].items()}
                          for q in params]}

    def load_state_dict(sd):
        """A healthy twin's shards (same group rank, so the same shard layout) into ours."""
        mark("heal")
        with torch.no_grad():
            for q, v in zip(params, sd["params"]):
                local(q).copy_(v)
            for q, st in zip(params, sd["optim"]):
                mine = optimizer.state[q]
                for k, v in st.items():
                    if k not in mine:  # a restarted rank has no Adam state yet
                        mine[k] = (torch.zeros_like(q) if k != "step" else torch.zeros_like(v))
                    local(mine[k]).copy_(v)

    # The group's manager server lives on group rank 0, which publishes its address in torchrun's
    # store; that store outlives a restart, so the other ranks read it only after rank 0 wrote it.
    if RANK != 0:
        dist.barrier()
    manager = Manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        replica_id=f"hsdp_{GROUP}",
        timeout=TIMEOUT,
        quorum_timeout=datetime.timedelta(seconds=60),
        connect_timeout=TIMEOUT,
        init_sync=False,  # every replica starts from the same seed
    )
    if RANK == 0:
        dist.barrier()
    mark("manager")
    if ATTEMPT == 0:
        start_together(args.groups)

    def all_reduce_hook(output):
        # FSDP2 has averaged the gradient over dp_shard; torchft averages it over the live
        # replica groups (errors are recorded by the manager: the step is then not committed).
        manager.allreduce(output, reduce_op=ReduceOp.AVG).wait()

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_all_reduce_hook(all_reduce_hook)

    with open(os.path.join(args.out, f"timeline-r{GLOBAL}.txt"), "a") as fh:
        fh.write(f"start {T_START:.6f} {ATTEMPT}\n")
    with open(os.path.join(args.out, f"steps-r{GLOBAL}.txt"), "a") as fh:
        while manager.current_step() < args.steps:
            step = manager.current_step()
            if GLOBAL == args.kill_rank and ATTEMPT == 0 and step == args.kill_step:
                with open(os.path.join(args.out, "kill.txt"), "w") as k:
                    k.write(f"{time.time():.6f}\n")
                os.kill(os.getpid(), signal.SIGKILL)
            manager.start_quorum()
            optimizer.zero_grad()
            x, y = batch(step, GLOBAL)
            F.mse_loss(model(x), y).backward()
            if args.sleep_ms:
                time.sleep(args.sleep_ms / 1000)  # stand-in for accelerator work
            if manager.should_commit():
                optimizer.step()
                fh.write(f"{manager.current_step()} {time.time():.6f} {ATTEMPT}\n")
                fh.flush()

    full = {k: v.full_tensor() for k, v in model.state_dict().items()}  # group collective
    if RANK == 0:
        name = "final.pt" if GROUP == 0 else f"final-g{GROUP}.pt"
        torch.save(full, os.path.join(args.out, name))
    dist.barrier()
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

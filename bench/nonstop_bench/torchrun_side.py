"""What a careful torchrun user writes around a training loop, shared by the benchmark jobs: the
group of each restart under a store prefix of its own, a checkpoint (model, optimizer, step: the
data position) written atomically every N steps and resumed from, and the kill of the first
attempt that the benchmark measures."""

from __future__ import annotations

import datetime
import os
import signal
import time
from typing import Any


def join_group(timeout_s: float) -> tuple[int, int, int]:
    """torchrun's restart count, rank and world size, the default group formed. Each restart's
    group gets a fresh store prefix: on torch 2.13 a restarted gloo group otherwise reads stale
    keys from torchrun's reused store."""
    import torch.distributed as dist

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, wait_for_workers=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt-{attempt}", store),
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return attempt, rank, world


def resume(path: str, model: Any, optimizer: Any) -> int:
    """The step of the newest checkpoint (0: none), model and optimizer loaded from it."""
    import torch

    if not os.path.exists(path):
        return 0
    saved = torch.load(path)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    return saved["step"]


def save(path: str, model: Any, optimizer: Any, step: int) -> None:
    """A checkpoint of ``step`` steps done, replacing the previous one atomically."""
    import torch

    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
               tmp)
    os.replace(tmp, path)


def save_dcp(root: str, model: Any, optimizer: Any, step: int) -> None:
    """A sharded model's checkpoint of ``step`` steps done, as an FSDP2 user writes it: DCP, every
    rank its shards, into ``root/step-N``; the newest complete one is named in ``root/latest``
    (written by rank 0 once every rank is done)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd, "step": step},
             checkpoint_id=os.path.join(root, f"step-{step}"))
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = os.path.join(root, "latest.tmp")
        with open(tmp, "w") as fh:
            fh.write(str(step))
        os.replace(tmp, os.path.join(root, "latest"))


def resume_dcp(root: str, model: Any, optimizer: Any) -> int:
    """The step of the newest complete DCP checkpoint under ``root`` (0: none), loaded."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    try:
        with open(os.path.join(root, "latest")) as fh:
            step = int(fh.read())
    except FileNotFoundError:
        return 0
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd, "step": step}
    dcp.load(state, checkpoint_id=os.path.join(root, f"step-{step}"))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    return step


def kill_self(out: str, signame: str = "SIGKILL") -> None:
    """The fault: its time to ``out/kill.txt`` (the benchmark's clock starts there), then the
    signal to this process."""
    with open(os.path.join(out, "kill.txt"), "w") as k:
        k.write(f"{time.time():.6f}\n")
    os.kill(os.getpid(), getattr(signal, signame))

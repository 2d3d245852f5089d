"""One rank of a 2-rank gloo generation with a job mesh (tests/test_pg_release.py): a collective
on the mesh's lasting group waits for a peer that never posts it, and nothing is left to shut -
as when gloo leaves a send waiting on a connection its peer already closed. The generation is
then marked aborted (without the socket shutdown an abort also does): the wait must end.

argv: rank, store port, and the collective: ``all_gather`` (torch.distributed's, as FSDP2's
unshard calls it), ``reduce_scatter`` (FSDP2's gradients: a gloo work that ignores the timeout it
is given) or ``functional`` (DTensor's functional all-reduce, waited for in C++). Prints what
happened to each step on rank 0, and how many works its generation holds as abandoned."""

import os
import sys
import threading
import time

import torch.distributed as dist

from nonstop.runtime import mesh as mesh_mod
from nonstop.runtime import pg

rank, port, how = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
group = pg.GenerationGroup("127.0.0.1", port, 0, rank, 2, "gloo", "g/0/pg", 30.0, 60.0)
group.open()
job = mesh_mod.JobMesh(mesh_mod.Mesh(("dp",), (-1,), lambda m: None))
group.extend(lambda: job.form(0, rank, 2, aborted=lambda: group.aborted,
                               abandoned=group.abandoned))
(lasting,) = job.groups
import torch  # noqa: E402
import torch.distributed._functional_collectives as fc  # noqa: E402


def all_reduce(t):
    if how == "functional":
        return fc.wait_tensor(fc.all_reduce(t, "sum", lasting))
    if how == "reduce_scatter":
        out = torch.empty(len(t) // 2)
        dist.reduce_scatter_tensor(out, t, group=lasting)
        return out
    out = torch.empty(len(t) * 2)
    dist.all_gather_into_tensor(out, t, group=lasting)
    return out.sum(0, keepdim=True) / 4


out = all_reduce(torch.ones(4))  # both ranks: it works as before
print(f"sum {out[0].item()}", flush=True)
if rank == 0:
    threading.Timer(0.3, lambda: setattr(group, "aborted", True)).start()
    t0 = time.monotonic()
    try:
        all_reduce(torch.ones(4))  # rank 1 never posts it
        print("returned", flush=True)
    except RuntimeError as exc:
        print(f"released {time.monotonic() - t0:.3f}: {exc}", flush=True)
    print(f"abandoned {len(group.abandoned)}", flush=True)
    t0 = time.monotonic()
    try:
        all_reduce(torch.ones(4))
        print("posted after the abort", flush=True)
    except RuntimeError as exc:
        print(f"refused {time.monotonic() - t0:.3f}: {exc}", flush=True)
else:
    time.sleep(2.0)
os._exit(0)  # gloo's worker thread on rank 0 is still blocked in the first: not joined

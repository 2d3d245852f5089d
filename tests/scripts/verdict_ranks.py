"""One rank of two, for tests/test_verdict.py: FSDP2 over both ranks with the NaN verdict carried
by the gradient reduce-scatter (runtime/verdict.py), in several steps, and the structures it is
not installed on. Prints one JSON line of what it saw. Usage: verdict_ranks.py RANK STORE_FILE"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from nonstop.runtime.verdict import install

rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
mesh = init_device_mesh("cpu", (2,))


def sharded(seed=0, hook=False):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    if hook:  # the first unit gets zero gradients: a NaN of the loss reaches the last unit only
        model[1].register_forward_hook(
            lambda m, i, o: o.register_hook(lambda g: torch.zeros_like(g)) and None)
    for layer in (model[0], model[2]):  # the last unit: a [1, 16] weight, rank 1's part empty
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
calls = []
real = dist.all_reduce
dist.all_reduce = lambda *a, **k: calls.append(1) or real(*a, **k)
seen = {}
STEP = 7  # (the state's step counter: a second optimizer of a step gets the first one's verdict)

model, opt = sharded()
verdict = install({"model": model, "optimizer": opt})
plain, plain_opt = sharded()  # the same model without it: the same gradients, bit for bit
verdict.begin(2)
seen["before_any"] = verdict.take(STEP)
model(x).sum().backward()
plain(x).sum().backward()
seen["finite"] = verdict.take(STEP)
seen["same_grads"] = all(torch.equal(a.grad.to_local(), b.grad.to_local())
                         for a, b in zip(model.parameters(), plain.parameters()))
opt.zero_grad()
(model(x).sum() * (float("nan") if rank == 1 else 1.0)).backward()
seen["nan_on_rank_1"] = verdict.take(STEP)
seen["second_optimizer"] = verdict.take(STEP)
seen["next_step_without_reductions"] = verdict.take(STEP + 1)
seen["own_grads_finite"] = all(bool(torch.isfinite(p.grad.to_local()).all())
                               for p in model.parameters())

hooked, hooked_opt = sharded(hook=True)
v2 = install({"model": hooked, "optimizer": hooked_opt})
v2.begin(2)
(hooked(x).sum() * (float("nan") if rank == 0 else 1.0)).backward()
seen["nan_in_last_unit_of_rank_0"] = v2.take(STEP)
seen["own_part_of_last_unit"] = [p.grad.to_local().numel() for p in hooked[2].parameters()]
v2.begin(2)
hooked(x).sum().backward()
seen["forgotten_then_finite"] = v2.take(STEP)
v2.begin(3)  # a reduction over fewer ranks than the world carries no verdict
hooked(x).sum().backward()
seen["group_not_the_world"] = v2.take(STEP)

# structures it is not installed on
hsdp = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
torch.manual_seed(0)
m = torch.nn.Linear(8, 8)
fully_shard(m, mesh=hsdp)
seen["hsdp"] = install({"m": m, "o": torch.optim.SGD(m.parameters(), lr=0.1)}) is not None
m2, o2 = sharded()
extra = torch.nn.Parameter(torch.zeros(2))
o2.add_param_group({"params": [extra]})
seen["a_parameter_of_no_unit"] = install({"m": m2, "o": o2}) is not None
seen["no_optimizer"] = install({"m": sharded()[0]}) is not None
seen["all_reduces"] = len(calls)
print(json.dumps(seen), flush=True)
dist.destroy_process_group()

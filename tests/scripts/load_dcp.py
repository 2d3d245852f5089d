"""A script without nonstop: builds the FSDP2 model of examples/train_fsdp.py afresh (one rank,
its own mesh), loads a step directory nonstop wrote with plain torch.distributed.checkpoint, and
saves the full parameters. Usage: load_dcp.py STEP_DIR OUT --dim D --blocks B"""

import argparse
import importlib.util
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

p = argparse.ArgumentParser()
p.add_argument("step_dir")
p.add_argument("out")
p.add_argument("--dim", type=int, default=32)
p.add_argument("--blocks", type=int, default=2)
p.add_argument("--example", required=True)
args = p.parse_args()

# the example's model classes, without running the example (it trains at its top level)
source = open(args.example).read()
head = source[:source.index("torch.manual_seed(args.seed)")]
spec = importlib.util.spec_from_loader("model_only", loader=None)
module = importlib.util.module_from_spec(spec)
sys.argv = [args.example]
exec(compile(head.replace("import nonstop\n", ""), args.example, "exec"), module.__dict__)

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.manual_seed(123)  # other weights than the run's: the load must replace every one
model = module.Model(args.dim, args.blocks)
mesh = init_device_mesh("cpu", (1,))
for block in model.blocks:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
state = {"model": model.state_dict()}
dcp.load(state, checkpoint_id=args.step_dir)
model.load_state_dict(state["model"])
torch.save({k: v.full_tensor() for k, v in model.state_dict().items()}, args.out)
dist.destroy_process_group()

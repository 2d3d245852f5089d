"""A Hugging Face Llama (``transformers``' ``LlamaForCausalLM``) trained with FSDP2 and tensor
parallelism under nonstop: a 2-D mesh ``(dp_shard, tp)``.

    nonstop run --nproc 4 --spares 1 examples/train_hf_llama.py --steps 100 --save final.pt

The model is the library's own code, built from a small ``LlamaConfig`` with random weights
(nothing is downloaded). The parallelisation is the usual one for Llama: in each decoder layer the
attention's q/k/v projections and the MLP's gate/up projections split by columns (each
tensor-parallel rank computes its share of the heads and of the hidden units), the attention's
output and the MLP's down projection by rows; then each layer, and the whole model, sharded with
FSDP2 across ``dp_shard`` (``--replicas 2``: HSDP over ``(dp_replicate, dp_shard)``, a 3-D mesh).
The training is next-token prediction on random tokens (one seed per step), the loss the
model's own (``labels=``).

As in examples/train_2d.py, the build function must not communicate: ``src_data_rank=None``.
"""

import argparse
import time

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import LlamaConfig, LlamaForCausalLM

import nonstop

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--hidden", type=int, default=32)
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--heads", type=int, default=4)
parser.add_argument("--kv-heads", type=int, default=2)
parser.add_argument("--vocab", type=int, default=128)
parser.add_argument("--seq", type=int, default=16)
parser.add_argument("--batch", type=int, default=2, help="sequences per data-parallel group")
parser.add_argument("--tp", type=int, default=2, help="the tensor-parallel degree")
parser.add_argument("--replicas", type=int, default=1,
                    help="replica groups (HSDP): above 1, a 3-D mesh (dp_replicate, dp_shard, tp)")
parser.add_argument("--sleep-ms", type=float, default=0.0, help="stand-in for accelerator work")
parser.add_argument("--save", help="rank 0 writes the final (full) parameters here")
parser.add_argument("--device", default="cpu", help="cpu, or cuda (the parts live on the GPU)")
parser.add_argument("--backend", default="gloo", help="gloo, or nccl (with --device cuda)")
args = parser.parse_args()

config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                     intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                     num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                     max_position_embeddings=args.seq, tie_word_embeddings=False, use_cache=False,
                     attn_implementation="sdpa")
torch.manual_seed(args.seed)
model = LlamaForCausalLM(config)  # the same initial weights on every rank (one seed)

DP = ("dp_replicate", "dp_shard") if args.replicas > 1 else ("dp_shard",)
LAYER_PLAN = {
    "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(),
}


def parallelize(mesh):
    """Tensor parallel within each decoder layer over ``tp``, then FSDP2 over the data-parallel
    dimensions. Runs once per process."""
    dp = mesh[DP] if len(DP) > 1 else mesh["dp_shard"]
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], LAYER_PLAN, src_data_rank=None)
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return nonstop.State(model=model, optimizer=optimizer)


def dp_position(mesh):
    """This rank's data-parallel group and how many there are."""
    index, size = 0, 1
    for name in DP:  # this generation's groups (a mesh's own sizes are the full mesh's)
        group = mesh[name].get_group()
        index, size = index * group.size() + group.rank(), size * group.size()
    return index, size


def batch(step, ctx):
    """This data-parallel group's sequences of the step's global batch (``--batch`` per group
    of the full mesh: the same global batch while a replica group is away)."""
    g = torch.Generator().manual_seed(nonstop.step_seed(args.seed, step, 0))
    tokens = torch.randint(0, args.vocab, (args.batch * (ctx.full_world_size // args.tp), args.seq),
                           generator=g)
    index, size = dp_position(ctx.mesh)
    share = len(tokens) // size
    return tokens[share * index:share * (index + 1)].to(args.device)


MESH = (nonstop.Mesh(("dp_shard", "tp"), (-1, args.tp), parallelize, device_type=args.device)
        if args.replicas == 1 else
        nonstop.Mesh(DP + ("tp",), (args.replicas, -1, args.tp), parallelize,
                     device_type=args.device))


@nonstop.wrap(MESH, backend=args.backend)
def train(ctx):
    optimizer = ctx.state["optimizer"]
    for step in ctx.steps(args.steps):
        tokens = batch(step, ctx)
        loss = model(input_ids=tokens, labels=tokens).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ctx.report(loss)
        if args.sleep_ms:
            time.sleep(args.sleep_ms / 1000)
        if ctx.rank == 0 and step % 25 == 0:
            print(f"step {step} loss {loss.item():.4f} (generation {ctx.generation})")
    full = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
    return full if ctx.rank == 0 else None


full = train()
if full is not None and args.save:
    torch.save(full, args.save)

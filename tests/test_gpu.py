"""State on the GPU: snapshots copy device tensors to the node's memory and restores put them
back, bit for bit. Needs CUDA; skipped elsewhere (CI has no GPU)."""

from __future__ import annotations

import pytest
import torch

from conftest import EXAMPLES, bitwise_equal, rank_wids, run_nonstop

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHARDED = EXAMPLES / "train_sharded.py"
ARGS = ("--steps", "40", "--device", "cuda")


def run(tmp_path, name, *flags):
    out = tmp_path / f"{name}.pt"
    r = run_nonstop(tmp_path / name, "--nproc=2", "--nodes=2", "--snapshot-every=1", *flags,
                    str(SHARDED), *ARGS, "--save", str(out))
    assert r.code == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r, out


def test_gpu_state_comes_back_from_memory_buddy_and_disk(tmp_path):
    _, ref = run(tmp_path, "reference")
    r, out = run(tmp_path, "crash", "--spares=2", "--inject=crash:rank=1,step=15")
    # a snapshot on the GPU is staged: one still being written when the rank dies does not
    # count, so the survivor may restore the step before from its memory rather than live
    (sources,) = [e["sources"] for e in r.of("restore") if e["gen"] > 0]
    assert sources["1"] == "memory" and sources["0"] in ("live", "memory")
    assert bitwise_equal(out, ref)
    r, out = run(tmp_path, "node", "--spare-nodes=1", "--inject=node_crash:rank=1,step=15")
    assert [e["sources"]["1"] for e in r.of("restore") if e["gen"] > 0] == ["buddy"]
    assert bitwise_equal(out, ref)
    ckpt = tmp_path / "ckpt"
    run(tmp_path, "first", f"--checkpoint-dir={ckpt}", "--checkpoint-every=10")
    r, out = run(tmp_path, "resumed", f"--checkpoint-dir={ckpt}")
    assert [e["sources"] for e in r.of("restore")] == [{"0": "disk", "1": "disk"}]
    assert bitwise_equal(out, ref)


def test_nccl_backend_carries_nonstops_own_collectives_on_gloo(tmp_path):
    """With ``backend="nccl"`` the restore's offers and the snapshot interval's agreement (CPU
    tensors) go through gloo beside NCCL; the training's CUDA tensors through NCCL. One GPU: one
    rank (NCCL refuses two ranks on one device)."""
    args = (*ARGS, "--backend", "nccl")

    def one(name, *flags):
        out = tmp_path / f"{name}.pt"
        r = run_nonstop(tmp_path / name, "--nproc=1", *flags, str(SHARDED), *args,
                        "--save", str(out))
        assert r.code == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return r, out

    _, ref = one("nccl-reference")
    r, out = one("nccl-crash", "--spares=1", "--snapshot-every=1",
                 "--inject=crash:rank=0,step=25")
    (restore,) = [e for e in r.of("restore") if e["gen"] > 0]
    # the snapshot of step 25 may still have been in flight (staged) when the rank died
    assert restore["sources"] == {"0": "memory"} and restore["step"] in (24, 25)
    assert bitwise_equal(out, ref)


@pytest.mark.parametrize("fault", ["stop:rank=1,step=25", "cuda_assert:rank=1,step=25"])
def test_two_nccl_ranks_on_one_gpu_survive_a_frozen_peer_and_a_device_assert(tmp_path, fault,
                                                                           monkeypatch):
    """Two rank processes share the one GPU (``NONSTOP_SHARE_GPU``: NCCL over its socket
    transport). A frozen rank 1 leaves rank 0 blocked in NCCL collectives until the abort of its
    communicators; a device-side assert ends rank 1's process. Either way rank 1 gets a new
    process, rank 0 restarts in place, and the weights are the fault-free ones."""
    monkeypatch.setenv("NONSTOP_SHARE_GPU", "1")
    args = (*ARGS, "--backend", "nccl")

    def two(name, *flags):
        out = tmp_path / f"{name}.pt"
        r = run_nonstop(tmp_path / name, "--nproc=2", "--snapshot-every=1", *flags, str(SHARDED),
                        *args, "--save", str(out))
        assert r.code == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return r, out

    _, ref = two("reference")
    r, out = two("fault", "--spares=1", f"--inject={fault}")
    held = rank_wids(r)
    assert len(held[1]) == 2 and len(held[0]) == 1
    assert bitwise_equal(out, ref)

"""A model nobody here wrote: Hugging Face ``transformers``' Llama (built from a small config,
random weights, nothing downloaded) trained with FSDP2 and tensor parallel under nonstop; a
killed rank is replaced in-process and the run ends bitwise-equal to a fault-free one."""

from __future__ import annotations

import pytest
from conftest import EXAMPLES, bitwise_equal, rank_wids, train

pytest.importorskip("transformers")

LLAMA = EXAMPLES / "train_hf_llama.py"
ARGS = ("--steps", "10", "--hidden", "16", "--layers", "1", "--heads", "4", "--kv-heads", "2",
        "--vocab", "64", "--seq", "8")


@pytest.mark.integration
def test_a_hugging_face_llama_with_fsdp_and_tensor_parallel_replaces_a_killed_rank_bitwise(
        tmp_path, reference):
    """(dp_shard, tp) = (2, 2): every decoder layer's attention and MLP split over ``tp`` by the
    usual Llama plan, FSDP2 over ``dp_shard``. Rank 3 is killed at step 6; a warm spare builds
    the library's model and the same parallel structure at rank 3's coordinates, alone, and
    receives its part from its node's memory (a snapshot every step); the others keep theirs in
    their processes. Nothing lost; the gathered weights bitwise those of the fault-free run."""
    run, out = train(tmp_path, "--spares=1", "--snapshot-every=1", "--inject=crash:rank=3,step=6",
                     args=ARGS, world=4, script=LLAMA)
    assert [d["level"] for d in run.of("decision")] == ["rank replacement"]
    held = rank_wids(run)
    assert len(held[3]) == 2 and all(len(held[r]) == 1 for r in (0, 1, 2))
    (inc,) = run.summary["incident_list"]
    assert inc["steps_lost"] == 0
    (restore,) = [r for r in run.of("restore") if r["gen"] == 1]
    assert restore["step"] == 6 and restore["sources"]["3"] == "memory", restore
    assert bitwise_equal(out, reference(4, *ARGS, script=LLAMA))

"""A model nobody here wrote: Hugging Face ``transformers``' Llama (built from a small config,
random weights, nothing downloaded) trained with FSDP2 and tensor parallel under nonstop; a
killed rank is replaced in-process and the run ends bitwise-equal to a fault-free one."""

from __future__ import annotations

import pytest
from conftest import EXAMPLES, bitwise_equal, rank_wids, train

pytest.importorskip("transformers")

LLAMA = EXAMPLES / "train_hf_llama.py"


@pytest.fixture(autouse=True)
def preloaded(monkeypatch):
    """transformers imported once per node, by the zygote (NONSTOP_PRELOAD), not by each of the
    runs' processes (2.5-3.5 s of CPU each here): the fault-free reference's too."""
    monkeypatch.setenv("NONSTOP_PRELOAD", "transformers,transformers.models.llama.modeling_llama")
ARGS = ("--steps", "10", "--hidden", "16", "--layers", "1", "--heads", "4", "--kv-heads", "2",
        "--vocab", "64", "--seq", "8")


@pytest.mark.integration
def test_a_hugging_face_llama_with_fsdp_and_tensor_parallel_replaces_a_rank_then_a_node_bitwise(
        tmp_path, reference):
    """(dp_shard, tp) = (2, 2) on two nodes of two ranks (a tensor-parallel group per node),
    every decoder layer's attention and MLP split over ``tp`` by the usual Llama plan, FSDP2
    over ``dp_shard``; a warm spare (on node 0) and a spare node. Rank 3 (node 1) is killed at
    step 4: the warm spare builds the library's model and the same parallel structure at rank
    3's coordinates, alone, and receives its part - no twin holds it - from rank 3's own
    snapshot in node 1's memory (a snapshot every step), read and sent by rank 2, still on node
    1; the others keep theirs in their processes. Then node 0 dies whole at step 7 (its memory
    too), with ranks 0, 1 and rank 3's replacement: they move to the spare node and take their
    parts from the replicas on their buddy node. Nothing lost; the gathered weights bitwise those
    of the fault-free run."""
    run, out = train(tmp_path, "--spares=1", "--nodes=2", "--spare-nodes=1", "--snapshot-every=1",
                     "--inject=crash:rank=3,step=4;node_crash:rank=1,step=7", args=ARGS, world=4,
                     script=LLAMA)
    decisions = run.of("decision")
    assert [d["level"] for d in decisions] == ["rank replacement", "node replacement"]
    assert decisions[1]["replace"] == [0, 1, 3]  # node 0's processes: rank 3's spare was there
    held = rank_wids(run)
    assert [len(held[r]) for r in range(4)] == [2, 2, 1, 3]
    # the buddy's replicas are copied in the background: under load the newest may not have
    # arrived when the node died, and the job goes back one step more
    lost = [i["steps_lost"] for i in run.summary["incident_list"]]
    assert lost[0] == 0 and lost[1] <= 1, lost
    first, second = sorted((r for r in run.of("restore") if r["gen"] > 0), key=lambda r: r["gen"])
    assert first["step"] == 4 and first["sources"] == {"0": "live", "1": "live", "2": "live",
                                                       "3": "node"}, first
    assert second["step"] == 7 - lost[1], second
    assert {second["sources"][r] for r in ("0", "1", "3")} == {"buddy"}, second
    assert bitwise_equal(out, reference(4, *ARGS, script=LLAMA))


@pytest.mark.integration
def test_a_hugging_face_llama_with_hsdp_and_tensor_parallel_shrinks_and_grows_back(tmp_path,
                                                                                   reference):
    """HSDP x tensor parallel, (dp_replicate, dp_shard, tp) = (2, 1, 2), no spare: rank 1 is
    killed and its whole replica group leaves; the other goes on alone at once, the global batch
    kept, then the group comes back at a step boundary, its parts from their twins. The weights
    end within the elastic oracle's tolerance of the fault-free run."""
    from conftest import policy_file
    from elastic_oracle import SCALE_IN, assert_shrank_by_a_group_and_grew_back

    # (the group's new processes build the model and join before it can grow back: a second)
    args = (ARGS[0], "30", *ARGS[2:], "--replicas", "2", "--sleep-ms", "100")
    run, out = train(tmp_path, "--spares=0", f"--policy={policy_file(tmp_path, SCALE_IN)}",
                     "--inject=crash:rank=1,step=6", args=args, world=4, script=LLAMA)
    assert_shrank_by_a_group_and_grew_back(run, out, reference(4, *args, script=LLAMA), step=6)

"""Silent data corruption with real processes: one bit of one rank's parameters flips; the
replicas' digests, compared before the next snapshot, find it; every rank resumes in place from
the last snapshot whose digests agreed, the replay of the steps names the rank, and the run ends
with the fault-free weights and a certificate in its summary. A layout with no twin is checked by
replaying a step in place (``detect.sdc.replay_every``)."""

from __future__ import annotations

import pytest

from conftest import EXAMPLES, SCRIPTS, bitwise_equal, policy_file, rank_wids, run_nonstop, train
from nonstop.decide.sdc import POINTS

pytestmark = pytest.mark.integration

ARGS = ("--steps", "40", "--sleep-ms", "10")


def test_two_replicas_a_flipped_bit_rolled_back_in_place_the_replay_names_its_rank_bitwise(
        tmp_path, reference):
    """DDP, two replicas (a warm spare ready), one bit of rank 1's parameters flipped at the
    start of step 12. The next comparison finds the replicas differ - which one is wrong the
    digests cannot say (neither is the majority; and rank 1's gradients reached rank 0 at step
    12's all-reduce: neither holds the fault-free parameters). Neither is replaced: every rank
    goes back in place to the snapshot before, which agreed, and redoes the steps from the same
    inputs. The replay agrees, and rank 1's forward outputs parted from its first pass at step
    12, rank 0's only after them (through the all-reduce): rank 1 is named (sdc_attributed,
    with every rank's evidence and digests), counted against its node - no process replaced,
    no step lost but the rollback's, and the run ends with the fault-free weights and a
    certificate."""
    run, out = train(tmp_path, "--spares=1", "--inject=bitflip:rank=1,step=12", args=ARGS,
                     world=2)
    (flip,) = run.of("rank_bitflip")
    assert flip["rank"] == 1 and flip["step"] == 12
    (fault,) = [f for f in run.of("fault") if f["kind"] == "sdc"]
    assert fault["rank"] is None and fault["attribution"] == "infrastructure"
    (d,) = run.of("decision")
    assert d["level"] == "in-process restart" and d["replace"] == []
    assert all(len(wids) == 1 for wids in rank_wids(run).values())  # no rank replaced
    (inc,) = run.of("incident")
    found = run.summary["sdc"]["found"]
    assert [(f["suspects"], f["repaired"], f["attributed"]) for f in found] == [([0, 1], True, 1)]
    assert inc["resume_step"] <= 12 < found[0]["step"]
    assert inc["steps_lost"] == found[0]["step"] - inc["resume_step"]
    (named,) = run.of("sdc_attributed")
    assert (named["verdict"], named["rank"], named["node"]) == ("transient", 1, 0)
    assert named["at"] == {"step": 12, "point": "output"} and not named["scheduled"]
    assert named["step"] == found[0]["step"]
    # both first-pass digests differ from what the replay agrees on; the evidence says who
    # parted first
    assert len(set(named["replayed"].values())) == 1
    assert set(named["original"].values()).isdisjoint(named["replayed"].values())
    by_rank = {e["rank"]: e for e in named["evidence"]}
    assert (by_rank[1]["step"], by_rank[1]["point"]) == (12, "output")
    # rank 0 took the fault in at step 12's all-reduce: its passes part after rank 1's outputs
    # (at step 12's end where a check looked there, the interval being one step; later else)
    assert (by_rank[0]["step"], POINTS.index(by_rank[0]["point"])) > (12, POINTS.index("output"))
    assert by_rank[1]["first"] != by_rank[1]["second"]
    assert "the replay names rank 1" in run.stderr
    sdc = run.summary["sdc"]
    assert sdc["checks"] > 0 and sdc["last_step"] == 40 and len(sdc["chain"]) == 64
    assert "every step's weights agreed across replicas" in run.stdout
    assert bitwise_equal(out, reference(2, *ARGS))


def test_a_fault_that_recurs_in_the_replay_gets_its_rank_a_new_process_and_no_other(
        tmp_path, reference):
    """DDP, two replicas: rank 1's device flips a bit at step 12 in the first pass and another
    when the replay runs step 12 again (``times=2``: a device that keeps failing). The replay
    differs from its twin again, and rank 1's passes part at step 12's outputs, rank 0's later:
    rank 1 is named (persistent) and only it gets a new process; every rank goes back once
    more, and the steps come out fault-free - bitwise. The replay after the replacement, which
    agrees, names no one again."""
    run, out = train(tmp_path, "--spares=1", "--inject=bitflip:rank=1,step=12,times=2",
                     args=ARGS, world=2)
    flips = run.of("rank_bitflip")
    assert [(f["gen"], f["step"]) for f in flips] == [(0, 12), (1, 12)]
    assert flips[0]["where"] != flips[1]["where"]
    assert [(d["level"], d["replace"]) for d in run.of("decision")] == [
        ("in-process restart", []), ("rank replacement", [1])]
    (named,) = run.of("sdc_attributed")
    assert (named["rank"], named["verdict"], named["gen"]) == (1, "persistent", 1)
    assert named["at"] == {"step": 12, "point": "output"}
    held = rank_wids(run)
    assert len(held[0]) == 1 and len(held[1]) == 2, held
    # the summary's records name rank 1 and no other (on a loaded machine a check between
    # snapshots, spaced by its measured cost, may find the redone fault at another step than
    # the first: that record is the replay's too, and may stay unnamed)
    found = run.summary["sdc"]["found"]
    assert any(f.get("attributed") == 1 for f in found), found
    assert all(f.get("attributed") in (1, None) for f in found), found
    assert bitwise_equal(out, reference(2, *ARGS))


def test_only_the_node_the_replay_points_at_is_isolated(tmp_path, reference):
    """Two replicas on two nodes, a spare node, and rules that isolate a node at its first
    fault: rank 1's bit flips. The mismatch names both ranks as suspects, and isolates neither
    node (isolating both would leave no node for the job). The replay names rank 1: its node -
    and only it - is isolated, rank 1 moves to the spare node with its twin's live state (no
    step lost), rank 0 keeps its process; bitwise."""
    pol = policy_file(tmp_path, "rules:\n  isolate: {times: 1}\n")
    run, out = train(tmp_path, "--nodes=2", "--spare-nodes=1", "--policy", pol,
                     "--inject=bitflip:rank=1,step=12", args=ARGS, world=2)
    (named,) = run.of("sdc_attributed")
    assert (named["rank"], named["node"], named["verdict"]) == (1, 1, "transient")
    assert [(d["level"], d["replace"], d["isolate"]) for d in run.of("decision")] == [
        ("in-process restart", [], []), ("node replacement", [1], [1])]
    assert [e["node"] for e in run.of("isolate")] == [1]
    held = rank_wids(run)
    assert len(held[0]) == 1 and len(held[1]) == 2, held
    assert run.summary["incident_list"][-1]["steps_lost"] == 0
    assert bitwise_equal(out, reference(2, *ARGS))


def test_report_only_warns_and_certifies_nothing(tmp_path):
    pol = policy_file(tmp_path, "detect:\n  sdc: {action: report}\n")
    run, _ = train(tmp_path, "--policy", pol, "--inject=bitflip:rank=0,step=5",
                   args=("--steps", "12"), world=2)
    assert not run.of("decision")  # training went on
    (m,) = run.of("rank_sdc_mismatch")[:1]
    assert m["suspects"] == [0, 1]  # two replicas: which one is right cannot be told
    assert run.summary["sdc"]["found"][0]["repaired"] is False
    assert "reported only" in run.stdout and "differ" in run.stderr


def test_a_fault_free_run_is_certified(tmp_path):
    run, _ = train(tmp_path, args=("--steps", "12"), world=2)
    sdc = run.summary["sdc"]
    assert sdc["mismatches"] == 0 and sdc["checks"] >= 6 and sdc["last_step"] == 12


def test_a_corruption_found_when_a_generation_forms_after_the_memory_was_lost(tmp_path, reference):
    # the node's memory dies (its snapshot of step 10 with it); an exception restarts the ranks
    # in place at 13, in a new memory that holds nothing: the generation's first step is
    # snapshotted (14). A bit flips in rank 1 (16), rank 0 dies before the next comparison (18):
    # the live states of ranks 1 and 2 differ, so every rank goes back to 14 - 4 steps, bit for
    # bit (counted from the entry, the next snapshot was due at 23: nothing was held, and a job
    # restart lost all 18 steps)
    args = ("--steps", "30", "--sleep-ms", "20")
    # the comparisons at the snapshots only: a check between them (spaced by its measured cost,
    # which a loaded machine makes smaller beside the step) found the flip at 17, before the crash
    pol = policy_file(tmp_path, "detect:\n  sdc: {max_overhead_pct: 0.001}\n")
    run, out = train(tmp_path, "--spares=1", "--snapshot-every=10", "--policy", pol,
                     "--inject=keeper_crash:"
                     "rank=0,step=10;exception:rank=2,step=13;bitflip:rank=1,step=16;"
                     "crash:rank=0,step=18", args=args)
    assert run.of("node_memory_lost") and run.of("rank_bitflip")
    assert "job restart" not in [d["level"] for d in run.of("decision")]
    restores = {e["gen"]: e for e in run.of("restore")}
    assert restores[1]["step"] == 13 and restores[2]["step"] == 14  # (reached, then resumed)
    back = restores[max(restores)]
    assert back["step"] == 14 and any(s["cause"] == "sdc" for s in back["skipped"])
    found = run.summary["sdc"]["found"]
    assert [(f["step"], f["verdict"]) for f in found] == [(18, "corruption")]
    inc = run.summary["incident_list"][-1]
    assert inc["resume_step"] == 14 and inc["steps_lost"] == 4
    assert bitwise_equal(out, reference(3, *args))


def test_replicas_that_compute_differently_diverge_the_job_stops_and_no_node_is_blamed(
        tmp_path, monkeypatch):
    # ranks 1 and 2 take a learning rate of their own from step 6 (their environment): at the
    # comparison after it rank 0 looks like the odd one - replaced, every rank rolled back - and
    # redone, the step comes out the same: a divergence, exit 1 with its diagnosis
    monkeypatch.setenv("NONSTOP_TEST_DIVERGE_RANKS", "1,2")
    monkeypatch.setenv("NONSTOP_TEST_DIVERGE_FROM", "6")
    run = run_nonstop(tmp_path / "run", "--nproc=3", "--spares=1", str(SCRIPTS / "sdc_diverge.py"),
                      "--steps", "20")
    assert run.code == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert "replicas diverge" in run.stderr and "not a silent corruption" in run.stderr
    assert "different code, arguments or data" in run.stderr
    (div,) = run.of("sdc_divergence")
    assert div["groups"] == [[1, 2], [0]]
    assert not run.of("isolate") and not any(d["isolate"] for d in run.of("decision"))
    (give_up,) = run.of("give_up")
    assert "diverge" in give_up["diagnosis"]
    found = run.summary["sdc"]["found"]
    assert [f["verdict"] for f in found] == ["corruption", "divergence"]
    assert "the replicas diverged" in run.stdout


def test_a_corruption_found_while_the_nodes_memory_is_out_goes_back_to_a_copy_kept_in_process(
        tmp_path, reference):
    # the node's memory dies at 10 (its snapshots with it; a new one comes only a second later,
    # or with the next generation): the snapshot of 12, whose replicas agreed, cannot be written
    # - each rank keeps it in its own process. A bit flips in rank 1 (13), found at 14: every
    # rank goes back in place to its copy of 12, 2 steps, bit for bit, and the replay names
    # rank 1 (with nothing certified left anywhere: a job restart, all 14)
    args = ("--steps", "24", "--sleep-ms", "10")
    run, out = train(tmp_path, "--spares=1", "--snapshot-every=2",
                     "--inject=keeper_crash:rank=0,step=10;bitflip:rank=1,step=13", args=args)
    assert run.of("node_memory_lost") and run.of("rank_snapshot_failed")
    assert [d["level"] for d in run.of("decision")] == ["in-process restart"]
    back = [e for e in run.of("restore") if e["gen"] == 1][0]
    assert back["step"] == 12 and set(back["sources"].values()) == {"kept"}
    assert [(a["rank"], a["verdict"]) for a in run.of("sdc_attributed")] == [(1, "transient")]
    (inc,) = run.summary["incident_list"]
    assert inc["resume_step"] == 12 and inc["steps_lost"] == 2
    assert bitwise_equal(out, reference(3, *args))


def test_a_flipped_bit_in_a_sharded_job_is_judged_among_its_twins_and_the_replay_names_its_rank(
        tmp_path, reference):
    """HSDP, 3 replica groups x 2 shards, a snapshot every 4 steps: a bit of rank 1's shard flips
    at step 5. At the next comparison (the snapshot of 8) shard 0's twins agree and shard 1's
    are 2 to 1, so rank 1 alone is suspect: every rank goes back in place to the snapshot of 4,
    which every twin group certified - one interval lost - and the replay names rank 1 among
    its twins (its replica group's forward outputs parted at step 5, its twins' later), no
    process replaced. (Judged across the whole world, the two agreeing twin groups looked like
    camps of replicas that compute differently: the job stopped, exit 1, the corruption blamed
    on the script.) Weights bitwise; no rank's log has a FutureWarning of the twins' checks."""
    args = ("--replicas", "3", "--steps", "16", "--dim", "16", "--blocks", "1")
    hsdp = EXAMPLES / "train_hsdp.py"
    run, out = train(tmp_path, "--spares=1", "--snapshot-every=4",
                     "--inject=bitflip:rank=1,step=5", args=args, world=6, script=hsdp)
    assert not run.of("sdc_divergence")
    assert [(d["level"], d["replace"]) for d in run.of("decision")] == [("in-process restart", [])]
    found = run.summary["sdc"]["found"]
    assert [(f["step"], f["suspects"], f["verdict"]) for f in found] == [(8, [1], "corruption")]
    (inc,) = run.summary["incident_list"]
    assert inc["faults"][0].startswith("sdc: rank(s) 1: parameters differ from their twins'")
    assert inc["resume_step"] == 4 and inc["steps_lost"] == 4  # at most one snapshot interval
    (named,) = run.of("sdc_attributed")
    assert (named["rank"], named["verdict"], named["candidates"]) == (1, "transient", [1, 3, 5])
    assert named["at"] == {"step": 5, "point": "output"}
    held = rank_wids(run)
    assert all(len(held[r]) == 1 for r in range(6)), held
    logs = [p.read_text(errors="replace") for p in (run.run_dir / "logs").glob("worker-*.log")]
    assert logs and not [x for x in logs if "FutureWarning" in x]
    assert bitwise_equal(out, reference(6, *args, script=hsdp))


def test_plain_fsdp_has_no_twin_a_replayed_step_finds_a_flipped_bit_names_its_rank_no_incident(
        tmp_path, reference):
    """Plain FSDP over 2 ranks: no rank holds another's shard, so no digest is compared. With
    ``detect.sdc.replay_every: 6`` steps 5 and 11 each run twice in place from the same state. A bit of rank 1's shard flips at the start of step 11: its passes part at once (the
    parameters the step started from), rank 0's only at its forward outputs (the shards
    all-gathered). A third pass agrees with the replay on every rank: the first pass is the
    one struck, the state goes on from the third, and rank 1 is named - no incident, no
    decision, no step lost, the replays' time counted as check time; step 5 replays alike and
    costs nothing else. Weights bitwise the fault-free run's."""
    pol = policy_file(tmp_path, "detect:\n  sdc: {replay_every: 6}\n")
    args = ("--steps", "16", "--dim", "16", "--blocks", "1")  # (test_sharded's reference)
    fsdp = EXAMPLES / "train_fsdp.py"
    run, out = train(tmp_path, "--policy", pol, "--inject=bitflip:rank=1,step=11", args=args,
                     world=2, script=fsdp)
    assert run.of("rank_bitflip")
    assert not run.of("incident") and not run.of("decision") and not run.of("fault")
    (named,) = run.of("sdc_attributed")
    assert (named["rank"], named["verdict"], named["scheduled"], named["struck"]) == \
        (1, "transient", True, 1)
    assert named["at"] == {"step": 11, "point": "start"} and named["step"] == 12
    by_rank = {e["rank"]: e for e in named["evidence"]}
    assert (by_rank[0]["step"], by_rank[0]["point"]) == (11, "output")
    sdc = run.summary["sdc"]
    assert "uncompared" in sdc and sdc["replays"] == 2 and sdc["replay_s"] > 0
    assert sdc["replay_pct"] is not None
    assert [(f["step"], f["attributed"]) for f in sdc["found"]] == [(12, 1)]
    assert run.summary["steps_lost"] == 0
    assert run.summary["time_s"]["snapshot"] > 0  # (the replays: check time, not steps)
    assert "replay check(s)" in run.stdout
    assert bitwise_equal(out, reference(2, *args, script=fsdp))

"""Every recovery path, for sharded jobs (FSDP2 and HSDP): a hang, a NaN step retried in place, a
whole node lost to a spare node, a second fault inside a recovery, a job restarted from its disk
checkpoint, a preempted job's emergency save. Real processes, real gloo; each run ends with the final (gathered) weights bitwise
those of a fault-free run of the same script and arguments, and says what it did (the level
decided, where each shard came from, the steps lost)."""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import (EXAMPLES, bitwise_equal, finish, policy_file, rank_wids, start, train,
                      wait_for_event, wait_for_events)

pytestmark = pytest.mark.integration

FSDP = EXAMPLES / "train_fsdp.py"
HSDP = EXAMPLES / "train_hsdp.py"
ARGS = ("--steps", "16", "--dim", "16", "--blocks", "1")


def restores(run) -> list[tuple[int, dict]]:
    """(step, sources) of every restore after the start (generation > 0)."""
    return [(r["step"], r["sources"]) for r in run.of("restore") if r["gen"] > 0]


# -- 1 and 2. a NaN step retried, a hang (FSDP2) -------------------------------------------------
def test_an_fsdp2_job_redoes_a_nan_step_and_replaces_a_hung_rank_with_nothing_lost(tmp_path,
                                                                                  reference):
    """1. Rank 0's forward output turns NaN at step 5. No shard has a twin, so the ranks' verdict
       rides in FSDP2's own gradient reduce-scatter (no commit all-reduced): rank 1, whose
       gradients were finite, stops its step too, and both redo it in place.
    2. Rank 1's main thread blocks at step 12; rank 0 waits in the step's all-gather (FSDP2
       mid-step). After the hang timeout the job is aborted, the hung rank (which cannot leave)
       is killed and replaced by a warm spare, which takes rank 1's shard from its node's memory
       (a snapshot every step); rank 0, set back to rest, keeps its own shard and its process.
    No step lost, weights bitwise."""
    run, out = train(tmp_path, "--spares=1", "--hang-timeout=3", "--snapshot-every=1",
                     "--inject=nan:rank=0,step=5;hang:rank=1,step=12", args=ARGS, world=2,
                     script=FSDP)
    assert {e["agreement"] for e in run.of("rank_entered")} == {"reduction"}
    kinds = [f["kind"] for f in run.of("fault")]
    assert kinds[0] == "nan" and kinds[1] == "hang" and "teardown_timeout" in kinds, kinds
    (hang,) = run.of("hang_detected")
    assert "rank 1 in python" in hang["where"], hang["where"]
    assert [k["rank"] for k in run.of("kill")] == [1]
    decisions = run.of("decision")
    assert [d["level"] for d in decisions] == ["step retry", "rank replacement"]
    assert decisions[0]["step"] == 5 and "rank(s) 0" in decisions[0]["reason"]
    held = rank_wids(run)
    assert len(held[1]) == 2 and len(held[0]) == 1
    assert restores(run) == [(12, {"0": "live", "1": "memory"})]
    retry, inc = run.summary["incident_list"]
    assert retry["levels"] == ["step retry"] and retry["steps_lost"] == 0
    assert inc["replaced"] == [1] and inc["steps_lost"] == 0
    assert bitwise_equal(out, reference(2, *ARGS, script=FSDP))


# -- 1 and 2. NaN steps retried in place, a hang (HSDP) ------------------------------------------
def test_an_hsdp_job_redoes_nan_steps_in_place_and_replaces_a_hung_rank_from_its_twin(
        tmp_path, reference):
    """HSDP, 2 replica groups x 2 shards, snapshots every 5 steps. Three incidents in one run:
    1. rank 1's forward output turns NaN at step 4: each rank checks its own gradient shards and
       the verdict is all-reduced (all must take the same decision, or some would step and some
       not): the step is redone in the same generation, same processes, same groups;
    2. rank 2 hangs at step 12, the others wait in the step's collectives: it is killed, a warm
       spare takes its place and receives its shard live from its twin (rank 0, the other
       replica group): nothing lost, though the last snapshot is of step 10;
    3. rank 3's output turns NaN at step 14, in the new generation (the mesh's lasting groups
       carry the verdict's all-reduce): redone in place again.
    Weights bitwise; the twins' digests agree at every check."""
    # (a 3 s timeout: at 1 s, the replacement's second step on a loaded machine was once taken
    # for a hang)
    run, out = train(tmp_path, "--spares=1", "--hang-timeout=3", "--snapshot-every=5",
                     "--inject=nan:rank=1,step=4;hang:rank=2,step=12;nan:rank=3,step=14",
                     args=ARGS, world=4, script=HSDP)
    assert {e["agreement"] for e in run.of("rank_entered")} == {"commit"}  # twins: commits
    decisions = run.of("decision")
    assert [d["level"] for d in decisions] == ["step retry", "rank replacement", "step retry"]
    assert decisions[0]["step"] == 4 and "rank(s) 1" in decisions[0]["reason"]
    assert decisions[2]["step"] == 14 and "rank(s) 3" in decisions[2]["reason"]
    assert decisions[1]["replace"] == [2]
    # the retries tear nothing down: one abort, one new generation, both for the hang
    assert len(run.of("abort")) == 1 and [g["gen"] for g in run.of("generation")] == [0, 1]
    (hang,) = run.of("hang_detected")
    assert "rank 2 in python" in hang["where"], hang["where"]
    assert [k["rank"] for k in run.of("kill")] == [2]
    held = rank_wids(run)
    assert len(held[2]) == 2 and all(len(held[r]) == 1 for r in (0, 1, 3))
    assert restores(run) == [(12, {str(r): "live" for r in range(4)})]
    incs = run.summary["incident_list"]
    assert [(i["levels"], i["step_before"], i["resume_step"], i["steps_lost"]) for i in incs] == [
        (["step retry"], 4, 4, 0), (["rank replacement"], 12, 12, 0), (["step retry"], 14, 14, 0)]
    sdc = run.summary["sdc"]
    assert sdc["checks"] > 0 and sdc["mismatches"] == 0 and not sdc.get("uncompared"), sdc
    assert bitwise_equal(out, reference(4, *ARGS, script=HSDP))


# -- 3. a whole node lost, a spare node (HSDP) -----------------------------------------------------
def test_a_lost_hsdp_node_moves_to_the_spare_node_its_shards_from_the_twins(tmp_path, reference):
    """Two nodes of two ranks: node 0 holds replica group 0 (ranks 0, 1), node 1 replica group
    1 (ranks 2, 3). Node 0 dies whole at step 9 (its keeper, then its ranks); both its ranks move
    to the spare node, and each receives its shard live from its twin on node 1 (the snapshot
    of step 5 is not needed, nor the buddy replica). No step lost, weights bitwise."""
    run, out = train(tmp_path, "--nodes=2", "--spare-nodes=1", "--snapshot-every=5",
                     "--inject=node_crash:rank=1,step=9", args=ARGS, world=4, script=HSDP)
    (decision,) = run.of("decision")
    assert decision["level"] == "node replacement" and decision["isolate"] == [0]
    assert sorted(decision["replace"]) == [0, 1]
    assert "node_lost" in decision["reason"]
    node_of = {e["wid"]: e["node"] for e in run.of("spawn")}
    last = run.of("generation")[-1]["ranks"]
    assert {int(r): node_of[w] for r, w in last.items()} == {0: 2, 1: 2, 2: 1, 3: 1}
    assert restores(run) == [(9, {str(r): "live" for r in range(4)})]
    (inc,) = run.summary["incident_list"]
    assert inc["steps_lost"] == 0 and sorted(inc["replaced"]) == [0, 1]
    sdc = run.summary["sdc"]
    assert sdc["checks"] > 0 and sdc["mismatches"] == 0, sdc
    assert bitwise_equal(out, reference(4, *ARGS, script=HSDP))


# -- 4. a second fault inside the recovery (FSDP2) -------------------------------------------------
# ten SIGKILLs on one machine would otherwise isolate it (rules.isolate); a survivor gets 3 s to
# leave a failed generation (a loaded machine may not schedule it within the default 0.5 s)
ISOLATE_LATE = "rules:\n  isolate:\n    times: 100\nrecover:\n  timeouts:\n    teardown_s: 3\n"
# each incident: a crash at a step, then a second fault inside its recovery, keyed by the
# generation that recovery forms (an incident with a second fault takes two generations)
SECOND = [
    ("crash:rank=1,step=3", "crash:rank=1,at=assigned,gen=1", "replace"),  # the spare, promoted
    ("crash:rank=0,step=6", "crash:rank=0,at=rendezvous,gen=3", "rendezvous"),
    ("crash:rank=1,step=9", "crash:rank=0,at=restore,gen=5", "restore"),  # the survivor
    ("crash:rank=0,step=12", "crash:rank=0,at=first_step,gen=7", "first_step"),
    ("crash:rank=1,step=14", "crash:rank=0,at=teardown,gen=8", None),  # the survivor, leaving
]


def test_a_second_fault_in_each_recovery_phase_of_an_fsdp2_job(tmp_path, reference):
    """Five incidents, each struck again inside its recovery: the promoted spare killed, the
    replacement killed while the group forms, the survivor killed once the state to restore is
    agreed (its shard then comes from memory; the replacement's too, unless it had read it
    already), the replacement killed at its first step, the survivor killed while leaving the
    failed generation (the whole world gone: a job restart, from the nodes' memory). Snapshots
    every step: no step lost; weights bitwise."""
    faults = ";".join(f"{first};{second}" for first, second, _ in SECOND)
    run, out = train(tmp_path, "--spares=1", "--snapshot-every=1", f"--inject={faults}",
                     f"--policy={policy_file(tmp_path, ISOLATE_LATE)}", args=ARGS, world=2,
                     script=FSDP)
    assert {e["fault"] for e in run.of("rank_inject")} == {f for p in SECOND for f in p[:2]}
    incidents = run.summary["incident_list"]
    assert len(incidents) == len(SECOND), [i["faults"] for i in incidents]
    for inc, (_, _, phase) in zip(incidents, SECOND):
        assert inc["outcome"] == "recovered" and len(inc["faults"]) == 2, inc
        assert inc["step_before"] == inc["resume_step"] and inc["steps_lost"] == 0, inc
        if phase is None:  # both ranks gone at once: every rank restarted
            assert inc["levels"] == ["job restart"] and inc["interrupted"] == [], inc
        else:
            assert set(inc["levels"]) == {"rank replacement"}, inc
            assert [a["phase"] for a in inc["interrupted"]] == [phase], inc
    # restore: both processes new; rank 1's had read its snapshot of 9 before the survivor was
    # killed (a local read, no peer needed): it holds step 9 and restores it in place
    got = restores(run)
    assert got[2] in ((9, {"0": "memory", "1": "live"}), (9, {"0": "memory", "1": "memory"}))
    assert got[:2] + got[3:] == [
        (3, {"0": "live", "1": "memory"}),  # the second spare promoted
        (6, {"0": "memory", "1": "live"}),   # rendezvous: rank 0 new again, rank 1 kept its own
        (12, {"0": "memory", "1": "live"}),  # first step, struck ...
        (12, {"0": "memory", "1": "live"}),  # ... and done again
        (14, {"0": "memory", "1": "memory"}),  # teardown: the job restart, from memory
    ]
    assert {"rendezvous_timeout", "deadline", "teardown_timeout"}.isdisjoint(
        f["kind"] for f in run.of("fault"))
    assert run.summary["steps_lost"] == 0
    assert bitwise_equal(out, reference(2, *ARGS, script=FSDP))


# -- 5. a job restart from the disk checkpoint (FSDP2) ---------------------------------------------
def test_an_fsdp2_job_that_loses_every_rank_and_its_memory_restarts_from_disk(tmp_path, reference):
    """Checkpoints every 4 steps. Once one is on disk, the one node dies whole: its memory (the
    keeper) first, then both rank processes. Nothing of the job's state is left in memory: the
    job restarts, every rank new, from the newest complete checkpoint - each rank reading its
    own shard - and ends bitwise where the fault-free run ends."""
    run_dir, ckpt, out = tmp_path / "run", tmp_path / "ckpt", tmp_path / "final.pt"
    t0 = time.time()
    # until the ranks are killed, every step takes most of a second (no number changes): the
    # first checkpoint reaches the disk while the job still has steps to go, even on a loaded
    # machine (at half a second, the whole suite beside it once delayed it past the last step);
    # the restarted job goes at full speed
    pace = tmp_path / "pace"
    pace.touch()
    proc = start(run_dir, "--nproc=2", f"--checkpoint-dir={ckpt}", "--checkpoint-every=4",
                 str(FSDP), *ARGS, "--slow-file", str(pace), "--slow-ms", "900", "--save",
                 str(out))
    try:
        keepers = wait_for_event(run_dir, lambda e: e["type"] == "keepers", timeout=90)
        first = wait_for_event(run_dir, lambda e: e["type"] == "checkpoint", timeout=90)
        spawned = wait_for_events(run_dir, lambda e: e["type"] == "spawn" and not e["spare"], 2)
        ranks = [e["pid"] for e in spawned]
        t_kill = time.time()
        for pid in [keepers["nodes"]["0"]["pid"], *ranks]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    finally:
        pace.unlink()
        run = finish(proc, run_dir, t0)
    assert run.code == 0, run.stdout[-4000:] + run.stderr[-4000:]
    (decision,) = run.of("decision")
    assert decision["level"] == "job restart" and sorted(decision["replace"]) == [0, 1]
    assert all(len(w) == 2 for w in rank_wids(run).values())  # every rank process is new
    written = [e["step"] for e in run.of("checkpoint") if e["t"] < t_kill]
    ((step, sources),) = restores(run)
    assert sources == {"0": "disk", "1": "disk"}
    assert step >= max(written) >= first["step"] >= 4 and step % 4 == 0
    (inc,) = run.summary["incident_list"]
    assert inc["resume_step"] == step and inc["steps_lost"] == inc["step_before"] - step
    assert bitwise_equal(out, reference(2, *ARGS, script=FSDP))


# -- 6. an emergency save (FSDP2) ---------------------------------------------------------------
def test_a_preempted_fsdp2_job_saves_its_newest_shards_and_a_new_run_resumes_from_them(
        tmp_path, reference):
    """A scheduler's SIGTERM to ``nonstop run``: the newest snapshot of every shard (a snapshot
    every step, no periodic checkpoint due) is written to disk before nonstop ends, as one
    checkpoint; a new run resumes from it, each rank reading its own shard, and ends bitwise
    where the fault-free run ends."""
    ckpt = tmp_path / "ckpt"
    t0 = time.time()
    # slow steps from step 3: the signal comes while there are steps to go, even on a loaded
    # machine (no number changes)
    proc = start(tmp_path / "first", "--nproc=2", "--snapshot-every=1", f"--checkpoint-dir={ckpt}",
                 "--checkpoint-every=1000", "--inject=slow:rank=all,step=3,ms=400", str(FSDP),
                 *ARGS)
    try:
        wait_for_event(tmp_path / "first", lambda e: e["type"] == "rank_first_step", timeout=90)
        time.sleep(1.0)
        os.kill(proc.pid, signal.SIGTERM)
    finally:
        first = finish(proc, tmp_path / "first", t0)
    assert first.code == 128 + signal.SIGTERM, first.stdout[-3000:] + first.stderr[-3000:]
    (em,) = first.of("emergency_checkpoint")
    assert em["complete"] and 0 < em["step"] < 16
    out = tmp_path / "final.pt"
    second = finish(start(tmp_path / "second", "--nproc=2", f"--checkpoint-dir={ckpt}", str(FSDP),
                          *ARGS, "--save", str(out)), tmp_path / "second", time.time())
    assert second.code == 0, second.stdout[-3000:] + second.stderr[-3000:]
    (rest,) = second.of("restore")
    assert rest["step"] == em["step"] and rest["sources"] == {"0": "disk", "1": "disk"}
    assert bitwise_equal(out, reference(2, *ARGS, script=FSDP))

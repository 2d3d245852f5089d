"""Recovering state from memory snapshots, buddy replicas and disk checkpoints, with real processes
and real gloo, every run checked bit for bit against the fault-free run of the same world size."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from conftest import (EXAMPLES, bitwise_equal, finish, policy_file, rank_wids, run_nonstop,
                      start, wait_for_event)

pytestmark = pytest.mark.integration

SHARDED = EXAMPLES / "train_sharded.py"
ARGS = ("--steps", "30", "--sleep-ms", "5")
EVERY_STEP = "--snapshot-every=1"
# A run long enough to be interrupted mid-run (steps of ~50 ms); what resumes it, and the fault-free
# reference, need not sleep: the sleep stands in for accelerator work and changes no number.
LONG = ("--steps", "150", "--sleep-ms", "40")
LONG_FAST = ("--steps", "150", "--sleep-ms", "0")


def run(tmp_path, *flags, world=2, args=ARGS, script=SHARDED, name="run", ok=True, timeout=180):
    out = tmp_path / f"{name}.pt"
    r = run_nonstop(tmp_path / name, f"--nproc={world}", *flags, str(script), *args,
                    "--save", str(out), timeout=timeout)
    if ok:
        assert r.code == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r, out


def restored(r) -> list[dict]:
    """The restores after the start (generation > 0)."""
    return [e for e in r.of("restore") if e["gen"] > 0]


def test_a_sharded_job_comes_back_from_its_nodes_memory(tmp_path, reference):
    # three incidents in one run, each restored from the nodes' memory:
    # 1. rank 1 crashes: its replacement takes its shard from its node's memory (nothing lost);
    # 2. rank 1 fails after its optimizer step: every rank is half-way through step 14 (the
    #    other waits in its broadcast): all roll back to their step-14 snapshots;
    # 3. rank 0 dies half-way through writing the snapshot of step 21: that slot stays invalid,
    #    never loaded; every rank rolls back to step 20, the newest step every shard has.
    r, out = run(tmp_path, EVERY_STEP, "--spares=1", "--inject=crash:rank=1,step=8;"
                 "exception:rank=1,step=14,at=optimizer;crash:rank=0,step=20,at=snapshot")
    assert [d["level"] for d in r.of("decision")] == ["rank replacement", "in-process restart",
                                                      "rank replacement"]
    assert [(e["step"], e["sources"]) for e in restored(r)] == [
        (8, {"0": "live", "1": "memory"}),
        (14, {"0": "memory", "1": "memory"}),
        (20, {"0": "memory", "1": "memory"})]
    assert [i["steps_lost"] for i in r.summary["incident_list"]] == [0, 0, 1]
    assert bitwise_equal(out, reference(2, *ARGS, script=SHARDED))


def test_a_lost_node_is_restored_from_its_buddy_node(tmp_path, reference):
    # node 1 dies whole (its rank and its memory); its rank moves to the spare node - its buddy
    # node, which holds the replica of its shard
    r, out = run(tmp_path, EVERY_STEP, "--nodes=2", "--spare-nodes=1",
                 "--inject=node_crash:rank=1,step=15")
    (decision,) = r.of("decision")
    assert decision["level"] == "node replacement" and decision["isolate"] == [1]
    assert any(f["kind"] == "node_lost" for f in r.of("fault")) or "node_lost" in decision["reason"]
    (rest,) = restored(r)
    assert rest["sources"]["1"] == "buddy" and rest["step"] >= 14
    assert r.summary["steps_lost"] <= 1  # the newest replica may still have been on its way
    assert bitwise_equal(out, reference(2, *ARGS, script=SHARDED))


def test_a_corrupted_snapshot_is_skipped_for_the_buddy_copy(tmp_path, reference):
    # one spare per node: rank 1's replacement runs on node 1, whose memory holds the bad copy
    r, out = run(tmp_path, EVERY_STEP, "--nodes=2", "--spares=2",
                 "--inject=corrupt:rank=1,step=15;crash:rank=1,step=16")
    (rest,) = restored(r)
    assert rest["step"] == 16 and rest["sources"]["1"] == "buddy"
    (skip,) = rest["skipped"]
    assert skip["source"] == "memory" and skip["step"] == 16 and skip["cause"] == "bad_copy"
    assert "checksum" in skip["why"]
    assert r.summary["steps_lost"] == 0
    assert bitwise_equal(out, reference(2, *ARGS, script=SHARDED))


def test_job_restart_resumes_from_memory_with_no_step_lost(tmp_path, reference):
    pol = policy_file(tmp_path, "recover:\n  levels:\n    rank_replacement:\n      enabled: false\n")
    r, out = run(tmp_path, EVERY_STEP, f"--policy={pol}", "--inject=crash:rank=1,step=15")
    assert [d["level"] for d in r.of("decision")] == ["job restart"]
    assert all(len(w) == 2 for w in rank_wids(r).values())  # every rank process is new
    (rest,) = restored(r)
    assert rest["step"] == 15 and set(rest["sources"].values()) == {"memory"}
    (inc,) = r.summary["incident_list"]
    assert inc["steps_lost"] == 0
    assert bitwise_equal(out, reference(2, *ARGS, script=SHARDED))


def test_a_killed_launcher_resumes_from_disk_losing_only_the_steps_since(tmp_path, reference):
    args = LONG
    ckpt = tmp_path / "ckpt"
    out = tmp_path / "first.pt"
    t0 = time.time()
    proc = start(tmp_path / "first", "--nproc=2", EVERY_STEP, f"--checkpoint-dir={ckpt}",
                 "--checkpoint-every=10", str(SHARDED), *args, "--save", str(out))
    wait_for_event(tmp_path / "first", lambda e: e["type"] == "checkpoint" and e["step"] >= 10)
    os.kill(proc.pid, signal.SIGKILL)  # the launcher: with it its agent and the nodes' memory
    killed = finish(proc, tmp_path / "first", t0)
    assert killed.code == -signal.SIGKILL and not out.exists()
    on_disk = sorted(int(p.name.split("-")[1]) for p in ckpt.glob("step-*"))
    r, final = run(tmp_path, f"--checkpoint-dir={ckpt}", "--checkpoint-every=10", args=LONG_FAST,
                   name="second")
    (rest,) = r.of("restore")
    # the memory went with the launcher: the newest checkpoint is where the job goes on from
    assert set(rest["sources"].values()) == {"disk"} and rest["step"] == on_disk[-1] >= 10
    assert bitwise_equal(final, reference(2, *LONG_FAST, script=SHARDED))


def test_a_corrupted_checkpoint_falls_back_to_the_previous_one(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    run(tmp_path, f"--checkpoint-dir={ckpt}", "--checkpoint-every=10", name="first")
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-0000000010", "step-0000000020",
                                                      "step-0000000030"]
    part = next((ckpt / "step-0000000030" / "rank-1").glob("*.distcp"))
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, in the middle of the tensors
    part.write_bytes(bytes(data))
    r, out = run(tmp_path, f"--checkpoint-dir={ckpt}", "--checkpoint-every=10", args=LONG_FAST,
                 name="second")
    (rest,) = r.of("restore")
    assert rest["step"] == 20 and set(rest["sources"].values()) == {"disk"}
    assert any(s["source"] == "disk" and s["step"] == 30 for s in rest["skipped"])
    assert bitwise_equal(out, reference(2, *LONG_FAST, script=SHARDED))


def test_sigterm_saves_the_newest_snapshot_and_the_job_resumes_from_it(tmp_path, reference):
    args = LONG
    ckpt = tmp_path / "ckpt"
    t0 = time.time()
    proc = start(tmp_path / "first", "--nproc=2", EVERY_STEP, f"--checkpoint-dir={ckpt}",
                 "--checkpoint-every=1000", str(SHARDED), *args)
    wait_for_event(tmp_path / "first", lambda e: e["type"] == "rank_first_step")
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGTERM)  # a scheduler's preemption
    first = finish(proc, tmp_path / "first", t0)
    assert first.code == 128 + signal.SIGTERM
    (em,) = first.of("emergency_checkpoint")
    assert em["complete"] and em["step"] > 0
    r, out = run(tmp_path, f"--checkpoint-dir={ckpt}", args=LONG_FAST, name="second")
    (rest,) = r.of("restore")
    assert rest["step"] == em["step"] and set(rest["sources"].values()) == {"disk"}
    assert bitwise_equal(out, reference(2, *LONG_FAST, script=SHARDED))


def test_emergency_save_on_give_up_skips_the_faulty_node(tmp_path, reference):
    # node 1 fails its health check and there is nowhere to move its rank (and no going on
    # without it: scale-in is off): nonstop gives up. Its rank's shard is also held on node 0
    # (the replica), so node 1 saves nothing and goes at once; node 0 writes both parts, and a
    # new run resumes from them.
    flag = tmp_path / "node1-broken"
    pol = policy_file(tmp_path, f"""
detect:
  health_checks:
    - name: disk
      command: test "$NONSTOP_NODE" != 1 || test ! -e {flag}
      every_s: 0.2
recover:
  levels:
    scale_in:
      enabled: false
    job_restart:
      enabled: false
""")
    args = LONG
    ckpt = tmp_path / "ckpt"
    t0 = time.time()
    proc = start(tmp_path / "first", "--nproc=2", "--nodes=2", EVERY_STEP, f"--policy={pol}",
                 f"--checkpoint-dir={ckpt}", "--checkpoint-every=1000", str(SHARDED), *args)
    wait_for_event(tmp_path / "first", lambda e: e["type"] == "rank_first_step")
    time.sleep(0.3)
    flag.touch()
    first = finish(proc, tmp_path / "first", t0)
    assert first.code == 1
    (em,) = first.of("emergency_checkpoint")
    assert em["faulty"] == [1] and em["complete"]
    assert em["sources"] == {"0": "r0 on node 0", "1": "rep1 on node 0"}
    (gone,) = first.of("keeper_killed")
    (done,) = [e for e in first.of("checkpoint") if e["step"] == em["step"]]
    assert gone["node"] == 1 and gone["t"] < done["t"]  # the faulty node went at once
    manifest = json.loads((ckpt / f"step-{em['step']:010d}" / "manifest.json").read_text())
    assert manifest["sources"] == em["sources"]
    r, out = run(tmp_path, f"--checkpoint-dir={ckpt}", "--nodes=2", args=LONG_FAST, name="second")
    (rest,) = r.of("restore")
    assert rest["step"] == em["step"]
    assert bitwise_equal(out, reference(2, *LONG_FAST, script=SHARDED))


def test_a_nodes_memory_lost_as_training_ends_gives_up_the_last_checkpoint_at_once(tmp_path):
    """A node's memory dies just as training completes (it is not restarted then): the last
    step's checkpoint, which that node's part belongs to, is given up at once and said so; the
    run ends, rather than waiting out timeouts.finish_s for a write that cannot come."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out.pt"
    pol = policy_file(tmp_path, "recover:\n  timeouts:\n    finish_s: 120\n")
    proc = start(tmp_path / "run", "--nproc=4", "--nodes=2", f"--checkpoint-dir={ckpt}",
                 "--checkpoint-every=1000", f"--policy={pol}", str(SHARDED), "--steps", "30",
                 "--sleep-ms", "40", "--save", str(out))
    t0 = time.time()
    try:
        keepers = wait_for_event(tmp_path / "run", lambda e: e["type"] == "keepers", timeout=90)
        wait_for_event(tmp_path / "run", lambda e: e["type"] == "rank_done", timeout=90)
        os.kill(keepers["nodes"]["1"]["pid"], signal.SIGKILL)
    finally:
        r = finish(proc, tmp_path / "run", t0)
    (done,) = r.of("training_complete")
    (end,) = r.of("run_end")
    assert end["t"] - done["t"] < 30, r.stdout[-2000:]  # not finish_s (120 s)
    lines = [x for x in r.stdout.splitlines() if "checkpoint of step 30 not written" in x]
    if lines:  # the keeper died before its part was written (else the step was complete)
        assert "lost their memory (keeper) as training ended" in lines[0]


def test_a_nodes_memory_killed_alone_costs_no_incident(tmp_path, reference):
    # node 1's keeper dies while its ranks train on, with disk checkpoints due every 4 steps:
    # its ranks' snapshots fail while node 0's succeed, yet every rank must still agree on which
    # steps are snapshotted and checked (a rank that thought a checkpoint still due snapshotted -
    # and compared digests - alone: the job hung until the hang detector restarted it). The node
    # gets a new, empty memory; nothing is lost and the weights are the fault-free run's.
    ckpt, out = tmp_path / "ckpt", tmp_path / "out.pt"
    # steps of 40 ms while the file is there: until node 1's ranks have lost a snapshot and the
    # node has its new memory, then the rest at full speed (the checkpoints still due every 4)
    pace = tmp_path / "pace"
    pace.touch()
    proc = start(tmp_path / "run", "--nproc=4", "--nodes=2", f"--checkpoint-dir={ckpt}",
                 "--checkpoint-every=4", str(SHARDED), *LONG_FAST, "--slow-file", str(pace), "--slow-ms", "40",
                 "--save", str(out))
    t0 = time.time()
    try:
        keepers = wait_for_event(tmp_path / "run", lambda e: e["type"] == "keepers", timeout=90)
        # the ranks past step 12 (their own report: a checkpoint's write may lag far behind its
        # step on a loaded machine, and the kill came with 10 steps to go once)
        wait_for_event(tmp_path / "run", lambda e: e["type"] == "rank_snapshot_interval"
                       and e["step"] >= 12, timeout=90)
        os.kill(keepers["nodes"]["1"]["pid"], signal.SIGKILL)
        wait_for_event(tmp_path / "run", lambda e: e["type"] == "keeper_restarted", timeout=90)
        wait_for_event(tmp_path / "run", lambda e: e["type"] == "rank_snapshot_failed",
                       timeout=90)
    finally:
        pace.unlink()
        r = finish(proc, tmp_path / "run", t0)
    assert r.code == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.of("node_memory_lost") and r.of("keeper_restarted")
    assert r.of("rank_snapshot_failed")  # node 1's ranks lost a snapshot, node 0's did not
    assert r.summary["incidents"] == 0, r.summary["incident_list"]
    assert bitwise_equal(out, reference(4, *LONG_FAST, script=SHARDED))

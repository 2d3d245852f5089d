"""Every recovery path with real processes and real gloo, checked bit for bit against the
fault-free run of the same world size."""

from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import (PLAIN, SCRIPTS, TRAIN, bitwise_equal, finish, rank_wids, run_nonstop, start,
                      wait_for_event)
from conftest import train as _train

pytestmark = pytest.mark.integration

WORLD = 3
ARGS = ("--steps", "40", "--sleep-ms", "5")


def train(tmp_path, *flags, args=ARGS, world=WORLD, timeout=180):
    return _train(tmp_path, *flags, args=args, world=world, timeout=timeout)


def test_crash_is_replaced_by_a_warm_spare(tmp_path, reference):
    run, out = train(tmp_path, "--spares=1", "--inject=crash:rank=1,step=15")
    decisions = run.of("decision")
    assert [d["level"] for d in decisions] == ["rank replacement"]
    (replace,) = run.of("replace")
    assert replace["rank"] == 1 and replace["warm"] and not replace["cold"]
    held = rank_wids(run)
    assert len(held[1]) == 2 and len(held[0]) == 1 and len(held[2]) == 1  # survivors never exit
    (inc,) = run.summary["incident_list"]
    assert inc["steps_lost"] == 0 and inc["mttr_s"] < 5
    # one node: no other to hold copies of its snapshots, and nothing to warn of
    assert "warning" not in run.stderr, run.stderr
    assert bitwise_equal(out, reference(WORLD, *ARGS))


def test_a_rank_crashed_just_after_its_nodes_memory_is_replaced_from_a_live_peer(tmp_path,
                                                                                  reference):
    # the node's memory (its keeper) dies, then one of its ranks, while the others live on: the
    # node is not lost - its dead rank is replaced from a survivor's live state, no step lost
    # (it was taken for a lost node: with no spare node, a job restart back to step 0)
    run, out = train(tmp_path, "--spares=1", "--inject=keeper_crash:rank=0,step=10;crash:rank=1,step=11")
    assert run.of("node_memory_lost")
    assert not [f for f in run.of("fault") if f["kind"] == "node_lost"]
    assert [d["level"] for d in run.of("decision")] == ["rank replacement"]
    (inc,) = run.summary["incident_list"]
    assert inc["steps_lost"] == 0 and inc["resume_step"] == 11
    assert bitwise_equal(out, reference(WORLD, *ARGS))


def test_crash_without_a_spare_starts_a_new_process(tmp_path, reference):
    run, out = train(tmp_path, "--spares=0", "--inject=crash:rank=2,step=20")
    replaced = {r["rank"]: r for r in run.of("replace")}
    assert replaced[2]["cold"]
    # (on a loaded machine a survivor too slow to leave the generation is killed at the teardown
    # deadline, and given a new process too: that is the only other replacement allowed)
    late = {f["rank"] for f in run.of("fault") if f["kind"] == "teardown_timeout"}
    assert set(replaced) - {2} <= late
    assert run.summary["steps_lost"] == 0
    assert bitwise_equal(out, reference(WORLD, *ARGS))


def test_two_crashes_in_a_row(tmp_path, reference):
    # the second crash hits the replacement itself, at the first step it runs
    run, out = train(tmp_path, "--spares=1", "--inject=crash:rank=1,step=12,times=2;crash:rank=0,step=25")
    assert [d["level"] for d in run.of("decision")] == ["rank replacement"] * 3
    assert len(rank_wids(run)[1]) == 3
    assert run.summary["steps_lost"] == 0
    assert bitwise_equal(out, reference(WORLD, *ARGS))


def test_a_spare_dying_while_idle_is_refilled(tmp_path, reference):
    args = ("--steps", "150")
    out = tmp_path / "final.pt"
    # (steps of 20 ms while the file is there: once the refill is ready, the rest at full speed)
    pace = tmp_path / "pace"
    pace.touch()
    t0 = time.time()
    proc = start(tmp_path / "run", f"--nproc={WORLD}", "--spares=1", "--inject=crash:rank=0,step=140",
                 str(TRAIN), *args, "--slow-file", str(pace), "--slow-ms", "20", "--save", str(out))
    try:
        run_dir = tmp_path / "run"
        spawn = wait_for_event(run_dir, lambda e: e["type"] == "spawn" and e["spare"])
        wait_for_event(run_dir, lambda e: e["type"] == "rank_ready" and e["wid"] == spawn["wid"])
        wait_for_event(run_dir, lambda e: e["type"] == "rank_first_step")
        os.kill(spawn["pid"], signal.SIGKILL)
        refill = wait_for_event(run_dir, lambda e: e["type"] == "spawn" and e["spare"]
                                and e["wid"] != spawn["wid"])
        wait_for_event(run_dir, lambda e: e["type"] == "rank_ready" and e["wid"] == refill["wid"])
    finally:
        pace.unlink()
        run = finish(proc, tmp_path / "run", t0)
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (lost,) = run.of("spare_lost")
    assert lost["wid"] == spawn["wid"]
    spares = [e for e in run.of("spawn") if e["spare"]]
    assert len(spares) >= 2  # the pool was refilled
    (replace,) = run.of("replace")
    assert replace["wid"] == spares[1]["wid"]  # and the refill took over the crashed rank
    assert bitwise_equal(out, reference(WORLD, *args))


def test_hang_is_killed_and_replaced(tmp_path, reference):
    run, out = train(tmp_path, "--spares=1", "--hang-timeout=1", "--inject=hang:rank=1,step=15")
    kinds = [f["kind"] for f in run.of("fault")]
    assert kinds[0] == "hang" and "teardown_timeout" in kinds
    late = [d for d in run.of("deadline") if d["what"] == "teardown" and d["detail"] == "killed"]
    assert [d["ranks"] for d in late] == [[1]] and late[0]["limit_s"] > 0
    (kill,) = run.of("kill")
    assert kill["rank"] == 1
    # killed with its stacks dumped: on one host no host is away to give it up with
    assert "did not leave generation" in run.stdout + run.stderr
    assert "does not answer" not in run.stdout + run.stderr
    assert "its stacks are in" in run.stdout + run.stderr
    # the survivors, blocked in a collective with the hung rank, left at once when aborted
    (abort,) = run.of("abort")
    survivors = [e for e in run.of("rank_left") if e["rank"] != 1]
    assert len(survivors) == WORLD - 1
    assert all(e["t_caught"] - abort["t"] < 0.5 for e in survivors), survivors
    assert bitwise_equal(out, reference(WORLD, *ARGS))


def test_exception_restarts_every_rank_in_process(tmp_path, reference):
    run, out = train(tmp_path, "--spares=0", "--inject=exception:rank=0,step=12")
    assert [d["level"] for d in run.of("decision")] == ["in-process restart"]
    assert not run.of("replace") and not [e for e in run.of("exit") if e["code"] not in (0,)]
    assert all(len(w) == 1 for w in rank_wids(run).values())  # same processes throughout
    assert bitwise_equal(out, reference(WORLD, *ARGS))


def test_rank_failing_after_its_optimizer_step_receives_the_newer_state(tmp_path, reference):
    # rank 1 fails after its optimizer step: its weights are neither step 12 nor 13 (dirty);
    # the others completed step 12. Every rank must resume from one consistent step.
    run, out = train(tmp_path, "--inject=exception:rank=1,step=12,at=optimizer")
    entered = [e for e in run.of("rank_entered") if e["gen"] == 1]
    assert {e["step"] for e in entered} == {13}
    assert {tuple(e["receivers"]) for e in entered} == {(1,)}
    assert bitwise_equal(out, reference(WORLD, *ARGS))


def test_user_exception_on_every_attempt_gives_up_with_one_traceback(tmp_path):
    run = run_nonstop(tmp_path / "run", "--nproc=2", str(SCRIPTS / "always_fails.py"), timeout=120)
    assert run.code == 1
    assert run.stderr.count("Traceback (most recent call last)") == 1
    assert "ValueError: bad batch at step 2" in run.stderr
    assert "giving up" in run.stderr
    assert "nonstop/runtime" not in run.stderr  # the user's frames, not ours
    assert len(run.of("decision")) == 4  # 3 in-process retries, then give up


def test_plain_torchrun_script_is_restarted_whole(tmp_path):
    out = tmp_path / "final.pt"
    t0 = time.time()
    proc = start(tmp_path / "run", "--nproc=2", "--spares=1", str(PLAIN), "--steps", "1500",
                 "--save", str(out))
    entered = wait_for_event(tmp_path / "run", lambda e: e["type"] == "rank_entered" and e["rank"] == 1)
    spawn = wait_for_event(tmp_path / "run", lambda e: e["type"] == "spawn" and e["wid"] == entered["wid"])
    time.sleep(1.0)
    os.kill(spawn["pid"], signal.SIGKILL)
    run = finish(proc, tmp_path / "run", t0)
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert [d["level"] for d in run.of("decision")] == ["job restart"]
    held = rank_wids(run)
    assert all(len(w) == 2 for w in held.values())  # every rank restarted
    assert out.exists()


def test_many_generations_do_not_leak(tmp_path):
    faults = ";".join(f"exception:rank={s % 2},step={s}" for s in range(3, 23))
    run, _ = train(tmp_path, f"--inject={faults}", "--policy", str(_no_budget(tmp_path)),
                   world=2, args=("--steps", "30"))
    entered = [e for e in run.of("rank_entered") if e["rank"] == 0]
    assert len(entered) == 21
    early, late = entered[2], entered[-1]
    assert late["fds"] <= early["fds"] + 2, (early["fds"], late["fds"])
    assert late["threads"] <= early["threads"] + 2, (early["threads"], late["threads"])


def _no_budget(tmp_path):
    p = tmp_path / "policy.yaml"
    p.write_text("rules:\n  user_error_retries: 100\n")
    return p


def test_old_generation_objects_are_freed_before_reentry(tmp_path):
    # the previous generation's DDP (and with it its process group and threads) must be gone when
    # the function is entered again, in the main thread, not left to the collector
    run = run_nonstop(tmp_path / "run", "--nproc=3", "--hang-timeout=1",
                      "--inject=crash:rank=2,step=10;hang:rank=1,step=20;exception:rank=0,step=25",
                      str(SCRIPTS / "ddp_freed.py"), "30")
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert len(run.of("decision")) == 3
    assert "LEAK" not in run.stdout, run.stdout

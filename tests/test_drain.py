"""Planned migration with real processes (``nonstop drain``): the ranks asked for move to warm
spares at their next step boundary - no fault, no incident, no step lost, the fault-free
weights - a node drained is released; what cannot be done now is refused with one line."""

from __future__ import annotations

import subprocess
import time

import pytest

from conftest import TRAIN, bitwise_equal, finish, nonstop_cmd, policy_file, start, wait_for_event

pytestmark = pytest.mark.integration

STEPS = ("--steps", "200")


def paced(tmp_path):
    """A file that keeps the steps at 20 ms while it exists: the test removes it once the drain
    is done, and the rest of the run goes at full speed."""
    pace = tmp_path / "pace"
    pace.touch()
    return ("--slow-file", str(pace), "--slow-ms", "20"), pace


def drain(run_dir, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(nonstop_cmd("drain", str(run_dir), *flags), capture_output=True,
                          text=True, timeout=120)


def test_a_rank_drained_moves_to_the_warm_spare_with_nothing_lost(tmp_path, reference):
    run_dir, out = tmp_path / "run", tmp_path / "final.pt"
    t0 = time.time()
    pacing, pace = paced(tmp_path)
    proc = start(run_dir, "--nproc=3", "--spares=1", str(TRAIN), *STEPS, *pacing, "--save",
                 str(out))
    try:
        wait_for_event(run_dir, lambda e: e["type"] == "rank_first_step", timeout=90)
        refused = drain(run_dir, "--rank", "7")
        assert refused.returncode == 1 and refused.stderr.strip() == \
            "nonstop: cannot drain rank 7: no rank 7 in a world of 3", refused.stderr
        done = drain(run_dir, "--rank", "1", "--why", "its GPU reports ECC errors")
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.startswith("nonstop: drained rank 1 (generation 1): training paused")
    finally:
        pace.unlink()
        run = finish(proc, run_dir, t0)
    assert run.code == 0, run.stderr[-3000:]
    (d,) = run.of("decision")
    assert d["level"] == "rank replacement" and d["replace"] == [1] and "ECC" in d["reason"]
    assert not run.of("fault") and not run.of("incident")  # planned: no fault, no incident
    (moved,) = run.of("replace")
    assert moved["rank"] == 1 and moved["warm"]
    (done_ev,) = run.of("drain_done")
    assert done_ev["pause_s"] < 5
    assert run.summary["steps_lost"] == 0
    assert bitwise_equal(out, reference(3, *STEPS))


def test_a_node_whose_health_check_fails_is_drained_to_the_spare_node_and_released(
        tmp_path, reference):
    """The policy's drain: a failing check (a warning sign, not a failure) moves the node's ranks
    to the spare node at a step boundary - no fault - and the node is released."""
    flag = tmp_path / "unhealthy"
    pol = policy_file(tmp_path, f"detect:\n  health_checks:\n    - name: ecc\n      command: "
                                f"'test ! -e {flag}-$NONSTOP_NODE'\n      every_s: 0.2\n"
                                "      action: drain\n")
    run_dir, out = tmp_path / "run", tmp_path / "final.pt"
    t0 = time.time()
    pacing, pace = paced(tmp_path)
    proc = start(run_dir, "--nproc=4", "--nodes=2", "--spare-nodes=1", "--policy", pol,
                 str(TRAIN), *STEPS, *pacing, "--save", str(out))
    try:
        wait_for_event(run_dir, lambda e: e["type"] == "rank_first_step", timeout=90)
        flag.with_name(flag.name + "-1").write_text("")
        wait_for_event(run_dir, lambda e: e["type"] == "drain_done", timeout=90)
    finally:
        pace.unlink()
        run = finish(proc, run_dir, t0)
    assert run.code == 0, run.stderr[-3000:]
    (d,) = run.of("decision")
    assert d["level"] == "node replacement" and d["isolate"] == [1] and sorted(d["replace"]) == [2, 3]
    assert "health check 'ecc' failed" in d["reason"]
    assert {e["rank"]: e["node"] for e in run.of("replace")} == {2: 2, 3: 2}
    assert [e["node"] for e in run.of("isolate")] == [1]
    assert not run.of("fault") and run.summary["steps_lost"] == 0
    assert run.of("drain_done")
    assert bitwise_equal(out, reference(4, *STEPS))


def test_bad_drains_are_one_line_and_exit_2(tmp_path):
    for flags, says in ((("--rank", "1", "--node", "0"), "not allowed with argument"),
                        ((), "one of the arguments --rank --node is required"),
                        (("--rank", "-1"), "must be 0 or more")):
        bad = drain(tmp_path, *flags)
        assert bad.returncode == 2 and says in bad.stderr and len(bad.stderr.splitlines()) == 1
    missing = drain(tmp_path / "nope", "--rank", "0")
    assert missing.returncode == 2 and "not a run directory" in missing.stderr
    (tmp_path / "events.jsonl").write_text('{"type": "run_start", "pid": 1}\n{"type": "run_end"}\n')
    ended = drain(tmp_path, "--rank", "0")
    assert ended.returncode == 2 and "has ended" in ended.stderr

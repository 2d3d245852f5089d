"""The chaos soak across test hosts: faults only the outside world can throw (a launcher SIGKILLed,
a rank frozen then woken after it was replaced, a host's memory killed, the controller killed)
thrown at one job of real processes on network namespaces, with etcd; it completes with the
fault-free weights, nothing of it left on any host, and the frozen rank never joins again."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from nonstop_bench.chaos_hosts import (FIRST, HOST_KINDS, KILLS_HOST, RANK_KINDS, gap, judge,
                                       schedule)


def test_the_schedule_is_the_seeds_and_gives_every_kind_before_a_repeat():
    kinds = len(RANK_KINDS) + len(HOST_KINDS)
    a, b = schedule(5, kinds, 4, 3), schedule(5, kinds, 4, 3)
    assert a == b and a != schedule(6, kinds, 4, 3)
    assert sorted(f["kind"] for f in a) == sorted([*RANK_KINDS, *HOST_KINDS])
    assert a[0]["step"] == FIRST
    for x, y in zip(a, a[1:]):  # a lost host has time to come back before the next fault
        assert y["step"] - x["step"] == gap(x["kind"])
    assert all(0 <= f["slot"] < 3 for f in a) and all(("spec" in f) == (f["kind"] in RANK_KINDS)
                                                       for f in a)
    only = schedule(1, 6, 4, 3, only=["launcher_kill", "nan"])
    assert {f["kind"] for f in only} == {"launcher_kill", "nan"}
    # a rank whose parameters were flipped is not the victim of the next faults (its check must
    # see it): not their rank, and a host fault is told which rank to spare
    many = schedule(2, 80, 4, 3)
    for i, f in enumerate(many[:-1]):
        if f["kind"] == "bitflip":
            nxt = many[i + 1]
            assert nxt["spare_rank"] == f["rank"]
            if "spec" in nxt:
                assert f"rank={f['rank']}," not in nxt["spec"]
    assert set(KILLS_HOST) <= set(HOST_KINDS)


def test_a_host_that_could_not_rejoin_is_told_from_a_failed_job(tmp_path):
    """The soak's verdict: a job that finished with the fault-free weights is completed even
    when a host could not rejoin (turned away: exit 2) - that is a finding of its own - and the
    weights are compared whether or not the job completed."""
    import torch

    ref, same, other = tmp_path / "ref.pt", tmp_path / "same.pt", tmp_path / "other.pt"
    torch.save({"w": torch.arange(4.0)}, ref)
    torch.save({"w": torch.arange(4.0)}, same)
    torch.save({"w": torch.arange(4.0) + 1}, other)
    codes = {0: 0, 1: 2, 2: 0}  # slot 1: its healed host turned away
    assert judge(None, codes, [same], [1], 0, ref) == (True, True)
    assert judge(None, codes, [same], [], 0, ref) == (False, True)  # a host that failed
    assert judge(None, {0: 0, 1: 0, 2: 1}, [same], [1], 0, ref) == (False, True)
    assert judge("TimeoutError: ...", codes, [other], [1], 0, ref) == (False, False)
    assert judge(None, {0: 0, 1: 0, 2: 0}, [], [], 0, ref) == (False, False)  # nothing saved


@pytest.mark.integration
def test_faults_of_the_outside_world_leave_the_weights_and_nothing_behind(test_hosts, tmp_path):
    # seed 25: the launcher of the controller's own host killed (a takeover, its ranks moved to
    # the spare host, a new host joins: a node number never used), a host's memory killed, the
    # new controller killed, a rank frozen then woken
    kinds = "launcher_kill,stop_cont,keeper_kill,controller_kill"
    out = subprocess.run([sys.executable, "-m", "nonstop", "chaos", "--hosts", "2", "--faults", "4",
                          "--seed", "25", "--kinds", kinds, "--json", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0, out.stderr[-4000:]
    assert result["completed"] and result["params_match_reference"], result
    assert result["rejoin_failed"] == [], result
    assert result["orphans"] == 0 and result["shm_left"] == [] and result["zombies_joined"] == []
    assert {k: v["fired"] for k, v in result["by_kind"].items()} == dict.fromkeys(kinds.split(","), 1)
    assert result["hosts_restarted"] == 1 and result["takeovers"] >= 1, result
    assert result["scaled_in"] == 0 and result["steps_lost"] == 0, result
    assert result["incidents"] >= 2 and result["incidents_closed"] == result["incidents"], result
    assert result["incidents_with_phases"] == result["incidents"]
    assert result["summary_incidents"] == result["incidents"]  # the last controller counts all


@pytest.mark.integration
def test_a_soak_ended_by_sigterm_ends_its_reference_run_too(test_hosts, tmp_path):
    """SIGTERM to ``nonstop chaos --hosts`` while its fault-free reference runs beside the job:
    it exits 143, its test hosts removed and the reference run (a session of its own) ended by
    its pid - nothing of the soak left running."""
    import os
    import signal
    import time

    from conftest import asked_to_end, kill_left, processes_below as below, still_running

    proc = subprocess.Popen([sys.executable, "-m", "nonstop", "chaos", "--hosts", "2", "--faults",
                             "1", "--kinds", "crash", "--seed", "1", "--out", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    seen: set[int] = set()
    try:
        log = tmp_path / "reference" / "run" / "logs"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (log.is_dir() and any(log.glob("worker-*"))):
            time.sleep(0.2)  # the reference's ranks have started
        seen = below(proc.pid)
        assert len(seen) >= 3, seen  # its launcher, the launcher's keeper and ranks at least
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 143
        assert not still_running(seen), "the soak's reference run still runs"
        assert not os.path.ismount(tmp_path / "ckpt")  # its checkpoints' small disk is gone too
    finally:
        asked_to_end(proc, 60)  # (only where the test failed: the soak asked to end first)
        kill_left(seen)  # (...and what it left: ended by pid)

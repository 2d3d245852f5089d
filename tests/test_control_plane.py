"""The control plane at scale: what makes a job of thousands of ranks cost its size squared is gone
(unit tests), and ``nonstop bench control-plane`` runs the real controller, elected in a real etcd,
against simulated hosts speaking the real protocol (a small size here; the sizes of the issue are
a benchmark)."""

from __future__ import annotations

import pytest

import json
import os
import subprocess
import sys
from types import SimpleNamespace

from nonstop.controller.generations import Generations
from nonstop.controller.workers import Worker
from nonstop.protocol import hosts as keys


def test_progress_rate_falls_with_hosts_so_the_controller_keeps_up():
    assert keys.progress_every(1) == keys.PROGRESS_EVERY_S
    assert keys.progress_every(20) == keys.PROGRESS_EVERY_S
    assert keys.progress_every(100) == 0.5
    assert keys.progress_every(2048) == keys.PROGRESS_MAX_S
    # the hosts together send PROGRESS_FRAMES_S frames a second at most, until each sends
    # only once a second (a rank's heartbeat is never older than that)
    for hosts in (50, 120, 200):
        assert hosts / keys.progress_every(hosts) <= keys.PROGRESS_FRAMES_S + 1e-9
    assert keys.progress_every(16384) == keys.PROGRESS_MAX_S


def _local_one(rank: int, node_of: dict[int, int]) -> dict[str, int]:
    """The per-rank definition (what each rank's LOCAL_RANK / GROUP_RANK must be)."""
    local = sorted(r for r, n in node_of.items() if n == node_of[rank])
    groups = list(dict.fromkeys(node_of[r] for r in sorted(node_of)))
    return {"local_rank": local.index(rank), "local_world": len(local),
            "group_rank": groups.index(node_of[rank])}


def test_local_ranks_of_every_rank_at_once_match_the_definition():
    gens = SimpleNamespace(mail=SimpleNamespace(host_of=lambda n: n))
    # ranks spread unevenly, a host whose lowest rank comes late, a replaced rank elsewhere
    node_of = {0: 3, 1: 3, 2: 0, 3: 1, 4: 0, 5: 3, 6: 2, 7: 1, 8: 5}
    got = Generations.local_ranks(gens, node_of)
    assert got == {r: _local_one(r, node_of) for r in node_of}


def test_a_worker_record_forgets_what_the_machine_saw_of_it_on_any_change():
    w = Worker(wid=7, spare=False)
    assert w.seen is None
    for field, value in (("dead", True), ("entered", 3), ("same_s", 1.5), ("loc", "x.py:1")):
        w.seen = ("key", "rank seen")
        setattr(w, field, value)
        assert w.seen is None, field
    w.seen = ("key", "rank seen")
    assert w.seen == ("key", "rank seen")


def test_the_jobs_view_is_made_again_only_when_a_worker_or_the_plan_changed():
    from nonstop.controller.workers import WorkerTable

    agent = SimpleNamespace(stopped=lambda wid: False)
    table = WorkerTable(agent, mail=None, log=None, spare_mode="script")
    workers = table.workers
    workers.update({w: Worker(wid=w, spare=False, rank=w, entered=2) for w in range(4)})
    plan = {r: r for r in range(4)}

    def look(rendezvous=False):
        return table.ranks_seen(plan, 2, rendezvous)

    first = look()
    assert look() is first  # nothing changed: the same view, not made again
    workers[2].left = 2
    second = look()
    assert second is not first and second[2].left == 2 and second[0] is first[0]
    workers[4] = Worker(wid=4, spare=False, entered=-1)
    assert look() is not second  # (any worker written: made again, the same values)
    third = look()
    plan[1] = 4  # rank 1 to another process: the plan alone changed
    assert look()[1].wid == 4 and look()[1].entered == -1
    assert third[1].wid == 1
    # while a generation forms, whether a joining rank's process is stopped is asked each look
    answers = iter([False, True])
    workers[3].joining, workers[3].entered = 2, 1
    agent.stopped = lambda wid: next(answers)
    assert not look(rendezvous=True)[3].stopped and look(rendezvous=True)[3].stopped


@pytest.mark.integration
def test_bench_control_plane_recovers_a_simulated_job_on_the_real_controller(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "nonstop", "bench", "control-plane", "--sizes", "16,64",
         "--repeat", "1", "--json"], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["scenario"] == "control_plane"
    # both placements: every process on every core, and the controller on a core of its own
    assert [(r["placement"], r["ranks"]) for r in res["results"]] == \
        [("shared", 16), ("shared", 64), ("split", 16), ("split", 64)]
    for r in res["results"]:
        assert r["store"] == "etcd" and r["hosts"] == r["ranks"] // 8
        rec = r["recovery_s"]["median"]
        assert 0 < rec < 30
        phases = r["phases_s"]
        assert set(phases) == {"decide_abort", "assign", "rendezvous", "first_step"}
        assert all(v >= 0 for v in phases.values())
        # decide, assign and rendezvous are the recovery
        assert abs(phases["decide_abort"] + phases["assign"] + phases["rendezvous"] - rec) < 0.01
    # each run's controller (its pid in the run's line on stderr) is gone
    runs = [json.loads(line) for line in out.stderr.splitlines() if line.startswith("{")]
    assert len(runs) == 4
    for run in runs:
        pid = run["controller_pid"]
        assert pid and not os.path.exists(f"/proc/{pid}"), run


@pytest.mark.integration
def test_bench_control_plane_refuses_an_unknown_placement(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "nonstop", "bench", "control-plane", "--sizes", "16",
         "--placement", "shared,elsewhere"], capture_output=True, text=True, timeout=60,
        cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "elsewhere" in out.stderr, out.stderr


def test_a_memory_that_does_not_start_is_the_machines_trouble_not_a_bug():
    from nonstop.controller.keepers import KeeperHandle, Keepers, KeeperStartError

    def keeper_link(node, name, deadline):
        raise TimeoutError("no answer")

    h = KeeperHandle(3, "mem-n3", 17)
    try:
        Keepers._connect(SimpleNamespace(agent=SimpleNamespace(keeper_link=keeper_link)), h)
    except KeeperStartError as exc:
        assert "node 3 did not start" in str(exc)
        assert isinstance(exc, RuntimeError)  # the handlers of a lost memory still take it
    else:
        raise AssertionError("no error")
    import inspect

    from nonstop.launch import one_host as launcher
    from nonstop.controller import elected as leader

    # both ends of a job say it as a start failure, not as a bug of nonstop's
    assert "except KeeperStartError" in inspect.getsource(leader.Leader.run)
    assert "except KeeperStartError" in inspect.getsource(launcher)

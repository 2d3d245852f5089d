"""The goodput account: every second of the wall time in one category (observe.goodput), on
synthetic timelines and on a real run whose rollback makes steps be done again."""

from __future__ import annotations

import json
import pytest

from nonstop.observe import goodput
from nonstop.observe.incidents import PHASES


def steps(wid, gen, t0, first, n, step_s=0.08, stall_s=0.02, busy0=0.0, stall0=0.0, every=1):
    """Rank 0's samples: ``n`` steps from ``first`` (exclusive), one every step_s + stall_s."""
    out = []
    for k in range(1, n + 1):
        if k % every and k != n:
            continue
        out.append({"t": t0 + k * (step_s + stall_s), "wid": wid, "gen": gen, "step": first + k,
                    "busy": busy0 + k * step_s, "stall": stall0 + k * stall_s})
    return out


def incident(id, t_fault, mttr, lost=0):
    return {"id": id, "t_fault": t_fault, "mttr_s": mttr,
            "phases_s": {p: mttr / len(PHASES) for p in PHASES}, "steps_lost": lost}


def test_a_fault_free_run_is_startup_steps_stalls_and_the_end():
    samples = steps(1, 0, 2.0, 0, 100)  # from t=2 to t=12
    acct = goodput.account(0.0, 13.0, [], samples, t_ready=2.0, t_train_end=12.0,
                           final_checkpoint=True)
    c = acct["categories"]
    assert c["startup"] == pytest.approx(2.0)
    assert c["productive"] == pytest.approx(8.0, rel=1e-6)
    assert c["snapshot"] == pytest.approx(2.0, rel=1e-6)
    assert c["checkpoint"] == pytest.approx(1.0)
    assert c["recomputed"] == 0 and c["idle"] == pytest.approx(0.0, abs=1e-6)
    assert goodput.total(c) == pytest.approx(13.0)
    assert acct["goodput"] == pytest.approx(8.0 / 13.0, abs=1e-4)


def test_a_rollback_redoes_steps_and_the_incident_pays_for_them():
    # 50 steps, a fault at t=7, 1 s of recovery, a new process resumes from step 40: steps
    # 41..50 are done again (the first of them inside the incident), then 20 new ones
    first = steps(1, 0, 2.0, 0, 50)
    t_fault, mttr = 7.0, 1.0
    second = steps(2, 1, t_fault + mttr - 0.1, 40, 30)  # its first step closes the incident
    acct = goodput.account(0.0, 12.0, [incident(1, t_fault, mttr, lost=10)], first + second,
                           t_ready=2.0, t_train_end=12.0)
    c = acct["categories"]
    assert sum(c["recovery"].values()) == pytest.approx(1.0)
    # steps 42..50 redone outside the incident: 9 x 0.08 s
    assert c["recomputed"] == pytest.approx(9 * 0.08, rel=1e-6)
    assert c["productive"] == pytest.approx(50 * 0.08 + 20 * 0.08, rel=1e-6)
    assert acct["by_incident"][0]["recomputed_s"] == pytest.approx(c["recomputed"])
    assert acct["by_incident"][0]["total_s"] == pytest.approx(1.0 + c["recomputed"])
    assert goodput.total(c) == pytest.approx(12.0)
    assert min(v for v in c.values() if not isinstance(v, dict)) >= 0


def test_sparse_samples_spread_their_time_and_skip_the_incident():
    # a sample every 5 steps; one spans the fault: only its part outside the incident counts
    samples = steps(1, 0, 1.0, 0, 60, every=5)
    acct = goodput.account(0.0, 8.0, [incident(1, 4.05, 0.5)], samples, t_ready=1.0)
    c = acct["categories"]
    assert goodput.total(c) == pytest.approx(8.0)
    assert c["productive"] < 60 * 0.08
    assert all(v >= 0 for v in c.values() if not isinstance(v, dict))


def test_an_incident_never_closed_runs_to_the_end():
    samples = steps(1, 0, 1.0, 0, 20)
    inc = {"id": 1, "t_fault": 3.5, "mttr_s": None, "phases_s": {}}
    acct = goodput.account(0.0, 6.0, [inc], samples, t_ready=1.0, t_train_end=None)
    c = acct["categories"]
    assert c["recovery"]["unrecovered"] == pytest.approx(2.5)
    assert goodput.total(c) == pytest.approx(6.0)


def test_no_samples_no_steps_everything_is_startup_or_idle():
    acct = goodput.account(10.0, 15.0, [], [], t_ready=11.0)
    c = acct["categories"]
    assert c["startup"] == pytest.approx(1.0) and c["idle"] == pytest.approx(4.0)
    assert acct["goodput"] == 0.0


def test_two_controllers_terms_merge_into_the_whole_jobs_account():
    # a controller counts 0..6 s, its host dies; the one taking over counts 6..12 s from the
    # first one's last sample: the two accounts add up to the job's, phases and all
    samples = steps(1, 0, 2.0, 0, 100)  # t=2..10
    inc = incident(1, 6.5, 1.0)
    a = goodput.account(0.0, 6.0, [], samples, t_ready=2.0)["categories"]
    b = goodput.account(6.0, 12.0, [inc], samples, t_ready=6.0)["categories"]
    whole = goodput.merge(a, b)
    assert goodput.total(whole) == pytest.approx(12.0)
    assert whole["startup"] == pytest.approx(2.0)
    assert sum(whole["recovery"].values()) == pytest.approx(1.0)
    assert whole["productive"] == pytest.approx(a["productive"] + b["productive"])
    assert goodput.merge({}, b) == b


def test_a_controller_taking_over_counts_the_whole_job_from_its_predecessors_account():
    """controller/account.py: the first term's account, passed on in the journal (``so_far``),
    is where the next one counts from - its start, its incidents, rank 0's last sample."""
    from nonstop.controller.account import JobAccount
    from nonstop.observe.progress import ProgressLog

    samples = steps(1, 0, 2.0, 0, 100)  # t=2..12
    first = JobAccount(ProgressLog())
    first.t_start = 0.0
    first.progress.rank0.extend(s for s in samples if s["t"] <= 6.0)
    first.formed(2.0)
    first.formed(5.0)  # a later generation: the start-up ended at the first
    closed = [incident(1, 4.0, 0.5)]
    job = first.so_far(6.0, closed)
    assert job["t_start"] == 0.0 and job["incidents"] == closed
    assert job["rank0"] == first.progress.rank0[-1]
    assert goodput.total(job["time_s"]) == pytest.approx(6.0)

    second = JobAccount(ProgressLog())
    second.t_start = 7.0  # it took office after the lease lapsed
    second.adopt(json.loads(json.dumps(job)))  # as the journal carries it
    assert second.progress.rank0[0] == job["rank0"]  # rank 0's time since counts from it
    second.progress.rank0.extend(s for s in samples if s["t"] > 6.0)
    assert second.job_start == 0.0 and second.earlier_incidents() == closed
    acct, whole = second.count(12.0, [])
    assert goodput.total(acct["categories"]) == pytest.approx(6.0)  # its own term: 6..12
    assert whole == goodput.merge(job["time_s"], acct["categories"])
    assert goodput.total(whole) == pytest.approx(12.0)  # the whole job
    assert second.so_far(12.0, [])["incidents"] == closed


@pytest.mark.integration
def test_a_real_rollback_is_accounted(tmp_path):
    from conftest import TRAIN, run_nonstop

    # both ranks die at step 27; their replacements resume from the last snapshot: the steps
    # since are lost, all but the first of them redone after the incident closed
    run = run_nonstop(tmp_path / "run", "--nproc=2", "--spares=2", "--snapshot-every=10",
                      "--inject=crash:rank=0,step=27;crash:rank=1,step=27", str(TRAIN), "--steps", "60",
                      "--sleep-ms", "20")
    assert run.code == 0, run.stderr[-3000:]
    s = run.summary
    (inc,) = s["incident_list"]
    lost = inc["steps_lost"]
    # exact, though the ranks were killed between two publishes of their progress: their agent
    # read the last step each completed (protocol.last_step)
    assert inc["step_before"] == 27 and inc["resume_step"] == 20 and lost == 7, json.dumps(inc)
    c = s["time_s"]  # (conftest checks that the categories add up to the wall time)
    step_s = c["productive"] / 60  # rank 0's steps that advanced the job: 60 of them
    assert 0.015 < step_s < 0.5, c
    assert inc["recomputed_s"] == pytest.approx((lost - 1) * step_s, rel=0.5), json.dumps([inc, c])
    assert c["recomputed"] == pytest.approx(inc["recomputed_s"], abs=1e-3)
    assert sum(c["recovery"].values()) == pytest.approx(inc["mttr_s"], abs=1e-3)
    assert s["goodput"] == pytest.approx(c["productive"] / s["wall_s"], abs=1e-3)
    # the start-up: from the launcher's start until the first generation formed on every rank
    # (ranks forked from a zygote template start in a fraction of a second: not a fixed floor)
    formed = max(e["t"] for e in run.of("rank_entered") if e["gen"] == 0)
    (start,) = run.of("run_start")
    # (the controller counts it once it has read the last rank's entry: not before it was
    # written, and on a loaded machine up to a few turns of its loop after)
    assert formed - start["t"] - 0.05 < c["startup"] < formed - start["t"] + 1.0, \
        (c, formed - start["t"])


def test_the_goodput_bench_schedule_is_seeded_and_paced(tmp_path):
    from nonstop_bench import goodput as bench

    a = bench.schedule(7, steps=5000, step_s=0.05, every_s=30)
    assert a == bench.schedule(7, steps=5000, step_s=0.05, every_s=30) != bench.schedule(
        8, steps=5000, step_s=0.05, every_s=30)
    assert [f["step"] for f in a] == list(range(600, 5000 - 300, 600))  # 30 s of 50 ms steps
    assert {f["kind"] for f in a[:4]} == set(bench.KINDS)  # every kind before any repeats
    # the step log's goodput: only steps that advanced the job, timed within an attempt
    (tmp_path / "steps-r0.txt").write_text("1 10.0 0\n2 10.1 0\n3 10.2 0\n2 11.0 1\n3 11.1 1\n"
                                           "4 11.2 1\n")
    assert bench.step_log_goodput(tmp_path, 9.0, 12.0) == round(0.3 / 3.0, 4)


def test_status_renders_a_job_mid_rendezvous_and_before_it_starts():
    from rich.console import Console

    from nonstop.observe import status

    def text(st, late=0.0):
        c = Console(width=200, record=True)
        c.print(status.render(st, now=st["t"] + late))
        return c.export_text()

    waiting = {"t": 5.0, "gen": -1, "phase": "waiting for hosts", "world": 0, "ranks": [],
               "step": 0, "incidents": 0, "over": False, "hosts_joined": 1, "hosts_wanted": 3,
               "waited_s": 12.0, "limit_s": 300.0}
    assert "waiting for hosts: 1/3 joined (12 s of 300 s)" in text(waiting)
    ranks = [{"rank": r, "wid": r + 1, "node": 0, "step": 40, "loss": None, "alive": True,
              "state": s} for r, s in enumerate(("entered", "joining"))]
    st = {"t": 5.0, "gen": 2, "phase": "rendezvous", "gen_age_s": 3.5, "world": 2, "ranks": ranks,
          "step": 40, "incidents": 1, "over": False, "spares": {"total": 1, "ready": 0},
          "incident": {"id": 1, "faults": ["rank 1 killed"], "phase": "restore", "since_s": 4.0},
          "budgets": {"rank replacement": 49}}
    out = text(st)
    assert "rendezvous 3.5 s (1/2 ranks in)" in out and "incident 1 open for 4.0 s, in restore" in out
    assert "joining" in out and "rank replacement 49" in out
    assert "no news from the controller for 60 s" in text(st, late=60)
    assert "no news" not in out

"""The ladder with real processes: a level that fails or misses its deadline hands over to the
next, repeated faults isolate a node, spent budgets end the job with a diagnosis and the
escalation hook. Weights are checked bit for bit wherever the recovery preserves them."""

from __future__ import annotations

import json

import pytest

from conftest import bitwise_equal, policy_file, rank_wids, train

pytestmark = pytest.mark.integration

ARGS = ("--steps", "40", "--sleep-ms", "10")


def test_a_level_that_misses_its_deadline_hands_over_to_the_next(tmp_path, reference):
    # the new process hangs once it has its assignment: rank replacement misses its deadline
    pol = policy_file(tmp_path, "recover:\n  levels:\n    rank_replacement: {deadline_s: 0.5}\n")
    run, out = train(tmp_path, "--spares=0", "--policy", pol,
                     "--inject=crash:rank=1,step=15;hang:rank=1,at=assigned,gen=1", args=ARGS)
    levels = [d["level"] for d in run.of("decision")]
    assert levels == ["rank replacement", "job restart"], levels
    assert [f["kind"] for f in run.of("fault") if f["kind"] != "peer"][-1] == "deadline"
    assert run.of("decision")[1]["escalated_from"] == "rank replacement"
    (missed,) = [d for d in run.of("deadline") if d["what"] == "recovery_level"]
    assert missed["limit_s"] == 0.5 and "rank replacement" in missed["detail"]
    assert bitwise_equal(out, reference(3, *ARGS))  # a job restart from step 0 is deterministic


def test_the_same_fault_on_a_node_isolates_it_and_moves_its_ranks(tmp_path, reference):
    run, out = train(tmp_path, "--nodes=2", "--spare-nodes=1", "--spares=1",
                     "--inject=crash:rank=1,step=10,times=3", args=ARGS, world=4)
    levels = [d["level"] for d in run.of("decision")]
    assert levels == ["rank replacement", "rank replacement", "node replacement"]
    assert run.of("decision")[-1]["isolate"] == [0]
    assert [e["node"] for e in run.of("isolate")] == [0]
    gen_last = run.of("generation")[-1]
    assert all(run_node(run, wid) == 2 for r, wid in gen_last["ranks"].items() if int(r) < 2)
    assert bitwise_equal(out, reference(4, *ARGS))


def run_node(run, wid):
    return next(e["node"] for e in run.of("spawn") if e["wid"] == wid)


def test_a_disabled_level_is_passed_over(tmp_path, reference):
    pol = policy_file(tmp_path, "recover:\n  levels:\n    in_process: {enabled: false}\n")
    run, out = train(tmp_path, "--spares=1", "--policy", pol,
                     "--inject=exception:rank=0,step=12", args=ARGS)
    (d,) = run.of("decision")
    assert d["level"] == "rank replacement" and d["replace"] == [0]
    assert "in-process restart: disabled" in d["passed_over"]
    assert len(rank_wids(run)[0]) == 2
    assert bitwise_equal(out, reference(3, *ARGS))


def test_spent_budgets_end_the_job_and_run_the_escalation_hook(tmp_path):
    got = tmp_path / "diagnosis.json"
    pol = policy_file(tmp_path, "recover:\n  levels:\n    rank_replacement: {budget: 1}\n"
                                "    node_replacement: {enabled: false}\n"
                                "    job_restart: {budget: 0}\n"
                                f"hooks:\n  on_give_up:\n    command: 'cat > {got}'\n")
    run, _ = train(tmp_path, "--spares=1", "--policy", pol,
                   "--inject=crash:rank=1,step=10;crash:rank=2,step=20", args=ARGS, ok=False)
    assert run.code == 1
    assert [d["level"] for d in run.of("decision")] == ["rank replacement", "fail"]
    assert "no recovery level left" in run.stderr and "budget of 1 spent" in run.stderr
    (hook,) = run.of("hook")
    assert hook["ok"]
    diagnosis = json.loads(got.read_text())
    assert "no recovery level left" in diagnosis["diagnosis"] and diagnosis["exit_code"] == 1
    assert len(diagnosis["incidents"]) == 2


def test_hanging_again_and_again_stops_the_job(tmp_path):
    pol = policy_file(tmp_path, "rules:\n  hang_restarts: 1\n"
                                "detect:\n  hang:\n    first_step: {floor_s: 2.0}\n")
    run, _ = train(tmp_path, "--spares=1", "--policy", pol,
                   "--inject=hang:rank=1,step=15,times=5", args=ARGS, ok=False)
    assert run.code == 1 and "hung 2 times in a row" in run.stderr
    assert [d["level"] for d in run.of("decision")] == ["rank replacement", "fail"]


def test_restarts_without_an_infrastructure_fault_blame_the_training_code(tmp_path):
    from conftest import SCRIPTS, run_nonstop

    pol = policy_file(tmp_path, "rules:\n  user_code_job_restarts: 2\n")
    run = run_nonstop(tmp_path / "run", "--nproc=2", "--policy", pol,
                      str(SCRIPTS / "plain_exits.py"))
    assert run.code == 1 and "training code itself fails" in run.stderr
    assert [d["level"] for d in run.of("decision")] == ["job restart", "job restart", "fail"]
    assert all(f["attribution"] != "infrastructure" for f in run.of("fault"))

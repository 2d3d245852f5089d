"""The ladder's decisions as a pure function of faults, counters and policy."""

from nonstop import ladder
from nonstop.ladder import Counters, Fault, Level
from nonstop.policy import Policy

P = Policy()


def test_crash_of_one_rank_replaces_only_that_rank():
    d = ladder.decide([Fault("crash", rank=2, code=-9)], {2}, 4, True, P, Counters())
    assert d.level is Level.REPLACE_RANK and d.replace == frozenset({2})
    assert "SIGKILL" in d.reason


def test_user_exception_is_retried_in_process_until_budget():
    f = [Fault("exception", rank=1, message="ValueError: bad", traceback="Traceback...")]
    c = Counters()
    for _ in range(P.budgets.user_error_retries):
        d = ladder.decide(f, set(), 4, True, P, c)
        assert d.level is Level.IN_PROCESS
        c = ladder.charge(d, f, c)
    d = ladder.decide(f, set(), 4, True, P, c)
    assert d.level is Level.FAIL and d.traceback == "Traceback..." and "ValueError" in d.diagnosis


def test_progress_resets_the_consecutive_user_error_count():
    c = Counters(user_errors_in_a_row=3)
    assert ladder.progressed(c).user_errors_in_a_row == 0


def test_plain_script_falls_back_to_job_restart_then_fails():
    f = [Fault("crash", rank=0, code=-9)]
    c = Counters()
    for _ in range(P.budgets.job_restarts):
        d = ladder.decide(f, {0}, 2, False, P, c)
        assert d.level is Level.JOB_RESTART and d.replace == frozenset({0, 1})
        c = ladder.charge(d, f, c)
    assert ladder.decide(f, {0}, 2, False, P, c).level is Level.FAIL


def test_replacement_budget_spent_escalates_to_job_restart():
    pol = P.with_overrides(**{"budgets.rank_replacements": 1})
    f = [Fault("crash", rank=1, code=-9)]
    c = ladder.charge(ladder.decide(f, {1}, 4, True, pol, Counters()), f, Counters())
    assert c.rank_replacements == 1
    assert ladder.decide(f, {1}, 4, True, pol, c).level is Level.JOB_RESTART


def test_import_error_is_a_usage_failure_at_once():
    f = [Fault("import_error", rank=1, message="ModuleNotFoundError: x")]
    d = ladder.decide(f, {1}, 2, True, P, Counters())
    assert d.level is Level.FAIL and d.usage_error


def test_no_consistent_state_needs_a_job_restart():
    d = ladder.decide([Fault("no_state", rank=0)], set(), 4, True, P, Counters())
    assert d.level is Level.JOB_RESTART


def test_hang_with_every_rank_leaving_is_an_in_process_restart():
    d = ladder.decide([Fault("hang")], set(), 4, True, P, Counters())
    assert d.level is Level.IN_PROCESS


def test_attribution():
    assert Fault("crash", code=-9).attribution is ladder.Attribution.INFRA
    assert Fault("exception").attribution is ladder.Attribution.USER
    assert Fault("exit", code=3).attribution is ladder.Attribution.UNKNOWN

"""The ladder's decisions as a pure function of faults, history and policy."""

from nonstop.decide import ladder
from nonstop.decide.faults import Attribution, Domain, Fault
from nonstop.decide.ladder import Counters, LadderView, Level
from nonstop.policy import Policy

P = Policy()
V4 = LadderView(world=4, node_of={0: 0, 1: 0, 2: 1, 3: 1}, spare_nodes=1, capacity=6)


def run(faults, dead=(), view=V4, policy=P, counters=None, now=100.0, **kw):
    return ladder.decide(list(faults), set(dead), view, policy, counters or Counters(), now, **kw)


def test_crash_of_one_rank_replaces_only_that_rank():
    d = run([Fault("crash", rank=2, code=-9)], dead={2})
    assert d.level is Level.REPLACE_RANK and d.replace == frozenset({2})
    assert "SIGKILL" in d.reason


def test_user_exception_is_retried_in_process_until_budget():
    f = [Fault("exception", rank=1, message="ValueError: bad", traceback="Traceback...")]
    c = Counters()
    for _ in range(P.rules.user_error_retries):
        d = run(f, counters=c)
        assert d.level is Level.IN_PROCESS
        c = ladder.charge(d, f, c)
    d = run(f, counters=c)
    assert d.level is Level.FAIL and d.traceback == "Traceback..." and "ValueError" in d.diagnosis


def test_progress_resets_the_in_a_row_counters():
    c = Counters(user_errors_in_a_row=3, hangs_in_a_row=2, nan_in_a_row=1)
    p = ladder.progressed(c)
    assert (p.user_errors_in_a_row, p.hangs_in_a_row, p.nan_in_a_row) == (0, 0, 0)


def test_the_pure_counter_functions_share_nothing_with_their_input():
    f = [Fault("crash", rank=1, code=-9)]
    c = Counters(spent={"rank replacement": 1}, recent=[(1.0, "SIGKILL", 1, 0)], isolated={3},
                 last_fault_t=1.0)
    outs = [ladder.charge(run(f, dead={1}, counters=c), f, c), ladder.progressed(c),
            ladder.quiet(c, 2.0, P), ladder.quiet(c, 2.0 + P.rules.quiet_period_s, P), c.but()]
    for out in outs:
        out.spent["x"] = 9
        out.recent.append((5.0, "X", 0, 0))
        out.isolated.add(7)
    assert c.spent == {"rank replacement": 1} and c.recent == [(1.0, "SIGKILL", 1, 0)]
    assert c.isolated == {3}


def test_plain_script_falls_back_to_job_restart_then_fails():
    f = [Fault("crash", rank=0, code=-9)]
    c = Counters()
    view = LadderView(world=2, managed=False)
    for _ in range(P.levels.job_restart.budget):
        d = run(f, dead={0}, view=view, counters=c)
        assert d.level is Level.JOB_RESTART and d.replace == frozenset({0, 1})
        c = ladder.charge(d, f, c)
    d = run(f, dead={0}, view=view, counters=c)
    assert d.level is Level.FAIL and "job restart: budget of 3 spent" in d.diagnosis


def test_replacement_budget_spent_falls_through_to_node_then_job_restart():
    pol = P.with_overrides(**{"recover.levels.rank_replacement.budget": 1})
    f = [Fault("crash", rank=1, code=-9)]
    c = ladder.charge(run(f, dead={1}, policy=pol), f, Counters())
    assert c.used(Level.REPLACE_RANK) == 1
    d = run(f, dead={1}, policy=pol, counters=c)
    assert d.level is Level.REPLACE_NODE and d.replace == frozenset({0, 1})
    assert any("rank replacement: budget" in p for p in d.passed_over)
    no_spare_node = LadderView(world=4, node_of=V4.node_of, spare_nodes=0, capacity=4)
    d = run(f, dead={1}, policy=pol, counters=c, view=no_spare_node)
    assert d.level is Level.JOB_RESTART
    assert any("no spare node" in p for p in d.passed_over)
    # a rank lost on a healthy node: its place is there (scale_in.when: no_capacity)
    assert any("scale-in: the lost place can be refilled" in p for p in d.passed_over)


def test_disabled_level_is_passed_over():
    pol = P.with_overrides(**{"recover.levels.in_process.enabled": False})
    d = run([Fault("exception", rank=0, message="E")], policy=pol)
    assert d.level is Level.REPLACE_RANK and d.replace == frozenset({0})  # a fresh process
    assert "in-process restart: disabled" in d.passed_over
    d = run([Fault("hang", message="no step")], policy=pol)
    assert d.level is Level.JOB_RESTART and "rank replacement: no rank at fault" in d.passed_over


def test_a_level_that_failed_hands_over_to_the_next():
    d = run([Fault("deadline", message="too slow")], dead=set(), escalate_from=Level.REPLACE_RANK)
    assert d.level is Level.JOB_RESTART  # node replacement needs a node at fault
    d = run([Fault("rendezvous_timeout", rank=2)], dead={2}, escalate_from=Level.REPLACE_RANK)
    assert d.level is Level.REPLACE_NODE and d.replace == frozenset({2, 3})


def test_same_fault_on_one_node_three_times_isolates_it():
    f = [Fault("crash", rank=1, code=-9)]
    c = Counters()
    for i in range(2):
        d = run(f, dead={1}, counters=c, now=100.0 + i)
        assert d.level is Level.REPLACE_RANK and not d.isolate
        c = ladder.charge(d, f, c, now=100.0 + i)
    d = run(f, dead={1}, counters=c, now=102.0)
    assert d.level is Level.REPLACE_NODE and d.isolate == frozenset({0})
    assert d.replace == frozenset({0, 1})
    c = ladder.charge(d, f, c, now=102.0)
    assert c.isolated == {0}


def test_a_rank_that_fails_on_one_node_then_another_isolates_neither():
    """Counted where each fault happened: rank 1 crashed twice on node 0, then once on node 2
    (it moved to a spare there): that points at the rank, not at node 2's hardware."""
    f = [Fault("crash", rank=1, code=-9)]
    c = Counters()
    for i in range(2):
        c = ladder.charge(run(f, dead={1}, counters=c), f, c, now=100.0 + i,
                          node_of=V4.node_of)
    assert [n for *_, n in c.recent] == [0, 0]
    moved = LadderView(world=4, node_of={0: 0, 1: 2, 2: 1, 3: 1}, spare_nodes=0, capacity=6)
    d = run(f, dead={1}, view=moved, counters=c, now=102.0)
    assert d.level is Level.REPLACE_RANK and not d.isolate
    back = run(f, dead={1}, counters=c, now=102.0)  # on node 0 again: its third there
    assert back.isolate == frozenset({0})


def test_isolation_window_and_quiet_period():
    f = [Fault("crash", rank=1, code=-9)]
    c = Counters()
    for t in (0.0, 1.0):
        c = ladder.charge(run(f, dead={1}, counters=c, now=t), f, c, now=t)
    later = 1.0 + P.rules.isolate.window_s + 1
    assert run(f, dead={1}, counters=c, now=later).level is Level.REPLACE_RANK  # out of window
    quiet = ladder.quiet(c, 1.0 + P.rules.quiet_period_s + 1, P)
    assert quiet.recent == [] and quiet.user_errors_in_a_row == 0


def test_user_faults_never_isolate():
    f = [Fault("exception", rank=1, message="E")]
    c = Counters(recent=[(99.0, "PY_E", 1, 0)] * 5)
    assert run(f, counters=c).level is Level.IN_PROCESS


def test_unhealthy_node_is_replaced_whole():
    d = run([Fault("node_unhealthy", node=1, tag="HEALTH_disk")])
    assert d.level is Level.REPLACE_NODE and d.replace == frozenset({2, 3}) and d.isolate == {1}


def test_not_enough_healthy_nodes_fails():
    view = LadderView(world=4, node_of=V4.node_of, spare_nodes=0, capacity=2)
    d = run([Fault("crash", rank=0, code=-9)], dead={0, 1, 2, 3}, view=view)
    assert d.level is Level.FAIL and "cannot hold 4 ranks" in d.diagnosis


def test_repeated_hangs_fail():
    f = [Fault("hang", message="no step")]
    c = Counters(hangs_in_a_row=P.rules.hang_restarts)
    d = run(f, counters=c)
    assert d.level is Level.FAIL and "hung" in d.diagnosis


def test_job_restarts_without_infrastructure_blame_the_user():
    f = [Fault("no_state")]
    c = Counters(restarts_without_infra=P.rules.user_code_job_restarts)
    d = run(f, counters=c)
    assert d.level is Level.FAIL and "training code itself fails" in d.diagnosis
    c2 = ladder.charge(ladder.Decision(Level.JOB_RESTART), [Fault("crash", rank=0, code=-9)], c)
    assert c2.restarts_without_infra == 0


def test_import_error_is_a_usage_failure_at_once():
    d = run([Fault("import_error", rank=1, message="ModuleNotFoundError: x")], dead={1})
    assert d.level is Level.FAIL and d.usage_error


def test_nan_retry_then_fail_naming_step_and_rank():
    c = Counters()
    for _ in range(P.detect.nan.max_consecutive):
        d = ladder.decide_nan(7, {0: 1.0, 1: "nan"}, P, c)
        assert d.level is Level.STEP_RETRY and not d.skip
        c = ladder.charge(d, [], c)
    d = ladder.decide_nan(7, {0: 1.0, 1: "nan"}, P, c)
    assert d.level is Level.FAIL and "step 7" in d.diagnosis and "rank(s) 1" in d.diagnosis


def test_nan_skip_batch_and_fail_actions():
    skip = P.with_overrides(**{"detect.nan.action": "skip_batch"})
    assert ladder.decide_nan(3, {}, skip, Counters()).skip
    fail = P.with_overrides(**{"detect.nan.action": "fail"})
    assert ladder.decide_nan(3, {}, fail, Counters()).level is Level.FAIL


def test_classification():
    assert Fault("crash", rank=0, code=-9).attribution is Attribution.INFRA
    assert Fault("crash", rank=0, code=-9).fault_code == "SIGKILL"
    assert Fault("exception", message="ValueError: x").fault_code == "PY_ValueError"
    assert Fault("exit", code=3).fault_code == "EXIT_3"
    assert Fault("exit", code=3).attribution is Attribution.UNKNOWN
    assert Fault("node_unhealthy", node=1).domain is Domain.NODE
    assert Fault("log_rule", rank=0, tag="LOG_OOM").fault_code == "LOG_OOM"
    assert Fault("nan").attribution is Attribution.USER


def test_isolating_the_last_node_fails_instead_of_restarting_nowhere():
    # one node, the same crash again and again: isolating it leaves no node for a job restart
    one = LadderView(world=2, node_of={0: 0, 1: 0}, spare_nodes=0, capacity=2, slots=2)
    c = Counters(recent=[(99.0, "SIGKILL", 1, 0)] * (P.rules.isolate.times - 1))
    d = run([Fault("crash", rank=1, code=-9)], dead={1}, view=one, counters=c)
    assert d.level is Level.FAIL and d.isolate == frozenset() and "cannot hold 2 ranks" in d.diagnosis


def test_nonstops_own_error_stops_the_job_named_as_nonstops_never_the_users():
    f = [Fault("internal", rank=1, message="RuntimeError: a DTensor where a tensor was meant",
               traceback="Traceback ... nonstop/state/shm.py ...")]
    assert f[0].attribution is Attribution.NONSTOP and f[0].fault_code == "INTERNAL"
    d = run(f)
    assert d.level is Level.FAIL and not d.isolate
    assert "nonstop's own state code raised RuntimeError" in d.diagnosis
    assert "a bug in nonstop" in d.diagnosis and "not in the training code" in d.diagnosis
    assert d.traceback == f[0].traceback
    assert ladder.charge(d, f, Counters()).user_errors_in_a_row == 0  # not the user's


def test_the_failure_domain_of_a_sharded_job_is_the_rank_or_its_replica_group():
    """HSDP, 2 replica groups of 2 shards: a crash replaces the rank alone (its twin has its
    shard), or - recover.failure_domain: replica_group, torchft's model - its whole group. A
    job with no replica groups (DDP, plain FSDP) is not affected."""
    groups = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
    hsdp = LadderView(world=4, node_of=V4.node_of, spare_nodes=1, capacity=6, replica_groups=groups)
    crash = [Fault("crash", rank=1, code=-9)]
    assert run(crash, dead={1}, view=hsdp).replace == {1}
    whole = Policy().with_overrides(**{"recover.failure_domain": "replica_group"})
    d = run(crash, dead={1}, view=hsdp, policy=whole)
    assert d.level is Level.REPLACE_RANK and d.replace == {0, 1}
    assert run(crash, dead={1}, view=V4, policy=whole).replace == {1}

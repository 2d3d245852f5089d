"""Log-pattern rules: trigger rules and liveness rules (pure logic, no processes)."""

from nonstop.decide.logrules import LogWatch, Match, default_code
from nonstop.policy import LogRule


def progress(**kw) -> LogRule:
    return LogRule(**{"name": "progress", "pattern": r"step \d+", "action": "hang", **kw})


def ranks(matches: list[Match]) -> list[int | None]:
    return [m.rank for m in matches]


# -- trigger rules ---------------------------------------------------------------------------------
def test_trigger_rule_matches_or_not():
    w = LogWatch([LogRule(name="oom", pattern=r"CUDA out of memory")])
    assert w.active
    assert w.feed(1, "all fine", 1.0) == []
    (m,) = w.feed(2, "RuntimeError: CUDA out of memory. Tried...\n", 2.0)
    assert (m.rule, m.kind, m.action, m.rank, m.t) == ("oom", "match", "fault", 2, 2.0)
    assert m.line == "RuntimeError: CUDA out of memory. Tried..."
    assert m.message.startswith("rank 2 printed 'RuntimeError: CUDA out of memory")
    assert m.message.endswith("(rule oom)")
    assert w.tick(1e9) == []  # a trigger rule never reports anything missing


def test_default_code_and_custom_code():
    assert default_code("cuda oom") == "LOG_CUDA_OOM"
    assert default_code("a-b  c!") == "LOG_A_B_C"
    w = LogWatch([LogRule(name="nccl-timeout", pattern="Watchdog caught"),
                  LogRule(name="xid", pattern="Xid 79", code="XID_79", action="report")])
    assert w.feed(0, "Watchdog caught collective operation timeout", 0.0)[0].code == "LOG_NCCL_TIMEOUT"
    (m,) = w.feed(0, "NVRM: Xid 79, GPU has fallen off the bus", 0.0)
    assert (m.code, m.action) == ("XID_79", "report")


def test_several_rules_on_one_line_in_rule_order():
    w = LogWatch([LogRule(name="a", pattern="err"), LogRule(name="b", pattern="fatal", action="hang"),
                  LogRule(name="c", pattern="nope")])
    assert [(m.rule, m.action) for m in w.feed(3, "fatal err", 1.0)] == [("a", "fault"), ("b", "hang")]


def test_long_lines_are_truncated():
    w = LogWatch([LogRule(name="e", pattern="E")])
    (m,) = w.feed(0, "E" * 1000, 0.0)
    assert m.line == "E" * 300
    assert len(m.message) < 200 and "\n" not in m.message


# -- liveness rules --------------------------------------------------------------------------------
def test_missing_within_after_start_unless_matched_in_time():
    w = LogWatch([progress(expected_within_s=10)])
    w.start(100.0, [0, 1])
    assert w.feed(0, "step 1", 105.0) == []  # good news, not a match
    assert w.tick(110.0) == []  # exactly at the cut-off: still in time
    (m,) = w.tick(110.5)
    assert (m.rule, m.kind, m.action, m.code, m.rank, m.t, m.line) == (
        "progress", "missing", "hang", "LOG_PROGRESS", 1, 110.5, None)
    assert m.message == r"rank 1: no line matching 'step \\d+' for 10 s (rule progress)"
    assert w.tick(1e6) == []  # rank 0 met the cut-off and no frequency is expected


def test_every_clock_runs_from_the_first_match():
    w = LogWatch([progress(expected_within_s=10, expected_every_s=5)])
    w.start(100.0, [0])
    assert w.tick(109.0) == []  # the every-clock does not run before the first match
    w.feed(0, "step 1", 108.0)
    assert w.tick(113.0) == []
    w.feed(0, "step 2", 112.0)
    assert w.tick(116.0) == []
    (m,) = w.tick(117.5)
    assert m.rank == 0 and "for 5 s" in m.message


def test_every_clock_without_cut_off_runs_from_the_start():
    w = LogWatch([progress(expected_every_s=5)])
    w.start(0.0, [0, 1])
    w.feed(1, "step 1", 4.0)
    assert ranks(w.tick(5.5)) == [0]
    assert ranks(w.tick(9.5)) == [1]


def test_missing_fires_once_then_rearms_after_a_new_match():
    w = LogWatch([progress(expected_every_s=5)])
    w.start(0.0, [0])
    assert ranks(w.tick(6.0)) == [0]
    assert w.tick(7.0) == [] and w.tick(100.0) == []  # once
    w.feed(0, "step 9", 101.0)
    assert w.tick(105.0) == []
    assert ranks(w.tick(106.5)) == [0]  # re-armed


def test_restart_resets_clocks_and_forgets_ranks():
    w = LogWatch([progress(expected_every_s=5)])
    w.start(0.0, [0, 1])
    assert ranks(w.tick(6.0)) == [0, 1]
    w.start(10.0, (r for r in [0, 2]))  # any iterable; rank 1 is forgotten, rank 0 re-armed
    assert w.tick(14.0) == []
    assert sorted(ranks(w.tick(16.0))) == [0, 2]


def test_ranks_not_started_and_spares_only_feed_trigger_rules():
    w = LogWatch([progress(expected_every_s=5), LogRule(name="bad", pattern="fatal")])
    w.start(0.0, [0])
    (m,) = w.feed(None, "step 1 fatal", 4.0)  # a warm spare: the trigger fires, no clock reset
    assert (m.rule, m.rank) == ("bad", None) and m.message.startswith("a spare printed")
    assert [m.rule for m in w.feed(7, "step 1 fatal", 4.0)] == ["bad"]  # rank 7 was not started
    assert ranks(w.tick(5.5)) == [0]  # rank 7 got no clock, rank 0's was not reset


def test_several_liveness_rules_are_independent():
    w = LogWatch([progress(expected_every_s=5),
                  LogRule(name="hb", pattern="heartbeat", action="slow", expected_every_s=20)])
    w.start(0.0, range(2))
    w.feed(0, "step 3 heartbeat", 1.0)
    assert [(m.rule, m.rank) for m in w.tick(5.5)] == [("progress", 1)]
    assert [(m.rule, m.rank, m.action) for m in w.tick(20.5)] == [
        ("progress", 0, "hang"), ("hb", 1, "slow")]


def test_no_rules_is_inactive():
    w = LogWatch([])
    assert not w.active
    w.start(0.0, [0, 1])
    assert w.feed(0, "anything", 1.0) == [] and w.tick(1e9) == []

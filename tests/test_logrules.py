"""Log-pattern rules: trigger rules and liveness rules (pure logic)."""

from nonstop.logrules import LogWatch, default_code
from nonstop.policy import LogRule


def test_trigger_rule_matches_with_its_code():
    w = LogWatch([LogRule(name="cuda oom", pattern=r"CUDA out of memory", action="fault")])
    assert w.active
    assert w.feed(1, "all fine", 1.0) == []
    (m,) = w.feed(1, "RuntimeError: CUDA out of memory. Tried...", 2.0)
    assert (m.kind, m.action, m.code, m.rank) == ("match", "fault", "LOG_CUDA_OOM", 1)
    assert default_code("a-b c") == "LOG_A_B_C"
    custom = LogWatch([LogRule(name="x", pattern="boom", code="XID_79")])
    assert custom.feed(0, "boom", 0.0)[0].code == "XID_79"


def test_liveness_rule_missing_after_start_then_every():
    rule = LogRule(name="progress", pattern=r"step \d+", action="hang",
                   expected_within_s=10, expected_every_s=5)
    w = LogWatch([rule])
    w.start(100.0, [0, 1])
    assert w.tick(109.0) == []
    assert w.feed(0, "step 1", 108.0) == []  # good news, not a match
    missing = w.tick(111.0)
    assert [(m.rank, m.kind, m.action) for m in missing] == [(1, "missing", "hang")]
    assert w.tick(112.0) == []  # fires once...
    assert [m.rank for m in w.tick(113.5)] == [0]  # rank 0's every-clock ran out
    w.feed(1, "step 9", 114.0)  # ...and re-arms after a new match
    assert [m.rank for m in w.tick(119.5)] == [1]


def test_restart_resets_clocks_and_forgets_ranks():
    w = LogWatch([LogRule(name="p", pattern="tick", action="hang", expected_every_s=5)])
    w.start(0.0, [0, 1])
    w.start(10.0, [0])
    assert [m.rank for m in w.tick(14.0)] == []
    assert [m.rank for m in w.tick(16.0)] == [0]


def test_spare_lines_only_feed_trigger_rules_and_no_rules_is_inactive():
    w = LogWatch([LogRule(name="p", pattern="tick", expected_every_s=1),
                  LogRule(name="bad", pattern="fatal")])
    w.start(0.0, [0])
    (m,) = w.feed(None, "tick fatal", 0.5)
    assert m.rule == "bad" and m.rank is None and "a spare" in m.message
    assert not LogWatch([]).active and LogWatch([]).feed(0, "x", 0) == []


def test_long_lines_are_truncated():
    w = LogWatch([LogRule(name="e", pattern="E")])
    (m,) = w.feed(0, "E" * 1000, 0.0)
    assert len(m.line) == 300

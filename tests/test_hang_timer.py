"""HangTimer, the auto-tuned hang timeout: numbers in, a timeout out (no clock, no process)."""

from __future__ import annotations

import math

import pytest

from nonstop.decide.detect import HangTimer
from nonstop.policy import Hang, HangTuning


def timer(**kw) -> HangTimer:
    return HangTimer(Hang(**kw))


def test_before_the_warmup_the_steady_timeout_is_the_initial_one():
    t = timer(warmup_steps=3, steady=HangTuning(initial_s=40.0))
    assert t.steady_timeout() == 40.0
    t.observe_step(0.1)
    t.observe_step(0.1)
    assert t.steady_timeout() == 40.0  # 2 of 3 steps seen
    t.observe_step(0.1)
    assert t.steady_timeout() == pytest.approx(1.0)  # 5 x 0.1 s, raised to the 1 s floor


def test_the_steady_timeout_follows_the_slowest_recent_step_within_floor_and_ceiling():
    t = timer(warmup_steps=1, steady=HangTuning(multiplier=4.0, floor_s=2.0, ceiling_s=30.0))
    t.observe_step(1.0)
    assert t.steady_timeout() == pytest.approx(4.0)
    t.observe_step(3.0)
    t.observe_step(0.5)
    assert t.steady_timeout() == pytest.approx(12.0)  # the slowest, not the last
    assert t.slowest_step() == 3.0
    t.observe_step(20.0)
    assert t.steady_timeout() == 30.0  # ceiling
    fast = timer(warmup_steps=1, steady=HangTuning(multiplier=4.0, floor_s=2.0))
    fast.observe_step(0.01)
    assert fast.steady_timeout() == 2.0  # floor


def test_a_slow_step_leaves_the_window_and_the_timeout_comes_back_down():
    t = timer(window=3, warmup_steps=1)
    t.observe_step(10.0)
    assert t.steady_timeout() == pytest.approx(50.0)
    for _ in range(3):
        t.observe_step(1.0)
    assert t.steady_timeout() == pytest.approx(5.0)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_a_step_time_that_means_nothing_is_ignored(bad):
    t = timer(warmup_steps=1)
    t.observe_step(bad)
    t.observe_first_step(bad)
    assert t.slowest_step() == 0.0
    assert t.steady_timeout() == Hang().steady.initial_s  # still warming up
    assert t.first_step_timeout() == Hang().first_step.initial_s


def test_the_first_step_of_a_generation_is_timed_from_the_slowest_first_step():
    t = timer()
    assert t.first_step_timeout() == 300.0  # nothing seen: its initial allowance
    t.observe_first_step(2.0)
    assert t.first_step_timeout() == 10.0  # 3 x 2 s, raised to its 10 s floor
    t.observe_first_step(40.0)
    t.observe_first_step(5.0)
    assert t.first_step_timeout() == pytest.approx(120.0)  # the slowest first step, x3
    for _ in range(10):
        t.observe_step(0.05)  # steady steps change nothing of it
    assert t.first_step_timeout() == pytest.approx(120.0)


def test_auto_off_is_the_fixed_timeout_and_the_first_steps_initial_allowance():
    t = timer(auto=False, timeout_s=7.0)
    for s in (0.1, 50.0):
        t.observe_step(s)
        t.observe_first_step(s)
    assert t.steady_timeout() == 7.0
    assert t.first_step_timeout() == 300.0


def test_a_step_while_the_generation_settles_may_take_as_long_as_the_slowest_first_step():
    t = timer(warmup_steps=1)
    assert t.settling_timeout() == t.steady_timeout()  # no first step seen: the steady one
    t.observe_step(0.05)
    assert t.settling_timeout() == 1.0  # the steady floor
    t.observe_first_step(2.5)
    assert t.settling_timeout() == 2.5  # a cold process's next steps, as long as its first
    t.observe_step(1.0)
    assert t.settling_timeout() == pytest.approx(5.0)  # steady above it: steady
    fixed = timer(auto=False, timeout_s=3.0)
    fixed.observe_first_step(8.0)
    assert fixed.settling_timeout() == 3.0  # a fixed timeout is kept as set

"""``nonstop bench overhead``'s arithmetic (pure): the paired figure is the median of each turn's
runs against each other, so a machine drifting between turns does not move it."""

from nonstop.bench.overhead import _paired, _pct, mean_step


def _runs(*steps):
    return [{"step_s": s} for s in steps]


def test_the_paired_overhead_is_each_turns_ratio_then_their_median():
    # the machine slows by 10% from turn to turn: the medians of each system see 1.7%, the
    # turns each see 1% (and a failed run drops its turn only)
    plain = _runs(0.040, 0.044, 0.0484, None)
    nonstop = _runs(0.0404, 0.04444, 0.048884, 0.05)
    assert _pct(0.04444, 0.044) == 1.0
    assert _paired(nonstop, plain) == 1.0
    assert _paired(None, plain) is None and _paired(nonstop, _runs(None)) is None


def test_the_mean_step_skips_the_first_fifth():
    rows = [(s, 0.01 * s + (0.5 if s < 2 else 0.0), 0) for s in range(10)]
    assert abs(mean_step(rows) - 0.01) < 1e-9
    assert mean_step(rows[:5]) is None

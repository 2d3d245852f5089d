"""Incident phases add up to the MTTR; summaries."""

from nonstop.metrics import PHASES, Incident, summarize


def test_phases_partition_the_mttr_even_with_missing_points():
    inc = Incident(id=1, t_fault=100.0, t_detect=100.02, t_decide=100.021, t_torn=100.05,
                   t_assigned=None, t_pg=100.08, t_restored=100.09, t_first_step=100.12,
                   step_before=50, resume_step=50)
    phases = inc.phases()
    assert list(phases) == list(PHASES)
    assert abs(sum(phases.values()) - inc.mttr) < 1e-9
    assert phases["replace"] == 0.0 and all(v >= 0 for v in phases.values())
    assert inc.steps_lost == 0


def test_points_out_of_order_are_clamped():
    inc = Incident(id=1, t_fault=10.0, t_detect=9.5, t_first_step=11.0)
    assert all(v >= 0 for v in inc.phases().values())
    assert abs(sum(inc.phases().values()) - 1.0) < 1e-9


def test_summary():
    incs = [Incident(id=i, t_fault=0.0, t_detect=0.1, t_first_step=m, step_before=10,
                     resume_step=10 - i).to_record() for i, m in ((1, 0.5), (2, 1.5))]
    s = summarize(incs, wall_s=10.0, productive_s=8.0, steps=100, exit_code=0)
    assert s["incidents"] == 2 and s["mttr_s"]["median"] == 1.0 and s["steps_lost"] == 3
    assert s["goodput"] == 0.8

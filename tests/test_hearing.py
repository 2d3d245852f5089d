"""Whether the controller can prove it hears the job (controller/hearing.py: pure, a fake clock)."""

from nonstop.controller.hearing import HeardAgain, Hearing, Unheard


def test_deaf_then_heard_again_moves_the_time_heard_on():
    h = Hearing(stall_s=1.0)
    assert h.look(10.0, deaf=False) is None and h.t_heard == 0.0
    assert h.look(10.5, deaf=True) == Unheard(first=True)
    assert h.look(11.0, deaf=True) == Unheard(first=False)  # said once
    assert h.look(14.5, deaf=False) == HeardAgain(4.0, "deaf")  # from when it went deaf
    assert h.t_heard == 14.5
    assert h.look(14.9, deaf=False) is None


def test_a_loop_held_up_longer_than_a_stall_is_heard_again_too():
    h = Hearing(stall_s=1.0)
    assert h.look(5.0, deaf=False) is None  # the first look: nothing before it to measure
    assert h.look(5.75, deaf=False) is None
    assert h.look(8.5, deaf=False) == HeardAgain(2.75, "held up")
    assert h.t_heard == 8.5

"""An incident whose recovery is interrupted by another fault: every attempt's time is kept in the
phase it was spent in, and the phases still add up to the MTTR. Pure: no process."""

import pytest

from nonstop.observe.console import ConsoleFilter
from nonstop.observe.incidents import PHASES, Incident


def _recovered(inc: Incident, t: float) -> None:
    inc.t_decide, inc.t_torn, inc.t_assigned = t, t + 0.1, t + 0.2
    inc.t_pg, inc.t_restored, inc.t_first_step = t + 0.3, t + 0.4, t + 0.5


def test_an_interrupted_attempt_keeps_its_time_in_the_phase_it_reached():
    inc = Incident(id=1, t_fault=100.0, t_detect=100.05)
    inc.t_decide, inc.t_torn = 100.06, 100.2
    inc.interrupt(103.2, "replace")  # the promoted spare died: 3 s into the replace phase
    assert inc.t_detect == 103.2 and inc.t_torn is None
    _recovered(inc, 103.3)
    phases = inc.phases()
    assert phases["replace"] == pytest.approx(3.0 + 0.1)
    assert phases["teardown"] == pytest.approx(0.14 + 0.1)
    assert phases["detect"] == pytest.approx(0.05 + 0.0)
    assert sum(phases.values()) == pytest.approx(inc.mttr)
    rec = inc.to_record()
    assert [a["phase"] for a in rec["interrupted"]] == ["replace"]


def test_a_rendezvous_cut_short_after_the_group_formed_was_spent_restoring():
    inc = Incident(id=1, t_fault=10.0, t_detect=10.1)
    inc.t_decide, inc.t_torn = 10.1, 10.2
    inc.interrupt(12.2, "rendezvous")
    inc.group_formed(11.7)  # a survivor says its group had formed then
    inc.group_formed(50.0)  # not in that attempt: ignored
    (a,) = inc.interrupted
    assert a["phase"] == "restore"
    assert a["phases_s"]["rendezvous"] == pytest.approx(1.5)
    assert a["phases_s"]["restore"] == pytest.approx(0.5)
    _recovered(inc, 12.3)
    assert sum(inc.phases().values()) == pytest.approx(inc.mttr)


def test_two_interruptions_and_every_phase_name_is_known():
    inc = Incident(id=1, t_fault=0.0, t_detect=0.0)
    inc.t_decide = inc.t_torn = 0.1
    inc.interrupt(1.0, "replace")
    inc.t_decide = inc.t_torn = inc.t_assigned = inc.t_pg = inc.t_restored = 1.1
    inc.interrupt(2.0, "first_step")
    _recovered(inc, 2.0)
    assert set(inc.phases()) == set(PHASES)
    assert inc.phases()["first_step"] == pytest.approx(0.9 + 0.1)
    assert sum(inc.phases().values()) == pytest.approx(inc.mttr) == pytest.approx(2.5)


def test_cpp_stack_traces_stay_off_the_console():
    lines = [
        "[W1123 14:51:30.545613850 TCPStore.cpp:138] [c10d] recvValueWithTimeout failed on ...",
        "Exception raised from recvBytes at /x/Utils.hpp:787 (most recent call first):",
        "frame #0: c10::Error::Error(...) + 0x98 (0x7f in libc10.so)",
        "frame #1: <unknown function> + 0x5 (0x7f in libtorch_cpu.so)",
        "<omitting python frames>",
        "frame #9: _start + 0x21 (0x5 in python3)",
        "",
        "step 3 loss 0.5",
        "Exception raised from run at /y/z.cpp:1 (most recent call first):",
        "frame #0: f()",
        "after",
    ]
    f = ConsoleFilter("worker-3.log")
    shown = [s for s in (f.show(x) for x in lines) if s is not None]
    assert shown == ["step 3 loss 0.5", "(C++ stack trace in logs/worker-3.log)", "after"]

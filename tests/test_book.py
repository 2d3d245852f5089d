"""The incidents as measured (controller/book.py): when an incident starts."""

from __future__ import annotations

from nonstop.controller.book import IncidentBook as Book
from nonstop.decide.faults import Fault


class _Log:
    def __init__(self):
        self.records = []

    def write(self, *what, **fields):
        self.records.append((what, fields))


class _Display:
    def info(self, text):
        pass


def test_an_incident_starts_at_the_injection_that_caused_it_and_no_older_one():
    book = Book(_Log(), _Display())
    book.injected(100.0, "crash")
    book.fault(Fault("crash", rank=1, message="killed"), now=100.2, gen=0, max_step=10)
    assert book.open.t_fault == 100.0  # measured from the moment it fired
    book.injected(100.3, "crash")  # a second fault inside this recovery: part of it
    book.close(t_first=101.0, resume_step=10, steps_known=True)
    # 27 s later, a NaN: it starts when it was found, not at the stale injection above
    book.injected(127.0, "corrupt")  # a snapshot corrupted: found at a restore, if ever
    book.retry_opened(step=960, now=128.0, gen=1, max_step=960)
    assert book.open.t_fault == 128.0


def test_an_incidents_headline_is_its_cause_and_no_library_source_path():
    from nonstop.controller.book import IncidentBook, short
    from nonstop.decide.ladder import Fault

    assert short("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
                 "pair.cc:553] Connection closed by peer [127.0.0.1]:29500") == \
        "RuntimeError: Connection closed by peer [127.0.0.1]:29500"

    class _Log:
        def write(self, *a, **k):
            return {}

    class _Display:
        def info(self, *a):
            pass

    book = IncidentBook(_Log(), _Display())
    book.fault(Fault("hang", message="no step completed for 1.00 s"), 10.0, 0, 50)
    book.fault(Fault("node_lost", node=1, message="its lease expired"), 12.0, 0, 50)
    assert book.open.faults[0].startswith("node 1: node_lost")  # the cause leads


def test_an_incident_closed_before_the_first_step_says_its_steps_lost_once_a_step_shows_them():
    """A crash before any step: the console said "steps lost: unknown" while the summary, which
    learned later that the function iterates ctx.steps, said 0. It is said once it is known."""
    said = []

    class _Shown:
        def info(self, text):
            said.append(text)

    book = Book(_Log(), _Shown())
    book.fault(Fault("crash", rank=1, message="killed"), now=10.0, gen=0, max_step=0)
    book.close(t_first=10.3, resume_step=0, steps_known=False, undecided=True)
    assert "unknown" not in said[-1] and "counted at its first step" in said[-1]
    book.steps_decided(True)
    assert said[-1] == "incident 1: steps lost: 0"
    assert book.closed[0].steps_lost == 0
    book.steps_decided(True)  # said once
    assert said[-1] == "incident 1: steps lost: 0" and len(said) == 3
    # a run whose function turns out not to iterate ctx.steps: unknown, as it is
    book.fault(Fault("crash", rank=1, message="killed"), now=20.0, gen=1, max_step=0)
    book.close(t_first=20.3, resume_step=0, steps_known=False, undecided=True)
    book.steps_decided(False)
    assert said[-1] == "incident 2: steps lost: unknown"

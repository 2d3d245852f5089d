"""What the end of a process means (controller/exits.py), with no process: the controller's
collaborator is given the job's facts and says what to do, as a record."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import pytest

from nonstop.agent.agent import Proc
from nonstop.controller import machine as mc
from nonstop.controller.exits import NOTHING, Exited, ProcessExits
from nonstop.controller.facts import JobNow
from nonstop.controller.phase import Phase
from nonstop.controller.workers import Worker
from nonstop.decide.ladder import Counters
from nonstop.protocol import events
from nonstop.protocol.last_step import LastStep


@dataclasses.dataclass
class Handle:
    node: int
    killed: bool = False


class FakeMemory:
    def __init__(self, keepers=None):
        self.keepers = keepers or {}  # wid -> Handle
        self.configured = []

    def node_of_wid(self, wid):
        h = self.keepers.get(wid)
        return None if h is None else h.node

    def on_exit(self, wid, code):
        return self.keepers.get(wid)

    def configure(self, node_of, usable):
        self.configured.append((dict(node_of), list(usable)))


class FakeGens:
    def __init__(self):
        self.spares_lost, self.waits = [], []

    def spare_lost(self, w, code):
        self.spares_lost.append((w.wid, code))

    def spares_wait(self, report):
        self.waits.append(report)

    def node_of(self):
        return {0: 0, 1: 1}


class Recorder:
    def __init__(self):
        self.lines = []

    def write(self, kind, **fields):
        self.lines.append((kind, fields))

    def info(self, text):
        self.lines.append(("info", text))

    def take(self, wid, rank, node, last):
        self.lines.append(("progress", wid, rank, node, last.step))


def setup(phase=Phase.RUNNING, gen=3, managed=True, max_step=10, isolated=(), keepers=None):
    workers = {100: Worker(wid=100, spare=False, rank=0, node=0),
               101: Worker(wid=101, spare=False, rank=1, node=1),
               200: Worker(wid=200, spare=True, node=1)}
    plan = {0: 100, 1: 101}
    state = mc.JobState(phase=phase, gen=gen,
                        counters=Counters.from_record({}, set(isolated)))
    mem, gens, rec = FakeMemory(keepers), FakeGens(), Recorder()
    exits = ProcessExits(workers, mem, gens, rec, rec, rec)
    job = JobNow(state=state, plan=MappingProxyType(plan), managed=managed, max_step=max_step,
                 total_nodes=3)
    return exits, job, workers, mem, gens, rec


def report(assigned):
    """A rank's last words: the script failed at its import."""
    return events.Exiting(wid=100, code=1, error="boom", assigned=assigned, import_error=True)


def proc(wid, code, last=None):
    return Proc(wid=wid, popen=None, started=0.0, spare=False, log_path=None,  # type: ignore
                returncode=code, last=last)


def test_a_rank_that_crashes_is_a_fault_and_its_last_step_counts_as_reached():
    exits, job, workers, *_ , rec = setup()
    what = exits.on_exit(proc(101, -9, last=LastStep(step=12, gen=3, t=5.0, busy=None, stall=None)), job)
    assert what.fault is not None and what.fault.kind == "crash" and what.fault.rank == 1
    assert what.reached == 12
    assert workers[101].dead
    assert ("progress", 101, 1, 1, 12) in rec.lines


def test_an_exit_nonstop_caused_is_no_fault():
    exits, job, workers, *_ = setup()
    workers[100].killed = True
    assert exits.on_exit(proc(100, -9), job) == NOTHING


def test_a_rank_no_longer_in_the_plan_is_no_fault():
    exits, job, workers, *_ = setup()
    workers[100].rank = 5  # replaced: another process holds its old rank
    assert exits.on_exit(proc(100, 1), job).fault is None


def test_a_spare_that_dies_is_replaced_not_a_fault():
    exits, job, _, _, gens, _ = setup()
    what = exits.on_exit(proc(200, -9), job)
    assert what == Exited(refill_spares=True) and gens.spares_lost == [(200, -9)]


def test_a_spare_that_dies_while_the_job_ends_is_left_alone():
    exits, job, _, _, gens, _ = setup(phase=Phase.OVER)
    assert exits.on_exit(proc(200, -9), job) == NOTHING and gens.spares_lost == []


def test_a_rank_failing_after_training_completed_gives_a_diagnosis_not_a_fault():
    exits, job, *_ = setup(phase=Phase.FINISHING)
    what = exits.on_exit(proc(100, 3), job)
    assert what.fault is None and "rank 0 exited with code 3 after training" in what.diagnosis
    assert exits.on_exit(proc(101, 0), job).diagnosis is None


def test_a_plain_script_completes_when_every_rank_exited_0():
    exits, job, workers, *_ = setup(managed=False)
    assert exits.on_exit(proc(100, 0), job).complete_at is None  # rank 1 still runs
    assert workers[100].done == 3
    assert exits.on_exit(proc(101, 0), job).complete_at is not None


def test_an_import_error_before_any_step_is_the_scripts_and_not_retried():
    exits, job, workers, _, gens, _ = setup(max_step=0)
    workers[100].exit_report = report(assigned=True)
    assert exits.on_exit(proc(100, 1), job).fault.kind == "import_error"
    exits, job, workers, _, gens, _ = setup(max_step=0)
    # its last step, read by its agent, says the job got past the start: a retry may help
    workers[100].exit_report = report(assigned=True)
    assert exits.on_exit(proc(100, 1, last=LastStep(step=4, gen=3, t=5.0, busy=None, stall=None)), job).fault.kind == "exception"
    exits, job, workers, _, gens, _ = setup(max_step=0)
    workers[100].exit_report = report(assigned=False)
    exits.on_exit(proc(100, 1), job)
    assert gens.waits  # a spare that ran the script without its rank: the spares wait


def test_a_keepers_exit_reconfigures_the_memory_unless_its_node_is_leaving():
    exits, job, _, mem, _, rec = setup(keepers={300: Handle(node=1)})
    assert exits.on_exit(proc(300, -9), job) == NOTHING
    assert mem.configured == [({0: 0, 1: 1}, [0, 1, 2])]
    assert any(k == "info" and "node 1" in f for k, f in rec.lines)
    exits, job, _, mem, _, _ = setup(keepers={300: Handle(node=1)}, isolated={1})
    exits.on_exit(proc(300, -9), job)
    assert mem.configured == []
    exits, job, _, mem, _, _ = setup(keepers={300: Handle(node=1)})
    exits.on_exit(proc(300, -9), dataclasses.replace(job, leaving={1}))
    assert mem.configured == []


def test_an_unknown_process_is_logged_only():
    exits, job, *_, rec = setup()
    assert exits.on_exit(proc(999, 1), job) == NOTHING
    assert rec.lines == [("exit", {"wid": 999, "code": 1, "unknown": True})]


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(Exited)])
def test_every_order_of_an_exit_is_carried_out_by_the_controller(field):
    """Each field of ``Exited`` is read by the controller (a new order nobody reads would be
    silently dropped)."""
    import inspect

    from nonstop.controller.controller import Controller

    assert f"what.{field}" in inspect.getsource(Controller._on_exit)

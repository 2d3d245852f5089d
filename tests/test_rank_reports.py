"""What the ranks report, and what it means for the job (controller/worker_events.py), with no
process: typed events in, orders out, the controller's collaborators real where they hold no
process (the ledger, the incident book, the replicas' comparisons and their judge, the watchers)."""

from __future__ import annotations

import dataclasses
import inspect
from types import MappingProxyType

import pytest

from nonstop.controller import machine as mc
from nonstop.controller import worker_events as reports
from nonstop.controller.book import IncidentBook
from nonstop.controller.controller import Controller
from nonstop.controller.facts import JobNow
from nonstop.controller.ledger import SdcBook, TrainingLedger
from nonstop.controller.phase import Phase
from nonstop.controller.watchers import Watchers
from nonstop.controller.workers import WorkerTable
from nonstop.decide.sdc import Judge
from nonstop.observe.progress import ProgressLog
from nonstop.policy import Policy
from nonstop.protocol import events, progress

GEN = 2
PLAN = {0: 100, 1: 101, 2: 102}  # rank -> wid; wids 100 and 101 on node 0, 102 on node 1


class Recorder:
    """The event log and the display: what they were told."""

    def __init__(self):
        self.lines = []

    def write(self, kind, **fields):
        self.lines.append((kind, fields))

    def warning(self, text):
        self.lines.append(("warning", text))

    def info(self, text):
        self.lines.append(("info", text))

    def __getattr__(self, name):  # anything else the book says (incident lines, status)
        return lambda *a, **k: self.lines.append((name, a))


class FakeAgent:
    def __init__(self):
        self.signalled = []
        self._wid = 500

    def new_wid(self):
        self._wid += 1
        return self._wid

    def signal(self, wid, sig=None):
        self.signalled.append(wid)


class FakeGens:
    def __init__(self):
        self.claimed, self.trained_world, self.not_after = {}, None, None

    def node_of(self):
        return {0: 0, 1: 0, 2: 1}


class FakeMemory:
    sharded = None


def make(incident=False, phase=Phase.RUNNING, plan=PLAN):
    rec, agent = Recorder(), FakeAgent()
    table = WorkerTable(agent, None, rec, "script")
    for rank, wid in plan.items():
        w = table.new(spare=False, node=0 if rank < 2 else 1)
        table.workers[wid] = table.workers.pop(w.wid)
        table.workers[wid].wid, table.workers[wid].rank = wid, rank
    book = IncidentBook(rec, rec)
    r = reports.RankReports(
        table=table, ledger=TrainingLedger(True), book=book, gens=FakeGens(),
        memory=FakeMemory(), sdc=SdcBook(), sdc_judge=Judge(),
        watchers=Watchers(Policy(), rec, rec), progress=ProgressLog(None), agent=agent,
        log=rec, display=rec)
    inc = book.begin(1.0, GEN - 1, 10) if incident else None
    job = JobNow(state=mc.JobState(phase=phase, gen=GEN), plan=MappingProxyType(plan),
                 managed=True, max_step=10, total_nodes=2, incident=inc)
    return r, job, table, rec, agent


def entered(rank, **kw):
    return events.EnteredGeneration(wid=PLAN[rank], t=5.0, gen=GEN, rank=rank, step=10,
                                    t_assigned=4.0, **kw)


def left(rank, reason, **kw):
    return events.LeftGeneration(wid=PLAN[rank], t=6.0, gen=GEN, rank=rank, step=12, dirty=False,
                                 reason=reason, t_caught=6.0, **kw)


def done(rank):
    return events.Done(wid=PLAN[rank], t=9.0, gen=GEN, rank=rank, step=20, busy=1.0, unfired=[],
                       steps=True, sdc=None, final_persist=None)


def test_the_generation_forms_once_every_rank_has_entered_it_judged_after_the_run():
    r, job, *_ = make(phase=Phase.RENDEZVOUS)
    for rank in (0, 1):
        assert r.on_event(entered(rank), job) == []
    assert r.take_run() == (True, False)
    assert r.entries(job) == []  # rank 2 has not entered
    r.on_event(entered(2), job)
    assert not r.ends_run(events.FirstStep(wid=100, gen=GEN, rank=0, step=11))
    assert r.ends_run(events.NanFound(wid=100, gen=GEN, rank=0, step=11, output="nan")) is True
    assert r.take_run() == (True, False)
    assert r.entries(job) == [mc.Entered()]
    assert r.last_entered.rank == 2


def test_an_event_about_an_older_generation_or_another_process_is_passed_over():
    r, job, table, *_ = make()
    old = dataclasses.replace(left(0, "exception", error="boom"), gen=GEN - 1)
    assert r.on_event(old, job) == []
    assert r.on_event(dataclasses.replace(left(0, "exception"), wid=101), job) == []
    assert r.on_event(dataclasses.replace(left(0, "exception"), wid=999), job) == []
    assert table.workers[100].left == -1


def test_a_rank_that_left_on_its_own_exception_is_a_fault_after_its_step_counts():
    r, job, table, *_ = make()
    orders = r.on_event(left(1, "exception", error="boom", traceback="tb"), job)
    assert orders[0] == reports.Reached(12, before_fault=True)
    assert isinstance(orders[1], reports.Faulted)
    f = orders[1].fault
    assert (f.kind, f.rank, f.message, f.traceback) == ("exception", 1, "boom", "tb")
    assert table.workers[101].left == GEN


def test_a_rank_leaving_an_active_generation_for_a_peer_is_a_peer_fault_not_when_it_forms():
    r, job, *_ = make()
    orders = r.on_event(left(0, "abort"), job)
    assert [o.fault.kind for o in orders if isinstance(o, reports.Faulted)] == ["peer"]
    r, job, *_ = make(phase=Phase.TEARING_DOWN)
    orders = r.on_event(left(0, "abort", t_pg=5.5), job)
    assert not any(isinstance(o, reports.Faulted) for o in orders)
    assert orders[-1] == reports.GroupFormed(5.5)  # after any fault it raised


def test_a_nan_asks_the_machine_for_a_retry():
    r, job, *_ = make()
    ev = events.NanFound(wid=100, t=5.0, gen=GEN, rank=0, step=11, output="nan")
    assert r.on_event(ev, job) == [mc.RetryAsked()]


def test_training_completes_when_every_rank_is_done_and_an_open_incident_closes_first():
    r, job, *_ = make(incident=True)
    assert r.on_event(done(0), job) == [reports.Reached(20)]
    assert r.on_event(done(1), job) == [reports.Reached(20)]
    assert r.on_event(done(2), job) == [reports.Reached(20), reports.CloseIncident(9.0, 20),
                                         reports.Complete(9.0)]


def test_the_first_steps_of_every_rank_close_the_incident_at_its_resume_step():
    r, job, table, *_ = make(incident=True)
    job.incident.resume_step = 10
    for rank in PLAN:
        ev = events.FirstStep(wid=PLAN[rank], t=7.0 + rank, gen=GEN, rank=rank, step=11)
        assert r.on_event(ev, job) == [reports.Reached(11)]
    assert r.take_run() == (False, True)
    # nothing carried out for the incident yet (a NaN some ranks reported, the first steps
    # replayed to a controller taking over): they show no recovery, it stays open
    assert r.first_steps(job) == []
    job.incident.levels.append("step retry")
    assert r.first_steps(job) == [reports.CloseIncident(9.0, 10)]
    # with no incident open, the job has grown: the book says so, nothing to close
    r, job, table, rec, _ = make()
    for rank in PLAN:
        r.on_event(events.FirstStep(wid=PLAN[rank], t=7.0, gen=GEN, rank=rank, step=11), job)
    assert r.first_steps(job) == [] and r.gens.trained_world == 3


def test_an_injected_node_crash_takes_the_rest_of_its_node_with_it():
    r, job, table, _, agent = make()
    ev = events.FaultFired(wid=100, t=5.0, fault="node_crash:rank=0,step=5", kind="node_crash",
                           rank=0, step=5, gen=GEN, pid=1, index=0)
    assert r.on_event(ev, job) == []
    # the rest of node 0; rank 2 (node 1) lives; rank 0 kills the node's memory, then itself
    # (killed here first, it would leave the memory alive: the node not lost whole)
    assert agent.signalled == [101]
    assert table.workers[100].dead and table.workers[101].dead and not table.workers[102].dead
    assert r.gens.claimed == {"0": 1}  # fired once in the job


def test_silent_corruption_found_at_a_restore_is_told_by_its_cause_not_its_text():
    r, job, _, rec, _ = make(phase=Phase.RENDEZVOUS)
    text_only = events.SkippedCopy(cause="bad_copy", source="memory", rank=1, step=10,
                                   why="its parameters differ (sdc)")
    r.on_event(entered(0, skipped=[text_only]), job)
    assert r.sdc.found == []
    sdc = events.SkippedCopy(cause="sdc", source="live", rank=1, step=10, why="differs")
    assert r.on_event(entered(1, skipped=[sdc]), job) == []  # one replica: a corruption
    assert r.sdc.found and any(k == "warning" and "rank(s) [1]" in str(v) for k, v in rec.lines)


def test_a_sharded_jobs_mismatch_puts_only_the_ranks_at_odds_with_their_twins_to_the_replay():
    """HSDP 2 x 2 (or a pipeline of 2 data-parallel groups x 2 stages): digests [A, B, A, C],
    ranks 0 and 2 holding one part and agreeing, ranks 1 and 3 the other and differing. The pair
    is suspect, not ranks 0 and 2; judged across the world (no ``twins``), all four were. No
    rank is replaced before the replay: one fault names none, every rank rolls back."""
    plan = {0: 100, 1: 101, 2: 102, 3: 103}
    for twins, suspects in (([0, 1, 0, 1], (1, 3)), (None, (0, 1, 2, 3))):
        r, job, *_ = make(plan=plan)
        ev = events.LeftGeneration(wid=100, t=6.0, gen=GEN, rank=0, step=32, dirty=False,
                                   reason="sdc", t_caught=6.0, sdc_step=32, suspects=[1, 3],
                                   digests=[10, 21, 10, 20], twins=twins)
        (fault,) = [o.fault for o in r.on_event(ev, job) if isinstance(o, reports.Faulted)]
        assert fault.kind == "sdc" and fault.rank is None and "rank(s) 1, 3" in fault.message
        assert r.sdc_judge.candidates(32) == suspects  # what the replay orders
        assert r.gens.not_after == 31  # every rank back to a snapshot before the mismatch


def _evidence(*parts):
    """Each rank's evidence: (rank, step, point) - step None: its passes agree throughout."""
    return [events.ReplayEvidence(rank=rank, compared=9) if step is None else
            events.ReplayEvidence(rank=rank, compared=9, step=step, point=point, first=1,
                                  second=2) for rank, step, point in parts]


def test_two_replicas_roll_back_in_place_and_the_replay_names_the_rank_whose_passes_part_first():
    """DDP, two replicas, rank 1's bit flipped at step 12, found at 18: neither is replaced, both
    go back; the replay agrees and rank 1's outputs parted at step 12, rank 0's at 13 - rank 1
    is named (transient), logged with the evidence, and counted against its node (node 0); a
    new process for nobody."""
    plan = {0: 100, 1: 101}
    r, job, _, rec, _ = make(plan=plan)
    ev = events.LeftGeneration(wid=100, t=6.0, gen=GEN, rank=0, step=18, dirty=False,
                               reason="sdc", t_caught=6.0, sdc_step=18, suspects=[0, 1],
                               digests=[7, 8])
    (fault,) = [o.fault for o in r.on_event(ev, job) if isinstance(o, reports.Faulted)]
    assert fault.rank is None and r.gens.not_after == 17
    replayed = events.SdcReplayed(wid=100, t=9.0, gen=GEN, rank=0, step=18, digests=[5, 5],
                                  evidence=_evidence((0, 13, "output"), (1, 12, "output")))
    (order,) = r.on_event(replayed, job)
    assert order == mc.Attributed(dataclasses.replace(order.fault, kind="sdc", rank=1))
    (logged,) = [f for k, f in rec.lines if k == "sdc_attributed"]
    assert (logged["verdict"], logged["rank"], logged["node"]) == ("transient", 1, 0)
    assert logged["at"] == {"step": 12, "point": "output"}
    assert logged["original"] == {"0": 7, "1": 8} and logged["replayed"] == {"0": 5, "1": 5}
    assert [e["rank"] for e in logged["evidence"]] == [0, 1]
    assert r.sdc.found[-1]["attributed"] == 1


def test_a_replay_that_differs_again_with_one_rank_first_replaces_that_rank_only():
    plan = {0: 100, 1: 101}
    r, job, _, rec, _ = make(plan=plan)
    first = events.LeftGeneration(wid=100, t=6.0, gen=GEN, rank=0, step=18, dirty=False,
                                  reason="sdc", t_caught=6.0, sdc_step=18, suspects=[0, 1],
                                  digests=[7, 8])
    r.on_event(first, job)
    job = dataclasses.replace(job, state=dataclasses.replace(job.state, gen=GEN + 1))
    again = dataclasses.replace(first, gen=GEN + 1, digests=[7, 9], sdc_evidence=_evidence(
        (0, 15, "end"), (1, 15, "output")))
    (fault,) = [o.fault for o in r.on_event(again, job) if isinstance(o, reports.Faulted)]
    assert (fault.kind, fault.rank) == ("sdc", 1) and "differs again" in fault.message
    assert r.gens.not_after == 17
    (logged,) = [f for k, f in rec.lines if k == "sdc_attributed"]
    assert logged["verdict"] == "persistent" and logged["rank"] == 1
    # the replay came out as the first pass did on every rank: the replicas diverge
    r, job, *_ = make(plan=plan)
    r.on_event(first, job)
    job = dataclasses.replace(job, state=dataclasses.replace(job.state, gen=GEN + 1))
    same = dataclasses.replace(first, gen=GEN + 1, sdc_evidence=_evidence((0, None, None),
                                                                          (1, None, None)))
    (order,) = [o for o in r.on_event(same, job) if isinstance(o, reports.GiveUp)]
    assert isinstance(order, reports.GiveUp) and "diverge" in order.decision.diagnosis


def test_a_replay_check_with_no_two_passes_alike_names_a_rank_or_stops_the_job():
    """A replay check of the policy's (plain FSDP, no twin): three passes over a step, no two
    alike on every rank. Rank 1's parted first: its fault recurs, it gets a new process and every
    rank goes back. Every rank parting at the same point: the step does not replay bit for bit
    - the job stops, no rank blamed."""
    plan = {0: 100, 1: 101}
    r, job, *_ = make(plan=plan)
    ev = events.LeftGeneration(wid=100, t=6.0, gen=GEN, rank=0, step=12, dirty=False,
                               reason="sdc", t_caught=6.0, sdc_step=12, suspects=[1],
                               digests=[3, 4], sdc_scheduled=True,
                               sdc_evidence=_evidence((0, 11, "output"), (1, 11, "start")))
    (fault,) = [o.fault for o in r.on_event(ev, job) if isinstance(o, reports.Faulted)]
    assert fault.rank == 1 and r.gens.not_after == 11
    r, job, *_ = make(plan=plan)
    tie = dataclasses.replace(ev, sdc_evidence=_evidence((0, 11, "output"), (1, 11, "output")))
    (order,) = [o for o in r.on_event(tie, job) if isinstance(o, reports.GiveUp)]
    assert isinstance(order, reports.GiveUp) and "does not replay bit for bit" in \
        order.decision.diagnosis


def test_a_mismatch_found_at_a_restore_is_judged_within_each_twin_group():
    """At a restore each odd copy carries the digests of its own twin group (the ranks holding
    its part, at its step): HSDP 3 x 2 with rank 1's live shard odd among shard 1's, and rank
    2's among shard 0's - each group judged on its own, both a corruption, none a divergence
    (the copies' digests side by side look like camps of agreeing twins)."""
    r, job, _, rec, _ = make(phase=Phase.RENDEZVOUS)
    odd = [events.SkippedCopy(cause="sdc", source="live", rank=1, step=12, why="differs",
                              digests={"1": 21, "3": 20, "5": 20}),
           events.SkippedCopy(cause="sdc", source="live", rank=2, step=12, why="differs",
                              digests={"0": 10, "2": 11, "4": 10})]
    assert r.on_event(entered(0, skipped=odd), job) == []  # no divergence: nothing to stop
    assert [(f["suspects"], f["verdict"]) for f in r.sdc.found] == [([1, 2], "corruption")]
    assert r.sdc_judge.pending == (12, (1, 2))


def test_injected_faults_that_cannot_fire_give_up_as_a_usage_error():
    r, job, *_ = make()
    ev = events.NoSteps(wid=100, t=5.0, gen=GEN, rank=0, via="returned", registered=True,
                        function="train", faults=["crash:rank=0,step=30"])
    (order,) = r.on_event(ev, job)
    assert isinstance(order, reports.GiveUp) and order.decision.usage_error
    r, job, *_ = make()
    assert r.on_event(ev, dataclasses.replace(job, over=True)) == []  # already ending


def _progress(step):
    return progress.encode(progress.Progress(
        hb=8.0, pid=1, where="python", loc="x.py:1 in f", same_s=0.0, paused=None,
        max_step_s=0.1, compute_s=None, gen=GEN, rank=0, step=step, t=8.0, loss=0.5))


def test_progress_reaches_the_newest_step():
    r, job, table, *_ = make()

    class Mail:
        def progress(self, wids):
            return {100: _progress(15), 102: _progress(14), 101: {"gen": GEN, "step": "x"}}

    table.mail = Mail()
    assert r.read_progress(job) == [reports.Reached(15)]
    assert table.workers[100].step == 15
    # a record that is not one is refused and said once, the others taken
    assert table.workers[101].step is None and "a progress record was refused" in table.refused[0]


def test_progress_is_read_a_share_at_a_time_every_rank_in_turn():
    """A share of the ranks' progress at each turn (a controller of 16,384 ranks): the shares
    follow one another round the plan, so each rank is read once before any is read twice."""
    r, job, table, *_ = make()
    asked: list[list[int]] = []

    class Mail:
        def progress(self, wids):
            asked.append(list(wids))
            return {w: _progress(10 + i) for i, w in enumerate(wids)}

    table.mail = Mail()
    wids = list(PLAN.values())
    for _ in range(len(wids)):
        r.read_progress(job, share=0.2)  # (at least one rank a turn)
    assert [w for a in asked for w in a] == wids
    asked.clear()
    r.read_progress(job, share=0.5)
    r.read_progress(job)  # a whole period: every rank
    assert asked[0] == wids[:2] and asked[1] == wids


@pytest.mark.parametrize("order", [o.__name__ for o in reports.Order.__args__])
def test_every_order_has_its_case_in_the_controller(order):
    source = inspect.getsource(Controller._carry_out_orders)
    assert f"case reports.{order}(" in source or f"mc.{order}()" in source

"""What a rank reports to the controller, typed (protocol/events.py): every type goes through its
encoding and back unchanged, and the controller's reading refuses anything else - an unknown
type, a field missing, unknown or of the wrong type, nested records included - where it reads."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from nonstop.controller.workers import Worker, WorkerTable
from nonstop.protocol.cuda import CudaFault
from nonstop.observe import event_types
from nonstop.observe.events import EventLog
from nonstop.protocol import events
from nonstop.protocol.hosts import shift_times
from nonstop.protocol.records import BadRecord, Reader

CHECKS = events.DigestChecks(checks=3, first_step=10, last_step=30, chain="ab12", cost_s=0.002,
                             certified=30, certified_t=1700000000.5, replays=2, replay_s=0.04,
                             stepped_s=1.5)
OOM = CudaFault("cuda_oom", "cudaErrorMemoryAllocation", "CUDA out of memory")

# one of each type, every field given a value of its own (None only where nothing else fits)
SAMPLES: list[events.RankEvent] = [
    events.Started(wid=1, t=1.0, pid=100),
    events.Ready(wid=1, t=1.0, pid=100, mode="import", warm_s=0.5),
    events.Wrapped(wid=1, t=1.0, pid=100),
    events.Joining(wid=1, t=1.0, gen=2, rank=0),
    events.EnteredGeneration(
        wid=1, t=2.0, gen=2, rank=0, step=14, t_assigned=1.5, source="memory", holder=1,
        receivers=[0, 2], sources={"0": "memory", "1": "live"}, nbytes=4096, restore_s=0.01,
        restore_phases={"offer": 0.001, "move": 0.009}, sharded=False, nccl=True,
        agreement="reduction", t_pg=1.7,
        t_restored=1.9, fds=30, threads=12, rss_mb=512.5, skipped=[
            events.SkippedCopy(cause="sdc", source="live", rank=1, step=18,
                               why="its parameters differ from its replicas'",
                               digests={"0": 7, "1": 8, "2": 7}),
            events.SkippedCopy(cause="bad_copy", source="buddy", rank=2, step=14, why="checksum",
                               offered_by=0),
            events.SkippedCopy(cause="memory_unreachable", source="memory", rank=0, step=None,
                               why="ConnectionRefusedError"),
            events.SkippedCopy(cause="bad_copy", source="disk", rank=None, step=10,
                               why="broken", shard=3, holder=1)]),
    events.EnteredGeneration(wid=1, t=2.0, gen=0, rank=3, step=None, t_assigned=1.5, plain=True),
    events.FirstStep(wid=1, t=3.0, gen=2, rank=0, step=15),
    events.FirstStep(wid=1, t=3.0, gen=2, rank=0, step=15, steps=False, via="optimizer"),
    events.LeftGeneration(wid=1, t=4.0, gen=2, rank=0, step=17, dirty=True, reason="sdc",
                          t_caught=3.9, phase="train", error="SilentCorruption: ...",
                          destroy_s=0.05, collected=12, sockets_shut=4, sdc_step=18,
                          suspects=[1], digests=[7, 8, 7], sdc=CHECKS, twins=[0, 0, 0],
                          sdc_scheduled=True, sdc_evidence=[
                              events.ReplayEvidence(rank=1, compared=12, step=15, point="output",
                                                    first=3, second=4)]),
    events.LeftGeneration(wid=1, t=4.0, gen=2, rank=0, step=17, dirty=False,
                          reason="cuda_oom", t_caught=3.9, phase="restore", t_pg=3.5,
                          traceback="Traceback ...", cuda=OOM),
    events.Done(wid=1, t=5.0, gen=2, rank=0, step=100, busy=12.5, unfired=["crash:rank=0,step=200"],
                steps=True, sdc=CHECKS, final_persist=100),
    events.NanFound(wid=1, t=5.0, gen=2, rank=0, step=7, output="nan"),
    events.NanFound(wid=1, t=5.0, gen=2, rank=0, step=7, output=1.0),
    events.LossRuleFired(wid=1, t=5.0, gen=2, rank=0, step=7, rule="spike", action="restart",
                         loss="inf"),
    events.NoSteps(wid=1, t=5.0, gen=2, rank=0, via="returned", registered=True, function="train",
                   faults=["crash:rank=0,step=3"]),
    events.StateNotKept(wid=1, t=5.0, gen=0, rank=1, function="train",
                        names=["model", "optimizer"]),
    events.FaultFired(wid=1, t=5.0, fault="crash:rank=0,step=3", kind="crash", rank=0, step=3,
                      gen=2, pid=100, index=0),
    events.Exiting(wid=1, t=6.0, code=86, error="AcceleratorError: ...", assigned=True,
                   traceback="Traceback ...", import_error=False, abort_hung=False,
                   collective=False, cuda=CudaFault("cuda_assert", "cudaErrorAssert", "assert"),
                   gen=2, rank=0, phase="train", step=9),
    events.SnapshotInterval(wid=1, t=6.0, gen=2, step=10, every=5, cost_s=0.01, step_s=0.2,
                            repl_s=0.02, last=10, taken=2, spent_s=0.03, error="slow",
                            staged=False, write_s=0.05, skipped=0),
    events.SnapshotFailed(wid=1, t=6.0, gen=2, rank=0, step=10, error="the memory is gone"),
    events.GroupKept(wid=1, t=6.0, gen=1, times=2),
    events.BitFlipped(wid=1, t=6.0, gen=2, rank=1, step=16, where="fc.weight[3] bit 7"),
    events.SdcMismatch(wid=1, t=6.0, gen=2, rank=0, step=20, suspects=[1], digests=[7, 8, 7]),
    events.SdcReplayed(wid=1, t=6.0, gen=3, rank=0, step=20, digests=[9, 9], scheduled=True,
                       struck=1, evidence=[
                           events.ReplayEvidence(rank=0, compared=3, step=19, point="end",
                                                 first=7, second=9),
                           events.ReplayEvidence(rank=1, compared=3, step=19, point="start",
                                                 first=-8, second=9),
                           events.ReplayEvidence(rank=2, compared=0)]),
    events.Prewarmed(wid=5, t=4.0, records=3, decided=83, took_s=0.33,
                     refused=["a record of torch 1.0.0, not 2.13.0"]),
]
WRONG = [["x"]]  # a value no field of any record holds (a list of lists of strings)


def _over_json(raw: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(raw))  # as it crosses the store: JSON text


def test_every_type_has_a_sample_and_each_goes_through_json_and_back_unchanged():
    assert {type(ev) for ev in SAMPLES} == set(events.KINDS.values())
    for ev in SAMPLES:
        raw = events.encode(ev)
        assert raw["type"] == ev.type and raw["t"] == ev.t and raw["wid"] == ev.wid
        assert "replay" not in raw  # said only when set
        assert events.decode(_over_json(raw)) == ev


@pytest.mark.parametrize("ev", SAMPLES, ids=lambda ev: ev.type)
def test_a_field_missing_unknown_or_of_the_wrong_type_is_refused(ev):
    raw = _over_json(events.encode(ev))
    defaults = {f.name for f in dataclasses.fields(ev)
                if f.default is not dataclasses.MISSING
                or f.default_factory is not dataclasses.MISSING}
    for name in raw:
        if name == "type":
            continue
        if name in defaults:  # left out, a field takes its default (encode leaves it out so)
            back = events.decode({k: v for k, v in raw.items() if k != name})
            assert getattr(back, name) == dataclasses.replace(
                ev, **{name: type(ev).__dataclass_fields__[name].default
                       if type(ev).__dataclass_fields__[name].default is not dataclasses.MISSING
                       else type(ev).__dataclass_fields__[name].default_factory()}
            ).__getattribute__(name)
            continue
        with pytest.raises(events.BadEvent, match=f"field '{name}' is missing"):
            events.decode({k: v for k, v in raw.items() if k != name})
        with pytest.raises(events.BadEvent, match=f"{ev.type}.{name}"):
            events.decode({**raw, name: WRONG})
    with pytest.raises(events.BadEvent, match=r"unknown field\(s\) \['extra'\]"):
        events.decode({**raw, "extra": 1})


def test_an_unknown_type_or_no_object_at_all_is_refused():
    for raw, said in [({"type": "entred", "wid": 1, "t": 1.0}, "unknown rank event 'entred'"),
                      ({"wid": 1, "t": 1.0}, "unknown rank event None"),
                      ({"type": ["entered"]}, "unknown rank event"),
                      ([1, 2], "unknown rank event"), ("entered", "unknown rank event")]:
        with pytest.raises(events.BadEvent, match=said):
            events.decode(raw)


def test_numbers_are_told_apart_from_truth_values_and_text():
    raw = _over_json(events.encode(SAMPLES[3]))  # joining: gen, rank
    for bad in (True, 2.0, "2", None):
        with pytest.raises(events.BadEvent, match="joining.gen"):
            events.decode({**raw, "gen": bad})
    done = _over_json(events.encode(next(e for e in SAMPLES if isinstance(e, events.Done))))
    assert events.decode({**done, "busy": 12}).busy == 12  # a float may come as an int
    with pytest.raises(events.BadEvent, match="done.busy"):
        events.decode({**done, "busy": False})


def test_nested_records_are_refused_as_strictly_with_the_path_to_the_fault():
    entered = _over_json(events.encode(SAMPLES[4]))
    sdc = dict(entered["skipped"][0])
    for skipped, said in [
            ({**sdc, "cause": "its parameters differ (sdc)"}, r"skipped\[0\].cause"),
            ({k: v for k, v in sdc.items() if k != "cause"}, "field 'cause' is missing"),
            ({**sdc, "source": "tape"}, r"skipped\[0\].source"),
            ({**sdc, "digests": {"0": "7"}}, r"skipped\[0\].digests\['0'\]"),
            ({**sdc, "note": "x"}, r"unknown field\(s\) \['note'\]")]:
        with pytest.raises(events.BadEvent, match=said):
            events.decode({**entered, "skipped": [skipped]})
    left = _over_json(events.encode(SAMPLES[9]))  # cuda_oom
    with pytest.raises(events.BadEvent, match="unknown CUDA fault kind 'cuda_oops'"):
        events.decode({**left, "cuda": {**left["cuda"], "kind": "cuda_oops"}})
    done = _over_json(events.encode(next(e for e in SAMPLES if isinstance(e, events.Done))))
    with pytest.raises(events.BadEvent, match="done.sdc: field 'chain' is missing"):
        events.decode({**done, "sdc": {k: v for k, v in done["sdc"].items() if k != "chain"}})


def test_silent_corruption_at_a_restore_is_told_by_its_cause_not_by_its_words():
    ev = events.decode(_over_json(events.encode(SAMPLES[4])))
    assert [s.rank for s in ev.skipped if s.cause == "sdc"] == [1]
    assert all("sdc" not in s.why for s in ev.skipped)


def test_replay_is_set_by_the_relay_only_and_read_when_present():
    raw = _over_json(events.encode(SAMPLES[0]))
    assert events.decode(raw).replay is False
    assert events.decode({**raw, "replay": True}).replay is True
    with pytest.raises(events.BadEvent, match="hello.replay"):
        events.decode({**raw, "replay": "yes"})


def test_a_relay_across_hosts_moves_the_top_level_times_and_the_record_still_decodes():
    entered = _over_json(events.encode(SAMPLES[4]))
    ev = events.decode(shift_times(entered, 100.0))
    assert (ev.t, ev.t_assigned, ev.t_pg, ev.t_restored) == (102.0, 101.5, 101.7, 101.9)
    left = events.decode(shift_times(_over_json(events.encode(SAMPLES[8])), -1.0))
    assert (left.t, left.t_caught, left.t_pg) == (3.0, 2.9, None)


def test_the_log_and_its_registry_take_the_forwarded_types_from_the_records():
    assert event_types.RANK_FORWARDED == tuple(k for k, c in events.KINDS.items() if c.logged)
    assert {"entered", "left", "done", "exit", "sdc_mismatch"} <= set(event_types.RANK_FORWARDED)
    assert not {"hello", "nan", "loss_rule"} & set(event_types.RANK_FORWARDED)


def test_a_record_field_must_say_what_it_holds():
    @dataclasses.dataclass(frozen=True)
    class Loose:
        anything: Any

    with pytest.raises(TypeError, match="Loose.anything"):
        Reader().record(Loose, {"anything": 1}, "loose")
    with pytest.raises(BadRecord, match="loose: 3 is not an object"):
        Reader().record(events.DigestChecks, 3, "loose")


class _Mail:
    def __init__(self, raws: list[Any]):
        self.raws = raws

    def events(self):
        return iter(self.raws)


def test_the_controller_passes_over_an_event_it_refuses_logs_it_and_says_so_once(tmp_path):
    good = [events.encode(SAMPLES[3]), events.encode(SAMPLES[6]),
            events.encode(dataclasses.replace(SAMPLES[6], wid=5))]  # (5: not a process of ours)
    bad = [{**good[0], "gen": "2"}, {"type": "teleported", "wid": 1, "t": 1.0},
           {**good[1], "wid": 7, "extra": True}, ["not", "an", "object"]]
    log = EventLog(tmp_path)
    table = WorkerTable(agent=None, log=log, spare_mode="script", mail=_Mail(
        [bad[0], good[0], bad[1], bad[2], good[1], bad[3], good[2], {**good[1], "replay": True}]))
    table.workers[1] = Worker(wid=1, spare=False)
    assert list(table.read_events()) == [SAMPLES[3], SAMPLES[6], dataclasses.replace(SAMPLES[6], wid=5),
                                         dataclasses.replace(SAMPLES[6], replay=True)]
    log.close()
    logged = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    # the good ones of its processes logged as they came, a replayed one not again
    assert [(r["type"], r["wid"]) for r in logged] == [
        ("event_refused", 1), ("rank_joining", 1), ("event_refused", 1), ("event_refused", 7),
        ("rank_first_step", 1), ("event_refused", None)]
    assert logged[1] == {**good[0], "type": "rank_joining"}
    assert "joining.gen: '2' is not int" in logged[0]["error"]
    assert logged[2]["event"] == bad[1]  # as it came
    # said once per process (and once for those of no process)
    assert len(table.refused) == 3 and "worker 1" in table.refused[0]
    assert "worker 7" in table.refused[1] and "unknown field(s) ['extra']" in table.refused[1]


@pytest.mark.parametrize("ev", SAMPLES, ids=lambda ev: ev.type)
def test_the_compiled_reader_takes_and_refuses_exactly_what_the_careful_one_does(ev):
    """The reader written out for each record (the path every record takes) against the one
    that checks field by field and says what is wrong: every field left out, added, or given
    each kind of JSON value, the two agree on the record or on refusing it."""
    cls = type(ev)
    opt = events._optional(cls)
    reader = Reader()
    compiled = reader._compile(cls, ("type",), opt)
    raw = _over_json(events.encode(ev))
    values = [None, True, 0, 3, -1, 1.5, "", "sdc", "train", [], [1], ["x"], {}, {"0": 1},
              {"a": "b"}, WRONG]
    cases = [raw, {k: v for k, v in raw.items() if k != "type"}, {**raw, "extra": 1}]
    for name in [f.name for f in dataclasses.fields(cls)]:
        cases.append({k: v for k, v in raw.items() if k != name})
        cases += [{**raw, name: v} for v in values]
    for case in cases:
        fast = compiled(case)
        try:
            careful = reader._record(cls, case, ("type",), opt)
        except BadRecord:
            careful = None
        assert fast == careful, (case, fast, careful)
        if fast is not None:
            assert type(fast) is cls


def test_a_spare_set_aside_with_its_part_built_takes_only_a_rank_at_its_position(tmp_path):
    """A sharded job's process set aside by a scale-in holds its part of the model at its
    position in a replica group (here position 1 of 2): when the group grows back it must take
    rank 1 or 3 - before any fresh spare there - and never rank 0 or 2, nor replace one."""
    log = EventLog(tmp_path)
    table = WorkerTable(agent=None, log=log, spare_mode="script", mail=_Mail([]))
    built = table.workers[4] = Worker(wid=4, spare=True, ready=True, home=(1, 2))
    fresh = table.workers[9] = Worker(wid=9, spare=True, ready=True)
    assert table.take_spare(0, only=True, rank=2) is fresh
    assert table.take_spare(0, only=True, rank=3) is built
    fresh.spare = False
    assert table.take_spare(0, only=True, rank=2) is None  # none that fits: a new process
    assert table.take_spare(0, rank=0) is None and table.take_spare(0) is None
    assert table.take_spare(0, rank=1) is built
    log.close()

"""Incident phases add up to the MTTR; summaries."""

from nonstop.observe.incidents import PHASES, Incident, summarize


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


def test_steps_lost_is_unknown_when_the_ranks_show_no_steps():
    inc = Incident(id=1, t_fault=0.0, t_detect=0.1, t_first_step=1.0, step_before=0,
                   resume_step=0, steps_known=False)
    assert inc.steps_lost is None and inc.to_record()["steps_lost"] is None
    known = Incident(id=2, t_fault=0.0, t_detect=0.1, t_first_step=1.0, step_before=5,
                     resume_step=3).to_record()
    s = summarize([known, inc.to_record()], wall_s=10.0, productive_s=None, steps=None, exit_code=0)
    assert s["steps_lost"] is None and s["goodput"] is None
    # an incident that gave up has no resumption: it makes nothing unknown
    gave_up = dict(Incident(id=3, t_fault=0.0, t_detect=0.1).to_record(), outcome="gave up")
    s = summarize([known, gave_up], wall_s=10.0, productive_s=1.0, steps=5, exit_code=1)
    assert s["steps_lost"] == 2


def test_a_resumed_attempt_counts_the_steps_it_redid():
    from nonstop.observe.incidents import continuation

    assert continuation([], 0) is None and continuation([], None) is None
    # resumed from a checkpoint of a run this directory has no record of: how far it got is unknown
    assert continuation([], 30)["steps_lost"] is None
    before = [{"steps": 50, "exit_code": 0}, {"steps": 62, "exit_code": 143}]
    cont = continuation(before, 55)
    assert cont["attempt"] == 3 and cont["previous_step"] == 62 and cont["steps_lost"] == 7
    assert continuation([{"steps": None}], 0)["steps_lost"] is None  # the earlier one ran no steps
    assert continuation(before, None)["steps_lost"] is None
    inc = Incident(id=1, t_fault=0.0, t_detect=0.1, t_first_step=1.0, step_before=70,
                   resume_step=68).to_record()
    s = summarize([inc], wall_s=10.0, productive_s=5.0, steps=80, exit_code=0, continues=cont)
    assert s["steps_lost"] == 2 + 7 and s["attempt"] == 3 and s["continues"] is cont


def test_an_event_log_keeps_every_attempt(tmp_path):
    import json

    from nonstop.observe.events import EventLog, attempts, read

    path = tmp_path / "events.jsonl"
    lines = [{"t": 1.0, "type": "run_start", "attempt": 1, "managed": True},
             {"t": 2.0, "type": "rank_first_step", "step": 1},
             {"t": 3.0, "type": "run_end", "exit_code": 143, "steps": 50, "diagnosis": "interrupted"},
             {"t": 4.0, "type": "run_start", "attempt": 2, "managed": True},
             {"t": 5.0, "type": "checkpoint", "step": 60},
             {"t": 6.0, "type": "rank_left", "step": 62}]
    # the second launcher was killed in the middle of a line
    path.write_text("".join(json.dumps(e) + "\n" for e in lines) + '{"t": 7.0, "type": "ran')
    a = attempts(path)
    assert [x["attempt"] for x in a] == [1, 2]
    assert a[0]["ended"] and a[0]["steps"] == 50 and a[0]["exit_code"] == 143
    assert not a[1]["ended"] and a[1]["steps"] == 62 and a[1]["exit_code"] is None
    log = EventLog(tmp_path)
    assert log.attempt == 3 and [x["steps"] for x in log.previous] == [50, 62]
    log.write("run_start", attempt=log.attempt)
    log.close()
    events = list(read(tmp_path))
    assert len(events) == len(lines) + 1 and events[-1]["attempt"] == 3  # the torn line skipped
    assert path.read_text().startswith(json.dumps(lines[0]))  # nothing earlier was lost


def test_the_event_log_is_buffered_within_a_turn_and_flushed_by_the_next(tmp_path, monkeypatch):
    from nonstop.observe import events

    log = events.EventLog(tmp_path)
    log.write("spawn", n=1)
    log.write("kill", n=2)
    assert [e["type"] for e in events.read(tmp_path)] == []  # one turn's events: not yet
    log.flush()  # the controller's loop, once per turn
    assert [e["type"] for e in events.read(tmp_path)] == ["spawn", "kill"]
    # a write long after the last flush flushes itself (a thread that writes between turns)
    monkeypatch.setattr(events, "FLUSH_S", 0.0)
    log.write("exit", n=3)
    assert [e["type"] for e in events.read(tmp_path)] == ["spawn", "kill", "exit"]
    monkeypatch.setattr(events, "FLUSH_S", 3600.0)
    log.write("abort", n=4)
    log.close()
    assert [e["n"] for e in events.read(tmp_path)] == [1, 2, 3, 4]

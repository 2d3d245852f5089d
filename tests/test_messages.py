"""The typed messages between the controller and the hosts' agents: every one survives the wire
(JSON) unchanged, and anything else is refused before it reaches an agent or a controller."""

from __future__ import annotations

import dataclasses
import json

import pytest

from nonstop.protocol import messages as m


def _all() -> list[type[m.Message]]:
    out, todo = [], [m.Message]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.op:
            out.append(cls)
    return out


SAMPLES = [
    m.Hello(epoch=7),
    m.Spawn(epoch=7, wid=3, spare=True, mode="script", node=2, keeper="nonstop-x-n2"),
    m.SpawnKeeper(wid=9, node=1, name="k", writer=True),
    m.KeeperOpen(id=4, name="k"),
    m.KeeperCall(id=None, name="k", msg={"op": "configure", "replicate": {"r0": "10.0.0.2:5"}}),
    m.Signal(wid=3, sig=10),
    m.Send(wid=3, seq=2, msg={"type": "assign", "gen": 1, "rank": 0}),
    m.Sends(mails=[{"wid": 3, "seq": 2, "msg": {"type": "assign", "gen": 1, "rank": 0}},
                   {"wid": 4, "seq": 0, "msg": {"type": "exit"}}]),
    m.Abort(gen=1, wids=[3, 4]),
    m.End(code=1, grace_s=0.5, why="etcd unreachable"),
    m.End(code=0, why="node 2 isolated", released=True),
    m.OpenStore(id=5, gen=2),
    m.State(now=1.5, host="h0", incarnation="abc", workers=[{"wid": 3, "alive": True}],
            takeover=True),
    m.Exits(exits=[{"wid": 3, "code": -9}]),
    m.Events(events=[{"type": "entered", "t": 1.0}], replay=True),
    m.Progress(recs={"3": {"step": 5, "t": 2.0}}, stopped=[4]),
    m.Output(wid=3, line="step 5"),
    m.Health(results=[{"check": "disk", "ok": False}], nvml_status="NVML: off"),
    m.KeeperEvents(events=[{"ev": "replicated"}]),
    m.Preempted(grace_s=19.5),
    m.Deadlines(records=[{"what": "host_reply", "limit_s": 5.0, "detail": "no answer to spawn"}]),
    m.Refused(why="stale epoch 3 < 7"),
    m.Reply(id=5, port=4242),
]


def test_every_message_has_a_sample_and_its_own_operation():
    classes = _all()
    assert {type(s) for s in SAMPLES} == set(classes)
    assert len({c.op for c in classes}) == len(classes)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda s: s.op)
def test_a_message_survives_the_wire(msg):
    wire = json.loads(json.dumps(m.encode(msg)))
    assert wire["op"] == msg.op
    assert m.decode(wire) == msg


def test_missing_fields_take_their_defaults_and_extra_ones_are_ignored():
    assert m.decode({"op": "abort", "gen": 2, "later_field": 1}) == m.Abort(gen=2)


@pytest.mark.parametrize("raw, why", [
    ({"op": "format_disk"}, "unknown operation"),
    ({"wid": 3}, "unknown operation"),
    ({"op": "signal", "wid": "3"}, "wid"),
    ({"op": "signal", "wid": True}, "wid"),  # a bool is not a process id
    ({"op": "abort", "gen": 1, "wids": [1, "2"]}, "wids"),
    ({"op": "send", "wid": 1, "seq": 0, "msg": ["assign"]}, "msg"),
    ({"op": "hello", "epoch": None}, "epoch"),
    ({"op": "progress", "recs": {"3": 5}}, "recs"),
    ({"op": "end", "code": 1.5}, "code"),
])
def test_a_malformed_message_is_refused(raw, why):
    with pytest.raises(m.BadMessage, match=why):
        m.decode(raw)


def test_orders_carry_the_epoch_and_reports_the_senders_clock():
    assert all(issubclass(c, m.Order) != issubclass(c, m.Report) for c in _all())
    order = dataclasses.replace(m.Abort(gen=1), epoch=9)
    assert m.encode(order)["epoch"] == 9
    assert m.decode({"op": "end", "grace_s": 1}) == m.End(grace_s=1)  # an int is a float


def test_mailbox_messages_round_trip_and_refuse_what_they_do_not_know():
    from nonstop import protocol

    msgs = [protocol.Assign(gen=3, rank=1, world=4, replacements=2, initial=True,
                            claimed={"0": 1}, local_rank=1, local_world=2, group_rank=0,
                            master_addr="10.0.0.1", pg_addr="10.0.0.1", pg_port=29400),
            protocol.Complete(), protocol.Exit(), protocol.Retry(skip=True)]
    for msg in msgs:
        rec = json.loads(json.dumps(protocol.mail_record(msg)))
        assert rec["type"] == msg.type and protocol.mail_from(rec) == msg
    for bad, why in [({"type": "reboot"}, "unknown mailbox message"),
                     ({"gen": 1}, "unknown mailbox message"),
                     ({"type": "retry", "skip": True, "rm": "-rf"}, "unknown fields")]:
        with pytest.raises(ValueError, match=why):
            protocol.mail_from(bad)
    with pytest.raises(ValueError, match="rank"):  # fields it must have are missing
        protocol.mail_from({"type": "assign", "gen": 1})


def test_a_remote_records_times_are_moved_onto_this_hosts_clock():
    from nonstop.protocol.hosts import shift_times

    rec = {"t": 10.0, "hb": 11, "t_pg": 12.5, "t_flag": True, "type": "entered", "step": 7,
           "tail": 3.0, "": 1, "t_life": 13.0}
    assert shift_times(rec, 0.5) == {"t": 10.5, "hb": 11.5, "t_pg": 13.0, "t_flag": True,
                                     "type": "entered", "step": 7, "tail": 3.0, "": 1,
                                     "t_life": 13.5}

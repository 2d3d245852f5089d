"""The typed messages between the controller and the hosts' agents: every one survives the wire
(JSON) unchanged, and anything else is refused before it reaches an agent or a controller."""

from __future__ import annotations

import dataclasses
import json

import pytest

from nonstop.protocol import messages as m
from nonstop.protocol.last_step import LastStep


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
    m.Sends(mails=[{"wid": 3, "seq": 2, "msg": {"rank": 0}},
                   {"wid": 4, "seq": 1, "msg": {"rank": 1}}],
            common={"type": "assign", "gen": 1, "world": 2}),
    m.Abort(gen=1, wids=[3, 4]),
    m.End(code=1, grace_s=0.5, why="etcd unreachable"),
    m.End(code=0, why="node 2 isolated", released=True),
    m.OpenStore(id=5, gen=2),
    m.State(now=1.5, host="h0", incarnation="abc", takeover=True, workers=[
        m.HostWorker(wid=3, pid=101, alive=True, spare=False, node=1, rank=2, gen=4, seq=5),
        m.HostWorker(wid=4, pid=102, alive=False, code=-9, spare=True, node=1),
        m.HostWorker(wid=5, pid=103, alive=True, node=1, keeper="nonstop-x-n1")]),
    m.Exits(exits=[m.ProcExit(wid=3, code=-9),
                   m.ProcExit(wid=4, code=1, last=LastStep(gen=2, step=17, t=1.25, busy=0.5,
                                                           stall=None)),
                   m.ProcExit(wid=5, code=None)]),
    m.Events(events=[{"type": "entered", "t": 1.0}], replay=True),
    m.Progress(recs={"3": {"step": 5, "t": 2.0}}, stopped=[4]),
    m.Output(wid=3, line="step 5"),
    m.Health(results=[m.HealthCheck(check="disk", ok=False, code=1, detail="exit 1: full",
                                    seconds=0.25),
                      m.HealthCheck(check="stuck", ok=False, code=None, detail="timed out",
                                    seconds=3, limit_s=3.0)], nvml_status="NVML: off"),
    m.KeeperEvents(events=[{"ev": "replicated"}]),
    m.Preempted(grace_s=19.5),
    m.Deadlines(records=[m.MissedDeadline("host_reply", 5.0, detail="no answer to spawn"),
                         m.MissedDeadline("zygote", None, node=3)]),
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
                     ({"type": "retry", "skip": True, "rm": "-rf"}, "unknown field"),
                     ({"type": "retry", "skip": "yes"}, "retry.*skip.*not bool"),
                     ({"type": "assign", "gen": 1, "rank": "0", "world": 2}, "rank.*not int"),
                     ({"type": "assign", "gen": 1, "rank": 0, "world": 2, "claimed": {"0": "x"}},
                      "claimed"),
                     (["assign"], "unknown mailbox message")]:
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


# == records inside the messages ====================================================================
def _exits(**rec):
    return {"op": "exits", "exits": [{"wid": 3, "code": -9, "last": None, **rec}]}


GOOD_WORKER = {"wid": 3, "pid": 101, "alive": True, "code": None, "spare": False, "node": 1,
               "keeper": None, "rank": 0, "gen": 2, "seq": 1,
               "done": None}
GOOD_LAST = {"gen": 2, "step": 17, "t": 1.25, "busy": None, "stall": None}


@pytest.mark.parametrize("raw, why", [
    ({"op": "exits", "exits": [{"wid": 3, "code": -9}]}, r"exits: exits\[0\]: field 'last' is missing"),
    (_exits(wid="3"), r"exits: exits\[0\].wid: '3' is not int"),
    (_exits(code=1.5), r"exits\[0\].code"),
    (_exits(signal=9), r"exits\[0\]: unknown field\(s\) \['signal'\]"),
    (_exits(last={**GOOD_LAST, "t": "now"}), r"exits\[0\].last.t: 'now' is not float"),
    (_exits(last={**GOOD_LAST, "extra": 1}), r"exits\[0\].last: unknown field"),
    (_exits(last=[1, 2]), r"exits\[0\].last: .* is not an object"),
    ({"op": "exits", "exits": {"wid": 3}}, "exits: exits: .* is not a list"),
    ({"op": "exits", "exits": [3]}, r"exits\[0\]: 3 is not an object"),
    ({"op": "state", "workers": [{**GOOD_WORKER, "alive": 1}]}, r"state: workers\[0\].alive"),
    ({"op": "state", "workers": [GOOD_WORKER, {k: v for k, v in GOOD_WORKER.items()
                                               if k != "pid"}]},
     r"state: workers\[1\]: field 'pid' is missing"),
    ({"op": "state", "workers": [{**GOOD_WORKER, "meta": {}}]}, r"workers\[0\]: unknown field"),
    ({"op": "deadlines", "records": [{"what": "zygote", "limit_s": 120.0, "detail": None}]},
     r"deadlines: records\[0\]: field 'node' is missing"),
    ({"op": "deadlines", "records": [{"what": None, "limit_s": 1.0, "detail": None,
                                      "node": None}]}, r"records\[0\].what: None is not str"),
    ({"op": "deadlines", "records": [{"what": "x", "limit_s": "5", "detail": None,
                                      "node": None}]}, r"records\[0\].limit_s"),
    ({"op": "health", "results": [{"check": "disk", "ok": "no", "code": 1, "detail": "",
                                   "seconds": 0.1, "limit_s": None}]}, r"results\[0\].ok"),
])
def test_a_malformed_record_inside_a_message_is_refused_with_where(raw, why):
    with pytest.raises(m.BadMessage, match=why):
        m.decode(raw)


def test_records_travel_as_plain_json_and_come_back_as_records():
    msg = SAMPLES[[type(s) for s in SAMPLES].index(m.Exits)]
    wire = m.encode(msg)
    assert json.loads(json.dumps(wire)) == wire  # plain values only
    assert wire["exits"][1]["last"] == {"gen": 2, "step": 17, "t": 1.25, "busy": 0.5,
                                        "stall": None}
    back = m.decode(json.loads(json.dumps(wire)))
    assert isinstance(back.exits[1], m.ProcExit) and isinstance(back.exits[1].last, LastStep)


def test_a_field_of_records_in_another_shape_is_a_mistake_said_at_once():
    @dataclasses.dataclass(frozen=True)
    class Odd(m.Report):  # (no op: never registered)
        by_wid: dict[str, m.ProcExit] = dataclasses.field(default_factory=dict)

    with pytest.raises(TypeError, match="by_wid"):
        m.encode(Odd())


def test_a_missed_deadline_says_only_what_is_known():
    assert m.MissedDeadline("zygote", 120.0, detail="slow").fields() == {"detail": "slow"}
    assert m.MissedDeadline("host_reply", 5.0, detail="no answer to spawn", node=2).fields() == \
        {"detail": "no answer to spawn", "node": 2}
    assert m.MissedDeadline("x", None).fields() == {}


# == the controller's side: what a host sends, refused or taken ===================================
@pytest.fixture
def host(tmp_path):
    """A cluster (epoch 7) with one host, whose side of a real channel is returned."""
    import threading

    from nonstop.controller.cluster import Cluster, RemoteProc
    from office import Office
    from nonstop.net.channel import connect, new_secret
    from nonstop.net.listener import Listener
    from nonstop.protocol import hosts as keys

    secret = new_secret().encode()
    with Listener("127.0.0.1", secret) as lst:
        box: dict = {}
        t = threading.Thread(target=lambda: box.setdefault("ch", lst.accept(10)))
        t.start()
        cluster = Cluster(7, secret, tmp_path, Office())
        rec = keys.HostRecord(host_id="h0", addr="127.0.0.1", ctl_port=lst.port, rdzv_port=1,
                              pid=1, slots=1, incarnation="a")
        cluster.add_host(0, rec, ch=connect("127.0.0.1", lst.port, secret))
        t.join(10)
        agent = box["ch"]
        assert isinstance(m.decode(agent.recv(5)[0]), m.Hello)
        for wid in (3, 4):
            cluster.procs[wid] = RemoteProc(wid, 0, False, tmp_path / f"worker-{wid}.log")
        yield cluster, agent
        cluster.close()
        agent.close()


def _poll_until(cluster, cond, timeout_s=5.0):
    import time

    deadline = time.monotonic() + timeout_s
    got = []
    while time.monotonic() < deadline:
        got += cluster.poll(0.02)
        if cond(got):
            break
    return got


def test_a_malformed_report_is_refused_and_the_reader_reads_on(host, capfd):
    import time

    cluster, agent = host
    for bad in ({"op": "exits", "exits": [{"wid": 3, "code": "dead", "last": None}]},
                {"op": "deadlines", "records": [{"what": "zygote", "limit_s": 1.0}]},
                {"op": "state", "host": "h0", "workers": [{"wid": 4, "alive": False}]},
                {"op": "exits", "exits": [{"wid": 4, "code": 1, "last": {"step": 3}}]},
                {"op": ["exits"]}):
        agent.send(bad)
    # then good ones, on the host's clock (100 s behind this one)
    now = time.time() - 100.0
    agent.send(m.encode(m.Deadlines(now=now, records=[m.MissedDeadline("zygote", 120.0,
                                                                       detail="slow")])))
    agent.send(m.encode(m.Exits(now=now, exits=[m.ProcExit(
        wid=3, code=-9, last=LastStep(gen=1, step=5, t=now - 1.0, busy=None, stall=None))])))
    (p,) = _poll_until(cluster, lambda got: got)
    assert p.wid == 3 and p.returncode == -9 and cluster.procs[4].alive  # the bad ones: nothing
    assert p.last is not None and p.last.step == 5 and abs(p.last.t - (time.time() - 1.0)) < 2.0
    assert cluster.deadlines() == [m.MissedDeadline("zygote", 120.0, detail="slow", node=0)]
    err = capfd.readouterr().err
    assert err.count("a message from host h0 refused") == 5, err
    assert "exits: exits[0].code" in err and "deadlines: records[0]: field" in err
    assert "state: workers[0]: field 'pid' is missing" in err and "exits[0].last" in err


def test_a_hosts_state_is_adopted_typed(host):
    cluster, agent = host
    agent.send(m.encode(m.State(host="h0", incarnation="a", workers=[
        m.HostWorker(wid=4, pid=104, alive=False, code=-11, node=0),
        m.HostWorker(wid=9, pid=109, alive=True, spare=True, node=0)])))
    (p,) = _poll_until(cluster, lambda got: got)
    assert (p.wid, p.returncode, p.pid) == (4, -11, 104)
    assert cluster.procs[9].spare and cluster.procs[9].alive and cluster.next_wid == 10
    assert cluster.links[0].state.workers[1] == m.HostWorker(wid=9, pid=109, alive=True,
                                                             spare=True, node=0)


def test_a_batch_sends_what_its_messages_share_once_and_the_host_gets_each_whole(host):
    """A generation's assignments: one frame per host, the fields every assignment shares in it
    once; put together, each is the record a message sent alone would be."""
    cluster, agent = host
    common = {"type": "assign", "gen": 3, "world": 2, "worlds": {"3": 2}, "claimed": {}}
    with cluster.batch(common):
        cluster.send(3, 0, {"rank": 0, "replacements": 0})
        cluster.send(4, 5, {"rank": 1, "replacements": 2})
    frame = m.decode(agent.recv(5)[0])
    assert isinstance(frame, m.Sends) and frame.common == common
    assert [len(item["msg"]) for item in frame.mails] == [2, 2]  # only their own fields
    whole = {item["wid"]: {**frame.common, **item["msg"]} for item in frame.mails}
    assert whole == {3: {**common, "rank": 0, "replacements": 0},
                     4: {**common, "rank": 1, "replacements": 2}}
    with cluster.batch(common):  # one message alone goes whole, as a Send
        cluster.send(4, 6, {"rank": 1, "replacements": 2})
    one = m.decode(agent.recv(5)[0])
    assert isinstance(one, m.Send) and one.msg == {**common, "rank": 1, "replacements": 2}
    cluster.send(4, 7, {"type": "exit"})  # outside a batch: nothing shared is added
    assert m.decode(agent.recv(5)[0]).msg == {"type": "exit"}


# == requests from outside the job (nonstop drain) ================================================
def test_a_request_is_typed_and_a_malformed_one_refused_once_with_why(tmp_path):
    from nonstop.controller.requests import FOLDER, RefusedRequest, Requests, send
    from nonstop.protocol.requests import DrainRequest

    good = DrainRequest(ranks=[1, 2], node=None, why="ECC errors")
    send(tmp_path, good)
    folder = tmp_path / FOLDER
    bad = {"a-missing.json": {"op": "drain", "ranks": [1], "why": "x"},
           "b-type.json": {"op": "drain", "ranks": ["1"], "node": None, "why": "x"},
           "c-unknown.json": {"op": "drain", "ranks": [], "node": 1, "why": "x", "force": True},
           "d-op.json": {"op": "reboot"},
           "e-list.json": [1]}
    for name, raw in bad.items():
        (folder / name).write_text(json.dumps(raw))
    (folder / "f-torn.json").write_text('{"op": "dr')
    got = Requests(tmp_path).poll(1.0)
    assert [r for r in got if isinstance(r, DrainRequest)] == [good]
    refused = {r.why.split(":", 1)[0]: r for r in got if isinstance(r, RefusedRequest)}
    assert refused.pop("f-torn.json").request is None
    assert refused == {n: RefusedRequest(bad[n], f"{n}: {why}") for n, why in (
        ("a-missing.json", "request: field 'node' is missing"),
        ("b-type.json", "request.ranks[0]: '1' is not int"),
        ("c-unknown.json", "request: unknown field(s) ['force']"),
        ("d-op.json", "unknown request 'reboot'"),
        ("e-list.json", "[1] is not an object"))}
    assert Requests(tmp_path).poll(2.0) == []  # each taken once, malformed or not
    assert sorted(p.suffix for p in folder.iterdir()) == [".taken"] * 7


def test_the_controller_logs_requests_refused_and_deadlines_as_before(tmp_path):
    """``Controller._check``'s reading of requests and missed deadlines (the rest stubbed)."""
    from types import SimpleNamespace

    from nonstop.controller.controller import Controller
    from nonstop.controller.phase import Phase
    from nonstop.controller.requests import FOLDER, Requests, send
    from nonstop.observe.events import EventLog, read
    from nonstop.protocol.requests import DrainRequest

    send(tmp_path, DrainRequest(ranks=[], node=2, why="maintenance"))
    (tmp_path / FOLDER / "x.json").write_text(json.dumps({"op": "drain", "ranks": [0]}))
    drained = []
    log = EventLog(tmp_path)
    me = SimpleNamespace(
        table=SimpleNamespace(kill_due=lambda now: None), requests=Requests(tmp_path),
        drain=lambda ranks, node, why: drained.append((ranks, node, why)), log=log,
        agent=SimpleNamespace(deadlines=lambda: [
            m.MissedDeadline("zygote", 120.0, detail="its imports did not finish"),
            m.MissedDeadline("host_reply", 5.0, detail="no answer to open_store", node=1)],
            preempted=lambda: []),
        preempts=SimpleNamespace(due=lambda now: []), phase=Phase.FINISHING,
        _step=lambda obs: None, _seen=lambda now=None: None,
        memory=SimpleNamespace(settled=lambda final: True),
        reports=SimpleNamespace(final_persist=None))
    Controller._check(me, 1.0)  # type: ignore[arg-type]
    log.close()
    assert drained == [((), 2, "maintenance")]
    evs = [{k: v for k, v in e.items() if k not in ("t", "attempt")} for e in read(tmp_path)]
    assert evs == [
        {"type": "request_refused", "request": {"op": "drain", "ranks": [0]},
         "why": "x.json: request: field 'node' is missing"},
        {"type": "deadline", "what": "zygote", "limit_s": 120.0,
         "detail": "its imports did not finish"},
        {"type": "deadline", "what": "host_reply", "limit_s": 5.0,
         "detail": "no answer to open_store", "node": 1}]

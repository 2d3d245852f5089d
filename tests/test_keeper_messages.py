"""What crosses a process to and from node memory, typed (protocol/keeper_messages.py): every
record goes through its encoding and back unchanged, anything else is refused, and each end does
what it should with a malformed message - the keeper answers an error (or logs one it would not
have answered) and serves on, a client raises KeeperError, a report is logged and passed over, a
malformed word from the checkpoint writer fails its part. No process is started."""

from __future__ import annotations

import json
import logging
import os
import selectors
import socket
import uuid
from types import SimpleNamespace
from typing import Any

import pytest

from nonstop.agent.host_keepers import HostKeepers
from nonstop.controller.keepers import Keepers
from nonstop.controller.remote_keepers import RemoteKeeperLink
from nonstop.protocol import keeper_messages as km
from nonstop.protocol import messages as m
from nonstop.state import shm, wire
from nonstop.keeper.disk import DiskWrites
from nonstop.keeper.server import ENV_TOKEN, Keeper
from nonstop.keeper.slots import Slots

INFO = shm.SlotInfo(seq=3, step=40, meta_len=512, data_len=4096, checksum=2**63 + 5,
                    written_at=1700000000.25, rank=1, gen=2)
PART = km.DiskPart(holder="r1", step=40, root="/ckpt", rank=1, world=4, sharded=True,
                   reason="periodic")
WRITTEN = km.PartWritten(dir="rank-1", files={"__0_0.distcp": km.FileWritten(bytes=4096,
                                                                            xxh3="ab12")},
                         bytes=4096, seconds=0.125,
                         info={"step": 40, "rank": 1, "world": 4, "sharded": True,
                               "source": "r1", "node": None, "reason": "periodic", "gen": 2})
ENTRY = km.HolderEntry(slots=[INFO, None], replicated_step=39, repl_s=0.01, repl_error=None,
                       buddies=["10.0.0.2:4000", "10.0.0.3:4000"])

REQUESTS: list[km.Request] = [
    km.Alloc(holder="r1", size=8192),
    km.Commit(holder="r1", slot=0, persist=PART),
    km.Commit(holder="r1", slot=1),
    km.Lease(holder="rep2", step=40),
    km.Lease(holder="r1"),
    km.Release(holder="r1", slot=1),
    km.ListHolders(),
    km.Configure(replicate={"r0": ["10.0.0.2:4000"], "r1": ["10.0.0.2:4000", "10.0.0.3:4000"],
                            "r2": []}),
    km.Configure(free_within_s=0.3, writer=True),
    km.Persist(part=PART),
    km.Persist(part=km.DiskPart(holder="rep1", step=40, root="/ckpt", rank=1, world=4,
                                sharded=True, reason="job restart", node=2), again=True),
    km.Forget(holder="r1", step=40),
    km.Corrupt(holder="r1"),
    km.Subscribe(),
    km.Ping(),
]
ANSWERS: list[tuple[type[km.Request], km.Answer]] = [
    (km.Alloc, km.Allocated(slot=1, seq=4, size=8192, repl_s=None, fresh=True)),
    (km.Alloc, km.Allocated(slot=0, seq=5, size=8192, repl_s=0.02, fresh=False)),
    (km.Lease, km.Leased(slot=0, info=INFO)),
    (km.Lease, km.Leased(slot=None, info=None)),
    (km.ListHolders, km.Listing(holders={"r1": ENTRY, "rep0": km.HolderEntry(
        slots=[None, None], replicated_step=None, repl_s=None, repl_error="gone", buddies=[])},
        node=1, tcp="10.0.0.1:4000")),
    (km.Configure, km.Configured(tcp="10.0.0.1:4000")),
    (km.Persist, km.Persisting(kept=True)),
    (km.Forget, km.Forgotten()),
    (km.Corrupt, km.Corrupted(step=40, offset=5000)),
    (km.Subscribe, km.Subscribed(tcp="10.0.0.1:4000", node=1, pid=123)),
    (km.Ping, km.Pong(pid=123, tcp="10.0.0.1:4000")),
    (km.Ping, km.Refused(error="no")),
]
REPORTS: list[km.Report] = [
    km.Replicated(holder="r1", step=40, bytes=8192, seconds=0.01, to="10.0.0.2:4000"),
    km.ReplicationFailed(holder="r1", step=40, bytes=8192, seconds=0.5, to="10.0.0.2:4000",
                         error="ConnectionRefusedError: ..."),
    km.ReplicationBehind(holder="r1", step=40, to=None, waited_s=0.5),
    km.PeerRefused(peer="10.0.0.9:5555", why="a wrong token"),
    km.ReplicaRefused(holder="rep1", why="its slot stayed leased for 120 s"),
    km.PartDone(job=PART, part=WRITTEN),
    km.PartFailed(job=PART, error="OSError: ...", errno="ENOSPC",
                  message="No space left on device", path="/ckpt", need=4096,
                  traceback="Traceback ..."),
    km.PartFailed(job=PART, retryable=False, error="no snapshot of step 40 in r1"),
    km.RequestFailed(op="configure", error="keeper k is not connected"),
    km.ReplicasHeld(bytes=1 << 20, holders=2),
]
WRITER: list[km.WriterMessage] = [
    km.Write(job=PART, info=INFO),
    km.WriteDone(part=WRITTEN),
    km.WriteFailed(error="OSError: ...", errno=None, message="broken", path="/ckpt", need=4096,
                   traceback="Traceback ..."),
]
FRAMES: list[Any] = [
    km.ReplicaHeader(owner="r1", total=8192, step=40, seq=3, node=0, token="t0k"),
    km.ReplicaHeader(owner="r1", total=8192, step=40, seq=3, node=0),
    km.ReplicaAck(ack="k"), km.ReplicaAck(ack="f"), km.ReplicaAck(ack="refused"),
]


def _wire(msg: Any) -> Any:
    return json.loads(json.dumps(km.encode(msg)))  # as it travels


def test_every_type_has_a_sample():
    assert {type(r) for r in REQUESTS} == set(km.REQUESTS.values())
    assert {type(r) for r in REPORTS} == set(km.REPORTS.values())
    assert {type(r) for r in WRITER} == set(km.WRITER_MESSAGES.values())
    answered = {r.answer for r in km.REQUESTS.values() if r.answer is not None}
    assert {type(a) for _, a in ANSWERS} == answered | {km.Refused}
    assert set(km.Answer.__subclasses__()) == answered | {km.Refused}


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda r: r.op)
def test_a_request_goes_through_its_encoding_unchanged(msg):
    raw = _wire(msg)
    assert raw["op"] == msg.op
    assert km.decode_request(raw) == msg


@pytest.mark.parametrize("request_type, answer", ANSWERS, ids=lambda x: getattr(x, "op", ""))
def test_an_answer_goes_through_its_encoding_unchanged(request_type, answer):
    raw = _wire(answer)
    assert "op" not in raw and "ev" not in raw  # known from what was asked
    assert km.decode_answer(request_type, raw) == answer


@pytest.mark.parametrize("msg", REPORTS + WRITER, ids=lambda r: type(r).__name__)
def test_a_report_and_the_writers_messages_go_through_their_encoding_unchanged(msg):
    decode = km.decode_report if isinstance(msg, km.Report) else km.decode_writer
    assert decode(_wire(msg)) == msg


@pytest.mark.parametrize("frame", FRAMES, ids=lambda f: type(f).__name__)
def test_a_replicas_frames_go_through_their_encoding_unchanged(frame):
    assert km.read(type(frame), _wire(frame)) == frame


def test_what_a_keeper_writes_a_part_as_reads_back():
    part = {"dir": "rank-0", "files": {".metadata": {"bytes": 10, "xxh3": "ff"}}, "bytes": 10,
            "seconds": 0.5, "info": {"step": 1, "rank": 0, "world": 1, "sharded": False,
                                     "source": "r0", "node": None, "reason": "final", "gen": 0},
            "dtensors": None}
    assert km.encode(km.read(km.PartWritten, part)) == part
    shards = dict(part, dtensors={"model.w": [[8, 4], [4, 0]]})  # a shard: whole shape, offset
    assert km.encode(km.read(km.PartWritten, shards)) == shards


@pytest.mark.parametrize("raw, said", [
    ({"op": "format_disk"}, "unknown request 'format_disk'"),
    ({"holder": "r0"}, "unknown request None"),
    (["alloc"], "unknown request ['alloc']"),
    ({"op": 3}, "unknown request 3"),
    ({"op": "alloc", "holder": "r0"}, "field 'size' is missing"),
    ({"op": "alloc", "holder": "r0", "size": "8k"}, "alloc.size: '8k' is not int"),
    ({"op": "alloc", "holder": "r0", "size": True}, "alloc.size: True is not int"),
    ({"op": "alloc", "holder": "r0", "size": 8, "later": 1}, "unknown field(s) ['later']"),
    ({"op": "commit", "holder": "r0", "slot": 0, "persist": {"root": "/x"}},
     "commit.persist: field 'holder' is missing"),
    ({"op": "configure", "replicate": {"r0": [4000]}, "free_within_s": None, "writer": False},
     "configure.replicate['r0'][0]: 4000 is not str"),
    ({"op": "configure", "replicate": {"r0": "10.0.0.2:4000"}, "free_within_s": None,
      "writer": False}, "configure.replicate['r0']"),
    ({"op": "persist", "part": {**km.encode(PART), "step": 4.5}, "again": False},
     "persist.part.step: 4.5 is not int"),
])
def test_a_malformed_request_is_refused_with_where(raw, said):
    with pytest.raises(km.BadKeeperMessage) as exc:
        km.decode_request(raw)
    assert said in str(exc.value)


@pytest.mark.parametrize("request_type, raw, said", [
    (km.Alloc, {"slot": 0, "seq": 1, "size": 8, "repl_s": None}, "'fresh' is missing"),
    (km.Alloc, {"slot": 0, "seq": 1, "size": 8, "repl_s": "soon", "fresh": False}, "repl_s"),
    (km.Lease, {"slot": 1, "info": None}, "both its slot and its snapshot, or neither"),
    (km.Lease, {"slot": 1, "info": {**km.encode(km.Leased(slot=1, info=INFO))["info"],
                                    "seq": None}}, "info.seq: None is not int"),
    (km.ListHolders, {"holders": {"r0": {"slots": [None]}}, "node": 0, "tcp": "a:1"},
     "holders['r0']: field 'replicated_step' is missing"),
    (km.Ping, {"error": 5}, "error: 5 is not str"),
    (km.Ping, "pong", "is not an object"),
    (km.Commit, {}, "never answered"),
])
def test_a_malformed_answer_is_refused(request_type, raw, said):
    with pytest.raises(km.BadKeeperMessage) as exc:
        km.decode_answer(request_type, raw)
    assert said in str(exc.value)


@pytest.mark.parametrize("decode, raw, said", [
    (km.decode_report, {"ev": "replicated", "holder": "r0"}, "field 'step' is missing"),
    (km.decode_report, {"ev": "exploded"}, "unknown report 'exploded'"),
    (km.decode_report, {**km.encode(REPORTS[5]), "node": 1}, "unknown field(s) ['node']"),
    (km.decode_report, {**km.encode(REPORTS[5]), "part": {"dir": "rank-0"}}, "part"),
    (km.decode_writer, {"op": "done"}, "field 'part' is missing"),
    (km.decode_writer, {"op": "alloc", "holder": "r0", "size": 1}, "unknown writer message"),
])
def test_a_malformed_report_or_writers_message_is_refused(decode, raw, said):
    with pytest.raises(km.BadKeeperMessage) as exc:
        decode(raw)
    assert said in str(exc.value)


def test_a_malformed_replica_frame_is_refused():
    with pytest.raises(km.BadKeeperMessage, match="not one of"):
        km.read(km.ReplicaAck, {"ack": "ok"})
    with pytest.raises(km.BadKeeperMessage, match="'owner' is missing"):
        km.read(km.ReplicaHeader, {"total": 1, "step": 1, "seq": 1, "node": 0, "token": None})
    with pytest.raises(km.BadKeeperMessage, match="unknown field"):  # the old name of ``node``
        km.read(km.ReplicaHeader, {"owner": "r0", "total": 1, "step": 1, "seq": 1, "node": 0,
                                   "token": None, "from": 0})


# == the keeper's dispatch =========================================================================
@pytest.fixture
def keeper(monkeypatch):
    """A keeper in this process, not running its loop or threads: its requests are served by
    hand."""
    monkeypatch.setenv(ENV_TOKEN, "test-token")
    monkeypatch.delenv("NONSTOP_JOB_SECRET", raising=False)
    k = Keeper(f"nonstop-test-{uuid.uuid4().hex[:8]}", node=3, host="127.0.0.1", writer=False)
    yield k
    for h in k.slots.holders.values():
        for fd in h.fds:
            if fd is not None:
                os.close(fd)
    for sock in (k.listener, k.replication.tcp, k._wake_r, k._wake_w, *k.conns.values()):
        sock.close()
    k.sel.close()


@pytest.mark.parametrize("raw, said", [
    ({"op": "format_disk"}, "a malformed request: unknown request 'format_disk'"),
    ({"op": "alloc", "holder": "r0"}, "a malformed request: alloc: field 'size' is missing"),
    ({"op": "lease", "holder": "r0", "step": "newest"}, "lease.step"),
    ({"op": "corrupt", "holder": "r9"}, "r9: no snapshot to corrupt"),
])
def test_the_keeper_answers_a_bad_request_with_why_and_serves_on(keeper, raw, said):
    (answer, fds), _ = keeper.serve(1, raw)
    assert isinstance(answer, km.Refused) and said in answer.error and fds == []
    (answer, _), request = keeper.serve(1, {"op": "ping"})
    assert request == km.Ping()
    assert answer == km.Pong(pid=os.getpid(), tcp=keeper.replication.tcp_addr)


def test_the_keeper_logs_a_bad_request_nobody_waits_an_answer_to(keeper, caplog):
    """An answer to a told request would be read as the answer to its sender's next request."""
    caplog.set_level(logging.WARNING, logger="nonstop.keeper")
    assert keeper.serve(1, {"op": "commit", "holder": "r0"})[0] == (None, [])
    assert keeper.serve(1, {"op": "release", "holder": "r0", "slot": 7})[0] == (None, [])
    said = [r.getMessage() for r in caplog.records]
    assert "commit: field 'slot' is missing" in said[0] and "passed over" in said[0]
    assert said[1].startswith("release: IndexError")


def test_the_keeper_serves_well_formed_requests(keeper):
    (answer, fds), _ = keeper.serve(1, km.encode(km.Alloc(holder="r0", size=shm.HEADER + 64)))
    assert isinstance(answer, km.Allocated) and answer.fresh and len(fds) == 1
    assert keeper.serve(1, km.encode(km.Commit(holder="r0", slot=answer.slot)))[0] == (None, [])
    (listing, _), _ = keeper.serve(2, km.encode(km.ListHolders()))
    assert listing.node == 3 and listing.holders["r0"].slots == [None, None]  # never written
    (leased, fds), _ = keeper.serve(2, km.encode(km.Lease(holder="r0")))
    assert leased == km.Leased(slot=None, info=None) and fds == []


def test_the_keeper_answers_what_is_not_json_with_an_error(keeper):
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    keeper.conns[7] = mine
    try:
        theirs.send(b"{not json")
        keeper._serve(7)
        raw, _ = wire.recv(theirs)
        assert isinstance(km.decode_answer(km.Ping, raw), km.Refused)
        assert 7 in keeper.conns  # still connected
    finally:
        theirs.close()


# == the clients ===================================================================================
def test_a_malformed_answer_is_a_keeper_error_to_the_client():
    name = f"nonstop-test-{uuid.uuid4().hex[:8]}"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(wire.address(name))
    server.listen(1)
    client = wire.Client(name, timeout_s=5)
    conn, _ = server.accept()
    try:
        conn.send(b'{"slot": "one", "seq": 1, "size": 8, "repl_s": null, "fresh": true}')
        with pytest.raises(wire.KeeperError, match="a malformed answer to 'alloc'.*slot"):
            client.call(km.Alloc(holder="r0", size=8))
        conn.send(b"[not json")
        with pytest.raises(wire.KeeperError, match="a malformed answer to 'ping'"):
            client.call(km.Ping())
        conn.send(b'{"error": "no such holder"}')
        with pytest.raises(wire.KeeperError, match="no such holder"):
            client.call(km.Ping())
        # what the client sent, one record each
        sent = [km.decode_request(json.loads(conn.recv(4096))) for _ in range(3)]
        assert sent == [km.Alloc(holder="r0", size=8), km.Ping(), km.Ping()]
    finally:
        client.close()
        conn.close()
        server.close()


def test_a_malformed_answer_across_hosts_is_a_keeper_error_too():
    asked = []

    def request(node, order, timeout_s):
        asked.append(order)
        return m.Reply(id=1, reply={"tcp": 4000})

    link = RemoteKeeperLink(SimpleNamespace(request=request), 2, "k", "10.0.0.2:4000")
    with pytest.raises(wire.KeeperError, match="a malformed answer to 'configure'.*tcp"):
        link.call(km.Configure(replicate={}))
    assert km.decode_request(asked[0].msg) == km.Configure(replicate={})


def test_the_agent_relays_a_request_and_refuses_a_malformed_one():
    link = SimpleNamespace(call=lambda request: km.Pong(pid=5, tcp="a:1"), told=[])
    link.tell = link.told.append
    reply = HostKeepers._relay(link, m.KeeperCall(id=4, name="k", msg=km.encode(km.Ping())))
    assert reply == m.Reply(id=4, reply={"pid": 5, "tcp": "a:1"})
    reply = HostKeepers._relay(link, m.KeeperCall(id=5, name="k", msg={"op": "ping", "x": 1}))
    assert reply.id == 5 and "a malformed request" in reply.error
    commit = km.Commit(holder="r0", slot=1)
    assert HostKeepers._relay(link, m.KeeperCall(id=6, name="k", msg=km.encode(commit))) == \
        m.Reply(id=6)  # told: never waited for at the keeper
    assert link.told == [commit]


def test_the_controller_logs_a_malformed_report_and_passes_it_over():
    logged: list[tuple[str, dict]] = []
    done: list[tuple] = []
    fake = SimpleNamespace(log=SimpleNamespace(write=lambda kind, **kw: logged.append((kind, kw))),
                           disk=SimpleNamespace(part_done=lambda *a: done.append(a)),
                           replicas={"count": 0, "bytes": 0, "seconds": 0.0, "failures": 0})
    Keepers._on_report(fake, 2, {"ev": "replicated", "holder": "r0", "step": "ten"})
    Keepers._on_report(fake, 2, {"ev": "meltdown"})
    Keepers._on_report(fake, 2, km.encode(REPORTS[0]))
    Keepers._on_report(fake, 2, km.encode(REPORTS[5]))
    assert [(k, kw["node"], kw["op"]) for k, kw in logged] == [("keeper_error", 2, "report")] * 2
    assert "replicated.step" in logged[0][1]["error"] and "meltdown" in logged[1][1]["error"]
    assert fake.replicas["count"] == 1 and fake.replicas["bytes"] == 8192
    assert done == [(PART, WRITTEN, 2)]


def test_a_malformed_word_from_the_writer_fails_its_part():
    reports: list[km.Report] = []
    sel = selectors.DefaultSelector()
    disk = DiskWrites(Slots(), reports.append, lambda: None, sel)
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    disk.writer_sock = mine
    staged = os.memfd_create("test-staged")
    disk.writer_job = (PART, INFO, staged)
    try:
        theirs.send(b'{"op": "done", "part": {"dir": 5}}')
        disk.from_writer()
        (failed,) = reports
        assert isinstance(failed, km.PartFailed) and failed.job == PART
        assert "the checkpoint writer said something malformed" in failed.error
        assert disk.writer_job is None and disk.kept["r1"] == (PART, INFO, staged)  # to retry
    finally:
        mine.close()
        theirs.close()
        os.close(staged)
        sel.close()

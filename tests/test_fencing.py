"""This host's membership in etcd (agent/fencing.py) without a process: a fake etcd, a fake
clock, peers that answer or not. Each case is a verdict the host agent carries out."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Callable

import pytest

from nonstop.agent.fencing import (EtcdSilent, Fence, JobEnded, Membership, OutageOver,
                                   Registered, Rejoined, peer_answers)
from nonstop.protocol import hosts as keys
from nonstop.store.etcd import StoreUnavailable

HOST = "h1"
TTL = 2
OUTAGE = 60.0
GRACE = 10.0
LIMIT = OUTAGE + 3 * TTL + 5 + GRACE


class FakeLease:
    def __init__(self, etcd: FakeEtcd, ttl_s: int):
        self.etcd, self.ttl_s = etcd, ttl_s
        self.on_lost: Callable[[], None] | None = None
        self.on_doubt: Callable[[bool], None] | None = None
        self.kept = self.stopped = self.revoked = False
        self.failure: str | None = None  # why its refreshes fail (the real lease's)

    def keepalive(self, on_lost: Callable[[], None] | None = None,
                  on_doubt: Callable[[bool], None] | None = None) -> None:
        self.on_lost, self.on_doubt, self.kept = on_lost, on_doubt, True

    def stop(self) -> None:
        self.stopped = True

    def revoke(self) -> None:
        self.etcd.check()
        self.stop()
        self.revoked = True
        self.etcd.drop(self)


class FakeEtcd:
    """The calls Membership makes, over a dict; ``down`` makes every call fail as etcd out of
    reach does."""

    def __init__(self) -> None:
        self.kv: dict[str, tuple[bytes, FakeLease | None]] = {}
        self.down = False
        self.leases: list[FakeLease] = []
        self.tried = threading.Event()  # a call was made (and failed, etcd down)

    def check(self) -> None:
        if self.down:
            self.tried.set()
            raise StoreUnavailable("etcd down (fake)")

    def drop(self, lease: FakeLease) -> None:
        for k in [k for k, (_, held) in self.kv.items() if held is lease]:
            del self.kv[k]

    def expire(self, lease: FakeLease) -> None:
        """etcd says the lease expired (its keys go), as the lease's thread tells."""
        self.drop(lease)
        assert lease.on_lost is not None
        lease.on_lost()

    def put(self, key: str, value: bytes | str, lease: FakeLease | None = None) -> None:
        self.kv[key] = (value.encode() if isinstance(value, str) else value, lease)

    def get(self, key: str) -> tuple[bytes | None, int]:
        self.check()
        return (self.kv[key][0], 1) if key in self.kv else (None, 0)

    def get_prefix(self, key: str = "") -> list[tuple[str, bytes, int, int]]:
        self.check()
        return [(k, v, 1, 1) for k, (v, _) in sorted(self.kv.items()) if k.startswith(key)]

    def create(self, key: str, value: bytes | str, lease: FakeLease | None = None) -> bool:
        self.check()
        if key in self.kv:
            return False
        self.put(key, value, lease)
        return True

    def rejoin(self, key: str, value: bytes | str, lease: FakeLease, unless: str) -> str:
        self.check()
        if key in self.kv:
            return "present"
        if unless in self.kv:
            return "gone"
        self.put(key, value, lease)
        return "rejoined"

    def lease(self, ttl_s: int) -> FakeLease:
        self.check()
        lease = FakeLease(self, ttl_s)
        self.leases.append(lease)
        return lease


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def record(host: str = HOST, addr: str = "10.0.0.1", port: int = 7000,
           incarnation: str = "") -> keys.HostRecord:
    return keys.HostRecord(host_id=host, addr=addr, ctl_port=port, rdzv_port=port + 1, pid=1,
                           slots=2, incarnation=incarnation)


class Setup:
    def __init__(self, answers: Callable[[tuple[str, int]], bool] = lambda peer: False,
                 peers: int = 1):
        self.etcd = FakeEtcd()
        self.clock = Clock()
        self.woke = threading.Event()
        self.stop = threading.Event()
        self.asked: list[tuple[str, int]] = []

        def answer(peer: tuple[str, int]) -> bool:
            self.asked.append(peer)
            return answers(peer)

        self.m = Membership(self.etcd, record(), TTL, OUTAGE, GRACE,  # type: ignore[arg-type]
                            wake=self.woke.set, stop=self.stop, clock=self.clock, answers=answer)
        for i in range(peers):
            other = record(f"h{i + 2}", f"10.0.0.{i + 2}", 7000 + 10 * i, incarnation="x")
            self.etcd.put(keys.host_key(other.host_id), other.dumps())
        assert self.m.register()
        assert self.m.read_job() is None  # the peers, as the store thread reads them

    @property
    def lease(self) -> FakeLease:
        assert self.m.lease is not None
        return self.m.lease  # type: ignore[return-value]

    def until(self, holds_ranks: bool = True, timeout: float = 5.0) -> list:
        """poll until it says something (a thread it started has told, and woken the loop)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            said = self.m.poll(holds_ranks)
            if said:
                return said
            self.woke.wait(0.05)
            self.woke.clear()
        raise AssertionError(f"nothing said within {timeout} s")

    def close(self) -> None:
        self.stop.set()
        for t in threading.enumerate():
            if t.name in ("nonstop-rejoin", "nonstop-probe"):
                t.join(5)
                assert not t.is_alive(), t.name


@pytest.fixture
def setup():
    made: list[Setup] = []

    def make(**kw) -> Setup:
        made.append(Setup(**kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_registers_under_a_lease_kept_alive(setup):
    s = setup()
    raw, _ = s.etcd.get(keys.host_key(HOST))
    assert keys.HostRecord.loads(raw).incarnation == s.m.incarnation != ""
    assert s.lease.kept and s.lease.on_lost is not None and s.lease.on_doubt is not None
    assert s.m.peers == [("10.0.0.2", 7000)]
    assert s.m.peer_names == {"10.0.0.1": HOST, "10.0.0.2": "h2"}
    assert s.m.poll(True) == []
    # a second agent with this host's id is refused, holding nothing
    other = Membership(s.etcd, record(), TTL, OUTAGE, GRACE,  # type: ignore[arg-type]
                       wake=lambda: None, stop=s.stop, clock=s.clock)
    assert not other.register() and s.etcd.leases[-1].revoked


def test_lapse_then_rejoined_as_itself(setup):
    s = setup()
    old, inc = s.lease, s.m.incarnation
    s.etcd.expire(old)
    assert s.m.poll(True) == []  # registering again, in a thread
    assert s.until() == [Rejoined()]
    raw, _ = s.etcd.get(keys.host_key(HOST))
    assert keys.HostRecord.loads(raw).incarnation == inc == s.m.incarnation
    assert s.lease is not old and s.lease.kept and old.stopped
    assert s.m.poll(True) == []  # said once


def test_lapse_while_the_job_gave_this_incarnation_up_fences(setup):
    s = setup()
    s.etcd.put(keys.gone_key(HOST, s.m.incarnation), "1")
    s.etcd.expire(s.lease)
    assert s.until() == [Fence("the job gave this host up while its lease had lapsed")]
    assert s.etcd.get(keys.host_key(HOST))[0] is None  # its try's lease revoked
    assert all(lease.revoked for lease in s.etcd.leases[1:])
    assert s.m.poll(True) == []


def test_lapse_with_another_run_of_this_host_registered_fences(setup):
    s = setup()
    s.etcd.expire(s.lease)
    s.etcd.put(keys.host_key(HOST), record(incarnation="newer").dumps())
    assert s.until() == [Fence("another run of this host registered in its place")]


def test_lapse_with_etcd_out_of_reach_gives_up_at_the_outage_limit(setup):
    s = setup()
    s.etcd.expire(s.lease)
    s.etcd.down = True
    assert s.m.poll(True) == []
    assert s.etcd.tried.wait(5)  # the rejoin thread tried (its start read the clock)
    t0 = s.clock.t
    s.clock.t += TTL + 1
    deadline = time.monotonic() + 5
    while s.m.doubt_since is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s.m.doubt_since == t0  # etcd silent since the lapse: the metrics say so
    s.clock.t = t0 + LIMIT + 1
    said = s.until()
    assert said == [OutageOver(LIMIT + 1, OUTAGE)]


def test_etcd_silent_reaching_no_peer_fences(setup):
    s = setup(answers=lambda peer: False)
    s.lease.on_doubt(True)
    assert s.m.doubt_since == s.clock.t
    said = s.m.poll(True)
    assert said == [EtcdSilent()]  # said once, as the judgement begins
    assert s.until() == [Fence("it reaches neither etcd nor any other host")]
    assert s.asked == [("10.0.0.2", 7000)]
    assert s.m.doubt_since is None and s.m.poll(True) == []


def test_etcd_silent_reaching_a_peer_trains_on_until_the_outage_limit(setup):
    s = setup(answers=lambda peer: True, peers=2)
    since = s.clock.t
    s.lease.on_doubt(True)
    s.woke.clear()
    assert s.m.poll(True) == [EtcdSilent()]
    assert s.woke.wait(5)  # the round of probes has ended
    assert s.m.poll(True) == []  # a peer answered: etcd is down, not this host cut off
    assert s.asked == [("10.0.0.2", 7000)]  # one answer is enough
    s.clock.t = since + LIMIT
    assert s.m.poll(True) == []
    s.clock.t = since + LIMIT + 2
    assert s.m.poll(True) == [OutageOver(LIMIT + 2, OUTAGE)]


def test_etcd_back_ends_the_judgement(setup):
    s = setup(answers=lambda peer: True)
    s.lease.on_doubt(True)
    assert s.m.poll(True) == [EtcdSilent()]
    s.lease.on_doubt(False)
    s.clock.t += LIMIT + 1
    assert s.m.doubt_since is None and s.m.poll(True) == []


def test_etcd_silent_with_no_peer_known(setup):
    """A host holding ranks with no peer known (a job of one host) cannot tell a cut from etcd
    down: it trains on; one holding no rank has nothing to lose: it fences."""
    s = setup(peers=0)
    s.lease.on_doubt(True)
    s.woke.clear()
    assert s.m.poll(True) == [EtcdSilent()]
    assert s.woke.wait(5)  # the round of probes (of no peer) has ended
    assert s.m.poll(True) == []
    assert s.m.poll(True) == []
    assert s.m.poll(False) == [Fence("it reaches neither etcd nor any other host")]


def test_job_done_read(setup):
    s = setup()
    s.etcd.put(keys.DONE, keys.JobDone(3, "x").dumps())
    assert s.m.read_job() == JobEnded(3)
    assert s.m.poll(True) == [JobEnded(3)]
    s.etcd.put(keys.DONE, json.dumps({}))  # another version's: the job ended all the same
    assert s.m.read_job() == JobEnded(1)


def test_given_up_marker_read_fences(setup):
    s = setup()
    s.etcd.put(keys.gone_key(HOST, "older"), "1")  # an earlier incarnation's: not this one
    s.m.read_job()
    assert s.m.poll(True) == []
    s.etcd.put(keys.gone_key(HOST, s.m.incarnation), "1")
    s.m.read_job()
    assert s.m.poll(True) == [Fence("the job gave this host up")]
    assert s.m.poll(True) == []


def test_fenced_host_joins_again_as_a_new_incarnation(setup):
    s = setup()
    old, inc = s.lease, s.m.incarnation
    s.m.leave()
    assert old.stopped and not old.revoked and s.m.lease is None
    s.etcd.down = True
    assert s.m.register_again() is None  # etcd out of reach: tried again later
    s.etcd.down = False
    said = s.m.register_again()
    assert old.revoked  # the old record went first: the controller sees a new host
    assert isinstance(said, Registered) and said.incarnation == s.m.incarnation != inc
    raw, _ = s.etcd.get(keys.host_key(HOST))
    assert keys.HostRecord.loads(raw).incarnation == said.incarnation


def test_fenced_host_finds_the_job_ended(setup):
    s = setup()
    s.m.leave()
    s.etcd.put(keys.DONE, keys.JobDone(0).dumps())
    assert s.m.register_again() == JobEnded(0)


def test_the_rejoin_thread_ends_with_the_agent(setup):
    s = setup()
    s.etcd.expire(s.lease)
    s.etcd.down = True
    assert s.m.poll(True) == []
    assert s.etcd.tried.wait(5)
    s.close()  # sets stop, joins the threads started here


def test_peer_answers_over_loopback():
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        assert peer_answers(srv.getsockname())  # accepted
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    assert peer_answers(("127.0.0.1", port))  # refused: the path works
    # ...but not from this host's own address: a cut host still reaches itself
    assert not peer_answers(("127.0.0.1", port), own="127.0.0.1")


def test_a_cut_host_with_a_record_of_an_earlier_run_at_its_own_address_fences():
    """A new machine in the place of one just gone (the same address) reads the old one's record
    among its peers before it expires; cut off then, its probe of that record is refused by its
    own kernel. That is no peer answering: it fences (it used to train on, cut off, forever)."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    etcd, clock, woke, stop = FakeEtcd(), Clock(), threading.Event(), threading.Event()
    m = Membership(etcd, record(addr="127.0.0.1", port=port + 1), TTL, OUTAGE,  # type: ignore
                   GRACE, wake=woke.set, stop=stop, clock=clock)  # the real probe
    earlier = record("h1-earlier", "127.0.0.1", port, incarnation="old")
    etcd.put(keys.host_key(earlier.host_id), earlier.dumps())
    try:
        assert m.register() and m.read_job() is None and m.peers == [("127.0.0.1", port)]
        etcd.down = True
        m.lease.on_doubt(True)  # type: ignore[union-attr]
        deadline, said = time.monotonic() + 5, []
        while time.monotonic() < deadline and not any(isinstance(v, Fence) for v in said):
            said += m.poll(True)
            woke.wait(0.05)
            woke.clear()
        assert Fence("it reaches neither etcd nor any other host") in said, said
    finally:
        stop.set()


def test_the_jobs_end_record_is_typed_and_a_malformed_one_refused():
    assert keys.JobDone.loads(keys.JobDone(2, "policy").dumps()) == keys.JobDone(2, "policy")
    assert keys.JobDone.loads('{"code": 0, "diagnosis": null}') == keys.JobDone(0)
    for bad in ('{"code": 0}', '{"code": "0", "diagnosis": null}', '{"code": true, "diagnosis":'
                ' null}', '{"code": 1, "diagnosis": 3}', '{"code": 1, "diagnosis": null, "x": 1}',
                "[]", "not json"):
        with pytest.raises(ValueError):
            keys.JobDone.loads(bad)
        assert keys.JobDone.read(bad).code == 1  # read: the job ended, cause unknown

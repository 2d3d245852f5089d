"""A controller that cannot prove its lease still holds acts on nothing: its orders to the hosts
wait until the lease is confirmed (then they go out, in order), except the end of the job after
the store's outage tolerance; a host refusing its epoch makes it step down, never crash; a
controller that hears no other host and not etcd either is deaf (its silence is no host's).
Real authenticated channels on loopback, no process."""

from __future__ import annotations

import threading
import time

import pytest

from nonstop.controller.cluster import Cluster, Deposed
from nonstop.net.channel import connect, new_secret
from nonstop.net.listener import Listener
from nonstop.protocol import hosts as keys
from nonstop.protocol import messages as m
from office import Office

HOST = "127.0.0.1"


@pytest.fixture
def host(tmp_path):
    """A cluster of this controller (epoch 7) with one host, whose side of the channel is
    returned: what the controller sends arrives there."""
    secret = new_secret().encode()
    with Listener(HOST, secret) as lst:
        box: dict = {}
        t = threading.Thread(target=lambda: box.setdefault("ch", lst.accept(10)))
        t.start()
        cluster = Cluster(7, secret, tmp_path, Office())
        rec = keys.HostRecord(host_id="h0", addr=HOST, ctl_port=lst.port, rdzv_port=1, pid=1,
                              slots=1, incarnation="a")
        cluster.add_host(0, rec, ch=connect(HOST, lst.port, secret))
        t.join(10)
        agent = box["ch"]
        hello = m.decode(agent.recv(5)[0])
        assert isinstance(hello, m.Hello) and hello.epoch == 7
        yield cluster, agent
        cluster.close()
        agent.close()


def _received(agent, timeout: float = 0.3) -> list:
    out = []
    while True:
        try:
            out.append(m.decode(agent.recv(timeout)[0]))
        except Exception:  # noqa: BLE001 - nothing more within the timeout
            return out


def test_orders_wait_while_office_is_unproven_then_go_out_in_order(host):
    cluster, agent = host
    cluster.office.held = False
    cluster.abort(3, [])  # nothing to abort: nothing is sent either way
    cluster.signal(99)  # an unknown process: nothing
    cluster.tell(0, m.Abort(gen=3, wids=[1]))
    cluster.tell(0, m.Abort(gen=4, wids=[2]))
    cluster.poll(0.05)
    assert _received(agent) == []  # not while the lease is not confirmed
    cluster.office.held = True
    cluster.poll(0.05)
    got = _received(agent)
    assert [(x.gen, x.wids, x.epoch) for x in got] == [(3, [1], 7), (4, [2], 7)]


def test_the_end_of_the_job_goes_out_without_a_lease(host):
    cluster, agent = host
    cluster.office.held = False
    cluster.giving_up = True  # etcd away longer than hosts.store_outage_s
    cluster.tell(0, m.End(code=1, why="etcd unreachable"))
    (end,) = _received(agent)
    assert isinstance(end, m.End) and end.code == 1


def test_a_host_that_met_a_newer_controller_deposes_this_one(host):
    cluster, agent = host
    agent.send(m.encode(m.Refused(why="epoch 7 is older than 9")))
    with pytest.raises(Deposed, match="refused a command"):
        for _ in range(50):
            cluster.poll(0.05)


def test_once_training_is_complete_the_jobs_end_goes_out_without_a_lease(host, capsys):
    """etcd gone for good as the ranks finish: what waited, then the ranks' completion and the
    job's end go out, in order - no successor could decide otherwise - and nothing claims the
    lease was confirmed."""
    cluster, agent = host
    cluster.office.held = False
    cluster.tell(0, m.Abort(gen=3, wids=[1]))
    cluster.poll(0.05)
    assert _received(agent) == []
    cluster.office.done = True
    cluster.poll(0.05)
    cluster.tell(0, m.End(code=0))
    got = _received(agent)
    assert [type(x) for x in got] == [m.Abort, m.End] and got[0].gen == 3
    err = capsys.readouterr().err
    assert "the job is ending: 1 order(s) that waited go out" in err
    assert "lease is confirmed" not in err


def test_a_host_that_answers_as_another_incarnation_is_not_taken_for_the_old_one(host):
    """The host fenced itself and registered again before our hello reached it: its answer is
    the new incarnation's. Nothing of it is adopted for the old one, and nothing meant for the
    old one reaches it: the old one is given up, the new one joins as a new host."""
    cluster, agent = host
    agent.send(m.encode(m.State(host="h0", incarnation="b", workers=[
        m.HostWorker(wid=4, pid=1, alive=False, code=-9)])))
    for _ in range(20):
        cluster.poll(0.05)
        if cluster.links[0].moved_on:
            break
    link = cluster.links[0]
    assert link.moved_on and link.state is None and not cluster.host_up(0)
    assert 4 not in cluster.procs
    cluster.tell(0, m.Abort(gen=3, wids=[1]))
    assert _received(agent) == []


def test_a_controller_that_hears_no_host_and_not_etcd_is_deaf(host):
    """Every other host silent at once proves nothing against them while etcd has not answered
    a request sent since the last of them spoke: the controller's own ears may have failed (its
    host's incoming traffic lost). etcd answering since, or any host speaking, ends it."""
    cluster, agent = host
    cluster.own_host = "elsewhere"
    before = time.monotonic()
    assert not cluster.deaf()  # never heard: nothing to judge
    agent.send(m.encode(m.Progress(recs={})))
    deadline = time.monotonic() + 5
    while cluster.links[0].heard is None and time.monotonic() < deadline:
        cluster.poll(0.02)
    cluster.office.heard = before  # etcd's newest answered request was sent before that frame
    assert not cluster.deaf()  # silent for less than the hosts' reporting allows
    time.sleep(0.5)  # every host silent past it (each reports every 0.1 s)
    assert cluster.deaf()
    cluster.office.heard = time.monotonic()  # etcd answered since: the silence is the hosts' own
    assert not cluster.deaf()
    # ...but an answer to a request sent just after the hosts' last frame, then nothing for two
    # of etcd's periods: its ears failed after that answer (it heard neither since)
    cluster.office.period = 0.1
    time.sleep(0.25)
    assert cluster.deaf()
    cluster.office.period = 1.0
    cluster.office.heard = before
    # its own host's agent speaks over loopback, which a host whose incoming traffic is lost
    # still carries: no proof that the controller hears the job
    cluster.own_host = "h0"
    agent.send(m.encode(m.Progress(recs={})))
    cluster.poll(0.3)
    assert cluster.deaf()
    cluster.own_host = "elsewhere"
    agent.send(m.encode(m.Progress(recs={})))  # another host speaks again
    deadline = time.monotonic() + 5
    while cluster.deaf() and time.monotonic() < deadline:
        cluster.poll(0.02)
    assert not cluster.deaf()



def test_a_takeover_asks_the_agent_for_its_handshake_not_the_kernel_for_a_connect():
    """A paused host's kernel still accepts a connection (its listening socket's backlog): a
    takeover waited 4 s more for such a host. Only the channel's authenticated handshake proves
    an agent is there, and it is given ``ANSWER_S`` to complete it."""
    import socket

    from nonstop.controller.handover import ANSWER_S, answers as _answers

    secret = new_secret().encode()
    with Listener(HOST, secret) as lst, socket.socket() as paused:
        stop = threading.Event()

        def serve() -> None:  # an agent's accept loop: it completes handshakes
            while not stop.is_set():
                ch = lst.accept(0.1)
                if ch is not None:
                    ch.close()

        t = threading.Thread(target=serve)
        t.start()
        try:
            assert _answers(HOST, lst.port, secret)
            paused.bind((HOST, 0))
            paused.listen()  # accepted by the kernel, never answered: a stopped process
            t0 = time.monotonic()
            assert not _answers(HOST, paused.getsockname()[1], secret)
            assert time.monotonic() - t0 < ANSWER_S + 0.5
            assert not _answers(HOST, lst.port, new_secret().encode())  # another job's secret
        finally:
            stop.set()
            t.join(5)


def test_what_the_offices_own_threads_find_reaches_it_in_the_pollers_thread(host):
    """The store loop and a host's connection run on threads of their own: what they find is a
    typed notice, handed to the office by the cluster's poll, in the controller's thread."""
    cluster, _agent = host
    from nonstop.controller.elected import HostGivenUp

    posted = threading.Thread(target=cluster.notice, args=(HostGivenUp(3),))
    posted.start()
    posted.join(5)
    assert cluster.office.notices == []  # not yet: at the next poll
    cluster.poll(0.5)
    assert cluster.office.notices == [(HostGivenUp(3), threading.get_ident())]

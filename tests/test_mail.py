"""The workers' events through the job's store (its server, and torch's TCPStore client): each worker numbers its own, so
a writer delayed for any time loses nothing and holds back no one else's."""

from __future__ import annotations

import threading
import time

import pytest

from nonstop import protocol
from nonstop.agent import loopback
from nonstop.protocol import events
from nonstop.agent.mail import SWEEP_S, StoreMail
from nonstop.runtime.worker import WorkerRuntime


@pytest.fixture
def store():
    s = loopback.master_store()
    yield s
    s.close()


def writer(store, wid: int) -> WorkerRuntime:
    """A worker's own event writing (``WorkerRuntime.emit``) on the real store, without the rest
    of a worker process (its monitor thread, its keeper)."""
    rt = object.__new__(WorkerRuntime)
    rt.host, rt.port, rt.worker_id = loopback.HOST, store.port, wid
    rt._local = threading.local()
    rt._ev_seq, rt._ev_lock = 0, threading.Lock()
    return rt


def read(mail: StoreMail, until, timeout: float = 5.0) -> list[dict]:
    got: list[dict] = []
    deadline = time.time() + timeout
    while not until(got):
        assert time.time() < deadline, got
        got += list(mail.events())
        time.sleep(0.01)
    return got


def test_a_delayed_writer_loses_nothing_and_delays_no_one(store):
    mail = StoreMail(wids=lambda: [3, 4])
    mail.attach(store)
    a, b = writer(store, 3), writer(store, 4)
    a.emit(events.Joining(gen=0, rank=0))
    b.emit(events.Joining(gen=0, rank=1))
    got = read(mail, lambda g: len(g) == 2)
    assert sorted(e["wid"] for e in got) == [3, 4]
    # 3 is stopped (SIGSTOP, a long pause) for longer than any wait the reader could make...
    for n in (1, 2):
        b.emit(events.GroupKept(gen=0, times=n))
    assert [(e["wid"], e["times"]) for e in read(mail, lambda g: len(g) == 2)] == [(4, 1), (4, 2)]
    time.sleep(2.5)
    # ...and its "left" when it goes on is still read, not skipped
    a.emit(events.LeftGeneration(gen=0, rank=0, step=1, dirty=False, reason="peer", t_caught=1.0))
    (late,) = read(mail, lambda g: len(g) == 1)
    assert (late["wid"], late["type"], late["step"]) == (3, "left", 1)


def test_what_a_rank_emits_the_controller_decodes_as_it_was_with_its_wid_and_time(store):
    mail = StoreMail(wids=lambda: [6])
    mail.attach(store)
    t0 = time.time()
    writer(store, 6).emit(events.FirstStep(gen=2, rank=1, step=5, steps=False, via="report"))
    (raw,) = read(mail, lambda g: len(g) == 1)
    ev = events.decode(raw)
    assert ev == events.FirstStep(wid=6, t=ev.t, gen=2, rank=1, step=5, steps=False, via="report")
    assert t0 <= ev.t <= time.time()


def test_an_event_written_without_its_doorbell_is_found_by_the_sweep(store):
    """A writer killed between its event and the doorbell: the next sweep reads the event."""
    mail = StoreMail(wids=lambda: [5])
    mail.attach(store)
    assert list(mail.events()) == []
    store.set(protocol.event_key(5, 0), protocol.dumps({"type": "rank_done", "wid": 5, "t": 1.0}))
    t0 = time.monotonic()
    (ev,) = read(mail, lambda g: len(g) == 1, timeout=SWEEP_S + 3)
    assert ev["type"] == "rank_done" and time.monotonic() - t0 <= SWEEP_S + 1


def test_events_from_many_threads_of_one_worker_arrive_once_each_in_their_order(store):
    mail = StoreMail(wids=lambda: [7])
    mail.attach(store)
    rt = writer(store, 7)
    threads, per = 4, 50

    def work(t: int) -> None:
        for i in range(per):
            rt.emit(events.GroupKept(gen=t, times=i))

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    got = read(mail, lambda g: len(g) >= threads * per, timeout=30)
    for w in workers:
        w.join(10)
    assert len(got) == threads * per
    for t in range(threads):
        assert [e["times"] for e in got if e["gen"] == t] == list(range(per))


def test_a_worker_no_longer_listed_is_forgotten(store):
    listed = [8]
    mail = StoreMail(wids=lambda: list(listed))
    mail.attach(store)
    writer(store, 8).emit(events.Started(pid=1))
    assert len(read(mail, lambda g: len(g) == 1)) == 1
    listed.clear()
    writer(store, 9).emit(events.Started(pid=2))  # rings the doorbell: a sweep
    assert list(mail.events()) == [] and mail._next == {}


def test_a_batch_on_one_host_writes_each_message_whole(store):
    """On one host a batch writes each mailbox as it is sent, with what its messages share put
    in (across hosts the shared fields go once a frame: tests/test_messages.py)."""
    mail = StoreMail(lambda: [])
    mail.attach(store)
    with mail.batch({"type": "exit", "why": "shared"}):
        mail.send(3, 0, {"why": "its own"})
        mail.send(4, 0, {})
    mail.send(5, 0, {"type": "exit"})  # after the batch: nothing added
    got = {wid: protocol.loads(store.get(protocol.mailbox_key(wid, 0))) for wid in (3, 4, 5)}
    assert got == {3: {"type": "exit", "why": "its own"}, 4: {"type": "exit", "why": "shared"},
                   5: {"type": "exit"}}

"""The host's link to the controller in office (agent/office.py), over real authenticated
channels on loopback, in this process: hellos and epochs, a deposed controller refused, what a
successor is told, exits that found no controller."""

from __future__ import annotations

import time

from nonstop.agent.office import OfficeLink
from nonstop.net import channel
from nonstop.protocol import messages as m

SECRET = b"office-link-test-secret-0123456789"


def _link() -> OfficeLink:
    return OfficeLink("127.0.0.1", SECRET, 5.0, now=lambda: 1000.0, wake=lambda: None).start()


def _orders(link: OfficeLink, n: int, timeout: float = 5.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += list(link.orders())
        time.sleep(0.01)
    return got


def _reports(ch, n: int) -> list:
    return [m.decode(ch.recv(timeout=5.0)[0]) for _ in range(n)]


def test_a_controller_says_hello_and_its_orders_are_obeyed_a_deposed_ones_refused():
    link = _link()
    try:
        first = channel.connect("127.0.0.1", link.port, SECRET)
        first.send(m.encode(m.Hello(epoch=3)))
        ((ch, hello),) = _orders(link, 1)
        assert isinstance(hello, m.Hello) and not link.heard
        assert link.hello(ch, hello.epoch) and link.heard and link.connected
        assert link.take_news() == (3, "127.0.0.1") and link.take_news() is None
        assert link.office_at("127.0.0.1") and not link.office_at("127.0.0.2")
        # a successor takes office: the one before is deposed, its orders refused and said so
        second = channel.connect("127.0.0.1", link.port, SECRET)
        second.send(m.encode(m.Hello(epoch=5)))
        ((ch2, hello2),) = _orders(link, 1)
        assert link.hello(ch2, hello2.epoch)  # a new one: the channel before is closed
        # the deposed controller, connecting again, still believes it is in office
        deposed = channel.connect("127.0.0.1", link.port, SECRET)
        deposed.send(m.encode(m.Signal(epoch=3, wid=1, sig=15)))
        second.send(m.encode(m.Signal(epoch=5, wid=2, sig=15)))
        ((_, obeyed),) = _orders(link, 1)
        assert isinstance(obeyed, m.Signal) and obeyed.wid == 2
        refused = None
        deadline = time.monotonic() + 5  # (its order may come in after the other's)
        while refused is None and time.monotonic() < deadline:
            assert list(link.orders()) == []
            try:
                refused = m.decode(deposed.recv(timeout=0.05)[0])
            except TimeoutError:
                pass
        assert isinstance(refused, m.Refused) and "stale epoch 3 < 5" in refused.why
        # the same controller saying hello again (it reconnected) is not a new one
        assert not link.hello(ch2, 5)
    finally:
        link.close()


def test_a_successor_is_told_every_event_and_the_exits_no_controller_heard():
    link = _link()
    try:
        link.relay([{"type": "a"}])  # no controller yet: kept
        link.exited(m.ProcExit(wid=4, code=1))
        assert not link.send(m.Refused(why="nobody"))
        ctl = channel.connect("127.0.0.1", link.port, SECRET)
        ctl.send(m.encode(m.Hello(epoch=2)))
        ((ch, hello),) = _orders(link, 1)
        link.catch_up(link.hello(ch, 2))
        events, exits = _reports(ctl, 2)
        assert events.events == [{"type": "a"}] and events.replay and events.now == 1000.0
        assert [(e.wid, e.code) for e in exits.exits] == [(4, 1)]
        link.relay([{"type": "b"}])  # only what it has not had
        (more,) = _reports(ctl, 1)
        assert more.events == [{"type": "b"}] and not more.replay
        # its channel breaks; it connects again: told what it missed, not everything again
        ctl.close()
        deadline = time.monotonic() + 5
        while link.connected and time.monotonic() < deadline:
            list(link.orders())
            time.sleep(0.01)
        assert not link.connected
        link.relay([{"type": "c"}])
        again = channel.connect("127.0.0.1", link.port, SECRET)
        again.send(m.encode(m.Hello(epoch=2)))
        ((ch, _),) = _orders(link, 1)
        link.catch_up(link.hello(ch, 2))
        (missed,) = _reports(again, 1)
        assert missed.events == [{"type": "c"}] and not missed.replay
        # fenced: nothing kept for the next controller
        link.drop()
        assert not link.connected and link.history == []
    finally:
        link.close()

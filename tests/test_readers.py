"""The controller's one reader of every host's channel (controller/readers.py): it holds off while the
controller fans out, for a bounded time, and then delivers what came meanwhile, in order."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from nonstop.controller import readers as rd
from nonstop.net.channel import new_secret
from nonstop.net.listener import Listener

from test_channel import HOST, open_pair


@pytest.fixture
def wired():
    secret = new_secret().encode()
    with Listener(HOST, secret) as lst:
        cli, srv = open_pair(secret, lst)
        got: list[tuple[float, dict]] = []
        stop = threading.Event()
        r = rd.Readers(lambda link, msg: got.append((time.monotonic(), msg)),
                       lambda link: None, stop)
        r.watch(SimpleNamespace(ch=srv, lost=False))
        yield r, cli, got
        stop.set()
        r.wake()
        cli.close()
        srv.close()


def _wait_for(cond, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_frames_wait_while_the_controller_fans_out_then_come_in_order(wired):
    r, cli, got = wired
    cli.send({"n": 0})
    assert _wait_for(lambda: len(got) == 1)
    with r.hold():
        for n in (1, 2, 3):
            cli.send({"n": n})
        time.sleep(0.3)
        assert len(got) == 1  # read nothing while held
        t_release = time.monotonic()
    assert _wait_for(lambda: len(got) == 4)
    assert [m["n"] for _, m in got] == [0, 1, 2, 3]
    assert all(t >= t_release for t, _ in got[1:])


def test_a_hold_never_stops_the_reading_longer_than_its_bound(wired, monkeypatch):
    r, cli, got = wired
    monkeypatch.setattr(rd, "HOLD_MAX_S", 0.2)
    cli.send({"n": 0})
    assert _wait_for(lambda: len(got) == 1)
    with r.hold():  # a fan-out that overstays: the frames come in all the same
        cli.send({"n": 1})
        assert _wait_for(lambda: len(got) == 2, timeout_s=3.0)


def test_a_channel_closed_as_it_is_taken_is_a_broken_link_and_the_reading_goes_on(wired):
    """A channel closed by another thread between its being handed over and its being watched
    (its descriptor gone): that link is broken (its host reconnects), and the one thread that
    reads every host lives on."""
    r, cli, got = wired
    broken = []
    r._broken = broken.append
    gone = SimpleNamespace(closed=False, fileno=lambda: 999_999)  # no descriptor (any more)
    link = SimpleNamespace(ch=gone, lost=False)
    r.watch(link)
    assert _wait_for(lambda: broken == [link])
    cli.send({"n": 1})  # the other host's channel is still read
    assert _wait_for(lambda: [m["n"] for _, m in got] == [1])

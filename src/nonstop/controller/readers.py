"""One thread reads every host's channel: the controller's side of many hosts.

A thread per host, each blocked on its own channel, is thousands of threads in a job of
thousands of hosts: when the hosts all speak at once (a generation forming) they all wake and
contend for the interpreter with the controller's own thread, which then barely runs (measured
with 2,048 simulated hosts: the controller's loop ran in fewer than 2% of its samples and the
job's start was not read in 5 minutes). Here one selector watches every channel and reads only
what has arrived (``Channel.recv_ready``: the start of a frame waits in the channel, never the
thread), so a host that stops mid-frame holds up no other.
"""

from __future__ import annotations

import contextlib
import os
import queue
import selectors
import threading
from typing import Any, Callable, Iterator

from ..net.channel import AuthError, ChannelClosed

HOLD_MAX_S = 1.0  # the longest the reading waits for the controller's fan-out


class Readers:
    """``deliver(link, message)`` for each frame a host sends (in this thread); ``broken(link)``
    once a channel fails (reconnecting is the caller's: ``watch`` the link's new channel)."""

    def __init__(self, deliver: Callable[[Any, dict], None], broken: Callable[[Any], None],
                 stop: threading.Event):
        self._deliver, self._broken, self._stop = deliver, broken, stop
        self._sel = selectors.DefaultSelector()
        self._new: "queue.SimpleQueue[tuple[Any, Any]]" = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._gate = threading.Lock()  # held while the controller fans out (see ``hold``)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """While the controller sends every host its part of a generation (or an abort), this
        thread reads nothing: what the hosts say meanwhile waits in their sockets. Both threads
        need the interpreter, and the hosts answer at once: with 2,048 hosts, reading their
        answers halved the speed of sending the rest. Never longer than ``HOLD_MAX_S``."""
        got = self._gate.acquire(timeout=HOLD_MAX_S)
        try:
            yield
        finally:
            if got:
                self._gate.release()

    def watch(self, link: Any) -> None:
        """Read ``link.ch`` from now on (from any thread)."""
        self._new.put((link, link.ch))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="nonstop-hosts-read",
                                                daemon=True)
                self._thread.start()
        self.wake()

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # full: a wake-up is already pending
            pass

    def _take_new(self) -> None:
        while True:
            try:
                link, ch = self._new.get_nowait()
            except queue.Empty:
                return
            if ch is None or ch.closed:
                continue
            try:
                fd = ch.fileno()
                self._drop(fd)  # a closed channel's number, taken again by a new one
                self._sel.register(fd, selectors.EVENT_READ, (link, ch))
            except (OSError, ValueError):  # closed by another thread since: a broken channel
                if not self._stop.is_set() and not link.lost and link.ch is ch:
                    self._broken(link)

    def _drop(self, fd: int) -> None:
        try:
            self._sel.unregister(fd)
        except (KeyError, ValueError):
            pass

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._take_new()
                ready = self._sel.select(1.0)
                if self._gate.acquire(timeout=HOLD_MAX_S):  # (see ``hold``)
                    self._gate.release()
                for key, _ in ready:
                    if key.data is None:
                        try:
                            os.read(self._wake_r, 4096)
                        except OSError:
                            pass
                        continue
                    link, ch = key.data
                    if link.lost or link.ch is not ch:  # gone, or replaced by a new channel
                        self._drop(key.fd)
                        continue
                    try:
                        frames = ch.recv_ready()
                    except (ChannelClosed, AuthError, OSError):
                        self._drop(key.fd)
                        if not self._stop.is_set() and not link.lost:
                            self._broken(link)
                        continue
                    for msg, _ in frames:
                        self._deliver(link, msg)
        finally:
            self._sel.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

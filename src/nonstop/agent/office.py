"""The host's link to the controller in office.

Controllers connect to the host (the one elected, and any that believes it still is): each
channel is authenticated by the listener and read on a thread of its own, and what comes on it
waits in one inbox for the host's loop. The epoch of the newest hello fences a deposed
controller off: its orders are refused. What the host tells the controller in office - its
processes' events, their exits - is kept for a successor: a controller that takes over is told
every event so far (it rebuilds its view from them), the same one reconnecting only what it
missed, and exits that found no controller to hear them go out with the next hello.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import sys
import threading
from typing import Any, Callable, Iterator

from ..net.channel import CONTROL_TOS
from ..protocol import messages as m

CLOSED = object()  # in the inbox: the channel it came on is closed
HISTORY_MAX = 50_000  # events kept for a controller that takes over


class OfficeLink:
    """The channels from controllers to this host, and what the one in office was told."""

    def __init__(self, addr: str, secret: bytes, stall_timeout_s: float,
                 now: Callable[[], float], wake: Callable[[], None]):
        """``now``: this host's clock (each report carries it); ``wake``: the host's loop is
        woken when something arrives. A controller that takes nothing from this host for
        ``stall_timeout_s`` is cut off or stalled: its channel closes rather than hold the
        host's loop in a send (a live controller connects again and is told what it missed)."""
        from ..net import listener

        self.epoch = 0  # the newest controller epoch seen: older ones are fenced off
        self.ctl: Any = None  # the channel of the controller in office (None: it broke)
        # the channel whose hello was the newest: its orders are obeyed even once it broke (a
        # controller may send its orders and close before this host's answer to its hello)
        self.office_ch: Any = None
        self.news: tuple[int, str] | None = None  # a new controller (epoch, its address)
        self.history: list[dict[str, Any]] = []  # every event of this host's processes
        self._delivered = 0  # how many of them reached the controller in office
        self._unsent_exits: list[m.ProcExit] = []
        self._inbox: "queue.Queue[tuple[Any, Any]]" = queue.Queue()
        self._refusals: dict[tuple[str, str], int] = {}  # (address, reason) -> times refused
        self._now, self._wake = now, wake
        self._stop = threading.Event()
        self.listener = listener.Listener(addr, secret, on_refused=self._refused,
                                          stall_timeout_s=stall_timeout_s, tos=CONTROL_TOS)
        self.port: int = self.listener.port

    def start(self) -> "OfficeLink":
        """Accept controllers from now on (a hello waits in the inbox until the loop reads it)."""
        threading.Thread(target=self._accept_loop, name="nonstop-accept", daemon=True).start()
        return self

    def close(self) -> None:
        self._stop.set()
        self.listener.close()

    @property
    def heard(self) -> bool:
        """Whether a controller has said hello (the job has formed)."""
        return self.epoch != 0

    @property
    def connected(self) -> bool:
        """Whether the channel of the controller in office is up."""
        return self.ctl is not None

    def office_at(self, addr: str) -> bool:
        """Whether the controller in office connected from ``addr``."""
        ch = self.office_ch
        return ch is not None and bool(ch.peer) and ch.peer[0] == addr

    # == what comes in ===========================================================================
    def orders(self) -> Iterator[tuple[Any, m.Order]]:
        """What arrived since, as (channel, order): hellos from any controller not deposed,
        other orders only from the one in office. A closed channel is forgotten; a deposed
        controller is told it is."""
        while True:
            try:
                ch, order = self._inbox.get_nowait()
            except queue.Empty:
                return
            if order is CLOSED:
                if ch is self.ctl:
                    self.ctl = None
                continue
            if order.epoch < self.epoch:  # a deposed controller: fenced off
                try:
                    ch.send(m.encode(m.Refused(why=f"stale epoch {order.epoch} < {self.epoch}")))
                except Exception:  # noqa: BLE001
                    pass
                continue
            if isinstance(order, m.Hello) or ch is self.office_ch:
                yield ch, order

    def hello(self, ch: Any, epoch: int) -> bool:
        """The controller on ``ch`` is the one in office from now on; True when it is a new one
        (a takeover, or the first)."""
        if self.ctl is not None and self.ctl is not ch:
            try:
                self.ctl.close()
            except Exception:  # noqa: BLE001
                pass
        new = epoch != self.epoch
        if new:  # said with its first order (a host it turns away hears only of its end)
            self.news = (epoch, ch.peer[0] if ch.peer else "?")
        self.epoch, self.ctl, self.office_ch = epoch, ch, ch
        return new

    def take_news(self) -> tuple[int, str] | None:
        """A new controller's (epoch, address), once."""
        news, self.news = self.news, None
        return news

    # == what goes out ===========================================================================
    def send(self, msg: m.Report) -> bool:
        """``msg`` to the controller in office, stamped with this host's clock; False when no
        channel is up (from the loop's thread, or the keepers' relay)."""
        ctl = self.ctl
        if ctl is None:
            return False
        try:
            ctl.send(m.encode(dataclasses.replace(msg, now=self._now())))
            return True
        except Exception:  # noqa: BLE001 - the controller is gone: a standby will say hello
            if self.ctl is ctl:
                self.ctl = None
            return False

    def catch_up(self, new: bool) -> None:
        """After a hello: the events the controller has not had (all of them, for a new one)
        and the exits no controller heard."""
        since = 0 if new else self._delivered
        if self.history[since:]:
            if self.send(m.Events(events=self.history[since:], replay=new)):
                self._delivered = len(self.history)
        if self._unsent_exits:
            exits, self._unsent_exits = self._unsent_exits, []
            self.send(m.Exits(exits=exits))

    def relay(self, evs: list[dict[str, Any]]) -> None:
        """Events of this host's processes: kept (the oldest go past ``HISTORY_MAX``), and what
        the controller in office has not had sent."""
        self.history += evs
        if len(self.history) > HISTORY_MAX:  # the oldest go: a takeover rebuilds from the rest
            cut = len(self.history) - HISTORY_MAX
            self.history = self.history[cut:]
            self._delivered = max(0, self._delivered - cut)
        if self.send(m.Events(events=self.history[self._delivered:])):
            self._delivered = len(self.history)

    def exited(self, rec: m.ProcExit) -> None:
        """A process's exit: sent, or kept for the next controller to say hello."""
        if not self.send(m.Exits(exits=[rec])):
            self._unsent_exits.append(rec)

    def drop(self) -> None:
        """The job moved on without this host (fenced): no controller in office, nothing kept."""
        if self.ctl is not None:
            self.ctl.close()
        self.ctl = self.office_ch = None
        self._unsent_exits.clear()
        self.history, self._delivered = [], 0

    # == the threads =============================================================================
    def _accept_loop(self) -> None:
        from ..net.channel import ChannelClosed

        while not self._stop.is_set():
            try:
                ch = self.listener.accept(timeout=0.5)
            except (OSError, ChannelClosed):  # closed: the agent is ending
                return
            if ch is None:
                continue
            threading.Thread(target=self._read_loop, args=(ch,), daemon=True,
                             name="nonstop-ctl").start()

    def _read_loop(self, ch: Any) -> None:
        from ..net.channel import AuthError, ChannelClosed

        while not self._stop.is_set():
            try:
                msg, _ = ch.recv(timeout=1.0)
            except TimeoutError:
                continue
            except (ChannelClosed, AuthError, OSError):
                self._inbox.put((ch, CLOSED))
                self._wake()
                return
            try:
                order = m.decode(msg)
            except m.BadMessage as exc:  # the job's secret, another nonstop: said, not obeyed
                print(f"nonstop: a message from the controller refused: {exc}", file=sys.stderr,
                      flush=True)
                continue
            self._inbox.put((ch, order))
            self._wake()

    def _refused(self, peer: tuple[str, int], why: str) -> None:
        """Said once per address and reason (a peer that retries is refused again and again),
        then counted: said again at the 10th, 100th... time."""
        if "closed the connection" in why:  # a probe (or a port scan): nothing was offered
            return
        key = (peer[0], why.split(":", 1)[0])
        n = self._refusals[key] = self._refusals.get(key, 0) + 1
        if n == 1 or math.log10(n).is_integer():
            again = f" ({n} times)" if n > 1 else ""
            print(f"nonstop: refused a connection from {peer[0]}: {why}{again}", file=sys.stderr,
                  flush=True)

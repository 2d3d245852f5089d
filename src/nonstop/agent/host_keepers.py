"""Node memory across hosts, the agent's side: each host's keeper (its ranks' snapshots, the
replicas of another host's) is started by that host's agent, which relays the controller's
requests to it and its reports back (``controller/remote_keepers.py`` is the other end), in a
thread of its own so that a slow keeper never holds up the agent's loop. Replicas go keeper to
keeper over the hosts' addresses, on the job's authenticated channel; the controller only tells
each keeper where to send them.
"""

from __future__ import annotations

import hashlib
import hmac
import queue
import threading
from typing import Any, Callable

from ..protocol import messages as m


def replica_secret(secret: bytes) -> str:
    """The keepers' own secret, derived from the job's: a key for one purpose only."""
    return hmac.new(secret, b"nonstop/keeper-replicas/1", hashlib.sha256).hexdigest()


class HostKeepers:
    """The agent's side: its keeper's connections, requests answered in order, reports relayed
    to the controller in office (dropped while there is none: they are counters and disk parts,
    and a controller taking over asks again)."""

    def __init__(self, send: Callable[[m.Report], bool]):
        self.send = send
        self.links: dict[str, Any] = {}  # keeper name -> its KeeperLink, once connected
        self.failed: dict[str, str] = {}  # keeper name -> why it could not be reached
        self._jobs: "queue.Queue[m.KeeperOpen | m.KeeperCall | tuple[str, float] | None]" = \
            queue.Queue()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="nonstop-keepers", daemon=True)

    def start(self) -> HostKeepers:
        self._thread.start()
        return self

    def started(self, name: str, deadline: float) -> None:
        """A keeper of this host was started: connect to it once it listens."""
        self._jobs.put((name, deadline))

    def request(self, order: m.KeeperOpen | m.KeeperCall) -> None:
        self._jobs.put(order)

    def gone(self, name: str) -> None:
        with self._lock:
            link = self.links.pop(name, None)
        if link is not None:
            link.close()

    def close(self) -> None:
        self._jobs.put(None)
        with self._lock:
            links, self.links = list(self.links.values()), {}
        for link in links:
            link.close()

    def poll(self) -> None:
        """Relay what the keepers reported (from the agent's loop)."""
        with self._lock:
            links = list(self.links.values())
        evs = [ev for link in links for ev in link.events()]
        if evs:
            self.send(m.KeeperEvents(events=evs))

    def _serve(self) -> None:
        from ..state.wire import KeeperLink

        while True:
            job = self._jobs.get()
            if job is None:
                return
            if isinstance(job, tuple):  # a keeper started: connect to it
                name, deadline = job
                try:
                    link = KeeperLink.open(name, deadline)
                except (TimeoutError, OSError) as exc:
                    self.failed[name] = f"{type(exc).__name__}: {exc}"
                    continue
                with self._lock:
                    self.links[name] = link
                continue
            with self._lock:
                link = self.links.get(job.name)
            if isinstance(job, m.KeeperOpen):
                answer = (m.Reply(id=job.id, tcp=link.tcp) if link is not None else
                          m.Reply(id=job.id, error=self.failed.get(job.name)))
            elif link is None:
                answer = m.Reply(id=job.id, error=f"keeper {job.name} is not connected")
            else:
                answer = self._relay(link, job)
            if job.id is not None:
                self.send(answer)
            elif answer.error:  # nobody waits for the answer: a report of the failure
                from ..protocol import keeper_messages as km

                op = job.msg.get("op")
                self.send(m.KeeperEvents(events=[km.encode(km.RequestFailed(
                    op=op if type(op) is str else None, error=answer.error))]))

    @staticmethod
    def _relay(link: Any, call: m.KeeperCall) -> m.Reply:
        """The controller's request to the keeper, and its answer (or why there is none)."""
        # (imported once a keeper is asked something: not on the agent's way to answering)
        from ..protocol import keeper_messages as km

        try:
            request = km.decode_request(call.msg)
        except km.BadKeeperMessage as exc:
            return m.Reply(id=call.id, error=f"a malformed request: {exc}")
        try:
            if request.answer is None:  # told: the keeper never answers it
                link.tell(request)
                return m.Reply(id=call.id)
            return m.Reply(id=call.id, reply=km.encode(link.call(request)))
        except Exception as exc:  # noqa: BLE001 - said to the controller, which logs it
            return m.Reply(id=call.id, error=f"{type(exc).__name__}: {exc}")

"""Node memory across hosts: each host's keeper (its ranks' snapshots, the replicas of another
host's) is started by that host's agent and reached by the controller through it.

The controller's side (``RemoteKeeperLink``) has the interface of a link to a keeper on its own
host: requests and their answers, the keeper's reports, its replica address. The agent's side
(``HostKeepers``) holds the local connections and relays, in a thread of its own so that a slow
keeper never holds up the agent's loop. Replicas go keeper to keeper over the hosts' addresses,
on the job's authenticated channel; the controller only tells each keeper where to send them.
"""

from __future__ import annotations

import hashlib
import hmac
import queue
import threading
import time
from typing import Any, Callable

from ..protocol import messages as m

CALL_TIMEOUT_S = 5.0  # a keeper's answer, relayed (a listing, a persist order)


def replica_secret(secret: bytes) -> str:
    """The keepers' own secret, derived from the job's: a key for one purpose only."""
    return hmac.new(secret, b"nonstop/keeper-replicas/1", hashlib.sha256).hexdigest()


class RemoteKeeperLink:
    """The controller's link to the keeper of a node on another host, through its agent."""

    def __init__(self, cluster: Any, node: int, name: str, tcp: str):
        self.cluster, self.node, self.name, self.tcp = cluster, node, name, tcp

    @classmethod
    def open(cls, cluster: Any, node: int, name: str, deadline: float) -> RemoteKeeperLink:
        """Once the host's agent is connected to its keeper (TimeoutError at ``deadline``)."""
        while True:
            left = deadline - time.time()
            if left <= 0:
                raise TimeoutError(f"the keeper of node {node} did not answer")
            if not cluster.host_up(node):  # its host went meanwhile: no waiting out the deadline
                raise TimeoutError(f"node {node}'s host cannot be reached")
            reply = cluster.request(node, m.KeeperOpen(name=name), timeout_s=min(left, 1.0))
            if reply is not None and reply.tcp:
                return cls(cluster, node, name, reply.tcp)
            if reply is not None and reply.error:
                raise TimeoutError(reply.error)
            time.sleep(0.05)

    def call(self, msg: dict[str, Any]) -> dict[str, Any]:
        from ..state.wire import KeeperError

        reply = self.cluster.request(self.node, m.KeeperCall(name=self.name, msg=msg),
                                     timeout_s=CALL_TIMEOUT_S)
        if reply is None:
            raise ConnectionError(f"no answer from the keeper of node {self.node}")
        if reply.error:
            raise KeeperError(reply.error)
        return dict(reply.reply or {})

    def tell(self, msg: dict[str, Any]) -> None:
        """Sent, not waited for: the agent reports a failure as a keeper event."""
        self.cluster.tell(self.node, m.KeeperCall(name=self.name, msg=msg))

    def answers(self, timeout_s: float) -> bool:
        """Whether the keeper answers through its host's agent within ``timeout_s``: a host cut
        off (its ranks silent, its lease not yet expired) does not, and its node is lost now."""
        reply = self.cluster.request(self.node, m.KeeperCall(name=self.name, msg={"op": "list"}),
                                     timeout_s=timeout_s)
        return reply is not None and not reply.error

    def events(self) -> list[dict[str, Any]]:
        return self.cluster.keeper_events(self.node)

    def close(self) -> None:
        pass  # nothing held here: the agent's connection ends with its keeper


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
                try:
                    answer = m.Reply(id=job.id, reply=link.call(job.msg))
                except Exception as exc:  # noqa: BLE001 - said to the controller, which logs it
                    answer = m.Reply(id=job.id, error=f"{type(exc).__name__}: {exc}")
            if job.id is not None:
                self.send(answer)
            elif answer.error:  # nobody waits for the answer: a report of the failure
                self.send(m.KeeperEvents(events=[{"ev": "keeper_error", "op": job.msg.get("op"),
                                                  "error": answer.error}]))

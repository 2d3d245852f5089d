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

from ..protocol import hosts as keys

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
            reply = cluster.request(node, {"op": keys.KEEPER_OPEN, "name": name},
                                    timeout_s=min(left, 5.0))
            if reply and reply.get("tcp"):
                return cls(cluster, node, name, str(reply["tcp"]))
            if reply and reply.get("error"):
                raise TimeoutError(str(reply["error"]))
            time.sleep(0.05)

    def call(self, msg: dict[str, Any]) -> dict[str, Any]:
        from ..state.wire import KeeperError

        reply = self.cluster.request(self.node, {"op": keys.KEEPER_CALL, "name": self.name,
                                                 "msg": msg}, timeout_s=CALL_TIMEOUT_S)
        if reply is None:
            raise ConnectionError(f"no answer from the keeper of node {self.node}")
        if reply.get("error"):
            raise KeeperError(str(reply["error"]))
        return dict(reply.get("reply") or {})

    def tell(self, msg: dict[str, Any]) -> None:
        """Sent, not waited for: the agent reports a failure as a keeper event."""
        self.cluster.tell(self.node, {"op": keys.KEEPER_CALL, "name": self.name, "msg": msg})

    def events(self) -> list[dict[str, Any]]:
        return self.cluster.keeper_events(self.node)

    def close(self) -> None:
        pass  # nothing held here: the agent's connection ends with its keeper


class HostKeepers:
    """The agent's side: its keeper's connections, requests answered in order, reports relayed
    to the controller in office (dropped while there is none: they are counters and disk parts,
    and a controller taking over asks again)."""

    def __init__(self, send: Callable[[dict[str, Any]], bool]):
        self.send = send
        self.links: dict[str, Any] = {}  # keeper name -> its KeeperLink, once connected
        self.failed: dict[str, str] = {}  # keeper name -> why it could not be reached
        self._jobs: "queue.Queue[tuple[str, dict[str, Any]] | None]" = queue.Queue()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="nonstop-keepers", daemon=True)
        self._thread.start()

    def started(self, name: str, deadline: float) -> None:
        """A keeper of this host was started: connect to it once it listens."""
        self._jobs.put(("connect", {"name": name, "deadline": deadline}))

    def request(self, op: str, msg: dict[str, Any]) -> None:
        self._jobs.put((op, msg))

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
            self.send({"op": keys.KEEPER_EVENTS, "events": evs})

    def _serve(self) -> None:
        from ..state.wire import KeeperLink

        while True:
            job = self._jobs.get()
            if job is None:
                return
            op, msg = job
            name = str(msg.get("name"))
            if op == "connect":
                try:
                    link = KeeperLink.open(name, float(msg["deadline"]))
                except (TimeoutError, OSError) as exc:
                    self.failed[name] = f"{type(exc).__name__}: {exc}"
                    continue
                with self._lock:
                    self.links[name] = link
                continue
            with self._lock:
                link = self.links.get(name)
            if op == keys.KEEPER_OPEN:
                answer: dict[str, Any] = ({"tcp": link.tcp} if link is not None else
                                          {"error": self.failed[name]} if name in self.failed else {})
            elif link is None:
                answer = {"error": f"keeper {name} is not connected"}
            else:
                try:
                    answer = {"reply": link.call(msg.get("msg") or {})}
                except Exception as exc:  # noqa: BLE001 - said to the controller, which logs it
                    answer = {"error": f"{type(exc).__name__}: {exc}"}
            if msg.get("id") is not None:
                self.send({"op": keys.REPLY, "id": msg.get("id"), **answer})
            elif answer.get("error"):  # nobody waits for the answer: a report of the failure
                self.send({"op": keys.KEEPER_EVENTS, "events": [{
                    "ev": "keeper_error", "op": (msg.get("msg") or {}).get("op"),
                    "error": answer["error"]}]})

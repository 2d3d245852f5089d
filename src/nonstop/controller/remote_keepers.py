"""Node memory across hosts, the controller's side: a link to the keeper of a node on another
host, through that host's agent (``agent/host_keepers.py`` is the other end), with the interface
of a link to a keeper on the controller's own host: requests and their answers, the keeper's
reports, its replica address. A request and its answer travel encoded
(``protocol/keeper_messages.py``) inside the channel's ``KeeperCall`` and ``Reply``, and are
decoded at the ends.
"""

from __future__ import annotations

import time
from typing import Any

from ..protocol import keeper_messages as km
from ..protocol import messages as m

CALL_TIMEOUT_S = 5.0  # a keeper's answer, relayed (a listing, a persist order)


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

    def call(self, request: km.Request) -> km.Answer:
        """The keeper's answer to a request that is answered (``request.answer``); KeeperError
        if it refused it, or the answer is malformed."""
        from ..state.wire import KeeperError

        reply = self.cluster.request(self.node, m.KeeperCall(name=self.name,
                                                             msg=km.encode(request)),
                                     timeout_s=CALL_TIMEOUT_S)
        if reply is None:
            raise ConnectionError(f"no answer from the keeper of node {self.node}")
        if reply.error:
            raise KeeperError(reply.error)
        try:
            answer = km.decode_answer(type(request), reply.reply)
        except km.BadKeeperMessage as exc:
            raise KeeperError(f"a malformed answer to {request.op!r}: {exc}") from None
        if isinstance(answer, km.Refused):
            raise KeeperError(answer.error)
        return answer

    def tell(self, request: km.Request) -> None:
        """Sent, not waited for: the agent reports a failure as a keeper event."""
        self.cluster.tell(self.node, m.KeeperCall(name=self.name, msg=km.encode(request)))

    def answers(self, timeout_s: float) -> bool:
        """Whether the keeper answers through its host's agent within ``timeout_s``: a host cut
        off (its ranks silent, its lease not yet expired) does not, and its node is lost now."""
        reply = self.cluster.request(self.node, m.KeeperCall(name=self.name,
                                                             msg=km.encode(km.ListHolders())),
                                     timeout_s=timeout_s)
        return reply is not None and not reply.error

    def events(self) -> list[dict[str, Any]]:
        return self.cluster.keeper_events(self.node)

    def close(self) -> None:
        pass  # nothing held here: the agent's connection ends with its keeper

"""The hand-over of a running job to a new controller, on the successor's side: the hosts it
finds (``place``: at the nodes its predecessor's journal gave them; a host registered since is a
new node, one gone is lost), a channel to each opened side by side (``connect``), what each runs
(``collect``: its answer to the hello), and the predecessor's last word (``last_word``: its
newest status). ``decide/takeover.py`` turns those into the adoption the controller continues
from; ``elected.Leader`` runs the job from there.

A host is given up in etcd (``give_up``) only while this controller holds its epoch; a newer
controller in office makes it ``Fenced``: the caller steps down.
"""

from __future__ import annotations

import time
from typing import Any

from ..decide import takeover
from ..protocol import hosts as keys

# a host whose lease lapsed (etcd paused or restarted) registers again at its next refresh
# (a third of the TTL): it is waited for one TTL and this long before it is given up
REGISTER_AGAIN_S = 2.0
# a live agent completes the channel's handshake in milliseconds: one that has not within this
# is paused, hung or cut off (its kernel may still accept the connection)
ANSWER_S = 0.5
CONNECT_S = 1.0  # ...and a host still registered in etcd gets this long at a takeover
PARALLEL = 64  # hosts asked side by side


def answers(addr: str | None, port: int | None, secret: bytes) -> bool:
    """Whether a host's agent itself answers: it completes the channel's handshake (proving it
    holds the job's secret) within ``ANSWER_S``. A bare connect proves nothing - the kernel of a
    paused host still accepts one. The channel is closed at once, before any hello."""
    from ..net import channel

    if not addr or not port:
        return False
    try:
        ch = channel.connect(addr, int(port), secret, timeout_s=ANSWER_S,
                             tos=channel.CONTROL_TOS)
    except Exception:  # noqa: BLE001 - refused, silent, or not a nonstop agent of this job
        return False
    ch.close()
    return True


def at_once(fn: Any, items: list[Any]) -> list[Any]:
    """``fn`` of every item, run side by side (each call bounds its own wait): a takeover waits
    for the slowest host once, not for each in turn."""
    if not items:
        return []
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(PARALLEL, len(items))) as pool:
        return list(pool.map(fn, items))


class Successor:
    """A controller taking office over a job its predecessor ran (epoch ``epoch``)."""

    def __init__(self, etcd: Any, epoch: int, secret: bytes, lease_ttl_s: float):
        self.etcd, self.epoch, self.secret = etcd, epoch, secret
        self.lease_ttl_s = lease_ttl_s

    def _guarded(self, puts: dict[str, str]) -> None:
        self.etcd.guarded(keys.LEADER, self.epoch, puts=puts)

    def place(self, journal: keys.JournalRecord
                     ) -> tuple[dict[int, keys.HostRecord], set[int]]:
        """The hosts alive now, at the nodes the journal gave them (a host that joined since is a
        new node); the journal's nodes whose host is gone are lost."""
        nodes = dict(journal.nodes)
        alive = self._registered(nodes)
        placed: dict[int, keys.HostRecord] = {}
        lost: set[int] = set()
        for node, h in nodes.items():
            rec = alive.pop((h.host, h.incarnation), None)
            if rec is None and not self.give_up(h.host, h.incarnation):
                alive = self._registered({})  # it registered again just now
                rec = alive.pop((h.host, h.incarnation), None)
            if rec is None:
                lost.add(node)
            else:
                placed[node] = rec
        known = list(journal.isolated) + list(journal.node_of.values())
        nxt = max(list(placed) + list(lost) + known + [-1]) + 1  # a new host: a node never used
        for _, rec in sorted(alive.items()):
            placed[nxt] = rec
            nxt += 1
        return placed, lost

    def _registered(self, nodes: dict[int, keys.NodeHost]
                          ) -> dict[tuple[str, str], keys.HostRecord]:
        """The hosts registered in etcd. A host of ``nodes`` (the journal's) that is not, but
        whose agent answers on its address, is waited for a while: its lease lapsed with the
        controller's (etcd paused or restarted expires every lease at once) and it registers
        again."""
        deadline = time.monotonic() + self.lease_ttl_s + REGISTER_AGAIN_S
        while True:
            alive = {}
            for _, raw, _, _ in self.etcd.get_prefix(keys.HOSTS):
                rec = keys.HostRecord.loads(raw)
                alive[(rec.host_id, rec.incarnation)] = rec
            absent = [h for h in nodes.values() if (h.host, h.incarnation) not in alive]
            answered = at_once(lambda h: answers(h.addr, h.port, self.secret), absent)
            waiting = [h for h, yes in zip(absent, answered) if yes]
            if not waiting or time.monotonic() > deadline:
                return alive
            time.sleep(0.2)

    def connect(self, hosts: list[keys.HostRecord]) -> dict[str, Any]:
        """At a takeover, a channel to each host registered in etcd, all opened side by side
        within ``CONNECT_S``: host id -> (its incarnation, the channel). One that does not
        answer in time (paused: its record outlives it by up to a lease) is not waited for."""
        from ..net import channel

        def open_one(rec: keys.HostRecord) -> Any:
            try:
                return channel.connect(rec.addr, rec.ctl_port, self.secret, timeout_s=CONNECT_S,
                                       tos=channel.CONTROL_TOS)
            except Exception:  # noqa: BLE001 - given up as an unreachable host
                return None

        opened = at_once(open_one, hosts)
        return {rec.host_id: (rec.incarnation, ch) for rec, ch in zip(hosts, opened)
                if ch is not None}

    def collect(self, cluster: Any, lost: set[int], timeout_s: float) -> list[Any]:
        """Every host's answer to our hello: what it runs. A host that does not answer in time
        is taken as lost (its processes with it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and \
                any(link.state is None for link in cluster.links.values()):
            cluster.poll(0.02)
        seen = []
        for node, link in cluster.links.items():
            if link.state is None:  # silent (frozen, or cut off after it was listed): given up
                self.give_up(link.rec.host_id, link.rec.incarnation, force=True)
                lost.add(node)
                continue
            for w in link.state.workers:
                seen.append(takeover.Seen(
                    wid=w.wid, node=node, alive=w.alive, spare=w.spare, rank=w.rank, gen=w.gen,
                    seq=w.seq, keeper=w.keeper, code=w.code, done=w.done))
        for node in lost:
            if node in cluster.links:
                cluster.host_gone(node)
        return seen

    def last_word(self) -> keys.LastWord | None:
        """The predecessor's last status record (written twice a second while in office): what
        it lost (a host, its own) went after its time, so an incident the takeover opens is
        timed from there, not from the takeover, and its step is the newest any rank had
        completed. The time is on that controller's clock (hosts' clocks agree to NTP's
        precision; the predecessor's host may be gone, no offset to it known)."""
        try:
            raw, _ = self.etcd.get(keys.STATUS)
            return keys.LastWord.loads(raw) if raw is not None else None
        except Exception:  # noqa: BLE001 - no status (etcd away, another version): the takeover
            return None

    def give_up(self, host_id: str, incarnation: str, force: bool = False) -> bool:
        """Mark a host given up in etcd (True), unless it registered again (False; with
        ``force``, given up all the same: its agent reads the mark and fences itself). A newer
        controller in office: ``Fenced`` (it steps down)."""
        from ..store.etcd import Fenced

        gone, record = keys.gone_key(host_id, incarnation), keys.host_key(host_id)
        try:
            if self.etcd.mark_gone(keys.LEADER, self.epoch, gone, unless=record):
                return True
            if force:
                self._guarded({gone: "1"})
                return True
            raw, _ = self.etcd.get(record)
            if raw is None or keys.HostRecord.loads(raw).incarnation == incarnation:
                return False  # back as itself (or gone again since: asked again next time)
            self._guarded({gone: "1"})  # the host runs again as a new incarnation: this one is gone
            return True
        except Fenced:
            raise
        except Exception:  # noqa: BLE001 - etcd away: nothing is given up without it
            return False

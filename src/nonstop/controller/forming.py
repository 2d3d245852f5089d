"""A new job's first hosts, as its first controller finds them.

The job forms once ``--nnodes`` hosts have registered in etcd and answer on their address: those
hold the ranks, in the order they joined; the others registered at the same time are spare
hosts, up to the job's size (``--nnodes`` + ``--spare-nodes``), and any beyond it are turned
away (they registered before any could see the job full). While it waits, the controller says
how many hosts joined in the job's status record (``nonstop status``). What it found is
returned - the hosts and their open channels, or why the job cannot form - for the controller
in office to act on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable

from ..protocol import hosts as keys

STATUS_EVERY_S = 1.0  # the wait, for nonstop status
LIST_EVERY_S = 0.1  # etcd asked for the hosts while fewer than --nnodes have joined
CONNECT_AGAIN_S = 0.2  # a host that did not answer is tried again after this long


@dataclasses.dataclass(frozen=True)
class Formed:
    """The job's first hosts, in the order they joined (--nnodes of them hold ranks, the rest
    are spare hosts), each with its channel: (its incarnation, the channel). ``beyond``: hosts
    that registered at the same time beyond the job's size, to be turned away."""

    hosts: list[keys.HostRecord]
    channels: dict[str, tuple[str, Any]]
    beyond: list[keys.HostRecord]


@dataclasses.dataclass(frozen=True)
class NotFormed:
    """Too few hosts joined, or answered, within the join timeout: the job ends (code 2)."""

    diagnosis: str


class Forming:
    """The first hosts of a new job: waited for in etcd, then reached on their address."""

    def __init__(self, job_id: str, nnodes: int, most: int, secret: bytes, etcd: Any,
                 publish: Callable[[str], None]):
        """``nnodes``: the hosts that hold ranks (--nnodes); ``most``: the job's size, spare
        hosts included; ``publish``: the job's status record while it waits (a JSON text)."""
        self.job_id, self.nnodes, self.most = job_id, nnodes, most
        self.secret, self.etcd, self.publish = secret, etcd, publish

    def first_hosts(self, timeout_s: float) -> Formed | NotFormed:
        """Within ``timeout_s`` (``hosts.join_timeout_s``): --nnodes hosts joined and answering."""
        deadline = time.monotonic() + timeout_s
        hosts = self._joined(timeout_s)
        if isinstance(hosts, NotFormed):
            return hosts
        channels: dict[str, tuple[str, Any]] = {}
        reached = self._reachable(hosts, channels, deadline)
        if isinstance(reached, NotFormed):
            for _, ch in channels.values():
                ch.close()
            return reached
        limit = self.most
        beyond = reached[limit:]
        for rec in beyond:
            _, ch = channels.pop(rec.host_id, (None, None))
            if ch is not None:
                ch.close()
        return Formed(reached[:limit], channels, beyond)

    def _joined(self, timeout_s: float) -> list[keys.HostRecord] | NotFormed:
        """The hosts registered in etcd once --nnodes have, in the order they joined."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        want = self.nnodes
        shown = 0.0
        while True:
            rows = self.etcd.get_prefix(keys.HOSTS)
            if time.monotonic() - shown >= STATUS_EVERY_S:
                shown = time.monotonic()
                self._waiting(len(rows), want, shown - t0, timeout_s)
            if len(rows) >= want:
                rows.sort(key=lambda r: r[3])  # create revision: the order they joined
                return [keys.HostRecord.loads(r[1]) for r in rows]
            if time.monotonic() > deadline:
                return NotFormed(f"only {len(rows)} of {want} host(s) joined job "
                                 f"'{self.job_id}' within {timeout_s:g} s "
                                 "(hosts.join_timeout_s): check --rdzv-id and --nnodes on each "
                                 "host")
            time.sleep(LIST_EVERY_S)

    def _reachable(self, hosts: list[keys.HostRecord], channels: dict[str, tuple[str, Any]],
                   deadline: float) -> list[keys.HostRecord] | NotFormed:
        """The hosts that answer on their channel (put in ``channels``), in the order they
        joined, once --nnodes do. A host that does not answer yet (still starting) is tried
        again, as etcd lists it then (it may have registered anew), until ``deadline``."""
        from ..net import channel

        want = self.nnodes
        while True:
            answered = [h for h in hosts if channels.get(h.host_id, (None,))[0] == h.incarnation]
            pending = [h for h in hosts if h not in answered]
            for rec in pending:
                try:
                    ch = channel.connect(rec.addr, rec.ctl_port, self.secret, timeout_s=2.0,
                                         tos=channel.CONTROL_TOS)
                except Exception:  # noqa: BLE001 - not listening yet, or out of reach
                    continue
                old = channels.pop(rec.host_id, None)
                if old is not None:
                    old[1].close()
                channels[rec.host_id] = (rec.incarnation, ch)
                answered.append(rec)
            if len(answered) >= want:  # spare hosts that answer later join as they do
                order = {h.host_id: i for i, h in enumerate(hosts)}
                return sorted(answered, key=lambda h: order[h.host_id])
            if time.monotonic() > deadline:
                late = [h for h in hosts if h not in answered]
                return NotFormed(f"only {len(answered)} of {want} host(s) of job "
                                 f"'{self.job_id}' answered on their address "
                                 f"({', '.join(f'{h.host_id} at {h.addr}' for h in late)} did "
                                 "not): check the network between the hosts and --node-addr")
            time.sleep(CONNECT_AGAIN_S)
            try:  # as etcd lists them now: one may have gone, or registered again
                rows = self.etcd.get_prefix(keys.HOSTS)
                rows.sort(key=lambda r: r[3])
                hosts = [keys.HostRecord.loads(r[1]) for r in rows]
            except Exception:  # noqa: BLE001 - etcd away for a moment: the same list
                pass

    def _waiting(self, joined: int, want: int, waited_s: float, limit_s: float) -> None:
        """Before the job starts: how many hosts joined, as its status record."""
        rec = {"t": time.time(), "pid": os.getpid(), "gen": -1, "phase": "waiting for hosts",
               "world": 0, "ranks": [], "step": 0, "incidents": 0, "over": False,
               "hosts_joined": joined, "hosts_wanted": want, "waited_s": round(waited_s, 1),
               "limit_s": limit_s}
        try:
            self.publish(json.dumps(rec))
        except Exception:  # noqa: BLE001 - etcd away: the wait itself will say so
            pass

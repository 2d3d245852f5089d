"""This host's membership in etcd: its lease, record and incarnation; the lease lapsing and the
host registering again as itself; etcd's silence judged by asking the peers (is this host cut
off, or is etcd down?); the job's end as read from etcd.

``Membership`` never acts on the host: it returns what happened as a verdict (``Fence``,
``Rejoined``, ``OutageOver``, ``JobEnded``...) and the host agent (``host.py``) carries it out.
"""

from __future__ import annotations

import dataclasses
import functools
import secrets
import socket
import threading
import time
from typing import TYPE_CHECKING, Callable

from ..protocol import hosts as keys

if TYPE_CHECKING:
    from ..store.etcd import Etcd
    from ..store.etcd_lease import Lease

REGISTER_RETRY_S = 0.5
PEER_PROBE_S = 0.5  # a peer's agent answers a connect within this (or refuses it)

Peer = tuple[str, int]  # another host's agent: its address and channel port


# == verdicts ====================================================================================
@dataclasses.dataclass(frozen=True)
class EtcdSilent:
    """etcd has not refreshed this host's lease for a whole TTL: the judgement begins (said once
    per silence)."""

    failure: str | None = None  # what the lease's refreshes met (``host:port: cause``)


@dataclasses.dataclass(frozen=True)
class Rejoined:
    """The lease had lapsed (etcd paused or restarted?); the host registered again as itself:
    its ranks train on."""


@dataclasses.dataclass(frozen=True)
class Fence:
    """The job has moved on without this host: its processes end now - they must never join a
    newer generation - and it joins again as a new host (``Membership.leave`` and
    ``register_again``)."""

    why: str


@dataclasses.dataclass(frozen=True)
class OutageOver:
    """etcd out of reach past the outage tolerance and its margins, and no word from the
    controller (it gives up at the tolerance and says so): the host ends its processes."""

    seconds: float  # how long etcd has been out of reach
    tolerance_s: float  # hosts.store_outage_s


@dataclasses.dataclass(frozen=True)
class JobEnded:
    """etcd holds the job's end: the host ends too, with the job's code."""

    code: int


@dataclasses.dataclass(frozen=True)
class Registered:
    """After a fence: the host is in the job again, as a new incarnation."""

    incarnation: str


# what the host's membership in etcd says happened (``Membership.poll``)
News = EtcdSilent | Rejoined | Fence | OutageOver | JobEnded


def peer_answers(peer: Peer, own: str | None = None) -> bool:
    """Whether another host's agent answers a connect (accepted or refused: either proves the
    path) within ``PEER_PROBE_S``. A refusal from ``own``, this host's own address, proves
    nothing: cut off, a host still reaches itself, and a record of an earlier run of this host
    at its address (a new machine in the place of one just gone) is refused there - taken for
    a peer that answered, it kept a cut host from ever fencing."""
    try:
        with socket.create_connection(peer, timeout=PEER_PROBE_S):
            return True
    except ConnectionRefusedError:  # a refusal came back: the path works (from elsewhere)
        return peer[0] != own
    except OSError:
        return False


class Membership:
    """This host in the job's etcd. Threads report here (the lease's, the store thread through
    ``read_job``, the rejoin and probe threads started here) and call ``wake``; the agent's loop
    calls ``poll`` to learn what happened. Nothing here waits on etcd in that loop.

    Args:
        etcd: the job's etcd client.
        record: this host's record; each registration gives it a new incarnation.
        lease_ttl_s: the lease's TTL (hosts.lease_ttl_s).
        outage_s: how long etcd may be out of reach while the job trains on
            (hosts.store_outage_s).
        grace_s: the controller's emergency save at that tolerance (state.emergency.grace_s,
            0 without one): not cut short here.
        wake: ends the agent loop's wait, from another thread.
        stop: set when the agent ends: the threads started here end with it.
        clock: monotonic seconds.
        answers: whether a peer's agent answers (by default a connect: ``peer_answers``).
    """

    def __init__(self, etcd: Etcd, record: keys.HostRecord, lease_ttl_s: int, outage_s: float,
                 grace_s: float, wake: Callable[[], None], stop: threading.Event,
                 clock: Callable[[], float] = time.monotonic,
                 answers: Callable[[Peer], bool] | None = None):
        self._etcd = etcd
        self._template = record
        self._ttl = lease_ttl_s
        self._outage_s = outage_s
        # the controller gives up at the tolerance and says so; this host waits 3 TTLs and 5 s
        # more for its word, and for its emergency save through this host's keeper
        self.limit_s = outage_s + 3 * lease_ttl_s + 5 + grace_s
        self._wake = wake
        self._stop = stop
        self._clock = clock
        self._answers = answers or functools.partial(peer_answers, own=record.addr)
        self.lease: Lease | None = None
        self.incarnation = ""  # none before the first registration
        self.record: keys.HostRecord | None = None  # what this incarnation registered
        self.peers: list[Peer] = []  # the other hosts' agents, as last read
        self.peer_names: dict[str, str] = {}  # address -> host id, as etcd lists the hosts
        self.doubt_since: float | None = None  # etcd unreachable since (clock)
        self._silent: EtcdSilent | None = None  # a silence began that poll has not told yet
        self._lost = threading.Event()  # etcd says the lease expired
        self._round = 0  # a fence starts a new round: a thread of an older one is ignored
        self._rejoiner: threading.Thread | None = None  # registering again after a lapse
        self._rejoined: Rejoined | Fence | OutageOver | None = None  # ...what came of it
        self._probe: threading.Thread | None = None
        self._probed: tuple[float, bool] | None = None  # the last round of probes: when, answered
        self._given_up: str | None = None  # an incarnation of this host the job marked gone
        self._ended: JobEnded | None = None
        self._left: Lease | None = None  # the lease of before a fence: revoked before registering

    # == registering ===========================================================================
    def register(self) -> bool:
        """The host's record under a new lease, kept alive in the background, as a new
        incarnation. False when the host's record is there already (nothing is held then)."""
        self._lost.clear()
        self.lease = self._etcd.lease(self._ttl)
        self.incarnation = secrets.token_hex(6)
        self.record = dataclasses.replace(self._template, incarnation=self.incarnation)
        if not self._etcd.create(keys.host_key(self.record.host_id), self.record.dumps(),
                                 lease=self.lease):
            self.lease.revoke()
            return False
        self.lease.keepalive(on_lost=self._on_lost, on_doubt=self._on_doubt)
        return True

    def leave(self) -> None:
        """After a fence: the lease is no longer kept alive (``register_again`` revokes it
        first, so the controller sees a new host, not the old one back)."""
        old, self.lease = self.lease, None
        if old is not None:
            old.stop()
            self._left = old
        self._reset()  # (the lease's thread may have reported until it stopped)

    def register_again(self) -> Registered | JobEnded | None:
        """One try, once fenced, to join again as a new host; None while etcd does not answer
        or the old record is still there. The job may have ended meanwhile."""
        try:
            ended = self.read_job()
            if ended is not None:
                return ended
            if self._left is not None:  # our old record goes first
                self._left.revoke()
                self._left = None
            if not self.register():
                return None
        except Exception:  # noqa: BLE001 - etcd still unreachable: try again
            return None
        return Registered(self.incarnation)

    def close(self) -> None:
        """The agent ends: its record goes now (or with its lease, etcd gone)."""
        if self.lease is None:
            return
        if self.doubt_since is not None:  # etcd out of reach: not waited for again
            self.lease.stop()
            return
        try:
            self.lease.revoke()
        except Exception:  # noqa: BLE001 - etcd gone: the lease expires by itself
            self.lease.stop()

    # == what the agent's loop hears ===========================================================
    def poll(self, holds_ranks: bool) -> list[News]:
        """What happened since the last call, in the order to carry it out. ``holds_ranks``:
        whether this host holds ranks now (a host that holds none has nothing to lose by a
        fence)."""
        out: list[News] = []
        silent, self._silent = self._silent, None
        if silent is not None:
            out.append(silent)
        given_up, self._given_up = self._given_up, None
        verdict: News | None = None
        if given_up is not None and given_up == self.incarnation:
            verdict = self._fence("the job gave this host up")
        elif self._lost.is_set():
            verdict = self._lapsed()
        elif self.doubt_since is not None:
            verdict = self._judge_doubt(holds_ranks)
        if verdict is not None:
            out.append(verdict)
        ended, self._ended = self._ended, None
        if ended is not None:
            out.append(ended)
        return out

    def _fence(self, why: str) -> Fence:
        self._reset()
        return Fence(why)

    def _reset(self) -> None:
        self._round += 1
        self._lost.clear()
        self.doubt_since = None
        self._silent = None
        self._probed = None
        self._rejoiner, self._rejoined = None, None

    # == the lease's thread ====================================================================
    def _on_lost(self) -> None:
        self._lost.set()
        self._wake()

    def _on_doubt(self, doubt: bool) -> None:
        """etcd unreachable for a whole TTL (or reachable again). Unreachable for everyone (etcd
        down), the job trains on and etcd extends the leases when it is back; unreachable for this
        host alone, the job has given this host up: which one is told by the peers."""
        self.doubt_since = self._clock() if doubt else None
        if doubt:
            lease = self.lease
            self._silent = EtcdSilent(lease.failure if lease is not None else None)
        self._wake()

    # == a lease lapsed ========================================================================
    def _lapsed(self) -> Rejoined | Fence | OutageOver | None:
        """etcd says this host's lease expired. That alone is not the job moving on without it:
        etcd paused (a VM, a disk stall, a long GC) or restarted expires every lease at once. The
        host registers again as itself (``_rejoin``, in a thread: etcd is never waited on in the
        agent's loop) unless the controller in office has given it up meanwhile - one
        transaction decides which came first - and only then fences itself."""
        if self._rejoiner is None:
            self._rejoined = None
            self._rejoiner = threading.Thread(target=self._rejoin, args=(self._round,),
                                              daemon=True, name="nonstop-rejoin")
            self._rejoiner.start()
            return None
        verdict = self._rejoined
        if verdict is None:
            return None  # still trying
        self._rejoiner, self._rejoined = None, None
        match verdict:
            case Rejoined():
                self._lost.clear()
            case Fence(why=why):
                return self._fence(why)
        return verdict

    def _rejoin(self, round_: int) -> None:
        """The lease's thread has ended; a new lease, and the host's own record again under it,
        while the job has not given this incarnation up. Sets ``_rejoined``; gives up as an
        outage past the limit (``limit_s``) of etcd out of reach."""
        assert self.record is not None  # (a lease lapses only once registered)
        key = keys.host_key(self.record.host_id)
        gone = keys.gone_key(self.record.host_id, self.incarnation)
        old, t0 = self.lease, self._clock()
        while not self._stop.is_set() and self._round == round_:
            if self._clock() - t0 > self.limit_s:
                self._tell(round_, OutageOver(self._clock() - t0, self._outage_s))
                return
            lease = None
            try:
                lease = self._etcd.lease(self._ttl)
                verdict = self._etcd.rejoin(key, self.record.dumps(), lease, unless=gone)
                if verdict == "present":  # an earlier try of ours, or a newer run of this host
                    raw, _ = self._etcd.get(key)
                    if raw is not None and \
                            keys.HostRecord.loads(raw).incarnation != self.incarnation:
                        verdict = "superseded"
            except Exception:  # noqa: BLE001 - etcd away again: the peers tell meanwhile
                verdict = None
                if self.doubt_since is None and self._clock() - t0 > self._ttl:
                    self.doubt_since = t0
            if verdict == "rejoined" and lease is not None and self._round == round_:
                if old is not None:
                    old.stop()
                self.lease = lease
                self.doubt_since = None
                lease.keepalive(on_lost=self._on_lost, on_doubt=self._on_doubt)
                self._tell(round_, Rejoined())
                return
            if lease is not None:
                try:
                    lease.revoke()
                except Exception:  # noqa: BLE001 - it expires by itself
                    lease.stop()
            if verdict == "gone":
                self._tell(round_, Fence("the job gave this host up while its lease had lapsed"))
                return
            if verdict == "superseded":
                self._tell(round_, Fence("another run of this host registered in its place"))
                return
            self._stop.wait(REGISTER_RETRY_S)

    def _tell(self, round_: int, verdict: Rejoined | Fence | OutageOver) -> None:
        if self._round == round_:
            self._rejoined = verdict
            self._wake()

    # == etcd silent ===========================================================================
    def _judge_doubt(self, holds_ranks: bool) -> Fence | OutageOver | None:
        """etcd is out of reach. Reaching none of its peers either, this host is the one cut off
        (its lease expires at etcd as ours did here): fence now. Reaching some, etcd itself is
        down: train on, up to the policy's outage tolerance."""
        now = self._clock()
        since = self.doubt_since  # (cleared by the lease's thread at any moment: read once)
        if since is None:
            return None
        done = self._probed  # (when the last round started, whether a peer answered)
        # with no peer known (it was cut off as it joined, before it read them), a host that
        # holds no rank fences too: it has nothing to lose; one that holds ranks alone (a job of
        # one host) cannot tell a cut from etcd down and trains on
        if done is not None and done[0] >= since and not done[1] and \
                (self.peers or not holds_ranks):
            return self._fence("it reaches neither etcd nor any other host")
        if (self._probe is None or not self._probe.is_alive()) and \
                (done is None or now - done[0] >= PEER_PROBE_S):
            self._probe = threading.Thread(target=self._probe_peers,
                                           args=(now, list(self.peers), self._round),
                                           daemon=True, name="nonstop-probe")
            self._probe.start()
        if now - since > self.limit_s:
            return OutageOver(now - since, self._outage_s)
        return None

    def _probe_peers(self, started: float, peers: list[Peer], round_: int) -> None:
        """Whether any other host answers; never judged on one host's word about another's
        clock. Each connect has its deadline (``PEER_PROBE_S``): a round ends within one per
        peer, or with the agent."""
        answered = False
        for peer in peers:
            if self._stop.is_set() or self._round != round_:
                return
            if self._answers(peer):
                answered = True
                break
        if self._round == round_:
            self._probed = (started, answered)
            self._wake()

    # == the store thread ======================================================================
    def read_job(self) -> JobEnded | None:
        """The job's record, as the store thread reads it every second: whether the job gave
        this incarnation up (then ``poll`` fences), the peers, and whether the job has ended
        (then ``poll`` says so too). Raises what etcd raises."""
        inc = self.incarnation  # (the loop fences only if it is still this one)
        host = self._template.host_id
        if inc and self._etcd.get(keys.gone_key(host, inc))[0] is not None:
            self._given_up = inc
            self._wake()
        raw, _ = self._etcd.get(keys.DONE)
        rows = self._etcd.get_prefix(keys.HOSTS)
        peers = [keys.HostRecord.loads(r[1]) for r in rows]
        self.peers = [(p.addr, p.ctl_port) for p in peers if p.host_id != host]
        self.peer_names = {p.addr: p.host_id for p in peers}
        if raw is None:
            return None
        ended = JobEnded(keys.JobDone.read(raw).code)
        self._ended = ended
        self._wake()
        return ended

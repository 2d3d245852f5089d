"""A host's agent against etcd: is this host cut off, or is etcd down? etcd out of reach, the agent
asks its peers; reaching none it fences itself (ends its processes, joins again as a new host),
reaching some it trains on. Its lease lapsed, it registers again as itself unless the job gave it
up. Also the job's end, as read from etcd."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from typing import Any

from ..errors import UsageError
from ..protocol import hosts as keys

CONTROLLER_WID = -1  # the standby controller in the agent's process table
DONE_CHECK_S = 1.0
REGISTER_RETRY_S = 0.5
PEER_PROBE_S = 0.5  # a peer's agent answers a connect within this (or refuses it)


class Fencing:
    """The part of ``HostAgent`` (``agent.py``) that judges etcd's silence."""

    cfg: Any
    agent: Any

    def _on_lease_lost(self) -> None:
        self.lease_lost.set()
        self._wake()

    # == a lease lapsed ==========================================================================
    def _lapsed(self) -> None:
        """etcd says this host's lease expired. That alone is not the job moving on without it:
        etcd paused (a VM, a disk stall, a long GC) or restarted expires every lease at once. The
        host registers again as itself (``_rejoin``, in a thread: etcd is never waited on in this
        loop) unless the controller in office has given it up meanwhile - one transaction
        decides which came first - and only then fences itself."""
        if self._rejoiner is None:
            self._rejoined = None
            self._rejoiner = threading.Thread(target=self._rejoin, daemon=True,
                                              name="nonstop-rejoin")
            self._rejoiner.start()
            return
        verdict = self._rejoined
        if verdict is None:
            return  # still trying
        self._rejoiner, self._rejoined = None, None
        if verdict == "rejoined":
            self.lease_lost.clear()
            print(f"nonstop: host {self.cfg.host_id}: its lease in etcd had lapsed (etcd paused "
                  "or restarted?); registered again: its ranks train on", file=sys.stderr,
                  flush=True)
            return
        self._fence(verdict)

    def _rejoin(self) -> None:
        """The lease's thread has ended; a new lease, and the host's own record again under it,
        while the job has not given this incarnation up. Sets ``_rejoined``: "rejoined", or why
        the host must fence."""
        key = keys.host_key(self.cfg.host_id)
        gone = keys.gone_key(self.cfg.host_id, self.incarnation)
        old, t0 = self.lease, time.monotonic()
        while not self._stop.is_set():
            lease = None
            try:
                lease = self.etcd.lease(self.cfg.lease_ttl_s)
                verdict = self.etcd.rejoin(key, self.record.dumps(), lease, unless=gone)
                if verdict == "present":  # an earlier try of ours, or a newer run of this host
                    raw, _ = self.etcd.get(key)
                    if raw is not None and \
                            keys.HostRecord.loads(raw).incarnation != self.incarnation:
                        verdict = "superseded"
            except Exception:  # noqa: BLE001 - etcd away again: the peers tell meanwhile
                verdict = None
                if self.doubt_since is None and time.monotonic() - t0 > self.cfg.lease_ttl_s:
                    self.doubt_since = t0  # the cut-off judgement (_judge_doubt) runs
            if verdict == "rejoined":
                if old is not None:
                    old.stop()
                self.lease = lease
                self.doubt_since = None
                lease.keepalive(on_lost=self._on_lease_lost, on_doubt=self._on_doubt)
                self._rejoined = "rejoined"
                self._wake()
                return
            if lease is not None:
                try:
                    lease.revoke()
                except Exception:  # noqa: BLE001 - it expires by itself
                    lease.stop()
            if verdict == "gone":
                self._rejoined = "the job gave this host up while its lease had lapsed"
                self._wake()
                return
            if verdict == "superseded":
                self._rejoined = "another run of this host registered in its place"
                self._wake()
                return
            self._stop.wait(REGISTER_RETRY_S)

    def _on_doubt(self, doubt: bool) -> None:
        """etcd unreachable for a whole TTL (or reachable again). Unreachable for everyone (etcd
        down), the job trains on and etcd extends the leases when it is back; unreachable for this
        host alone, the job has given this host up: which one is told by the peers."""
        self.doubt_since = time.monotonic() if doubt else None
        if doubt:
            print(f"nonstop: host {self.cfg.host_id} cannot reach etcd at "
                  f"{_endpoints(self.cfg.endpoints)} (lease not refreshed for "
                  f"{self.cfg.lease_ttl_s} s)", file=sys.stderr, flush=True)
        self._wake()

    # == fencing ================================================================================
    def _judge_doubt(self) -> None:
        """etcd is out of reach. Reaching none of its peers either, this host is the one cut off
        (its lease expires at etcd as ours did here): fence now. Reaching some, etcd itself is
        down: train on, up to the policy's outage tolerance."""
        now = time.monotonic()
        since = self.doubt_since  # (cleared by the lease's thread at any moment: read once)
        if since is None:
            return
        done = self._probed  # (when the last round started, whether a peer answered)
        # with no peer known (it was cut off as it joined, before it read them), a host that
        # holds no rank fences too: it has nothing to lose; one that holds ranks alone (a job of
        # one host) cannot tell a cut from etcd down and trains on
        holds = any(x.get("rank") is not None and not x.get("spare") for x in self.meta.values())
        if done is not None and done[0] >= since and not done[1] and (self.peers or not holds):
            self._fence("it reaches neither etcd nor any other host")
            return
        if (self._probe is None or not self._probe.is_alive()) and \
                (done is None or now - done[0] >= PEER_PROBE_S):
            self._probe = threading.Thread(target=self._probe_peers, args=(now,), daemon=True,
                                           name="nonstop-probe")
            self._probe.start()
        outage = self.cfg.policy["hosts"]["store_outage_s"]
        emergency = self.cfg.policy["state"]["emergency"]
        # the controller gives up at the tolerance and may first save the newest state (its
        # emergency checkpoint, through this host's keeper, up to its grace): not cut short here
        grace = emergency["grace_s"] if emergency["on_give_up"] else 0.0
        if now - since > outage + 3 * self.cfg.lease_ttl_s + 5 + grace:
            # the controller gives up at the tolerance and says so; it did not reach us
            print(f"nonstop: error: etcd unreachable for {now - since:.0f} s "
                  f"(hosts.store_outage_s={outage:g}) and no word from the controller: ending "
                  "this host's processes", file=sys.stderr, flush=True)
            self.agent.end_all(0.0)
            self.code = 1

    def _probe_peers(self, started: float) -> None:
        """Whether any other host answers (a connect accepted or refused: either proves the
        path); never judged on one host's word about another's clock."""
        import socket

        for addr, port in list(self.peers):
            try:
                with socket.create_connection((addr, port), timeout=PEER_PROBE_S):
                    pass
            except ConnectionRefusedError:  # a refusal came back: the path works
                pass
            except OSError:
                continue
            self._probed = (started, True)
            return
        self._probed = (started, False)

    def _fence(self, why: str) -> None:
        """The job has moved on without this host (it gave it up, or it is cut off). Its
        processes end now - they must never join a newer generation - then the host offers
        itself again, as a new host (a spare), once etcd answers."""
        self.lease_lost.clear()
        self.doubt_since = None
        self._probed = None
        self._rejoiner, self._rejoined = None, None
        killed = [p.wid for p in self.agent.alive() if p.wid != CONTROLLER_WID]
        for wid in killed:
            self.agent.signal(wid, signal.SIGKILL)
        self.agent.signal(CONTROLLER_WID, signal.SIGKILL)
        if self.ctl is not None:
            self.ctl.close()
            self.ctl = None
        self.meta.clear()
        self._unsent_exits.clear()
        self.history, self._delivered = [], 0
        print(f"nonstop: host {self.cfg.host_id} fenced ({why}): ended its {len(killed)} "
              "process(es); it joins again as a new host once etcd answers", file=sys.stderr,
              flush=True)
        old, self.lease = self.lease, None
        if old is not None:
            old.stop()
        deadline = time.time() + 3600
        while self.code is None and time.time() < deadline:
            self.agent.poll(REGISTER_RETRY_S)
            try:
                if self._read_job():
                    self._end_done()
                    return
                if old is not None:  # our old record goes first: the controller sees a new host
                    old.revoke()
                    old = None
                self._register()
                break
            except UsageError:  # our old record is still there
                continue
            except Exception:  # noqa: BLE001 - etcd still unreachable: keep trying
                continue
        self._respawn_at = time.time()

    def _store_loop(self) -> None:
        """etcd is read here, never in the loop that serves the ranks: an etcd out of reach makes
        a call wait for its deadline, and the ranks' heartbeats must not wait with it."""
        while not self._stop.wait(DONE_CHECK_S):
            try:
                self._read_job()
            except Exception:  # noqa: BLE001 - etcd away for a moment: the job goes on
                continue

    def _read_job(self) -> bool:
        """Whether the job has ended (then this host ends too); reads the peers on the way, and
        whether the job gave this host up (then it fences itself)."""
        inc = self.incarnation  # (the loop fences only if it is still this one)
        if inc and self.etcd.get(keys.gone_key(self.cfg.host_id, inc))[0] is not None:
            self.given_up = inc
            self._wake()
        raw, _ = self.etcd.get(keys.DONE)
        self._yield_secret()
        rows = self.etcd.get_prefix(keys.HOSTS)
        peers = [keys.HostRecord.loads(r[1]) for r in rows]
        self.peers = [(p.addr, p.ctl_port) for p in peers if p.host_id != self.cfg.host_id]
        self.peer_names = {p.addr: p.host_id for p in peers}
        if raw is None:
            return False
        self.done = json.loads(raw)
        self._wake()
        return True

    def _end_done(self) -> None:
        self.agent.end_all(0.0)
        self.code = int((self.done or {}).get("code", 1))


def _endpoints(endpoints: list[tuple[str, int]]) -> str:
    return ",".join(f"{h}:{p}" for h, p in endpoints)

"""The controller process of a job across hosts.

Every host's agent keeps one ready, in standby: it campaigns in etcd for the job's leader key, on a
lease of its own. The one elected connects to every host's agent and runs the job with the same
controller as on one host (``Cluster`` stands in for the agent and the mail). It writes its
journal to etcd only while it still holds its epoch; a host refuses commands from an older epoch.
When its lease is lost it stops at once: a standby takes over.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

from ..protocol import hosts as keys
from ..protocol import messages as m
from .phase import Phase
from ..decide import places, takeover
from ..agent.host_config import HostConfig
from .forming import Forming, NotFormed
from .handover import CONNECT_S, REGISTER_AGAIN_S, Successor
from .journal import Journal

HOSTS_EVERY_S = 0.2  # how often etcd is asked whether the host list changed while the job runs
HOSTS_FULL_S = 2.0  # ...and how often it is read whole all the same
TURN_AWAY_S = 30.0  # a host turned away is given this long to end before its channel is closed
HEARD_S = 1.0  # a host whose agent spoke this recently is alive, whatever its lease says


# == what the office's own threads find, taken in the controller's thread (Office.notice) ======
@dataclasses.dataclass(frozen=True)
class HostsListed:
    """etcd's host records as the store thread read them: (host id, incarnation) -> record."""
    alive: dict[tuple[str, str], keys.HostRecord]


@dataclasses.dataclass(frozen=True)
class HostGivenUp:
    """A host whose record vanished was given up in etcd: now here too."""
    node: int


@dataclasses.dataclass(frozen=True)
class HostReached:
    """A host that joined answered on its channel: taken in once no recovery is under way."""
    key: tuple[str, str]
    rec: keys.HostRecord
    ch: Any


@dataclasses.dataclass(frozen=True)
class HostNotReached:
    """A host that joined did not answer: tried again at the next look at etcd."""
    key: tuple[str, str]


def _die_with_parent() -> None:
    """The standby is the agent's child: it ends with it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    parent = os.environ.get("NONSTOP_LAUNCHER_PID")
    if parent and os.getppid() != int(parent):
        os._exit(1)


def _import_office() -> None:
    from . import controller  # noqa: F401
    from ..observe import display, events  # noqa: F401
    from . import summary  # noqa: F401
    from . import cluster  # noqa: F401


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    _die_with_parent()
    cfg = HostConfig.from_json(Path(argv[0]).read_text())
    from ..net.channel import load_secret
    from ..store.etcd import StoreUnavailable

    secret = load_secret()
    # everything a controller needs is imported while in standby (pydantic and the controller's
    # modules: 0.3 s on an idle core, seconds while the host's processes import torch), on a
    # thread, while this one campaigns: a takeover then costs the lease's expiry, not an import,
    # and the job's first election does not wait for one
    office_imports = threading.Thread(target=_import_office, name="nonstop-imports", daemon=True)
    office_imports.start()
    etcd = cfg.etcd()
    stop = threading.Event()
    reach = StoreReach(",".join(f"{h}:{p}" for h, p in cfg.endpoints))

    def lost() -> None:
        step_down(f"the controller on {cfg.host_id} lost its lease in etcd")

    me = json.dumps({"host": cfg.host_id, "pid": os.getpid()})
    while True:
        try:
            lead = etcd.campaign(keys.LEADER, me, cfg.lease_ttl_s, stop, on_lost=lost,
                                 on_doubt=reach.doubt)
            break
        except StoreUnavailable:
            time.sleep(0.5)
    if lead is None:
        os._exit(0)
    office_imports.join()
    reach.confirm = lambda: _still_leader(etcd, lead.epoch)
    reach.lease = lead.lease
    code = Leader(cfg, secret, etcd, lead, reach).run()
    sys.stdout.flush()
    os._exit(0 if code is not None else 1)


_LOG: list[Any] = []  # the event log of the controller in office (one, once it is)


def step_down(why: str) -> NoReturn:
    """Leave office at once, leaving the hosts and their processes to the successor; the event
    log says so (nonstop report then tells a controller that stepped down from one killed)."""
    print(f"nonstop: {why}: this controller steps down", file=sys.stderr, flush=True)
    for log in _LOG:
        try:
            log.write("stepped_down", why=why)
            log.flush()
        except Exception:  # noqa: BLE001 - leaving all the same
            pass
    os._exit(3)


class StoreReach:
    """Whether etcd is reachable for the controller in office. Out of reach, the ranks train on;
    the controller's orders wait (``Leader.in_office``: its lease is not confirmed) and go out
    once it is, after it checked that it is still the one in office. Each outage is said once,
    naming etcd and what its client met, and the job's summary says how long etcd was away and
    whether it was back at the end (``record``)."""

    def __init__(self, endpoints: str) -> None:
        self.endpoints = endpoints
        self.down_since: float | None = None
        self.confirm: Any = None
        self.lease: Any = None  # the leader key's lease (store.etcd_lease.Lease), once elected
        self.failure: str | None = None  # what the newest outage looked like to the client
        self.outages = 0
        self._down_s = 0.0  # the outages that are over, in all

    def doubt(self, doubt: bool) -> None:
        if doubt:
            self.down_since = time.monotonic()
            self.outages += 1
            failure = self.lease.failure if self.lease is not None else None
            self.failure = failure or f"no answer from {self.endpoints}"
            print(f"nonstop: etcd out of reach ({self.failure}): training goes on without it",
                  file=sys.stderr, flush=True)
            return
        if self.down_since is not None:
            self._down_s += time.monotonic() - self.down_since
        self.down_since = None
        if self.confirm is not None and not self.confirm():
            step_down("another controller took office while etcd was out of reach")
        print("nonstop: etcd is back: the control plane resumes", file=sys.stderr, flush=True)

    def record(self) -> dict[str, Any] | None:
        """etcd's outages while this controller was in office, for the job's summary (None:
        there was none)."""
        if not self.outages:
            return None
        since = self.down_since  # (cleared by the lease's thread at any moment: read once)
        now = time.monotonic()
        return {"store": "etcd", "endpoints": self.endpoints, "error": self.failure,
                "outages": self.outages,
                "out_of_reach_s": round(self._down_s + (now - since if since else 0.0), 3),
                "back": since is None}


def _still_leader(etcd: Any, epoch: int) -> bool:
    try:
        found = etcd.leader(keys.LEADER)
    except Exception:  # noqa: BLE001 - out of reach again: judged at the next answer
        return True
    return found is not None and found[1] == epoch


class Leader:
    """The controller in office: it runs the job through a ``Cluster`` of the hosts' agents,
    which reports to it (``ports.Office``)."""

    def __init__(self, cfg: HostConfig, secret: bytes, etcd: Any, lead: Any, reach: StoreReach):
        self.cfg, self.secret, self.etcd, self.lead = cfg, secret, etcd, lead
        self.reach = reach
        self.epoch = lead.epoch
        self.run_dir = cfg.run_dir
        self._journal_key: tuple[int, ...] = (-2,)  # what the newest journal handed over was
        self._written_gen = -2  # the newest generation the journal in etcd holds
        self.journal = Journal(etcd, self.epoch)
        self._pending: keys.JournalRecord | None = None  # the journal to write next
        self._worker: threading.Thread | None = None
        self._joining: set[tuple[str, str]] = set()  # hosts being joined or turned away
        self._connecting: set[tuple[str, str]] = set()  # ...being joined: their places taken
        self.controller: Any = None
        self.cluster: Any = None
        # the controller runs the job (after a takeover, once it adopted it): before, the
        # cluster's polls collect what the hosts run, and nothing else is done with them
        self._serving = False
        self._status: str | None = None  # the newest status record, to put in etcd
        self._vanished: dict[int, float] = {}  # node -> since when its record is gone from etcd
        self._joins: list[HostReached] = []  # taken in once no recovery is under way
        # the hand-over's side of a takeover, and how a host is given up in etcd
        self.successor = Successor(etcd, self.epoch, secret, cfg.lease_ttl_s)

    # == the office, as the cluster reports to it (ports.Office) ================================
    def in_office(self) -> bool:
        return not self._serving or bool(self.lead.alive)

    def completed(self) -> bool:
        return self._serving and self.controller.outcome.completed

    def store_heard(self) -> float:
        return float(self.lead.lease.last_refresh) if self._serving else time.monotonic()

    def store_period(self) -> float:
        return self.lead.lease.period

    def node_lost(self, node: int) -> None:
        if self._serving:  # (before, a takeover counts it lost from what the hosts answered)
            self.controller.node_lost(node, "its lease in etcd expired")

    def output(self, wid: int, line: str) -> None:
        if self.controller is not None:
            self.controller.on_output(wid, line)

    def tick(self) -> None:
        if self._serving:
            self._tick(self.controller, self.cluster)

    def guarded(self, puts: dict[str, str]) -> None:
        self.etcd.guarded(keys.LEADER, self.epoch, puts=puts)

    def notice(self, notice: Any) -> None:
        """What the office's own threads found (the store loop, a host's connection), in the
        controller's thread."""
        match notice:
            case HostsListed(alive=alive):
                self._on_hosts(alive, self.cluster)
            case HostGivenUp(node=node):
                self.cluster.host_gone(node)
            case HostReached():
                self._joins.append(notice)
            case HostNotReached(key=key):
                self._connecting.discard(key)
                self._joining.discard(key)
            case _:
                raise TypeError(f"the office has no case for {type(notice).__name__}")

    def run(self) -> int | None:
        from .. import policy as policy_mod
        from .controller import Controller
        from ..observe.display import Display
        from ..observe.events import EventLog
        from .summary import report
        from .cluster import Cluster, Deposed

        cfg = self.cfg
        done, _ = self.etcd.get(keys.DONE)
        if done is not None:
            return keys.JobDone.read(done).code
        raw, _ = self.etcd.get(keys.JOURNAL)
        try:
            journal = keys.JournalRecord.loads(raw) if raw is not None else None
        except ValueError as exc:  # another version's: nothing of it can be trusted
            self._finish(2, f"the job's journal in etcd cannot be read ({exc}): it was written "
                            "by another version of nonstop, or is damaged")
            return 2
        pol = policy_mod.Policy.model_validate(cfg.policy)
        channels: dict[str, Any] = {}
        if journal is None:
            formed = Forming(cfg.job_id, cfg.nnodes_max, cfg.nnodes_max + cfg.spare_nodes,
                             self.secret, self.etcd, self._put_status).first_hosts(
                                 pol.hosts.join_timeout_s)
            if isinstance(formed, NotFormed):
                self._finish(2, formed.diagnosis)
                return 2
            channels = formed.channels
            for rec in formed.beyond:  # registered at once beyond the job's size (before any
                key = (rec.host_id, rec.incarnation)  # could see it full): turned away
                self._joining.add(key)
                threading.Thread(target=self._turn_away, args=(key, rec), daemon=True).start()
            placed = dict(enumerate(formed.hosts))
            lost: set[int] = set()
        else:
            placed, lost = self._at_takeover(lambda: self.successor.place(journal))
        display = Display(quiet=cfg.quiet, live=False)
        log = EventLog(self.run_dir)
        _LOG.append(log)
        log.write("leader", epoch=self.epoch, host=cfg.host_id, pid=os.getpid(),
                  takeover=journal is not None,
                  hosts={h.host_id: h.addr for _, h in sorted(placed.items())})
        if journal is not None:  # (a new job's hosts answered already: ``_reachable``)
            channels = self.successor.connect(list(placed.values()))
        cluster = self.cluster = Cluster(self.epoch, self.secret, self.run_dir, self,
                                         next_wid=journal.next_wid if journal is not None else 0)
        cluster.own_host = cfg.host_id
        for node, rec in sorted(placed.items()):
            try:
                ch = channels.get(rec.host_id, (None, None))[1]
                if ch is None:
                    raise ConnectionError(f"its agent did not answer within {CONNECT_S:g} s")
                cluster.add_host(node, rec, ch=ch)
            except Exception as exc:  # noqa: BLE001 - alive in etcd, out of reach: lost for us
                print(f"nonstop: host {rec.host_id} cannot be reached: {exc}", file=sys.stderr,
                      flush=True)
                cluster.links.pop(node, None)
                # and given up in etcd first, as a silent host is (``_collect``): its lease may
                # outlast a takeover (a frozen host's did, on a loaded machine), and woken, it
                # must find itself given up and fence itself - not register again as if its
                # ranks were still its own
                if journal is not None:
                    self._give_up(rec.host_id, rec.incarnation, force=True)
                lost.add(node)
        nodes = cfg.nnodes_max
        world = nodes * cfg.nproc_per_node
        total = max(list(placed) + list(lost)) + 1
        cluster.managed = cfg.managed
        controller = Controller(world=world, spares=cfg.spares * nodes, policy=pol, mail=cluster,
                                agent=cluster, log=log, display=display, managed=cfg.managed,
                                nodes=nodes, spare_nodes=total - nodes, run_dir=self.run_dir)
        self.controller = controller
        controller.status.publish = self._publish_status
        served = self._serve_metrics(pol, controller, log, display)
        if journal is not None:
            seen = self._at_takeover(lambda: self.successor.collect(
                cluster, lost, timeout_s=cfg.lease_ttl_s + 3.0))
            # a job that shrank goes on at its size (it grows back from there)
            adoption = takeover.adopt(journal, seen, len(journal.plan) or world, cfg.managed)
            display.info(f"controller on {cfg.host_id} (epoch {self.epoch}) takes over at "
                         f"generation {adoption.gen}"
                         + ("; every rank had finished" if adoption.over else
                            "" if adoption.steady else
                            f"; rank(s) {adoption.missing} to recover"))
            controller.adopt(adoption, seen, journal, lost, last=self.successor.last_word())
        else:
            display.info(f"controller on {cfg.host_id} (epoch {self.epoch}): {world} rank(s) on "
                         f"{nodes} host(s) + {total - nodes} spare host(s)")
        self._serving = True
        from .keepers import KeeperStartError

        try:
            code = controller.run()
        except Deposed as exc:  # a successor is in office: leave everything to it, at once
            step_down(f"{exc}: another controller is in office")
        except KeeperStartError as exc:  # the machine's trouble: said as such, not as a bug
            controller.outcome.diagnosis = f"the job could not start: {exc}"
            print(f"nonstop: error: {controller.outcome.diagnosis}", file=sys.stderr, flush=True)
            code = 1
            try:
                controller.agent.end_all(0.0)
            except Exception:  # noqa: BLE001
                pass
        except Exception:  # noqa: BLE001 - a fault of nonstop's own: end cleanly, never loop
            import traceback

            text = traceback.format_exc()
            sys.stderr.write(text)
            # a standby would take office and meet the same state: the job ends here, saying why
            controller.outcome.diagnosis = (
                "the controller failed (a bug in nonstop; please report it with "
                f"{self.run_dir}/logs/controller.log): {text.strip().splitlines()[-1]}")
            code = 1
            try:
                controller.agent.end_all(0.0)
            except Exception:  # noqa: BLE001
                pass
        controller.outcome.store = self.reach.record()
        report(controller, log, self.run_dir, code, display)
        # the other hosts hear of the end first: recording it in etcd may wait out etcd's
        # timeouts (etcd away is one way a job ends), and a host told nothing ends only at its
        # own limit; this host last, once it is recorded (its agent ends this process)
        cluster.end_hosts(code, own=False)
        self._finish(code, controller.outcome.diagnosis)
        cluster.end_hosts(code, own=True)
        time.sleep(0.2)  # the END frames leave before the process does
        cluster.close()
        if served is not None:
            served.close()
        return code

    def _serve_metrics(self, pol: Any, controller: Any, log: Any, display: Any) -> Any:
        """The job's metrics while this controller is in office: on the port after its host's
        (``--metrics-port`` + 1; 0: one from the OS), its address in the ``metrics`` event and
        in the status record."""
        from ..errors import UsageError
        from ..observe.metrics import Served

        port = self.cfg.metrics_port
        if port is None:
            return None
        try:
            served = Served(port + 1 if port else 0, self.cfg.metrics_addr, pol)
        except UsageError as exc:  # the job goes on without them
            print(f"nonstop: no job metrics: {exc}", file=sys.stderr, flush=True)
            return None
        served.attach(controller, log, display)
        return served

    def _give_up(self, host_id: str, incarnation: str, force: bool = False) -> bool:
        """A host given up in etcd (``Successor.give_up``); a newer controller in office: this
        one steps down."""
        from ..store.etcd import Fenced

        try:
            return self.successor.give_up(host_id, incarnation, force)
        except Fenced:
            step_down("a newer controller is in office")

    @staticmethod
    def _at_takeover(part: Any) -> Any:
        """A part of the hand-over; a newer controller in office meanwhile: this one steps down."""
        from ..store.etcd import Fenced

        try:
            return part()
        except Fenced:
            step_down("a newer controller is in office")

    def _publish_status(self, text: str) -> None:
        self._status = text  # written by the store loop (this is the controller's thread)

    def _put_status(self, text: str) -> None:
        """The job's status record, in etcd now (before the job forms: no store loop yet)."""
        self.guarded({keys.STATUS: text})

    def _finish(self, code: int, diagnosis: str | None) -> None:
        try:
            self.guarded({keys.DONE: keys.JobDone(code, diagnosis).dumps()})
        except Exception as exc:  # noqa: BLE001 - deposed or etcd gone: the hosts end anyway
            if self.reach.down_since is None:  # (else said already, and in the summary)
                print(f"nonstop: could not record the job's end in etcd: {exc}", file=sys.stderr)
        if diagnosis and code == 2:
            print(f"nonstop: error: {diagnosis}", file=sys.stderr, flush=True)

    # == while the job runs =====================================================================
    def _tick(self, controller: Any, cluster: Any) -> None:
        """Once per controller tick, in the controller's thread: never waits on etcd (a worker
        thread reads and writes it); hands the journal over, acts on what the worker read."""
        if self._worker is None:
            self._worker = threading.Thread(target=self._store_loop, args=(cluster,),
                                            daemon=True, name="nonstop-store")
            self._worker.start()
        down = self.reach.down_since
        # once training is complete the job's end needs no etcd (it goes out without a lease,
        # bounded by timeouts.finish_s): giving up then would end the ranks in their final save
        if down is not None and not controller.outcome.completed:
            outage = controller.policy.hosts.store_outage_s
            if time.monotonic() - down > outage and controller.outcome.exit_code is None:
                cluster.giving_up = True  # no lease to prove: the job ends all the same
                controller.give_up("etcd unreachable", (
                    f"etcd at {','.join(f'{h}:{p}' for h, p in self.cfg.endpoints)} unreachable "
                    f"for {time.monotonic() - down:.0f} s (hosts.store_outage_s={outage:g}): no "
                    "host can be known alive or dead without it"))
        # a generation, an incident closed, a host joined or lost, a node isolated: a standby
        # taking over must number the nodes as we did (a node isolated must stay so)
        key = (controller.gen, len(controller.incidents), len(cluster.links),
               sum(link.lost for link in cluster.links.values()), len(controller.counters.isolated))
        if key != self._journal_key and controller.phase is not Phase.STARTING:
            self._journal_key = key
            self._pending = controller.journal(self.epoch)  # the newest wins
        if cluster.own_release is not None and self._written_gen >= controller.gen \
                and self._pending is None:
            cluster.release_own()
        # a host taken in starts its memory, which the controller waits for (seconds on a busy
        # machine): not in the middle of a recovery - a host fenced by it comes back as a spare
        # while it is still under way - unless the recovery waits for a host to join
        if self._joins and (controller.phase is Phase.WAITING_FOR_HOSTS or (
                controller.incident is None and controller.phase is not Phase.TEARING_DOWN)):
            self._take_in(self._joins.pop(0), controller, cluster)

    def _take_in(self, joined: HostReached, controller: Any, cluster: Any) -> None:
        """A host that joined becomes a node of the job: one never used - not one the job
        holds, lost or isolated (after a takeover the lost ones are in no link: the new host
        was given a lost node's number, isolated)."""
        self._connecting.discard(joined.key)
        self._joining.discard(joined.key)
        used = [*cluster.links, *controller.counters.isolated, *controller.gens.node_of().values()]
        node = max(used) + 1 if used else 0
        cluster.add_host(node, joined.rec, ch=joined.ch)
        controller.node_joined(node)

    def _store_loop(self, cluster: Any) -> None:
        """etcd's side of the controller, in its own thread: the journal written (only while
        this controller holds its epoch), the hosts read. What it finds is handed to the
        controller's thread through the cluster's inbox."""
        from ..store.etcd import Fenced

        seen_rev, full_due = -1, 0.0  # the list is read again only when etcd changed (2,048 hosts)
        while True:
            time.sleep(HOSTS_EVERY_S)
            if self.reach.down_since is not None:
                continue  # nothing is decided on etcd's word until it is back
            pending, self._pending = self._pending, None
            if pending is not None:
                try:
                    self.journal.write(pending.dumps())
                    self._written_gen = pending.gen
                except Fenced:
                    step_down("a newer controller is in office")
                except Exception:  # noqa: BLE001 - etcd out of reach: written later
                    if self._pending is None:
                        self._pending = pending
            status, self._status = self._status, None
            if status is not None:
                try:
                    self.guarded({keys.STATUS: status})
                except Exception:  # noqa: BLE001 - etcd away or a newer controller: not ours to say
                    pass
            try:
                rev = self.etcd.revision()
                if rev == seen_rev and time.monotonic() < full_due and not self._vanished:
                    continue
                rows = self.etcd.get_prefix(keys.HOSTS)
            except Exception:  # noqa: BLE001 - etcd away: nothing is decided without it
                continue
            seen_rev, full_due = rev, time.monotonic() + HOSTS_FULL_S
            alive = {}
            for _, raw, _, _ in rows:
                rec = keys.HostRecord.loads(raw)
                alive[(rec.host_id, rec.incarnation)] = rec
            self._give_up_vanished(alive, cluster)
            cluster.notice(HostsListed(alive))

    def _give_up_vanished(self, alive: dict[tuple[str, str], keys.HostRecord],
                          cluster: Any) -> None:
        """Hosts whose record is gone from etcd (in the store thread). A record goes with its
        host (killed, cut off) or without it: etcd paused or restarted expires every lease at
        once, and the host registers again. A host whose agent still speaks to us gets that
        time; one that is silent, or takes too long, is given up - in etcd first, by a
        transaction that holds only while its record is absent and this controller in office
        (the host, registering again, checks the same key) - and only then here."""
        now = time.monotonic()
        grace = self.cfg.lease_ttl_s + REGISTER_AGAIN_S
        held = [(link.rec.host_id, link.rec.incarnation) for link in cluster.links.values()
                if not link.lost]
        # a host that registered again as a new incarnation, or answers as one, has left its
        # older incarnation behind for good: no grace for that one (decide/places.py)
        renewed = set(places.superseded(held, alive))
        for node, link in list(cluster.links.items()):
            key = (link.rec.host_id, link.rec.incarnation)
            if link.lost or key in alive:
                self._vanished.pop(node, None)
                continue
            since = self._vanished.setdefault(node, now)
            if link.heard is not None and now - link.heard < HEARD_S and now - since < grace \
                    and key not in renewed and not link.moved_on:
                continue  # it speaks: its lease lapsed, it registers again
            if self._give_up(link.rec.host_id, link.rec.incarnation):
                self._vanished.pop(node, None)
                cluster.notice(HostGivenUp(node))

    def _on_hosts(self, alive: dict[tuple[str, str], keys.HostRecord], cluster: Any) -> None:
        """Hosts that joined are connected (in the background) and become spare nodes (those
        whose record went are judged by ``_give_up_vanished``)."""
        known = {(link.rec.host_id, link.rec.incarnation) for link in cluster.links.values()}
        # an isolated host leaves (released once a generation forms without it): its place is
        # free for a new one - a job waiting for hosts forms none until one joins
        isolated = set(self.controller.counters.isolated) if self.controller is not None else set()
        held = [(link.rec.host_id, link.rec.incarnation) for node, link in cluster.links.items()
                if not link.lost and node not in isolated]
        new = [key for key in alive if key not in known and key not in self._joining]
        admission = places.admit(self.cfg.nnodes_max + self.cfg.spare_nodes,
                                 held + sorted(self._connecting), new)
        for key in admission.turn_away:  # it registered before it could see the job was full
            self._joining.add(key)
            threading.Thread(target=self._turn_away, args=(key, alive[key]), daemon=True).start()
        for key in admission.join:  # (one that waits for its older incarnation's place: later)
            self._joining.add(key)
            self._connecting.add(key)
            threading.Thread(target=self._connect_new, args=(key, alive[key], cluster),
                             daemon=True, name="nonstop-join").start()

    def _turn_away(self, key: tuple[str, str], rec: keys.HostRecord) -> None:
        """Tell a host that registered into a full job to end (exit 2). Not reached (its agent
        slow to listen, on a loaded machine): tried again at the next look at the hosts, else it
        waited for the job to take it until its join timeout."""
        from ..net import channel

        why = (f"job '{self.cfg.job_id}' already has {self.cfg.nnodes_max + self.cfg.spare_nodes} "
               f"host(s), the most it takes (--nnodes {self.cfg.nnodes_max} + --spare-nodes "
               f"{self.cfg.spare_nodes})")
        ch = None
        try:
            ch = channel.connect(rec.addr, rec.ctl_port, self.secret, timeout_s=5.0,
                                 tos=channel.CONTROL_TOS)
            ch.send(m.encode(m.Hello(epoch=self.epoch)))
            ch.send(m.encode(m.End(epoch=self.epoch, code=2, why=why)))
        except Exception as exc:  # noqa: BLE001 - it may be gone already, or not listening yet
            print(f"nonstop: could not turn host {rec.host_id} away (tried again): {exc}",
                  file=sys.stderr, flush=True)
            if ch is not None:
                ch.close()
            self._joining.discard(key)
            return
        try:  # the channel is held until the host ends (it closes), for a while at most
            deadline = time.monotonic() + TURN_AWAY_S
            while (left := deadline - time.monotonic()) > 0:
                ch.recv(timeout=left)  # its answer to the hello, then its end
        except Exception:  # noqa: BLE001 - closed: it ended (or it went); else it was told
            pass
        finally:
            ch.close()

    def _connect_new(self, key: tuple[str, str], rec: keys.HostRecord, cluster: Any) -> None:
        from ..net import channel

        try:
            ch = channel.connect(rec.addr, rec.ctl_port, self.secret, timeout_s=5.0,
                                 tos=channel.CONTROL_TOS)
        except Exception as exc:  # noqa: BLE001 - tried again at the next look
            print(f"nonstop: host {rec.host_id} joined but cannot be reached yet: {exc}",
                  file=sys.stderr, flush=True)
            cluster.notice(HostNotReached(key))
            return
        cluster.notice(HostReached(key, rec, ch))


if __name__ == "__main__":
    main()

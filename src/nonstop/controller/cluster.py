"""The controller's view of many hosts: one channel to each host's agent, and the same interface as
one host's agent (start, signal, watch processes) and mail (mailboxes, aborts, events, progress).
The controller above it decides as it does on one host; a node here is a host.

A host is alive while its lease in etcd is: a host whose record is gone (or came back as a new
incarnation, after fencing itself) is lost, and every process it held is reported as exited. Its
channel going quiet alone proves nothing (a controller's own network may be at fault), so it is
only reconnected.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from ..protocol import hosts as keys, last_step
from ..protocol import messages as m
from .ports import Office
from .readers import Readers

RECONNECT_S = 0.2
HOST_LOST_CODE = -int(signal.SIGKILL)  # what a lost host's processes are reported to exit with
# every other host silent this long (at the least), and etcd silent too: the controller may be
# the one that cannot hear (``deaf``); the hang check's frozen ranks are judged after 0.5 s
SILENT_ALL_S = 0.4


@dataclasses.dataclass
class RemoteProc:
    """A process on another host, as its agent reports it."""

    wid: int
    node: int
    spare: bool
    log_path: Path  # on its host
    pid: int | None = None
    returncode: int | None = None
    t_exit: float | None = None
    last: last_step.LastStep | None = None  # the last step it completed (protocol.last_step)

    @property
    def alive(self) -> bool:
        return self.returncode is None


@dataclasses.dataclass
class HostLink:
    node: int
    rec: keys.HostRecord
    ch: Any = None
    lost: bool = False
    unreachable: bool = False  # our channel to it broke and connecting again failed
    offset: float = 0.0  # our clock minus the host's, from its newest message
    heard: float | None = None  # time.monotonic() of its newest frame
    stopped: set[int] = dataclasses.field(default_factory=set)
    state: m.State | None = None  # its answer to our hello
    # its host answered as another incarnation (it fenced itself and joined again): this one is
    # gone for good, and nothing meant for it may reach the new one (given up at once)
    moved_on: bool = False


class Cluster:
    """Agents of many hosts behind one agent-and-mail interface."""

    def __init__(self, epoch: int, secret: bytes, run_dir: Path, office: Office,
                 next_wid: int = 0):
        self.epoch, self.secret = epoch, secret
        self.run_dir = run_dir
        self.office = office  # what it reports to, and asks whether it may give orders
        self.links: dict[int, HostLink] = {}
        self.procs: dict[int, RemoteProc] = {}
        # (node, a report) from the hosts' readers; (-1, None): wake up; (-1, fn): run fn here
        self.inbox: "queue.Queue[tuple[int, Any]]" = queue.Queue()
        self._next_wid = next_wid
        self._events: list[dict[str, Any]] = []
        self._progress: dict[int, dict[str, Any]] = {}
        self._keeper_events: dict[int, list[dict[str, Any]]] = {}
        self._preempted: list[tuple[int, float]] = []  # (node, grace): hosts told to stop
        self._missed: list[m.MissedDeadline] = []  # deadlines that fired here or on a host
        self.own_host: str | None = None  # the host this controller runs on
        self.own_release: tuple[int, str] | None = None  # ...released once the journal says so
        self._exited: list[RemoteProc] = []
        self._unsent: dict[int, list[tuple[int, dict[str, Any]]]] = {}  # wid -> (seq, message)
        self._held: dict[int, list[dict[str, Any]]] | None = None  # node -> mails (in a batch)
        self._common: dict[str, Any] = {}  # ...and what they share
        self._replies: dict[int, tuple[threading.Event, list[m.Reply]]] = {}
        self._req = 0
        self.managed = True  # the script uses nonstop.wrap
        self._stop = threading.Event()
        self.grace_s = 0.0
        self.health = RemoteHealth()  # each host's agent runs its own checks
        self._readers = Readers(self._deliver, self._reconnect, self._stop)
        # orders go out without a confirmed lease (``office.in_office``) only where no successor
        # could decide otherwise: once training is complete for every rank (a successor finds
        # the ranks done and ends the job the same way), and the job's end after etcd was away
        # too long
        self.giving_up = False
        self._heard_other: float | None = None  # time.monotonic() of another host's newest frame
        self._held_orders: list[tuple[int, m.Order]] = []

    # == hosts ==================================================================================

    @property
    def next_wid(self) -> int:
        """The worker id the next process started will get (a successor goes on from it)."""
        return self._next_wid
    def add_host(self, node: int, rec: keys.HostRecord, timeout_s: float = 5.0,
                 ch: Any = None) -> HostLink:
        """Connect to a host's agent (or take the channel already opened to it) and say hello
        (it answers with what it runs)."""
        link = HostLink(node, rec)
        self.links[node] = link
        if ch is None:
            self._connect(link, timeout_s)
        else:
            link.ch = ch
            ch.send(m.encode(m.Hello(epoch=self.epoch)))
        self._readers.watch(link)
        return link

    def _connect(self, link: HostLink, timeout_s: float) -> None:
        from ..net import channel

        link.ch = channel.connect(link.rec.addr, link.rec.ctl_port, self.secret,
                                  timeout_s=timeout_s, tos=channel.CONTROL_TOS)
        link.ch.send(m.encode(m.Hello(epoch=self.epoch)))

    def _reconnect(self, link: HostLink) -> None:
        """The channel to a host broke: the agent may be fine (our link was not), so it is
        connected again, in a thread of its own, until it is or the host is lost."""
        def run() -> None:
            while not self._stop.is_set() and not link.lost and not link.moved_on:
                time.sleep(RECONNECT_S)
                try:
                    self._connect(link, timeout_s=2.0)
                except Exception:  # noqa: BLE001 - etcd decides whether the host is lost
                    link.unreachable = True
                    continue
                link.unreachable = False
                self._readers.watch(link)
                return

        threading.Thread(target=run, daemon=True, name=f"nonstop-host-{link.node}").start()

    def _deliver(self, link: HostLink, msg: dict[str, Any]) -> None:
        """A frame from a host (in the readers' thread)."""
        link.heard = time.monotonic()
        if link.rec.host_id != self.own_host:
            self._heard_other = link.heard
        try:
            report = m.decode(msg)
        except m.BadMessage as exc:  # an agent with the secret but another nonstop
            print(f"nonstop: a message from host {link.rec.host_id} refused: {exc}",
                  file=sys.stderr, flush=True)
            return
        if isinstance(report, m.Reply) and report.id in self._replies:
            waiter, answer = self._replies[report.id]
            answer.append(report)
            waiter.set()
            return
        self.inbox.put((link.node, report))

    def host_gone(self, node: int) -> None:
        """The host's lease is gone: every process it held is gone with it."""
        link = self.links.get(node)
        if link is None or link.lost:
            return
        link.lost = True
        if link.ch is not None:
            link.ch.close()
        now = time.time()
        for p in self.procs.values():
            if p.node == node and p.alive:
                p.returncode, p.t_exit = HOST_LOST_CODE, now
                self._exited.append(p)
        self.office.node_lost(node)

    def node_of_host(self, host_id: str, incarnation: str) -> int | None:
        for node, link in self.links.items():
            if link.rec.host_id == host_id and link.rec.incarnation == incarnation:
                return node
        return None

    def _unleashed(self) -> bool:
        """Whether orders go out without a confirmed lease: the job is ending."""
        return self.giving_up or self.office.completed()

    def _to(self, node: int, order: m.Order) -> None:
        if not (self._unleashed() or self.office.in_office()):
            # it cannot prove its lease still holds (its host was frozen, etcd is away): a
            # successor may be in office, so nothing goes out until the lease is confirmed
            if not self._held_orders:
                print("nonstop: the controller cannot confirm it is still in office (its lease "
                      "in etcd): its orders wait until it can", file=sys.stderr, flush=True)
            self._held_orders.append((node, order))
            return
        link = self.links.get(node)
        if link is None or link.lost or link.moved_on or link.ch is None:
            return
        try:
            link.ch.send(m.encode(dataclasses.replace(order, epoch=self.epoch)))
        except Exception:  # noqa: BLE001 - the reader reconnects; etcd decides if it is lost
            pass

    # == the agent interface ======================================================================
    def new_wid(self) -> int:
        wid = self._next_wid
        self._next_wid += 1
        return wid

    def spawn(self, wid: int, spare: bool, spare_mode: str | None = None, node: int = 0,
              keeper: str | None = None) -> RemoteProc:
        log = self.run_dir / "logs" / f"worker-{wid}.log"
        proc = self._start(RemoteProc(wid, node, spare, log),
                           m.Spawn(wid=wid, spare=spare, mode=spare_mode, node=node,
                                   keeper=keeper))
        for seq, msg in self._unsent.pop(wid, []):  # its assignment went out before it existed
            self._to(node, m.Send(wid=wid, seq=seq, msg=msg))
        return proc

    def spawn_keeper(self, wid: int, node: int, name: str, writer: bool) -> RemoteProc:
        """The node memory of a host, started by its agent (which connects to it)."""
        log = self.run_dir / "logs" / f"keeper-n{node}.log"
        return self._start(RemoteProc(wid, node, False, log),
                           m.SpawnKeeper(wid=wid, node=node, name=name, writer=writer))

    def _start(self, proc: RemoteProc, order: m.Order) -> RemoteProc:
        """Ask the process's host to start it; on a host that is gone it has exited already."""
        self.procs[proc.wid] = proc
        link = self.links.get(proc.node)
        if link is None or link.lost:
            proc.returncode, proc.t_exit = HOST_LOST_CODE, time.time()
            self._exited.append(proc)
        else:
            self._to(proc.node, order)
        return proc

    def keeper_link(self, node: int, name: str, deadline: float) -> Any:
        from .remote_keepers import RemoteKeeperLink

        link = self.links.get(node)
        if link is None or link.lost:
            raise TimeoutError(f"node {node} is gone")
        return RemoteKeeperLink.open(self, node, name, deadline)

    def keeper_events(self, node: int) -> list[dict[str, Any]]:
        return self._keeper_events.pop(node, [])

    def signal(self, wid: int, sig: int = signal.SIGKILL) -> None:
        p = self.procs.get(wid)
        if p is not None and p.alive:
            self._to(p.node, m.Signal(wid=wid, sig=int(sig)))

    def stopped(self, wid: int) -> bool:
        p = self.procs.get(wid)
        link = self.links.get(p.node) if p is not None else None
        return bool(link is not None and wid in link.stopped)

    def alive(self) -> list[RemoteProc]:
        return [p for p in self.procs.values() if p.alive]

    def deadlines(self) -> list[m.MissedDeadline]:
        """The deadlines that fired since the last call (here, or on a host: its node)."""
        out, self._missed = self._missed, []
        return out

    def preempted(self) -> list[tuple[int, float]]:
        """Hosts told to stop since the last call: (node, grace in seconds)."""
        out, self._preempted = self._preempted, []
        return out

    def release(self, node: int, why: str) -> None:
        """The job needs the host no more (drained, preempted, isolated): its agent ends its
        processes and leaves (exit 0), so that the slot can be filled by another host. This
        controller's own host goes last, once the journal holds the generation that goes on
        without it (``release_own``): the standby that takes over must find the job steady."""
        link = self.links.get(node)
        if link is not None and not link.lost:
            if link.rec.host_id == self.own_host:
                self.own_release = (node, why)
                return
            self.tell(node, m.End(code=0, grace_s=0.0, why=why, released=True))

    def release_own(self) -> None:
        """This controller's host, released (see ``release``): ends this process too."""
        if self.own_release is not None:
            node, why = self.own_release
            self.own_release = None
            self.tell(node, m.End(code=0, grace_s=0.0, why=why, released=True))

    #: new hosts join the job (a lost machine's replacement, a spare): a job short of places
    #: waits for one (``hosts.capacity_wait_s``)
    takes_hosts = True

    def host_up(self, node: int) -> bool:
        """Whether the node's host is in the job and its agent reachable: then its ranks and its
        memory dying together is not the host lost (its lease says when that is)."""
        link = self.links.get(node)
        return link is not None and not link.lost and not link.unreachable and not link.moved_on

    def failure_domain(self, node: int) -> str:
        """The failure domain its host registered with (``--failure-domain``; else the host)."""
        link = self.links.get(node)
        return link.rec.failure_domain if link is not None else f"node {node}"

    def host_away(self, node: int) -> bool:
        """Whether the node's host is out of reach: lost, unreachable, or silent for over a
        second (then nothing sent to its ranks arrives, and no stack of theirs is dumped)."""
        link = self.links.get(node)
        return not self.host_up(node) or (
            link is not None and link.heard is not None and time.monotonic() - link.heard > 1.0)

    def silent_hosts(self) -> dict[int, float]:
        """node -> seconds since its host's agent last sent anything (hosts it holds)."""
        now = time.monotonic()
        return {n: now - link.heard for n, link in self.links.items()
                if not link.lost and link.heard is not None}

    def deaf(self) -> bool:
        """Whether this controller cannot prove that it hears: every other host of the job has
        been silent for a while (each speaks at least every ``progress_every``) and etcd too -
        it has not answered a request sent since the last of them spoke, or none for two of its
        periods (an answer that came just before the ears failed proves nothing after it). The
        fault may then be its own ears (its host's incoming traffic lost), so the silence is
        evidence against no host."""
        last = self._heard_other
        if last is None:
            return False
        now = time.monotonic()
        quiet = max(SILENT_ALL_S, 2 * keys.progress_every(len(self.links)))
        store = self.office.store_heard()
        return now - last > quiet and (store < last or now - store > 2 * self.office.store_period())

    def lost_nodes(self) -> set[int]:
        return {n for n, link in self.links.items() if link.lost}

    def wake(self) -> None:
        self.inbox.put((-1, None))

    def notice(self, notice: Any) -> None:
        """A notice of the office's own threads, handed to it in the controller's thread at its
        next poll (``Office.notice``; from any thread)."""
        self.inbox.put((-1, notice))

    def poll(self, timeout: float) -> list[RemoteProc]:
        """Wait up to ``timeout`` for what the hosts report; return the processes that exited."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                node, msg = self.inbox.get(timeout=max(0.0, left)) if left > 0 else \
                    self.inbox.get_nowait()
            except queue.Empty:
                break
            self._on_message(node, msg)
            if self._exited:
                break
        while True:  # whatever else arrived meanwhile
            try:
                node, msg = self.inbox.get_nowait()
            except queue.Empty:
                break
            self._on_message(node, msg)
        self.office.tick()
        if self._held_orders and (self._unleashed() or self.office.in_office()):
            held, self._held_orders = self._held_orders, []
            why = ("the job is ending" if self._unleashed() else
                   "the controller's lease is confirmed")
            print(f"nonstop: {why}: {len(held)} order(s) that waited go out", file=sys.stderr,
                  flush=True)
            for node, order in held:
                self._to(node, order)
        exited, self._exited = self._exited, []
        return exited

    def _on_message(self, node: int, msg: Any) -> None:
        if msg is None:  # woken
            return
        if not isinstance(msg, m.Report):  # the office's own (``notice``)
            self.office.notice(msg)
            return
        link = self.links.get(node)
        if link is None or link.lost or link.moved_on:
            return
        if isinstance(msg, m.State) and msg.incarnation != link.rec.incarnation:
            # its host fenced itself and offers itself again: what it runs now is not this
            # incarnation's, and it joins as a new host once this one is given up
            link.moved_on = True
            if link.ch is not None:
                link.ch.close()
            return
        if msg.now is not None:
            link.offset = time.time() - msg.now
        match msg:
            case m.Exits(exits=exits):
                now = time.time()
                for e in exits:
                    p = self.procs.get(e.wid)
                    if p is not None and p.alive:
                        p.returncode = e.code if e.code is not None else HOST_LOST_CODE
                        p.t_exit = now
                        # (its time on this host's clock: keys.shift_times)
                        p.last = None if e.last is None else \
                            dataclasses.replace(e.last, t=e.last.t + link.offset)
                        self._exited.append(p)
            case m.Events(events=events, replay=replay):
                for ev in events:
                    if replay:  # already in the event log of the controller before us
                        ev["replay"] = True
                    self._events.append(keys.shift_times(ev, link.offset))
            case m.Progress(recs=recs, stopped=stopped):
                for wid, rec in recs.items():
                    self._progress[int(wid)] = keys.shift_progress(rec, link.offset)
                link.stopped = set(stopped)
            case m.KeeperEvents(events=events):
                self._keeper_events.setdefault(node, []).extend(events)
            case m.Output(wid=wid, line=line):
                self.office.output(wid, line)
            case m.Health(results=results, nvml_status=nvml_status):
                self.health.report(node, results, nvml_status)
            case m.State():
                link.state = msg
                self._adopt(link, msg)
            case m.Deadlines(records=records):
                self._missed.extend(dataclasses.replace(r, node=node) for r in records)
            case m.Preempted(grace_s=grace_s):
                self._preempted.append((node, float(grace_s)))
            case m.Refused(why=why):  # a newer controller is in office: we must stop at once
                raise Deposed(f"host {link.rec.host_id} refused a command: {why}")

    def _adopt(self, link: HostLink, state: m.State) -> None:
        """What a host runs, as it says (after a takeover, or a reconnect)."""
        for w in state.workers:
            wid = w.wid
            p = self.procs.get(wid)
            if p is None:
                p = RemoteProc(wid, link.node, w.spare,
                               self.run_dir / "logs" / f"worker-{wid}.log")
                self.procs[wid] = p
                self._next_wid = max(self._next_wid, wid + 1)
            p.pid = w.pid
            if not w.alive and p.alive:
                p.returncode, p.t_exit = w.code, time.time()
                self._exited.append(p)

    def end_all(self, grace_s: float, deadline_s: float = 10.0) -> None:
        """The job is over: the leader tells every host to end its processes and leave."""
        self.grace_s = grace_s

    def end_hosts(self, code: int, own: bool | None = None) -> None:
        """Tell the hosts the job is over: all of them, or (``own``) only this controller's
        host, or (``own=False``) every other one."""
        for node, link in list(self.links.items()):
            mine = link.rec.host_id == self.own_host
            if own is None or own == mine:
                self._to(node, m.End(code=code, grace_s=self.grace_s))

    def close(self) -> None:
        self._stop.set()
        self._readers.wake()
        for link in self.links.values():
            if link.ch is not None:
                link.ch.close()

    # == the mail interface ======================================================================
    def send(self, wid: int, seq: int, msg: dict[str, Any]) -> None:
        p = self.procs.get(wid)
        if self._held is not None and p is not None:
            self._held.setdefault(p.node, []).append({"wid": wid, "seq": seq, "msg": msg})
            return
        if self._common:
            msg = {**self._common, **msg}
        if p is None:  # a process about to be started: its mailbox is written once its host
            self._unsent.setdefault(wid, []).append((seq, msg))  # starts it
        else:
            self._to(p.node, m.Send(wid=wid, seq=seq, msg=msg))

    @contextlib.contextmanager
    def batch(self, common: dict[str, Any] | None = None) -> Iterator[None]:
        """The mailbox messages sent inside go out as one frame per host when it ends (a
        generation's assignments: a job of 16,384 ranks on 2,048 hosts sends 2,048 frames, not
        16,384). Each message is ``common``'s fields with its own over them: the fields they
        share go once in each frame, and the host puts every message together."""
        self._held, self._common = {}, common or {}
        with self._readers.hold():  # (the hosts' answers wait: see Readers.hold)
            try:
                yield
            finally:
                held, common, self._held, self._common = self._held, self._common, None, {}
                self._send_held(held, common)

    def _send_held(self, held: dict[int, list[dict[str, Any]]], common: dict[str, Any]) -> None:
        for node, mails in held.items():
            if len(mails) == 1:
                one = mails[0]
                self._to(node, m.Send(wid=one["wid"], seq=one["seq"],
                                      msg={**common, **one["msg"]} if common else one["msg"]))
            else:
                self._to(node, m.Sends(mails=mails, common=common))

    def abort(self, gen: int, wids: list[int], regroup: bool = False) -> None:
        by_node: dict[int, list[int]] = {}
        for wid in wids:
            p = self.procs.get(wid)
            if p is not None:
                by_node.setdefault(p.node, []).append(wid)
        with self._readers.hold():
            for node, mine in by_node.items():
                self._to(node, m.Abort(gen=gen, wids=mine, regroup=regroup))

    def events(self) -> Iterator[dict[str, Any]]:
        evs, self._events = self._events, []
        return iter(evs)

    def progress(self, wids: list[int]) -> dict[int, dict[str, Any]]:
        return {w: self._progress[w] for w in wids if w in self._progress}

    @staticmethod
    def host_of(node: int) -> int:
        return node

    def generation_store(self, gen: int, node: int) -> dict[str, Any]:
        """The group forms on a store of its rank 0's host: the host's own store under the
        generation's prefix (nonstop.wrap), or a fresh store of the generation's (a plain script,
        whose keys have no prefix)."""
        rec = self.links[node].rec
        port = rec.rdzv_port
        if not self.managed:
            reply = self.request(node, m.OpenStore(gen=gen))
            port = reply.port if reply is not None and reply.port else rec.rdzv_port
        return {"pg_addr": rec.addr, "pg_port": rec.rdzv_port, "master_addr": rec.addr,
                "port": port}

    def tell(self, node: int, order: m.Order) -> None:
        """Say something to a host, waiting for nothing."""
        self._to(node, order)

    def request(self, node: int, order: m.Order, timeout_s: float = 5.0) -> m.Reply | None:
        """Ask one host and wait for its answer (None: no answer in time, or none to come: the
        host cannot be connected to)."""
        link = self.links.get(node)
        if link is None or link.lost or link.unreachable or link.moved_on:
            return None
        self._req += 1
        rid = self._req
        waiter = threading.Event()
        self._replies[rid] = (waiter, [])
        self._to(node, dataclasses.replace(order, id=rid))
        if not waiter.wait(timeout_s) and not (link.lost or link.unreachable):
            self._missed.append(m.MissedDeadline("host_reply", timeout_s,
                                                 detail=f"no answer to {order.op}", node=node))
        _, answer = self._replies.pop(rid)
        return answer[0] if answer else None


class RemoteHealth:
    """The health checks of every host, run by its agent: the results as they arrive, with the
    interface of one host's HealthMonitor."""

    def __init__(self) -> None:
        from ..agent.health import HealthResult

        self._result = HealthResult
        self._pending: list[Any] = []
        self._removed: set[int] = set()
        self.nvml_status = "NVML: checked by each host's agent"

    def report(self, node: int, results: list[m.HealthCheck], nvml_status: str | None) -> None:
        if nvml_status:
            self.nvml_status = nvml_status
        if node in self._removed:
            return
        now = time.time()
        for r in results:
            self._pending.append(self._result(check=r.check, node=node, ok=r.ok, code=r.code,
                                              detail=r.detail, t=now, seconds=float(r.seconds),
                                              limit_s=r.limit_s))

    def poll(self, now: float) -> list[Any]:
        out, self._pending = self._pending, []
        return out

    def add_node(self, node: int) -> None:
        self._removed.discard(node)

    def remove_node(self, node: int) -> None:
        self._removed.add(node)

    def close(self) -> None:
        self._pending = []


class Deposed(Exception):
    """A host answered that a newer controller is in office."""

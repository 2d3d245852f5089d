"""The host agent: ``nonstop run --rdzv-endpoint ...`` on each host.

It registers the host in etcd under a lease, keeps a standby controller process ready (one of
them is elected), and carries out what the controller in office tells it over the channel: start,
signal and message its rank processes and warm spares. It relays what they report (events,
progress, exits, output) with its own times turned into ages, so that no decision ever compares
two hosts' clocks.

Its ranks live and die with it (each asks the kernel to kill it when the agent dies), never with a
remote controller. The host's membership in etcd (its lease, its record, etcd's silence judged by
the peers: ``fencing.py``) tells the agent when the job has moved on without it (its host cut
off, or given up): it ends its processes at once - they must never join a newer generation - and
registers again as a new host, a spare.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .. import inject, protocol
from . import loopback
from .agent import Agent, Proc, worker_env
from ..errors import UsageError
from .mail import StoreMail
from ..net.channel import SECRET_ENV
from ..protocol import hosts as keys
from ..protocol import events
from ..protocol import messages as m
from .entry import WAITING_SAY_S, JobEntry
from .host_config import HostConfig
from .fencing import (REGISTER_RETRY_S, EtcdSilent, Fence, JobEnded, Membership, News,
                      OutageOver, Registered, Rejoined)
from .host_keepers import HostKeepers, replica_secret
from .office import OfficeLink
from ..net.netif import bound_socket, close_store, interface_of, job_store
from ..store.tcpstore import StoreServer

CONTROLLER_WID = -1  # the standby controller in the agent's process table
DONE_CHECK_S = 1.0  # the store thread reads the job's record this often
FENCED_REGISTER_S = 3600.0  # a fenced host tries to join again this long
KEEPER_START_S = 15.0  # the node memory has this long to listen (a bare Python start)
RESPAWN_S = 0.5  # a standby controller that died is replaced after this long


class HostAgent:
    membership: Membership  # this host in etcd (made in run(), once its ports are known)

    def __init__(self, cfg: HostConfig, secret: bytes, faults: list[inject.FaultSpec]):
        self.cfg, self.secret, self.faults = cfg, secret, faults
        self.run_dir = cfg.run_dir
        self.office: OfficeLink  # its link to the controller in office (made in run())
        self.agent: Agent | None = None
        self.health: Any = None  # this host's health checks (False: none configured)
        self.keepers: HostKeepers | None = None  # its node memory's connections
        self.meta: dict[int, dict[str, Any]] = {}  # wid -> spare, node, rank (for labels)
        self.code: int | None = None
        self.refused_why: str | None = None  # outvoted on the job's secret: this host leaves
        self.other_secrets = 0  # hosts waiting to join with another secret than ours
        self._say_waiting = time.time() + WAITING_SAY_S  # when a host still alone says so
        self._gen_stores: dict[int, Any] = {}  # a plain script's stores, per generation
        self._last_progress = 0.0
        self._respawn_at: float | None = None
        self._stop = threading.Event()
        self.preempted_at: float | None = None  # SIGTERM seen (monotonic): a preemption notice
        self._preempt_told = False  # the controller in office knows
        self.shift_s = float(os.environ.get("NONSTOP_TEST_CLOCK_SHIFT_S", "0") or 0)
        self.metrics: Any = None  # observe.metrics.HostServed, with --metrics-port
        self.progress_s = keys.progress_every(cfg.nnodes_max + cfg.spare_nodes)

    def now(self) -> float:
        """This host's clock (shifted in a test that pretends it is wrong)."""
        return time.time() + self.shift_s

    @property
    def doubt_since(self) -> float | None:
        """Since when (monotonic) etcd has been out of reach, None while it answers."""
        return self.membership.doubt_since

    # == start ===================================================================================
    def run(self) -> int:
        from ..store.etcd import StoreError, StoreUnavailable

        cfg = self.cfg
        self.etcd = cfg.etcd()
        try:
            self.entry = JobEntry(self.etcd, cfg, self.secret)
            self.entry.join()
        except StoreUnavailable as exc:
            raise UsageError(f"cannot reach etcd at {_endpoints(cfg.endpoints)}: {exc}") from None
        except StoreError as exc:  # it answered, and refused (a wrong user or password)
            raise UsageError(f"etcd at {_endpoints(cfg.endpoints)} refused us: {exc}") from None
        # the host is counted as soon as it can be (before torch is imported, which takes a
        # second or more): a host that joins a full job learns it from the others at once
        # A controller that takes nothing from this host for a lease's TTL is cut off (its lease
        # lapses) or stalled: a send to it must not hold up this host's loop longer (with the
        # default 30 s a cut controller's channel, its buffers full, kept this host from
        # answering its successor's hello, and from fencing itself). The channel closes; a
        # live controller connects again and is told what it missed.
        self.office = OfficeLink(cfg.addr, self.secret, cfg.lease_ttl_s + 1.0, self.now,
                                 self._wake)
        rdzv_sock = bound_socket(cfg.addr)
        self.rdzv_port = rdzv_sock.getsockname()[1]
        emergency = cfg.rules.state.emergency
        self.membership = Membership(
            self.etcd, keys.HostRecord(host_id=cfg.host_id, addr=cfg.addr,
                                       ctl_port=self.office.port, rdzv_port=self.rdzv_port,
                                       pid=os.getpid(), slots=cfg.nproc_per_node, incarnation="",
                                       domain=cfg.failure_domain),
            cfg.lease_ttl_s, outage_s=cfg.rules.hosts.store_outage_s,
            # the controller gives up at the tolerance and may first save the newest state (its
            # emergency checkpoint, through this host's keeper, up to its grace)
            grace_s=emergency.grace_s if emergency.on_give_up else 0.0,
            wake=self._wake, stop=self._stop)
        if not self.membership.register():
            raise UsageError(f"host '{cfg.host_id}' is already in job '{cfg.job_id}'")
        self.agent: Agent | None = None
        # the controller may connect at once: its hello waits in the inbox until the loop runs
        self.office.start()
        try:
            self.local_listener = loopback.listen()
            self.local_port = self.local_listener.getsockname()[1]
            env = self._worker_env()
            self.agent = Agent(cfg.script, cfg.script_args, f"{loopback.HOST}:{self.local_port}",
                               self.run_dir, env, self._output)
            self.agent.start_zygote()  # ranks are forked from it: it imports torch meanwhile
            # the standby campaigns while this process imports torch for its stores below (on a
            # loaded host the import took seconds, and the first election waited for it)
            self._spawn_controller()
            self.agent.keeper_host = cfg.addr  # replicas come in from other hosts
            self.agent.keeper_env = {SECRET_ENV: replica_secret(self.secret)}
            self.keepers = HostKeepers(self.office.send).start()
            # only this host's ranks meet on its own store: nonstop's server of the protocol
            self.store = StoreServer(self.local_listener)
            self.store.set(protocol.JOB_KEY, protocol.dumps(self._job_settings()))
            self.mail = StoreMail(wids=self.agent.recent_wids)
            self.mail.attach(self.store)
            # where the generations whose rank 0 is here meet: every rank of the job, at most
            self.rdzv = job_store(rdzv_sock, self._ranks())
            threading.Thread(target=self._store_loop, name="nonstop-store", daemon=True).start()
            return self._loop()
        finally:
            self._stop.set()
            if self.health:
                self.health.close()
            if self.keepers is not None:
                self.keepers.close()
            if self.agent is not None:
                self.agent.close()
            self.office.close()
            self.membership.close()
            self.etcd.close()
            if self.metrics is not None:
                self.metrics.close()

    def _ranks(self) -> int:
        """The most ranks that may meet on one of this host's generation stores: the job's at
        its largest, spares and spare hosts included."""
        cfg = self.cfg
        return (cfg.nnodes_max + cfg.spare_nodes) * (cfg.nproc_per_node + cfg.spares)

    def _job_settings(self) -> dict[str, Any]:
        timeouts = self.cfg.rules.timeouts
        return {"run_id": self.cfg.job_id, "world": self.cfg.nnodes_max * self.cfg.nproc_per_node,
                "rendezvous_timeout_s": timeouts.rendezvous_s,
                "collective_timeout_s": timeouts.collective_s, "policy": self.cfg.policy}

    def _yield_secret(self) -> None:
        """Outvoted on the job's secret while it forms (``JobEntry.outvoted``): this host leaves."""
        if self.office.heard:
            return  # the job formed: its secret is settled
        self.other_secrets, refused = self.entry.outvoted()
        if refused is not None:
            self.refused_why = refused
            self._wake()

    def _worker_env(self) -> dict[str, str]:
        env = worker_env(self.run_dir, self.faults, pin=False)
        iface = interface_of(self.cfg.addr)
        if iface:  # the collectives listen on the host's address, not on every interface
            for var in loopback.IFNAME_VARS:
                env.setdefault(var, iface)
        return env

    def _spawn_controller(self) -> None:
        """A standby controller: it campaigns, and runs the job while elected."""
        conf = self.run_dir / "host.json"
        conf.write_text(self.cfg.to_json())
        env = dict(os.environ)
        env["NONSTOP_JOB_SECRET"] = self.secret.decode()
        pkg_parent = str(Path(__file__).resolve().parent.parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pkg_parent, env.get("PYTHONPATH")]))
        env[protocol.ENV_LAUNCHER_PID] = str(os.getpid())
        cmd = [sys.executable, "-u", "-m", "nonstop.controller.elected", str(conf)]
        self.agent.procs.pop(CONTROLLER_WID, None)
        self.agent.spawn_command(CONTROLLER_WID, cmd, env, "controller.log")
        self._respawn_at = None

    def _wake(self) -> None:
        if self.agent is not None:  # none yet: the loop has not started, it reads the inbox first
            self.agent.wake()

    # == the loop ===============================================================================
    def _loop(self) -> int:
        self._say_waiting = time.time() + WAITING_SAY_S
        while self.code is None:
            exited = self.agent.poll(0.02)
            for proc in exited:
                self._on_exit(proc)
            self._handle_commands()
            if self.code is not None:
                break
            self._relay_events()
            missed = self.agent.deadlines()
            if missed:
                self.office.send(m.Deadlines(records=missed))
            self.keepers.poll()
            now = time.time()
            if now - self._last_progress >= self.progress_s:
                self._last_progress = now
                self._relay_progress()
                if self.metrics is not None:
                    self.metrics.update(self)
            if self.refused_why is not None:
                raise UsageError(self.refused_why)
            holds = any(x.get("rank") is not None and not x.get("spare")
                        for x in self.meta.values())
            for verdict in self.membership.poll(holds_ranks=holds):
                self._carry_out(verdict)
            if self.preempted_at is not None:
                self._preempting()
            self._check_health(now)
            if not self.office.heard and now >= self._say_waiting:  # the job has not formed yet
                self._say_waiting = now + WAITING_SAY_S
                need = self.cfg.nnodes_max + self.cfg.spare_nodes
                odd = (f" ({self.other_secrets} host(s) with another secret wait too)"
                       if self.other_secrets else "")
                print(f"nonstop: host {self.cfg.host_id}: registered in job "
                      f"'{self.cfg.job_id}'; {len(self.membership.peers) + 1} of its {need} host(s) so "
                      f"far: waiting for the others{odd}", file=sys.stderr, flush=True)
            if self._respawn_at is not None and now >= self._respawn_at:
                self._spawn_controller()
        return self.code

    # == this host in etcd =======================================================================
    def _store_loop(self) -> None:
        """etcd is read here, never in the loop that serves the ranks: an etcd out of reach makes
        a call wait for its deadline, and the ranks' heartbeats must not wait with it."""
        while not self._stop.wait(DONE_CHECK_S):
            try:
                self.membership.read_job()
                self._yield_secret()
            except Exception:  # noqa: BLE001 - etcd away for a moment: the job goes on
                continue

    def _carry_out(self, verdict: News) -> None:
        """What the host's membership in etcd says happened, done."""
        host = self.cfg.host_id
        match verdict:
            case EtcdSilent(failure=failure):
                # the controller in office says it for the job, on its host's console: said
                # once there
                if not self._office_here():
                    print(f"nonstop: host {host} cannot reach etcd "
                          f"({failure or 'no answer from ' + _endpoints(self.cfg.endpoints)}; "
                          f"its lease not refreshed for {self.cfg.lease_ttl_s} s)",
                          file=sys.stderr, flush=True)
            case Rejoined():
                print(f"nonstop: host {host}: its lease in etcd had lapsed (etcd paused or "
                      "restarted?); registered again: its ranks train on", file=sys.stderr,
                      flush=True)
            case Fence(why=why):
                self._fence(why)
            case OutageOver(seconds=seconds, tolerance_s=tolerance):
                print(f"nonstop: error: etcd unreachable for {seconds:.0f} s "
                      f"(hosts.store_outage_s={tolerance:g}) and no word from the controller: "
                      "ending this host's processes", file=sys.stderr, flush=True)
                self.agent.end_all(0.0)
                self.code = 1
            case JobEnded(code=code):
                self.agent.end_all(0.0)
                self.code = code

    def _office_here(self) -> bool:
        """Whether the controller in office runs on this host (its lines are this console's)."""
        return self.office.office_at(self.cfg.addr)

    def _fence(self, why: str) -> None:
        """The job has moved on without this host (it gave it up, or it is cut off). Its
        processes end now - they must never join a newer generation - then the host offers
        itself again, as a new host (a spare), once etcd answers."""
        killed = [p.wid for p in self.agent.alive() if p.wid != CONTROLLER_WID]
        for wid in killed:
            self.agent.signal(wid, signal.SIGKILL)
        self.agent.signal(CONTROLLER_WID, signal.SIGKILL)
        self.office.drop()
        self.meta.clear()
        print(f"nonstop: host {self.cfg.host_id} fenced ({why}): ended its {len(killed)} "
              "process(es); it joins again as a new host once etcd answers", file=sys.stderr,
              flush=True)
        self.membership.leave()
        deadline = time.time() + FENCED_REGISTER_S
        while self.code is None and time.time() < deadline:
            self.agent.poll(REGISTER_RETRY_S)
            match self.membership.register_again():
                case JobEnded() as ended:
                    self._carry_out(ended)
                    return
                case Registered():
                    break
        self._respawn_at = time.time()

    def _on_exit(self, proc: Proc) -> None:
        if proc.wid == CONTROLLER_WID:
            if self.code is None:  # a standby ends only with the job: start another
                self._respawn_at = time.time() + RESPAWN_S
            return
        if self.meta.get(proc.wid, {}).get("keeper"):
            self.keepers.gone(self.meta[proc.wid]["keeper"])
        self.office.exited(m.ProcExit(wid=proc.wid, code=proc.returncode, last=proc.last))

    def _handle_commands(self) -> None:
        for ch, order in self.office.orders():
            if isinstance(order, m.Hello):
                self._hello(ch, order.epoch)
            else:
                self._command(order)

    def _hello(self, ch: Any, epoch: int) -> None:
        """A controller says hello: it is the one in office from now on. A new one (a takeover)
        gets what this host runs and every event of its processes so far, to rebuild its view;
        the same one, reconnecting, gets what it missed."""
        new = self.office.hello(ch, epoch)
        self._preempt_told = False  # (a new controller hears of a preemption again)
        workers = [_worker(p, self.meta.get(p.wid, {}))
                   for p in self.agent.procs.values() if p.wid != CONTROLLER_WID]
        self.office.send(m.State(host=self.cfg.host_id, incarnation=self.membership.incarnation,
                                 workers=workers, takeover=new))
        self.office.catch_up(new)

    def _command(self, order: m.Order) -> None:
        news = None if isinstance(order, m.End) else self.office.take_news()
        if news is not None:
            epoch, addr = news
            names = self.membership.peer_names
            where = "this host" if addr == self.cfg.addr else \
                f"host {names[addr]}" if addr in names else addr
            print(f"nonstop: host {self.cfg.host_id}: the controller in office is on {where} "
                  f"(epoch {epoch})", file=sys.stderr, flush=True)
        match order:
            case m.Spawn(wid=wid, spare=spare, mode=mode, node=node, keeper=keeper):
                self.meta[wid] = {"spare": spare, "node": node}
                try:
                    self.agent.spawn(wid, spare=spare, spare_mode=mode, node=node, keeper=keeper)
                except OSError as exc:
                    print(f"nonstop: cannot start worker {wid}: {exc}", file=sys.stderr,
                          flush=True)
                    self.office.send(m.Exits(exits=[m.ProcExit(wid=wid, code=127)]))
            case m.SpawnKeeper(wid=wid, node=node, name=name, writer=writer):
                self.meta[wid] = {"keeper": name, "node": node}
                try:
                    self.agent.spawn_keeper(wid, node, name, writer)
                except OSError as exc:
                    print(f"nonstop: cannot start the node memory: {exc}", file=sys.stderr,
                          flush=True)
                    self.office.send(m.Exits(exits=[m.ProcExit(wid=wid, code=127)]))
                    return
                self.keepers.started(name, time.time() + KEEPER_START_S)
            case m.KeeperOpen() | m.KeeperCall():
                self.keepers.request(order)
            case m.Signal(wid=wid, sig=sig):
                self.agent.signal(wid, sig)
            case m.Send(wid=wid, seq=seq, msg=body):
                self._deliver(wid, seq, body)
            case m.Sends(mails=mails, common=common):
                for item in mails:
                    try:
                        wid, seq, body = int(item["wid"]), int(item["seq"]), \
                            {**common, **item["msg"]}
                    except (KeyError, TypeError, ValueError) as exc:
                        print(f"nonstop: a mailbox message refused: {exc!r}", file=sys.stderr,
                              flush=True)
                        continue
                    self._deliver(wid, seq, body)
            case m.Abort(gen=gen, wids=wids, regroup=regroup):
                self.mail.abort(gen, [w for w in wids if w in self.agent.procs], regroup)
            case m.OpenStore(gen=gen):
                # a plain script rendezvouses with unprefixed keys through MASTER_ADDR/PORT: each
                # of its generations gets a store of its own, on this host's address only
                store = job_store(bound_socket(self.cfg.addr), self._ranks())
                self._gen_stores[gen] = store
                for old in [g for g in self._gen_stores if g < gen - 1]:
                    close_store(self._gen_stores.pop(old))
                self.office.send(m.Reply(id=order.id, port=store.port))
            case m.End(code=code, grace_s=grace_s, why=why, released=released):
                self.agent.end_all(grace_s)
                self.code = code
                if released:
                    print(f"nonstop: host {self.cfg.host_id} released by the job ({why}): it "
                          "leaves, the job goes on", file=sys.stderr, flush=True)
                elif why:
                    print(f"nonstop: error: {why}", file=sys.stderr, flush=True)

    def _deliver(self, wid: int, seq: int, body: dict[str, Any]) -> None:
        """One mailbox message from the controller into its process's mailbox."""
        try:
            mail = protocol.mail_from(body)
        except ValueError as exc:  # from a newer controller, say
            print(f"nonstop: mailbox message for worker {wid} refused: {exc}", file=sys.stderr,
                  flush=True)
            return
        meta = self.meta.setdefault(wid, {})
        if isinstance(mail, protocol.Assign):
            meta.update(rank=mail.rank, gen=mail.gen, spare=False)
        meta["seq"] = seq + 1  # a controller taking over goes on from here
        self.mail.send(wid, seq, body)

    def _relay_events(self) -> None:
        evs = list(self.mail.events())
        if not evs:
            return
        if self.shift_s:  # a test pretending this host's clock is off: its ranks' times too
            evs = [keys.shift_times(ev, self.shift_s) for ev in evs]
        for ev in evs:  # a rank that said it is done: a controller taking over is told so
            if ev.get("type") == events.Done.type and type(ev.get("wid")) is int \
                    and type(ev.get("gen")) is int:
                self.meta.setdefault(ev["wid"], {})["done"] = ev["gen"]
        self.office.relay(evs)

    def _relay_progress(self) -> None:
        live = [p.wid for p in self.agent.alive() if p.wid != CONTROLLER_WID]
        if not live or not self.office.connected:
            return
        recs = self.mail.progress(live)
        if self.shift_s:
            recs = {w: keys.shift_times(r, self.shift_s) for w, r in recs.items()}
        stopped = [wid for wid in live if self.agent.stopped(wid)]
        self.office.send(m.Progress(recs={str(w): r for w, r in recs.items()}, stopped=stopped))

    def _check_health(self, now: float) -> None:
        """This host's health checks (the policy's commands, NVML), run here and reported: a
        check of a host runs on that host."""
        if self.health is None:
            d = self.cfg.rules.detect
            if not d.health_checks and d.nvml == "off":
                self.health = False
                return
            from .health import HealthMonitor

            self.health = HealthMonitor(list(d.health_checks), [0], nvml=d.nvml)
        if not self.health:
            return
        results = self.health.poll(now)
        if results:
            self.office.send(m.Health(nvml_status=self.health.nvml_status,
                                results=[m.HealthCheck(check=r.check, ok=r.ok, code=r.code,
                                                       detail=r.detail, seconds=r.seconds,
                                                       limit_s=r.limit_s)
                                         for r in results]))

    def _output(self, wid: int, line: str) -> None:
        if wid == CONTROLLER_WID:
            print(line, flush=True)
            return
        meta = self.meta.get(wid, {})
        label = f"rank {meta['rank']}" if meta.get("rank") is not None and not meta.get("spare") \
            else f"spare {wid}"
        if not self.cfg.quiet:
            print(f"[{self.cfg.host_id} {label}] {line}", flush=True)
        self.office.send(m.Output(wid=wid, line=line))

    # == preemption =============================================================================
    def preempt(self) -> None:
        """SIGTERM: a scheduler wants this host back. With a grace in the policy, the host stays
        that long for its ranks to move away at a step boundary (the controller releases it
        once they have); a second signal, or the grace spent, ends it at once (130)."""
        grace = self.cfg.rules.hosts.preempt_grace_s
        if self.preempted_at is not None or grace <= 0 or self.code is not None:
            raise KeyboardInterrupt
        self.preempted_at = time.monotonic()
        print(f"nonstop: host {self.cfg.host_id} asked to stop (SIGTERM): its ranks move away "
              f"within {grace:g} s (hosts.preempt_grace_s), then it leaves", file=sys.stderr,
              flush=True)

    def _preempting(self) -> None:
        grace = self.cfg.rules.hosts.preempt_grace_s
        left = grace - (time.monotonic() - (self.preempted_at or 0.0))
        if not self._preempt_told and self.office.connected:
            self._preempt_told = self.office.send(m.Preempted(grace_s=max(0.0, left)))
        if left <= 0:
            print(f"nonstop: host {self.cfg.host_id}: its ranks did not move away within "
                  f"{grace:g} s of SIGTERM: it ends them and leaves", file=sys.stderr, flush=True)
            self.agent.end_all(0.0)
            self.code = 130


def _worker(p: Proc, meta: dict[str, Any]) -> m.HostWorker:
    """A process of this host, as a new controller is told of it."""
    return m.HostWorker(wid=p.wid, pid=p.pid, alive=p.alive, code=p.returncode,
                        spare=bool(meta.get("spare", False)), node=meta.get("node"),
                        keeper=meta.get("keeper"), rank=meta.get("rank"), gen=meta.get("gen"),
                        seq=meta.get("seq", 0), done=meta.get("done"))


def _endpoints(endpoints: list[tuple[str, int]]) -> str:
    return ",".join(f"{h}:{p}" for h, p in endpoints)

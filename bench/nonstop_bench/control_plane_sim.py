"""The simulated side of ``nonstop bench control-plane`` (``control_plane.py``): H host agents of
8 ranks each in this one process, speaking the hosts' real protocol to the real controller, and a
real rendezvous store their ranks meet on. One run: start the job, report one rank dead, time the
recovery (``measure``)."""

from __future__ import annotations

import dataclasses
import gc
import os
import queue
import random
import secrets
import selectors
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import nonstop
from nonstop import protocol
from nonstop.agent.host_config import HostConfig
from nonstop.net import listener
from nonstop.protocol import events
from nonstop.protocol import hosts as keys
from nonstop.protocol import messages as m

PER_HOST = 8  # ranks of a simulated host (a machine of 8 accelerators)
LEASE_TTL_S = 60  # the controller's (the policy's longest)
HOST_TTL_S = 900  # the simulated hosts' leases, refreshed from one thread: a long TTL
STACK = 256 << 10
TIMEOUT_S = 300.0  # each wait of a run
TEARDOWN_S = 10.0
CONNECTORS = 64
STORE_CONNS = 16  # the simulated ranks' connections to the rendezvous store (and as many waits)


class _Rank:
    __slots__ = ("wid", "spare", "rank", "gen", "world", "step", "alive", "t_assigned", "left")

    def __init__(self, wid: int, spare: bool):
        self.wid, self.spare = wid, spare
        self.rank: int | None = None
        self.gen = -1
        self.world = 0
        self.step = 0
        self.alive = True
        self.t_assigned = 0.0
        self.left = -1


class _Host:
    def __init__(self, sim: "Sim", i: int):
        self.sim, self.i = sim, i
        self.host_id = f"sim-{i:05d}"
        self.incarnation = secrets.token_hex(6)
        self.listener = listener.Listener("127.0.0.1", sim.secret, backlog=4)
        self.ch: Any = None
        self.ranks: dict[int, _Rank] = {}
        self.lease: Any = None
        self.ended = False
        self.joined: dict[int, list[_Rank]] = {}  # gen -> its ranks that joined it
        self.lock = threading.Lock()

    def record(self) -> keys.HostRecord:
        return keys.HostRecord(host_id=self.host_id, addr="127.0.0.1", ctl_port=self.listener.port,
                               rdzv_port=self.sim.store_port, pid=os.getpid(), slots=PER_HOST,
                               incarnation=self.incarnation)

    def send(self, msg: m.Report) -> None:
        ch = self.ch
        if ch is None:
            return
        try:
            ch.send(m.encode(dataclasses.replace(msg, now=time.time())))
        except Exception:  # noqa: BLE001 - the controller is gone: the bench ends
            self.ch = None

    def events(self, evs: list[dict[str, Any]]) -> None:
        if evs:
            self.send(m.Events(events=evs))


_SHAPES: dict[tuple[Any, ...], dict[str, Any]] = {}  # (record, its fields) -> encoded once


def _ev(record: type[events.RankEvent], wid: int, **fields: Any) -> dict[str, Any]:
    """A rank's event as its process writes it (the controller refuses one that is not). Its
    first of a kind is encoded by the ranks' own encoder; the others are that record with their
    own values (each simulated host's ranks would encode theirs on their own cores: here, 65,536
    events of one process would take a quarter of a second of the bench's one core)."""
    key = (record, *fields)
    shape = _SHAPES.get(key)
    now = time.time()
    if shape is None:
        shape = _SHAPES[key] = events.encode(record(wid=wid, t=now, **fields))
        return dict(shape)
    return {**shape, "wid": wid, "t": now, **fields}


class Sim:
    """H simulated hosts and the real controller, around one real etcd."""

    def __init__(self, hosts: int, spares: int, base: Path, etcd_url: str, seed: int,
                 pin: tuple[str, ...] = ()):
        self.pin = pin  # a command prefix that puts the controller on its core (split placement)
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # (the polled waits' timeouts)
        import torch.distributed as dist

        self.n = hosts
        self.spares = spares
        self.base = base
        self.rng = random.Random(seed)
        self.secret = secrets.token_hex(24).encode()
        self.server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(60),
                                    wait_for_workers=False, use_libuv=True)
        self.store_port = self.server.port
        self.etcd_url = etcd_url
        self.job_id = f"cp-{os.getpid()}-{hosts}-{secrets.token_hex(3)}"
        self.hosts: list[_Host] = []
        self.sel = selectors.DefaultSelector()
        self.accepted: "queue.Queue[tuple[_Host, Any]]" = queue.Queue()
        self.stop = threading.Event()
        self.rdzv_done: dict[int, float] = {}  # gen -> when the last host's ranks met
        self.gen_hosts: dict[int, int] = {}  # gen -> hosts whose ranks met
        self.first: dict[int, int] = {}  # gen -> ranks past their first step
        self.assigned: dict[int, list[float]] = {}  # gen -> when each rank got its assignment
        self.aborted: dict[int, float] = {}  # host -> when its abort arrived (the fault's gen)
        self.leader: subprocess.Popen | None = None
        self.world = hosts * PER_HOST
        self.fault_gen: int | None = None
        self.lock = threading.Lock()
        # the rendezvous: ranks assigned, to join (host, ranks); each group's generations to
        # wait for
        self.groups = min(STORE_CONNS, hosts)
        self.joins: "queue.Queue[tuple[_Host, list[_Rank]] | None]" = queue.Queue()
        self.to_join: list[tuple[_Host, list[_Rank]]] = []  # (the hosts' loop only)
        self.waits: list["queue.Queue[int | None]"] = [queue.Queue() for _ in range(self.groups)]
        self.waited: list[set[int]] = [set() for _ in range(self.groups)]

    # -- set-up ----------------------------------------------------------------------------------
    def start(self) -> None:
        from nonstop.store.etcd import Etcd
        from torch.distributed import TCPStore

        threading.stack_size(STACK)
        self.etcd = Etcd.from_url(self.etcd_url, self.job_id, timeout_s=10.0)
        self.hosts = [_Host(self, i) for i in range(self.n)]

        def connect(_: int) -> Any:
            return TCPStore("127.0.0.1", self.store_port, None, False, timedelta(60))

        # side by side: here a store connection now and then waits out a connect timeout (5 s)
        # before it succeeds; the set-up is not what is measured
        with ThreadPoolExecutor(CONNECTORS) as pool:
            conns = list(pool.map(connect, range(2 * self.groups)))
        for h in self.hosts:
            threading.Thread(target=self._accept, args=(h,), daemon=True).start()
        for k in range(self.groups):
            threading.Thread(target=self._adder, args=(conns[k],), daemon=True).start()
            threading.Thread(target=self._waiter, args=(k, conns[self.groups + k]),
                             daemon=True).start()
        for h in self.hosts:  # in order: the controller numbers hosts as they joined
            h.lease = self.etcd.lease(HOST_TTL_S)
            if not self.etcd.create(keys.host_key(h.host_id), h.record().dumps(), lease=h.lease):
                raise RuntimeError(f"{h.host_id} is already registered")
        threading.Thread(target=self._refresh, daemon=True).start()
        threading.Thread(target=self._loop, daemon=True).start()
        self._start_leader()

    def _refresh(self) -> None:
        while not self.stop.wait(HOST_TTL_S / 6):
            for h in self.hosts:
                if not h.ended:
                    try:
                        h.lease.refresh()
                    except Exception:  # noqa: BLE001
                        pass

    def _start_leader(self) -> None:
        from nonstop.policy import Policy

        # the simulated ranks leave within milliseconds of their abort, but their hosts' work runs
        # on the controller's cores here: the teardown gets TEARDOWN_S rather than 0.5 s
        pol = Policy().with_overrides(**{"state.snapshot.enabled": False,
                                         "hosts.lease_ttl_s": LEASE_TTL_S,
                                         "recover.timeouts.teardown_s": TEARDOWN_S})
        run_dir = self.base / "controller"
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg = HostConfig(script="simulated.py", script_args=[], nnodes_min=self.n,
                         nnodes_max=self.n, nproc_per_node=PER_HOST, spare_nodes=0,
                         spares=self.spares, endpoints=self.etcd.endpoints, job_id=self.job_id,
                         addr="127.0.0.1", host_id="controller", run_dir=run_dir,
                         policy=pol.model_dump(), policy_digest="bench", lease_ttl_s=LEASE_TTL_S,
                         inject=[], quiet=True)
        conf = run_dir / "host.json"
        conf.write_text(cfg.to_json())
        env = dict(os.environ, NONSTOP_JOB_SECRET=self.secret.decode())
        env[protocol.ENV_LAUNCHER_PID] = str(os.getpid())
        pkg_parent = str(Path(nonstop.__file__).resolve().parent.parent)  # (a checkout too)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pkg_parent, env.get("PYTHONPATH")]))
        self.out = open(run_dir / "controller.out", "wb")
        self.leader = subprocess.Popen([*self.pin, sys.executable, "-u", "-m",
                                        "nonstop.controller.elected",
                                        str(conf)], env=env, stdout=self.out,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        self.run_dir = run_dir

    def _accept(self, h: _Host) -> None:
        while not self.stop.is_set() and not h.ended:
            try:
                ch = h.listener.accept(timeout=5.0)
            except Exception:  # noqa: BLE001 - closed: the bench ends
                return
            if ch is not None:
                self.accepted.put((h, ch))

    # -- the hosts' loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        every = keys.progress_every(self.n)
        last_turn, owed, cursor = time.time(), 0.0, 0
        while not self.stop.is_set():
            while True:
                try:
                    h, ch = self.accepted.get_nowait()
                except queue.Empty:
                    break
                self.sel.register(ch.fileno(), selectors.EVENT_READ, (h, ch))
            for key, _ in self.sel.select(0.05):
                h, ch = key.data
                try:
                    frames = ch.recv_ready()  # (what has come, in one read)
                except Exception:  # noqa: BLE001 - the controller closed it
                    self.sel.unregister(key.fd)
                    if h.ch is ch:
                        h.ch = None
                    continue
                for msg, _ in frames:
                    self._order(h, ch, m.decode(msg))
            # the ranks assigned in this round join once every frame that had come is read: the
            # joining ranks' threads would otherwise take the interpreter from this reading
            for item in self.to_join:
                self.joins.put(item)
            self.to_join.clear()
            # each host reports its ranks' progress once every ``every`` seconds, the hosts
            # spread over the period as independent hosts are (not all 2,048 in one burst)
            now = time.time()
            owed += (now - last_turn) / every * self.n
            last_turn = now
            due, owed = int(owed), owed - int(owed)
            for _ in range(min(due, self.n)):
                h = self.hosts[cursor]
                cursor = (cursor + 1) % self.n
                # (as progress.encode writes a Progress: built directly, thousands a second)
                recs = {str(r.wid): {"hb": now, "pid": r.wid, "where": "python", "loc": "train",
                                     "same_s": 0.0, "paused": None, "max_step_s": 0.0,
                                     "compute_s": None, "gen": r.gen, "rank": r.rank,
                                     "step": r.step, "t": now}
                        for r in h.ranks.values() if r.alive and r.rank is not None}
                if recs and h.ch is not None:
                    h.send(m.Progress(recs=recs, stopped=[]))

    def _order(self, h: _Host, ch: Any, order: m.Order) -> None:
        match order:
            case m.Hello():
                h.ch = ch
                h.send(m.State(host=h.host_id, incarnation=h.incarnation, workers=[
                    m.HostWorker(wid=r.wid, pid=r.wid, alive=r.alive, spare=r.spare,
                                 rank=r.rank, gen=r.gen) for r in h.ranks.values()],
                    takeover=False))
            case m.Spawn(wid=wid, spare=spare):
                r = _Rank(wid, spare)
                h.ranks[wid] = r
                evs = [_ev(events.Started, wid, pid=wid)]
                if spare:
                    evs += [_ev(events.Wrapped, wid, pid=wid),
                            _ev(events.Ready, wid, pid=wid, mode="script")]
                h.events(evs)
            case m.Send(wid=wid, msg=body):
                r = self._mail(h, wid, body)
                if r is not None:
                    self.to_join.append((h, [r]))
            case m.Sends(mails=mails, common=common):
                batch = [self._mail(h, int(item["wid"]), {**common, **item["msg"]})
                         for item in mails]
                batch = [r for r in batch if r is not None]
                if batch:
                    self.to_join.append((h, batch))
            case m.Abort(gen=gen, wids=wids):
                now = time.time()
                evs = []
                for wid in wids:
                    r = h.ranks.get(wid)
                    if r is not None and r.alive and r.gen == gen and r.left < gen:
                        r.left = gen
                        evs.append(_ev(events.LeftGeneration, wid, gen=gen, rank=r.rank,
                                       step=r.step, dirty=False, destroy_s=0.0, reason="abort",
                                       t_caught=now, phase="train"))
                with self.lock:
                    if gen == self.fault_gen:
                        self.aborted[h.i] = now
                h.events(evs)
            case m.Signal(wid=wid, sig=sig):
                r = h.ranks.get(wid)
                if r is not None and r.alive and sig in (signal.SIGKILL, signal.SIGTERM):
                    r.alive = False
                    h.send(m.Exits(exits=[m.ProcExit(wid=wid, code=-sig)]))
            case m.End():
                h.ended = True
            case m.OpenStore():
                h.send(m.Reply(id=order.id, port=self.store_port))
            case _:
                pass

    def _mail(self, h: _Host, wid: int, body: dict[str, Any]) -> _Rank | None:
        """A rank's mail; the rank when it was assigned (it joins its generation)."""
        r = h.ranks.get(wid)
        if r is None or not r.alive:
            return None
        mail = protocol.mail_from(body)
        if isinstance(mail, protocol.Assign):
            r.rank, r.gen, r.world, r.spare = mail.rank, mail.gen, mail.world, False
            r.t_assigned = time.time()
            with self.lock:
                self.assigned.setdefault(mail.gen, []).append(r.t_assigned)
            return r
        if isinstance(mail, (protocol.Complete, protocol.Exit)):
            r.alive = False
            h.send(m.Exits(exits=[m.ProcExit(wid=wid, code=0)]))
        return None

    def _adder(self, store: Any) -> None:
        """Ranks join their generations as their assignments arrive: each announces itself on
        the generation's store; the last of the world opens it."""
        while True:
            item = self.joins.get()
            if item is None:
                return
            h, batch = item
            # (a rank says it runs inside nonstop.wrap once in its life: a spare at its start,
            # a rank of the first generation when it first joins)
            h.events([_ev(events.Wrapped, x.wid, pid=x.wid) for x in batch if x.gen == 0] +
                     [_ev(events.Joining, x.wid, gen=x.gen, rank=x.rank) for x in batch])
            k = h.i % self.groups
            for x in batch:
                with h.lock:
                    h.joined.setdefault(x.gen, []).append(x)
                with self.lock:
                    first = x.gen not in self.waited[k]
                    self.waited[k].add(x.gen)
                if first:
                    self.waits[k].put(x.gen)
                prefix = protocol.pg_prefix(x.gen)
                try:
                    if store.add(prefix + "bench/arrived", 1) == x.world:
                        store.set(prefix + "bench/open", b"1")
                except Exception:  # noqa: BLE001 - the bench ends
                    return

    def _waiter(self, k: int, store: Any) -> None:
        """...and the hosts of group ``k`` wait for it to open, then their ranks enter and take
        their first step (every rank has joined by then: the last one opened it)."""
        hosts = self.hosts[k::self.groups]
        while True:
            gen = self.waits[k].get()
            if gen is None:
                return
            try:
                store.wait([protocol.pg_prefix(gen) + "bench/open"], timedelta(seconds=120))
            except Exception:  # noqa: BLE001 - the bench ends, or a newer generation came
                continue
            now = time.time()
            for h in hosts:
                with h.lock:
                    joined = h.joined.pop(gen, [])
                if not joined:
                    continue
                world = joined[0].world
                with self.lock:
                    self.gen_hosts[gen] = self.gen_hosts.get(gen, 0) + len(joined)
                    if self.gen_hosts[gen] >= world:
                        self.rdzv_done[gen] = now
                entered = [_ev(events.EnteredGeneration, r.wid, gen=gen, rank=r.rank,
                               step=r.step, source="memory", holder=None, receivers=[],
                               sources={}, skipped=[], nbytes=0, restore_s=0.0, restore_phases={},
                               sharded=False, t_assigned=r.t_assigned, t_pg=now, t_restored=now)
                           for r in joined]
                for r in joined:
                    r.step += 1
                steps = [_ev(events.FirstStep, r.wid, gen=gen, rank=r.rank, step=r.step)
                         for r in joined]
                h.events(entered + steps)
                with self.lock:
                    self.first[gen] = self.first.get(gen, 0) + len(joined)

    # -- the measurement ---------------------------------------------------------------------------
    def wait(self, what: str, cond: Any, timeout_s: float) -> float:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.leader is not None and self.leader.poll() is not None:
                tail = (self.run_dir / "controller.out").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the controller ended ({self.leader.returncode}) before "
                                   f"{what}:\n{tail}")
            if cond():
                return time.time()
            time.sleep(0.005)
        tail = (self.run_dir / "controller.out").read_text(errors="replace")[-2000:]
        raise TimeoutError(f"{what}: not within {timeout_s:g} s\n{tail}")

    def current_gen(self) -> int:
        return max((g for g, n in self.first.items() if n >= self.world), default=-1)

    def run(self, timeout_s: float) -> dict[str, Any]:
        t0 = time.time()
        self.wait("the job started", lambda: self.current_gen() >= 0, timeout_s)
        started = time.time() - t0
        # the fault strikes a job in steady state: once the controller has read every rank's
        # first step (the start's backlog is not the recovery's)
        log = self.run_dir / "events.jsonl"
        seen = [0, 0]

        def caught_up() -> bool:
            with open(log, "rb") as f:
                f.seek(seen[0])
                chunk = f.read()
            cut = chunk.rfind(b"\n") + 1
            seen[0] += cut
            seen[1] += chunk[:cut].count(b'"rank_first_step"')
            return seen[1] >= self.world

        self.wait("the controller read the start", caught_up, timeout_s)
        settled = time.time() - t0
        gc.freeze()  # the simulated hosts' records: no full collection of them in the measure
        gen = self.current_gen()
        ranks = [(h, r) for h in self.hosts for r in h.ranks.values()
                 if r.alive and r.rank is not None and r.gen == gen]
        h, victim = self.rng.choice(ranks)
        self.fault_gen = gen
        hosts_of_gen = {x.i for x, _ in ranks}
        t_fault = time.time()
        victim.alive = False
        h.send(m.Exits(exits=[m.ProcExit(wid=victim.wid, code=-signal.SIGKILL)]))
        new = gen + 1
        t_abort = self.wait("every host told to abort",
                            lambda: len(self.aborted) >= len(hosts_of_gen), timeout_s)
        t_assign = self.wait("every rank assigned",
                             lambda: len(self.assigned.get(new, ())) >= self.world, timeout_s)
        t_rdzv = self.wait("the rendezvous complete", lambda: new in self.rdzv_done, timeout_s)
        t_first = self.wait("every rank past its first step",
                            lambda: self.first.get(new, 0) >= self.world, timeout_s)
        t_last_assign = max(self.assigned[new])
        t_abort = max(self.aborted.values())  # as recorded, not as polled (5 ms apart)
        res = {"ranks": self.world, "hosts": self.n, "store": "etcd", "start_s": round(started, 3),
               "settled_s": round(settled, 3),
               "recovery_s": round(self.rdzv_done[new] - t_fault, 4),
               "phases_s": {"decide_abort": round(t_abort - t_fault, 4),
                            "assign": round(t_last_assign - t_abort, 4),
                            "rendezvous": round(self.rdzv_done[new] - t_last_assign, 4),
                            "first_step": round(t_first - self.rdzv_done[new], 4)},
               "first_step_s": round(t_first - t_fault, 4), "gen": new,
               "controller_pid": self.leader.pid if self.leader is not None else None}
        del t_assign, t_rdzv
        return res

    def close(self) -> None:
        self.stop.set()
        if self.leader is not None and self.leader.poll() is None:
            try:
                os.killpg(self.leader.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.leader.wait(10)
        for _ in range(self.groups):
            self.joins.put(None)
        for q in self.waits:
            q.put(None)
        for h in self.hosts:
            h.ended = True
            if h.ch is not None:
                h.ch.close()
            h.listener.close()
            if h.lease is not None:
                try:
                    h.lease.revoke()
                except Exception:  # noqa: BLE001
                    pass
        try:
            self.etcd.delete_prefix("")
        except Exception:  # noqa: BLE001
            pass
        self.etcd.close()
        if getattr(self, "out", None) is not None:
            self.out.close()


def measure(ranks: int, spares: int, base: Path, etcd_url: str, seed: int,
            timeout_s: float, pin: tuple[str, ...] = ()) -> dict[str, Any]:
    hosts = max(1, ranks // PER_HOST)
    sim = Sim(hosts, spares, base / f"r{ranks}", etcd_url, seed, pin)
    try:
        sim.start()
        return sim.run(timeout_s)
    finally:
        sim.close()

"""The controller process of a job across hosts.

Every host's agent keeps one ready, in standby: it campaigns in etcd for the job's leader key, on a
lease of its own. The one elected connects to every host's agent and runs the job with the same
controller as on one host (``Cluster`` stands in for the agent and the mail). It writes its
journal to etcd only while it still holds its epoch; a host refuses commands from an older epoch.
When its lease is lost it stops at once: a standby takes over.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from . import keys
from .agent import HostConfig

HOSTS_EVERY_S = 0.2  # how often the host list is read from etcd while the job runs


def _die_with_parent() -> None:
    """The standby is the agent's child: it ends with it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    parent = os.environ.get("NONSTOP_LAUNCHER_PID")
    if parent and os.getppid() != int(parent):
        os._exit(1)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    _die_with_parent()
    cfg = HostConfig.from_json(Path(argv[0]).read_text())
    from ..net.channel import load_secret
    from ..store.etcd import Etcd, StoreUnavailable

    secret = load_secret()
    etcd = Etcd(cfg.endpoints, cfg.job_id, timeout_s=max(2.0, cfg.lease_ttl_s))
    stop = threading.Event()

    def lost() -> None:
        print(f"nonstop: the controller on {cfg.host_id} lost its lease in etcd: it steps down",
              file=sys.stderr, flush=True)
        os._exit(3)

    me = json.dumps({"host": cfg.host_id, "pid": os.getpid()})
    while True:
        try:
            lead = etcd.campaign(keys.LEADER, me, cfg.lease_ttl_s, stop, on_lost=lost)
            break
        except StoreUnavailable:
            time.sleep(0.5)
    if lead is None:
        os._exit(0)
    code = Leader(cfg, secret, etcd, lead).run()
    sys.stdout.flush()
    os._exit(0 if code is not None else 1)


class Leader:
    def __init__(self, cfg: HostConfig, secret: bytes, etcd: Any, lead: Any):
        self.cfg, self.secret, self.etcd, self.lead = cfg, secret, etcd, lead
        self.epoch = lead.epoch
        self.run_dir = cfg.run_dir
        self._hosts_rev = 0
        self._last_hosts = 0.0
        self._journal_gen = -2

    def guarded(self, puts: dict[str, str]) -> None:
        self.etcd.guarded(keys.LEADER, self.epoch, puts=puts)

    def run(self) -> int | None:
        from .. import policy as policy_mod
        from ..controller import Controller
        from ..display import Display
        from ..events import EventLog
        from ..launcher import report
        from .cluster import Cluster

        cfg = self.cfg
        done, _ = self.etcd.get(keys.DONE)
        if done is not None:
            return json.loads(done).get("code", 0)
        journal, _ = self.etcd.get(keys.JOURNAL)
        if journal is not None:
            # a controller was in office before: taking over a running job is the next step;
            # until then the job stops cleanly rather than run twice
            self._finish(1, "the controller was replaced while the job ran; taking over a "
                            "running job is not supported yet")
            return 1
        pol = policy_mod.Policy.model_validate(cfg.policy)
        hosts = self._wait_for_hosts(pol.hosts.join_timeout_s)
        if hosts is None:
            return 2
        display = Display(quiet=cfg.quiet, live=False)
        log = EventLog(self.run_dir)
        log.write("leader", epoch=self.epoch, host=cfg.host_id,
                  hosts={h.host_id: h.addr for h in hosts})
        controller: Controller | None = None

        def output(wid: int, line: str) -> None:
            if controller is not None:
                controller.on_output(wid, line)

        cluster = Cluster(self.epoch, self.secret, self.run_dir, output)
        for node, rec in enumerate(hosts):
            cluster.add_host(node, rec)
        nodes = cfg.nnodes_max
        world = nodes * cfg.nproc_per_node
        controller = Controller(world=world, spares=cfg.spares * nodes, policy=pol, mail=cluster,
                                agent=cluster, log=log, display=display, managed=True,
                                nodes=nodes, spare_nodes=len(hosts) - nodes, run_dir=self.run_dir)
        cluster.on_node_lost = lambda n: controller.node_lost(n, "its lease in etcd expired")
        cluster.on_tick = lambda: self._tick(controller, cluster)
        display.info(f"controller on {cfg.host_id} (epoch {self.epoch}): {world} rank(s) on "
                     f"{nodes} host(s) + {len(hosts) - nodes} spare host(s)")
        code = controller.run()
        report(controller, log, self.run_dir, code, display)
        self._finish(code, controller.diagnosis)
        cluster.end_hosts(code)
        time.sleep(0.2)  # the END frames leave before the process does
        cluster.close()
        return code

    def _wait_for_hosts(self, timeout_s: float) -> list[keys.HostRecord] | None:
        """The job's first hosts: --nnodes of them hold ranks (in the order they joined), the
        others are spare hosts."""
        deadline = time.monotonic() + timeout_s
        want = self.cfg.nnodes_max
        while True:
            rows = self.etcd.get_prefix(keys.HOSTS)
            if len(rows) >= want:
                rows.sort(key=lambda r: r[3])  # create revision: the order they joined
                return [keys.HostRecord.loads(r[1]) for r in rows]
            if time.monotonic() > deadline:
                self._finish(2, f"only {len(rows)} of {want} host(s) joined job "
                                f"'{self.cfg.job_id}' within {timeout_s:g} s "
                                "(hosts.join_timeout_s): check --rdzv-id and --nnodes on each host")
                return None
            time.sleep(0.1)

    def _finish(self, code: int, diagnosis: str | None) -> None:
        try:
            self.guarded({keys.DONE: json.dumps({"code": code, "diagnosis": diagnosis})})
        except Exception as exc:  # noqa: BLE001 - deposed or etcd gone: the hosts end anyway
            print(f"nonstop: could not record the job's end in etcd: {exc}", file=sys.stderr)
        if diagnosis and code == 2:
            print(f"nonstop: error: {diagnosis}", file=sys.stderr, flush=True)

    # == while the job runs =====================================================================
    def _tick(self, controller: Any, cluster: Any) -> None:
        now = time.monotonic()
        if controller.gen != self._journal_gen and controller.phase not in ("starting",):
            self._journal_gen = controller.gen
            self._write_journal(controller)
        if now - self._last_hosts >= HOSTS_EVERY_S:
            self._last_hosts = now
            self._check_hosts(controller, cluster)

    def _write_journal(self, controller: Any) -> None:
        rec = {"epoch": self.epoch, "gen": controller.gen,
               "plan": {str(r): w for r, w in controller.plan.items()},
               "nodes": {str(n): {"host": link.rec.host_id, "incarnation": link.rec.incarnation}
                         for n, link in controller.agent.links.items()},
               "isolated": sorted(controller.counters.isolated),
               "replacements": controller.replacements, "max_step": controller.max_step}
        try:
            self.guarded({keys.JOURNAL: json.dumps(rec, separators=(",", ":"))})
        except Exception as exc:  # noqa: BLE001
            from ..store.etcd import Fenced

            if isinstance(exc, Fenced):
                print("nonstop: a newer controller is in office: this one stops", file=sys.stderr,
                      flush=True)
                os._exit(3)

    def _check_hosts(self, controller: Any, cluster: Any) -> None:
        """Hosts whose lease expired are lost; hosts that joined are spare nodes."""
        try:
            rows = self.etcd.get_prefix(keys.HOSTS)
        except Exception:  # noqa: BLE001 - etcd away: nothing is decided without it
            return
        alive = {}
        for _, raw, _, _ in rows:
            rec = keys.HostRecord.loads(raw)
            alive[(rec.host_id, rec.incarnation)] = rec
        for node, link in list(cluster.links.items()):
            if not link.lost and (link.rec.host_id, link.rec.incarnation) not in alive:
                cluster.host_gone(node)
        known = {(link.rec.host_id, link.rec.incarnation) for link in cluster.links.values()}
        for key, rec in alive.items():
            if key in known:
                continue
            node = max(cluster.links) + 1 if cluster.links else 0
            try:
                cluster.add_host(node, rec, timeout_s=2.0)
            except Exception as exc:  # noqa: BLE001 - try again at the next look
                cluster.links.pop(node, None)
                print(f"nonstop: host {rec.host_id} joined but cannot be reached yet: {exc}",
                      file=sys.stderr, flush=True)
                continue
            controller.node_joined(node)


if __name__ == "__main__":
    main()

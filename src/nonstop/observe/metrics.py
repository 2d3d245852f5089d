"""Prometheus metrics (``--metrics-port``): the job's, served by the controller, and each host's,
served by its agent - from one HTTP server per ``nonstop run`` process.

The job's counters and histograms follow its event log (every event the controller writes passes
through ``JobMetrics.on_event``), so a scrape and the log tell the same story; its gauges are set
from the controller's state as it runs. Names follow Prometheus conventions: ``nonstop_`` prefix,
units in the name, ``_total`` counters, histograms for durations (docs/observe.md lists them).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from .incidents import PHASES

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0, 600.0)
ACCOUNT_EVERY_S = 2.0  # the goodput account is recomputed this often


class Server:
    """One HTTP endpoint for a registry; ``port`` 0 takes one from the OS (``self.port``)."""

    def __init__(self, registry: Any, port: int, addr: str = "127.0.0.1"):
        from prometheus_client import start_http_server

        try:
            self._server, self._thread = start_http_server(port, addr=addr, registry=registry)
        except OSError as exc:
            from ..errors import UsageError

            raise UsageError(f"--metrics-port {port} on {addr}: {exc.strerror or exc}") from None
        self.addr, self.port = addr, self._server.server_port

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def registry() -> Any:
    from prometheus_client import CollectorRegistry, disable_created_metrics

    disable_created_metrics()  # no ``_created`` series beside every counter and histogram
    return CollectorRegistry(auto_describe=True)


class JobMetrics:
    """The job as its controller sees it."""

    def __init__(self, reg: Any, policy: Any):
        from prometheus_client import Counter, Gauge, Histogram

        self.policy = policy
        g = lambda name, doc, labels=(): Gauge(name, doc, labels, registry=reg)  # noqa: E731
        c = lambda name, doc, labels=(): Counter(name, doc, labels, registry=reg)  # noqa: E731
        h = lambda name, doc, labels=(): Histogram(name, doc, labels, registry=reg,  # noqa: E731
                                                   buckets=DURATION_BUCKETS)
        self.world = g("nonstop_world_size", "Ranks the job runs with now (its generation's world)")
        self.ranks = g("nonstop_ranks", "Rank processes of the current generation by state", ["state"])
        self.spares = g("nonstop_spares", "Spare processes by state", ["state"])
        self.spare_hosts = g("nonstop_spare_hosts", "Hosts (nodes) that hold no rank: spare capacity")
        self.generation = g("nonstop_generation", "The current generation")
        self.phase = g("nonstop_phase", "The controller's phase (1 for the current one)", ["phase"])
        self.step = g("nonstop_step", "The newest step any rank completed")
        self.step_s = g("nonstop_step_seconds", "Rank 0's last step, snapshot stall included")
        self.incidents = c("nonstop_incidents", "Incidents closed, by the first fault's kind and "
                           "code and the recovery level that ended it", ["kind", "code", "level"])
        self.faults = c("nonstop_faults", "Faults detected", ["kind", "code"])
        self.decisions = c("nonstop_decisions", "Decisions of the recovery ladder", ["level"])
        self.recovery = h("nonstop_recovery_seconds", "Recovery time of closed incidents by phase",
                          ["phase"])
        self.mttr = h("nonstop_mttr_seconds", "Time from fault to the first step after recovery")
        self.lost = c("nonstop_steps_lost", "Steps a recovery undid (to be done again)")
        self.goodput = g("nonstop_goodput_ratio", "Productive share of the wall time so far")
        self.time = g("nonstop_time_seconds", "The goodput account so far: seconds by category "
                      "(recovery by phase)", ["category", "phase"])
        self.restores = c("nonstop_restores", "Ranks' state restored, by where it came from",
                          ["source"])
        self.restore_s = h("nonstop_restore_seconds", "A generation's restore (the slowest rank)")
        self.restore_bytes = c("nonstop_restore_bytes", "Bytes of state moved by restores")
        self.snapshot_s = g("nonstop_snapshot_seconds", "Rank 0's cost of one memory snapshot")
        self.snapshot_every = g("nonstop_snapshot_interval_steps", "Steps between memory snapshots")
        self.checkpoints = c("nonstop_checkpoints", "Disk checkpoints completed", ["reason"])
        self.checkpoint_s = h("nonstop_checkpoint_seconds", "Time to write a disk checkpoint")
        self.checkpoint_bytes = c("nonstop_checkpoint_bytes", "Bytes written to disk checkpoints")
        self.checkpoint_failures = c("nonstop_checkpoint_failures", "Checkpoint parts that failed")
        self.budget = g("nonstop_budget_remaining", "Uses left of each recovery level's budget",
                        ["level"])
        self.deadlines = c("nonstop_deadlines", "Deadlines that fired, by what waited", ["what"])
        self._fault_of: dict[Any, tuple[str, str]] = {}  # incident -> its first fault's kind, code
        self._next_account = 0.0

    # -- from the event log ------------------------------------------------------------------
    def on_event(self, ev: dict[str, Any]) -> None:
        handler = getattr(self, "_ev_" + str(ev.get("type")), None)
        if handler is not None:
            handler(ev)

    def _ev_fault(self, ev: dict[str, Any]) -> None:
        kind, code = str(ev.get("kind")), str(ev.get("code"))
        self.faults.labels(kind, code).inc()
        self._fault_of.setdefault(ev.get("incident"), (kind, code))

    def _ev_decision(self, ev: dict[str, Any]) -> None:
        self.decisions.labels(str(ev.get("level"))).inc()

    def _ev_incident(self, ev: dict[str, Any]) -> None:
        kind, code = self._fault_of.pop(ev.get("id"), ("unknown", "unknown"))
        levels = ev.get("levels") or ["none"]
        self.incidents.labels(kind, code, str(levels[-1])).inc()
        if ev.get("mttr_s") is not None:
            self.mttr.observe(ev["mttr_s"])
            for phase in PHASES:
                self.recovery.labels(phase).observe((ev.get("phases_s") or {}).get(phase, 0.0))
        if ev.get("steps_lost"):
            self.lost.inc(ev["steps_lost"])

    def _ev_generation(self, ev: dict[str, Any]) -> None:
        self.generation.set(ev.get("gen") or 0)
        self.world.set(len(ev.get("ranks") or {}))

    def _ev_restore(self, ev: dict[str, Any]) -> None:
        for source in (ev.get("sources") or {}).values():
            self.restores.labels(str(source)).inc()
        self.restore_s.observe(ev.get("seconds") or 0.0)
        self.restore_bytes.inc(ev.get("bytes") or 0)

    def _ev_checkpoint(self, ev: dict[str, Any]) -> None:
        self.checkpoints.labels(str(ev.get("reason"))).inc()
        self.checkpoint_s.observe((ev.get("write_s") or 0.0) + (ev.get("finalize_s") or 0.0))
        self.checkpoint_bytes.inc(ev.get("bytes") or 0)

    def _ev_deadline(self, ev: dict[str, Any]) -> None:
        self.deadlines.labels(str(ev.get("what"))).inc()

    def _ev_checkpoint_failed(self, ev: dict[str, Any]) -> None:
        self.checkpoint_failures.inc()

    def _ev_rank_snapshot_interval(self, ev: dict[str, Any]) -> None:
        if ev.get("every") is not None:
            self.snapshot_every.set(ev["every"])
        if ev.get("cost_s") is not None:
            self.snapshot_s.set(ev["cost_s"])

    # -- from the controller's state ---------------------------------------------------------
    def update(self, controller: Any, now: float | None = None) -> None:
        """The gauges, from the controller as it is now (called a few times a second)."""
        from ..decide.ladder import _FIELD, LADDER

        now = time.time() if now is None else now
        status = controller.table.status(controller.plan)
        alive = sum(r["alive"] for r in status["ranks"])
        self.ranks.labels("alive").set(alive)
        self.ranks.labels("dead").set(len(status["ranks"]) - alive)
        self.spares.labels("ready").set(status["spares_ready"])
        self.spares.labels("warming").set(status["spares"] - status["spares_ready"])
        used = set(controller.gens.busy_nodes()) | set(controller.counters.isolated)
        self.spare_hosts.set(max(0, controller.total_nodes - len(used)))
        for phase in type(controller.phase):
            self.phase.labels(phase.value).set(1 if phase is controller.phase else 0)
        self.step.set(controller.max_step)
        snap = controller.reports.snap_stats or {}
        rank0 = controller.progress.rank0
        if rank0 and rank0[-1].get("step_s") is not None:
            self.step_s.set(rank0[-1]["step_s"])
        if snap.get("every") is not None:
            self.snapshot_every.set(snap["every"])
        for level in LADDER:
            cfg = getattr(self.policy.levels, _FIELD[level])
            self.budget.labels(level.value).set(max(0, cfg.budget - controller.counters.used(level)))
        if now >= self._next_account:
            self._next_account = now + ACCOUNT_EVERY_S
            self.account(controller, now)

    def account(self, controller: Any, now: float) -> None:
        from . import goodput

        # the whole job's: after a takeover, with what the controllers before this one counted
        _, cats = controller.job_account.count(
            now, [i.to_record() for i in controller.incidents], controller.incident,
            controller.outcome.t_train_end)
        wall = goodput.total(cats)
        if wall > 0:
            self.goodput.set(round(cats.get("productive", 0.0) / wall, 4))
        for cat, secs in cats.items():
            if isinstance(secs, dict):
                for phase, s in secs.items():
                    self.time.labels(cat, phase).set(s)
            else:
                self.time.labels(cat, "").set(secs)


class Served:
    """A ``nonstop run`` process's metrics: its registry and endpoint, the job's metrics while
    its controller is in office (``attach``) and, across hosts, its host's."""

    def __init__(self, port: int, addr: str, policy: Any):
        self.registry = registry()
        self.policy = policy
        self.server = Server(self.registry, port, addr)
        self.job: JobMetrics | None = None
        self.host: HostMetrics | None = None

    def attach(self, controller: Any, log: Any, display: Any) -> JobMetrics:
        """The job's metrics, from this controller's events and state."""
        if self.job is None:
            self.job = JobMetrics(self.registry, self.policy)
        log.listeners.append(self.job.on_event)
        controller.metrics = self.job
        display.info(f"metrics on {self.server.url}")
        log.write("metrics", url=self.server.url, addr=self.server.addr, port=self.server.port)
        return self.job

    def close(self) -> None:
        self.server.close()


class HostMetrics:
    """One host's part of a job across hosts, served by its agent."""

    def __init__(self, reg: Any, host: str):
        from prometheus_client import Gauge

        self.info = Gauge("nonstop_host_info", "This host in the job (always 1)", ["host"],
                          registry=reg)
        self.info.labels(host).set(1)
        self.node = Gauge("nonstop_host_node", "This host's node number in the job (-1: none yet)",
                          registry=reg)
        self.procs = Gauge("nonstop_host_processes", "Processes this host's agent runs, by role",
                           ["role"], registry=reg)
        self.keeper = Gauge("nonstop_host_keeper_up", "1 while this host's memory (keeper) runs",
                            registry=reg)
        self.etcd = Gauge("nonstop_host_etcd_reachable", "1 while this host reaches etcd",
                          registry=reg)
        self.node.set(-1)


class HostServed:
    """A host agent's metrics endpoint (across hosts)."""

    def __init__(self, port: int, addr: str, host: str):
        self.registry = registry()
        self.server = Server(self.registry, port, addr)
        self.host = HostMetrics(self.registry, host)
        print(f"nonstop: host metrics on {self.server.url}", file=sys.stderr, flush=True)

    def update(self, agent: Any) -> None:
        """From the agent as it is now: its processes by role, its memory, etcd, its controller."""
        roles = {"rank": 0, "spare": 0, "keeper": 0, "controller": 0}
        for proc in agent.agent.alive() if agent.agent is not None else ():
            meta = agent.meta.get(proc.wid) or {}
            role = ("controller" if proc.wid < 0 else "keeper" if meta.get("keeper") else
                    "spare" if meta.get("spare") else "rank")
            roles[role] += 1
        for role, n in roles.items():
            self.host.procs.labels(role).set(n)
        self.host.keeper.set(1 if roles["keeper"] else 0)
        self.host.etcd.set(0 if agent.doubt_since is not None else 1)
        nodes = {meta.get("node") for meta in agent.meta.values() if meta.get("node") is not None}
        if len(nodes) == 1:
            self.host.node.set(nodes.pop())

    def close(self) -> None:
        self.server.close()

"""What nonstop sees of a job's liveness: hangs and stragglers (from the ranks' progress), the
nodes' health checks and the policy's log rules. Each observation becomes a command for the
controller (raise a fault, end hung ranks, replace a slow rank, stop using a spare node); the
watchers themselves change nothing in the job.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Collection, Iterable

from ..decide.ladder import Fault
from .liveness import Signals
from ..decide.logrules import LogWatch
from ..policy import Policy
from ..protocol import events


@dataclasses.dataclass(frozen=True)
class Command:
    action: str  # "fault": raise it; "hang": end ``culprits`` (wid -> why), then raise it, as of
    #              ``t_fault``; "replace": a straggler the policy replaces; "isolate": a node
    #              that holds no rank failed a check: stop using it
    fault: Fault | None = None
    node: int | None = None
    culprits: dict[int, str] | None = None
    t_fault: float | None = None


class Watchers:
    def __init__(self, policy: Policy, log: Any, display: Any):
        self.policy = policy
        self.log = log
        self.display = display
        self.logs = LogWatch(policy.detect.log_rules)
        self.health: Any = None  # the node health checks, once started
        self.signals = Signals(policy)  # hangs and stragglers, from the ranks' progress
        self._slow_said: tuple[int, frozenset[int]] = (-1, frozenset())  # (gen, ranks) said slow

    def loss_rule_fired(self, ev: events.LossRuleFired) -> tuple[str, str]:
        """A loss rule a rank reported: logged and shown; (what to say, its action)."""
        text = f"loss rule '{ev.rule}' on rank {ev.rank} at step {ev.step} (loss {ev.loss})"
        self.log.write("loss_rule_fired", **{k: v for k, v in events.encode(ev).items()
                                             if k != "type"})
        self.display.info(text)
        return text, ev.action

    def start(self, nodes: Iterable[int], source: Any = None) -> None:
        """Health checks for ``nodes``: run here (one host), or by each host's agent and
        reported (``source``: the same interface as HealthMonitor)."""
        from ..agent.health import HealthMonitor

        if self.health is not None:  # started already: the nodes join it
            for node in nodes:
                self.health.add_node(node)
            return
        d = self.policy.detect
        self.health = source if source is not None else \
            HealthMonitor(d.health_checks, nodes, nvml=d.nvml)
        if d.health_checks or d.nvml != "off":
            self.log.write("health", status=self.health.nvml_status,
                           checks=[c.name for c in d.health_checks])

    def close(self) -> None:
        if self.health is not None:
            self.health.close()

    def remove_node(self, node: int) -> None:
        if self.health is not None:
            self.health.remove_node(node)

    def poll_health(self, now: float, isolated: set[int],
                    busy: Callable[[], Collection[int]]) -> list[Command]:
        """Finished health checks; ``busy()``: the nodes that hold ranks (asked only when a
        check failed)."""
        out: list[Command] = []
        for r in self.health.poll(now) if self.health is not None else ():
            if r.ok or r.node in isolated:
                continue
            self.log.write("health", check=r.check, node=r.node, ok=r.ok, detail=r.detail)
            if r.limit_s is not None:
                self.log.deadline("health_check", r.limit_s, waited_s=round(r.seconds, 3),
                                  check=r.check, node=r.node)
            message = f"health check {r.check!r} failed: {r.detail}"
            if r.node not in busy():
                self.display.info(f"node {r.node}: {message}")
                out.append(Command("isolate", node=r.node))
                continue
            code = "NVML_ECC" if r.check == "nvml" else f"HEALTH_{r.check}"
            fault = Fault("node_unhealthy", node=r.node, tag=code, message=message)
            out.append(Command("drain" if self._drains(r.check) else "fault", fault))
        return out

    def _drains(self, check: str) -> bool:
        """Whether the policy moves a node off when this check fails (rather than a fault)."""
        return any(c.name == check and c.action == "drain" for c in self.policy.detect.health_checks)

    def steps(self, ranks: list[Any], gen: int, t_running: float, now: float,
              silent: dict[int, float] | None = None) -> list[Command]:
        """A hang, else the stragglers, among the ranks of generation ``gen`` (while it trains).
        A hang began after the stalled ranks' last progress, not when it was noticed.
        ``silent``: node -> seconds its host's agent has said nothing (across hosts)."""
        fault, culprits = self.signals.check_hang(ranks, gen, t_running, now, silent)
        if fault is not None:
            rank_of = {w.wid: w.rank for w in ranks}
            self.log.write("hang_detected", timeout_s=round(self.signals.last_limit, 3),
                           frozen={str(rank_of[w]): why for w, why in culprits.items()},
                           where=fault.traceback, last_progress=self.signals.last_progress)
            return [Command("hang", fault, culprits=culprits, t_fault=self.signals.last_progress)]
        self._say_slow()
        return [c for f in self.signals.check_stragglers(ranks, now) for c in self.straggler(f)]

    def _say_slow(self) -> None:
        """Ranks past their step's timeout whose collectives still move data: said once as they
        become slow (a slow link or step is waited for: replacing a rank cannot speed a link)."""
        gen, slow = self.signals.slow
        said_gen, said = self._slow_said
        if said_gen != gen or not slow:  # a new generation, or every rank stepped again
            said = frozenset()
        new = frozenset(slow) - said
        self._slow_said = (gen, said | new)
        if not new:
            return
        first = not said  # the console hears of an episode once; the event log of every rank
        longest = max(slow.values())
        self.log.write("slow_step", gen=gen, ranks=sorted(slow),
                       step_s={str(r): round(t, 3) for r, t in sorted(slow.items())},
                       timeout_s=round(self.signals.hang.steady_timeout(), 3))
        if first:
            self.display.info(f"rank(s) {', '.join(map(str, sorted(slow)))}: a step has run "
                              f"{longest:.1f} s, past the hang timeout, but its collectives "
                              "still move data - a slow link or step, not a hang: waited for")

    def straggler(self, fault: Fault) -> list[Command]:
        """A slow rank: reported; replaced if the policy says so."""
        action = self.policy.detect.straggler.action
        self.log.write("straggler", rank=fault.rank, message=fault.message, action=action)
        self.display.info(f"straggler: rank {fault.rank}: {fault.message}"
                          + {"replace": " - replacing it", "drain": " - draining it"}.get(action, ""))
        return [Command(action, fault)] if action in ("replace", "drain") else []

    def line(self, rank: int | None, text: str, now: float, forming_or_running: bool) -> list[Command]:
        """A line a process printed (``rank`` None: not a rank's)."""
        if not self.logs.active:
            return []
        return [c for m in self.logs.feed(rank, text, now) for c in self._matched(m, forming_or_running)]

    def tick(self, now: float) -> list[Command]:
        """Lines expected by now that did not come (called while the job trains)."""
        return [c for m in self.logs.tick(now) for c in self._matched(m, True)]

    def _matched(self, m: Any, forming_or_running: bool) -> list[Command]:
        self.log.write("log_rule", rule=m.rule, kind=m.kind, action=m.action, code=m.code,
                       rank=m.rank, line=m.line, message=m.message)
        if m.action == "report":
            self.display.info(m.message)
            return []
        if m.action == "slow":
            return [] if m.rank is None else \
                self.straggler(Fault("straggler", rank=m.rank, message=m.message))
        if m.action == "hang":
            return [Command("fault", Fault("hang", message=m.message))]
        if m.rank is not None or forming_or_running:
            return [Command("fault", Fault("log_rule", rank=m.rank, tag=m.code, message=m.message))]
        return []

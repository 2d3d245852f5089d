"""``nonstop run``: check the input, host the store, start the agent and controller, report.

The coordination store speaks torch's TCPStore protocol, served here on loopback (port from the
OS) without importing torch: no external service on one machine.
"""

from __future__ import annotations

import ast
import dataclasses
import datetime
import importlib.util
import os
import secrets
import signal
import sys
from pathlib import Path
from typing import Any

from .. import inject, policy as policy_mod, protocol
from ..agent.agent import worker_env
from ..controller.summary import report
from ..agent import loopback
from ..controller.phase import ENDING
from ..errors import UsageError


@dataclasses.dataclass
class RunConfig:
    script: str
    script_args: list[str]
    nproc: int = 1
    spares: int = 0
    nodes: int = 1
    spare_nodes: int = 0
    policy_file: str | None = None
    run_dir: str | None = None
    inject: list[str] = dataclasses.field(default_factory=list)
    hang_timeout: float | None = None
    teardown_timeout: float | None = None
    max_restarts: int | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    snapshot_every: str | None = None
    quiet: bool = False
    live: bool | None = None
    # across hosts (torchrun's flags): the same command on every host
    nnodes: str | None = None  # "N" or "MIN:MAX"
    nproc_per_node: int | None = None  # ranks per host
    rdzv_endpoint: str | None = None  # etcd://HOST:PORT[,HOST:PORT...]
    rdzv_id: str | None = None
    node_addr: str | None = None  # this host's address (default: the one that reaches etcd)
    node_id: str | None = None
    failure_domain: str | None = None  # its rack, switch... (default $NONSTOP_FAILURE_DOMAIN)
    secret_file: str | None = None
    etcd_cacert: str | None = None  # TLS to etcd (with https:// endpoints)
    etcd_cert: str | None = None
    etcd_key: str | None = None
    etcd_user: str | None = None  # password in $NONSTOP_ETCD_PASSWORD
    metrics_port: int | None = None  # Prometheus metrics (0: a port from the OS)
    metrics_addr: str = "127.0.0.1"

    @property
    def across_hosts(self) -> bool:
        """One host of many (``launch.hosts.run_host`` runs it), not a job on this host alone."""
        return bool(self.rdzv_endpoint or self.rdzv_id or self.nnodes not in (None, "1", "1:1"))


def check_script(path: str) -> tuple[bool, list[str]]:
    """Refuse a script that cannot run: missing, not a file, bad syntax, an import not installed.
    Returns (uses nonstop, top-level imports)."""
    p = Path(path)
    try:
        found, is_file = p.exists(), p.is_file()
    except (OSError, ValueError) as exc:  # a name too long, a NUL byte, ...
        raise UsageError(f"cannot read script {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not found:
        raise UsageError(f"script not found: {path}")
    if not is_file:
        raise UsageError(f"not a file: {path}")
    try:
        source = p.read_bytes()
        tree = ast.parse(source, str(p))
    except SyntaxError as exc:
        raise UsageError(f"{path}:{exc.lineno}: syntax error: {exc.msg}") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from None
    tops: list[tuple[str, int]] = []
    for node in tree.body:  # module level only: imports inside functions may be optional
        if isinstance(node, ast.Import):
            tops += [(a.name.split(".")[0], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            tops.append((node.module.split(".")[0], node.lineno))
    script_dir = str(p.resolve().parent)
    sys.path.insert(0, script_dir)
    try:
        for name, line in tops:
            if name in sys.modules:
                continue
            try:
                found = importlib.util.find_spec(name) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                raise UsageError(f"{path}:{line}: imports '{name}', which is not installed "
                                 "(ModuleNotFoundError)")
    finally:
        sys.path.remove(script_dir)
    names = [n for n, _ in tops]
    from ..script_scan import uses_nonstop

    return uses_nonstop(p, tree), names


def prepare(cfg: RunConfig) -> tuple[policy_mod.Policy, list[inject.FaultSpec], bool]:
    if cfg.nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {cfg.nproc}")
    if cfg.spares < 0:
        raise UsageError(f"--spares must be 0 or more, got {cfg.spares}")
    if cfg.nodes < 1 or cfg.nproc % cfg.nodes:
        raise UsageError(f"--nodes must be at least 1 and divide --nproc ({cfg.nproc}), got {cfg.nodes}")
    if cfg.spare_nodes < 0:
        raise UsageError(f"--spare-nodes must be 0 or more, got {cfg.spare_nodes}")
    pol = policy_mod.load(cfg.policy_file).with_overrides(**{
        "detect.hang.auto": False if cfg.hang_timeout is not None else None,
        "detect.hang.timeout_s": cfg.hang_timeout,
        "recover.timeouts.teardown_s": cfg.teardown_timeout,
        "recover.levels.job_restart.budget": cfg.max_restarts,
        "state.checkpoint.dir": cfg.checkpoint_dir,
        "state.checkpoint.every_steps": cfg.checkpoint_every,
        "state.snapshot.every_steps": _snapshot_every(cfg.snapshot_every)})
    if pol.state.checkpoint.dir:  # every process (ranks, keepers) must agree where it is
        try:
            root = Path(pol.state.checkpoint.dir).expanduser().resolve()
            not_dir = root.exists() and not root.is_dir()
        except (OSError, ValueError, RuntimeError) as exc:  # too long, a loop of links, no $HOME
            raise UsageError(f"checkpoint directory {pol.state.checkpoint.dir}: "
                             f"{getattr(exc, 'strerror', None) or exc}") from None
        if not_dir:
            raise UsageError(f"checkpoint directory {pol.state.checkpoint.dir} is not a directory")
        pol = pol.with_overrides(**{"state.checkpoint.dir": str(root)})
    faults = inject.parse(cfg.inject)
    inject.check_world(faults, cfg.nproc)
    uses_nonstop, _ = check_script(cfg.script)
    return pol, faults, uses_nonstop


def _snapshot_every(text: str | None) -> Any:
    if text is None or text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"--snapshot-every takes 'auto' or a number of steps, got {text!r}") from None


def make_run_dir(run_dir: str | None) -> Path:
    if run_dir is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        run_dir = os.path.join("nonstop-runs", f"{stamp}-{secrets.token_hex(2)}")
    p = Path(run_dir)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create run directory {run_dir}: {exc.strerror or exc}") from None
    return p


class _Interrupted(Exception):
    def __init__(self, signum: int):
        self.signum = signum


def run(cfg: RunConfig) -> int:
    """A job on this host alone (one host of many: ``launch.hosts.run_host``)."""
    if cfg.across_hosts:
        raise UsageError("a job across hosts is run by launch.hosts.run_host")
    if cfg.nproc_per_node is not None:  # one host: per host is the total
        if cfg.nproc not in (1, cfg.nproc_per_node):
            raise UsageError(f"--nproc {cfg.nproc} and --nproc-per-node {cfg.nproc_per_node} "
                             "disagree (one host: give one of them)")
        cfg.nproc = cfg.nproc_per_node
    pol, faults, uses_nonstop = prepare(cfg)
    served = serve_metrics(cfg, pol)  # a port taken is a usage error before anything starts
    run_dir = make_run_dir(cfg.run_dir)
    from ..agent.agent import Agent
    from ..controller.controller import Controller
    from ..observe.display import Display
    from ..observe.events import EventLog, mark_logs
    from ..controller.checkpoints import CheckpointsFailing
    from ..controller.keepers import KeeperStartError

    display = Display(quiet=cfg.quiet, live=cfg.live)
    log = EventLog(run_dir)
    if log.attempt > 1:  # the same run directory again: one history, the earlier logs kept
        mark_logs(run_dir, log.attempt)
    store = loopback.master_store()
    port = store.port
    controller: Controller | None = None

    def label(wid: int) -> str:
        w = controller.workers.get(wid) if controller else None
        node = controller.memory.node_of_wid(wid) if controller else None
        if node is not None:
            return f"keeper n{node}"
        if w is None or w.spare or w.rank is None:
            return f"spare {wid}"
        return f"rank {w.rank}"

    def output(wid: int, line: str) -> None:
        display.worker_line(label(wid), line)
        if controller is not None:
            controller.on_output(wid, line)

    agent = Agent(cfg.script, cfg.script_args, f"{loopback.HOST}:{port}", run_dir,
                  worker_env(run_dir, faults), output)
    agent.start_zygote()  # ranks are forked from it: it imports torch while the launcher goes on
    from ..agent.mail import StoreMail

    mail = StoreMail(wids=agent.recent_wids)
    controller = Controller(world=cfg.nproc, spares=cfg.spares, policy=pol, mail=mail, agent=agent,
                            log=log, display=display, managed=uses_nonstop, nodes=cfg.nodes,
                            spare_nodes=cfg.spare_nodes, run_dir=run_dir)

    if served is not None:
        served.attach(controller, log, display)

    def on_signal(signum: int, _frame: Any) -> None:
        raise _Interrupted(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    nodes = f" on {cfg.nodes} node(s) + {cfg.spare_nodes} spare" if cfg.nodes > 1 or cfg.spare_nodes else ""
    display.info(f"{cfg.nproc} rank(s){nodes}, {cfg.spares} warm spare(s), run directory {run_dir}")
    display.start()
    code: int
    try:
        controller.prespawn()
        store.set(protocol.JOB_KEY, protocol.dumps({
            "run_id": run_dir.name, "world": cfg.nproc,
            "rendezvous_timeout_s": pol.timeouts.rendezvous_s,
            "collective_timeout_s": pol.timeouts.collective_s, "policy": pol.model_dump()}))
        mail.attach(store)
        code = controller.run()
    except _Interrupted as exc:
        display.stop()
        name = signal.Signals(exc.signum).name
        log.write("interrupted", signal=exc.signum)
        controller.outcome.diagnosis = f"interrupted by {name}"
        code = 128 + exc.signum
        if pol.state.emergency.on_signal and controller.phase not in ENDING:
            display.info(f"interrupted by {name}: saving the newest snapshot, then ending every "
                         "process")
            for s in old:  # a second signal ends it at once
                signal.signal(s, signal.SIG_DFL)
            try:
                controller.emergency(f"signal {name}")
            except CheckpointsFailing:  # the disk refuses it: ending anyway
                pass
        else:
            display.info(f"interrupted by {name}: ending every process")
    except CheckpointsFailing as exc:  # state.checkpoint.on_failure: fail
        if controller.outcome.exit_code is None:  # not already ending (for another reason)
            controller.give_up("checkpoints failing", str(exc))
        code = controller.outcome.exit_code if controller.outcome.exit_code is not None else 1
    except KeeperStartError as exc:  # the machine's trouble (too slow, out of memory)
        controller.outcome.diagnosis = f"the job could not start: {exc}"
        display.error(controller.outcome.diagnosis)
        code = 1
    finally:
        display.stop()
        for s, h in old.items():
            signal.signal(s, h)
        agent.close()
        store.close()
        controller.memory.disk.clean_up()
    report(controller, log, run_dir, code, display)
    if served is not None:
        served.close()
    return code


def serve_metrics(cfg: RunConfig, pol: Any) -> Any:
    """The metrics endpoint (``--metrics-port``), or None."""
    if cfg.metrics_port is None:
        return None
    from ..observe.metrics import Served

    return Served(cfg.metrics_port, cfg.metrics_addr, pol)

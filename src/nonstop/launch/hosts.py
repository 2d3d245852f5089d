"""``nonstop run`` on one host of many (``--rdzv-endpoint``): from the command's flags, checked,
to the host's agent - beside ``launcher.run``, the same command for a job on one host alone."""

from __future__ import annotations

import dataclasses
import faulthandler
import hashlib
import json
import os
import signal
from typing import Any

from . import one_host as launcher
from ..errors import UsageError
from ..agent.host import HostAgent
from ..agent.host_config import HostConfig
from ..store.access import etcd_access
from .config import failure_domain


def _nnodes(text: str | None) -> tuple[int, int]:
    raw = text or "1"
    lo, _, hi = raw.partition(":")
    try:
        n_min, n_max = int(lo), int(hi or lo)
    except ValueError:
        raise UsageError(f"--nnodes takes N or MIN:MAX, got {raw!r}") from None
    if n_min < 1 or n_max < n_min:
        raise UsageError(f"--nnodes needs 1 <= MIN <= MAX, got {raw!r}")
    return n_min, n_max


def with_min_hosts(pol: Any, n_min: int, n_max: int, per_node: int) -> Any:
    """The policy with ``--nnodes MIN:MAX``'s minimum: a scale-in never leaves fewer than MIN
    hosts' ranks (the policy's own ``scale_in.min_world`` where that is higher)."""
    if n_min >= n_max:
        return pol
    least = max(pol.levels.scale_in.min_world, n_min * per_node)
    return pol.with_overrides(**{"recover.levels.scale_in.min_world": least})


def run_host(cfg: Any) -> int:
    """``nonstop run`` on one host of many: check everything, then run the host's agent."""
    import socket

    from ..net.channel import load_secret
    from ..store.etcd import parse_endpoints
    from ..net.netif import interface_of, route_to

    if not cfg.rdzv_endpoint:
        raise UsageError("--nnodes > 1 needs --rdzv-endpoint etcd://HOST:PORT (the etcd the hosts "
                         "meet in)")
    if not cfg.rdzv_id:
        raise UsageError("--rdzv-endpoint needs --rdzv-id JOB (the same on every host)")
    try:
        endpoints = parse_endpoints(cfg.rdzv_endpoint)
    except ValueError as exc:
        raise UsageError(f"--rdzv-endpoint: {exc}") from None
    tls = etcd_access(cfg.rdzv_endpoint, cfg.etcd_cacert, cfg.etcd_cert, cfg.etcd_key,
                      cfg.etcd_user)
    n_min, n_max = _nnodes(cfg.nnodes)
    per_node = cfg.nproc_per_node or cfg.nproc
    run_cfg = dataclasses.replace(cfg, nproc=per_node * n_max, nodes=n_max)
    pol, faults, uses_nonstop = launcher.prepare(run_cfg)
    pol = with_min_hosts(pol, n_min, n_max, per_node)
    try:
        secret = load_secret(cfg.secret_file)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        addr = cfg.node_addr or route_to(*endpoints[0])
    except OSError as exc:
        raise UsageError(f"cannot find this host's address towards {endpoints[0][0]}: {exc}") \
            from None
    if interface_of(addr) is None and not addr.startswith("127."):
        raise UsageError(f"--node-addr {addr} is not an address of this host")
    host_id = cfg.node_id or f"{socket.gethostname()}-{addr}"
    domain = failure_domain(cfg.failure_domain)
    run_dir = launcher.make_run_dir(cfg.run_dir)
    digest = hashlib.sha256(json.dumps(pol.model_dump(), sort_keys=True).encode()).hexdigest()[:16]
    hcfg = HostConfig(script=cfg.script, script_args=list(cfg.script_args), nnodes_min=n_min,
                      nnodes_max=n_max, nproc_per_node=per_node, spare_nodes=cfg.spare_nodes,
                      spares=cfg.spares, endpoints=endpoints, job_id=cfg.rdzv_id, addr=addr,
                      host_id=host_id, run_dir=run_dir.resolve(), policy=pol.model_dump(),
                      policy_digest=digest, lease_ttl_s=pol.hosts.lease_ttl_s,
                      inject=list(cfg.inject), quiet=cfg.quiet, etcd_tls=tls,
                      etcd_user=cfg.etcd_user, managed=uses_nonstop,
                      metrics_port=cfg.metrics_port, metrics_addr=cfg.metrics_addr,
                      failure_domain=domain)
    # torch's store server warns of every client whose host name it cannot resolve: noise here
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    agent = HostAgent(hcfg, secret, faults)
    if cfg.metrics_port is not None:
        from ..observe.metrics import HostServed

        agent.metrics = HostServed(cfg.metrics_port, cfg.metrics_addr, host_id)

    def on_signal(signum: int, _frame: Any) -> None:
        if signum == signal.SIGTERM:
            agent.preempt()  # a preemption notice: the ranks move away first (else raises)
            return
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    # SIGUSR1: every thread's Python stack on this host's output (what it is doing, for an
    # operator or a harness whose host does not answer), as a rank's
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        return agent.run()
    except KeyboardInterrupt:
        return 130
    finally:
        for s, h in old.items():
            signal.signal(s, h)

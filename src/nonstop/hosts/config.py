"""One host's settings for a job across hosts (the command's flags, checked), and ``run_host``:
``nonstop run`` with ``--rdzv-endpoint``, from its flags to the host's agent."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import signal
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..protocol import hosts as keys

ETCD_PASSWORD = "NONSTOP_ETCD_PASSWORD"


def _script_digest(script: str, args: list[str]) -> str:
    """The script's bytes and its arguments (a spare host started with --steps 150 where the
    others have 300 would take ranks and train another job)."""
    h = hashlib.sha256()
    try:
        h.update(Path(script).read_bytes())
    except OSError:  # said elsewhere (a missing script is refused before this)
        h.update(script.encode())
    h.update(json.dumps(list(args)).encode())
    return h.hexdigest()[:32]


def _versions() -> str:
    from importlib import metadata

    from .. import __version__

    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = "none"
    return f"nonstop {__version__}, torch {torch}"


def _env_digest(env: Any) -> str:
    pairs = sorted((k, env[k]) for k in keys.NUMERIC_ENV if k in env)
    return hashlib.sha256(json.dumps(pairs).encode()).hexdigest()[:32]


@dataclasses.dataclass
class HostConfig:
    script: str
    script_args: list[str]
    nnodes_min: int
    nnodes_max: int
    nproc_per_node: int
    spare_nodes: int
    spares: int  # warm spares per host that holds ranks
    endpoints: list[tuple[str, int]]
    job_id: str
    addr: str
    host_id: str
    run_dir: Path
    policy: dict[str, Any]  # the effective policy (the file and the flags)
    policy_digest: str
    lease_ttl_s: int
    inject: list[str]
    quiet: bool = False
    metrics_port: int | None = None  # this host's metrics; the job's (its controller's) on the next port
    metrics_addr: str = "127.0.0.1"
    etcd_tls: dict[str, str | None] | None = None  # ca, cert, key (https)
    etcd_user: str | None = None  # its password: $NONSTOP_ETCD_PASSWORD
    managed: bool = True  # the script uses nonstop.wrap (else: restarted whole on any fault)

    def etcd(self) -> Any:
        """A client of the job's etcd, as the flags say (TLS, a user)."""
        from ..store.etcd import TLS, Etcd

        user = self.etcd_user
        return Etcd(self.endpoints, self.job_id, timeout_s=max(2.0, self.lease_ttl_s),
                    tls=TLS(**self.etcd_tls) if self.etcd_tls is not None else None, user=user,
                    password=os.environ.get(ETCD_PASSWORD) if user else None)

    def job_record(self, secret: bytes) -> keys.JobRecord:
        return keys.JobRecord(
            nnodes_min=self.nnodes_min, nnodes_max=self.nnodes_max,
            nproc_per_node=self.nproc_per_node, spare_nodes=self.spare_nodes,
            script=os.path.basename(self.script), policy_digest=self.policy_digest,
            secret_check=hmac.new(secret, b"nonstop job secret check", hashlib.sha256).hexdigest(),
            script_digest=_script_digest(self.script, self.script_args),
            versions=_versions(), env_digest=_env_digest(os.environ))

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["run_dir"] = str(self.run_dir)
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> "HostConfig":
        d = json.loads(text)
        d["run_dir"] = Path(d["run_dir"])
        d["endpoints"] = [tuple(e) for e in d["endpoints"]]
        return cls(**d)


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

    from .. import launcher
    from ..net.channel import load_secret
    from ..store.etcd import parse_endpoints, wants_tls
    from .agent import HostAgent
    from .netif import interface_of, route_to

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
    run_dir = launcher.make_run_dir(cfg.run_dir)
    digest = hashlib.sha256(json.dumps(pol.model_dump(), sort_keys=True).encode()).hexdigest()[:16]
    hcfg = HostConfig(script=cfg.script, script_args=list(cfg.script_args), nnodes_min=n_min,
                      nnodes_max=n_max, nproc_per_node=per_node, spare_nodes=cfg.spare_nodes,
                      spares=cfg.spares, endpoints=endpoints, job_id=cfg.rdzv_id, addr=addr,
                      host_id=host_id, run_dir=run_dir.resolve(), policy=pol.model_dump(),
                      policy_digest=digest, lease_ttl_s=pol.hosts.lease_ttl_s,
                      inject=list(cfg.inject), quiet=cfg.quiet, etcd_tls=tls,
                      etcd_user=cfg.etcd_user, managed=uses_nonstop,
                      metrics_port=cfg.metrics_port, metrics_addr=cfg.metrics_addr)
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
    try:
        return agent.run()
    except KeyboardInterrupt:
        return 130
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def etcd_access(endpoint: str, cacert: str | None, cert: str | None, key: str | None,
                user: str | None) -> dict[str, str | None] | None:
    """The TLS files of the ``--etcd-*`` flags, checked (a missing file, a certificate without
    its key, a user without a password: one line, exit 2); None without TLS."""
    from ..store.etcd import wants_tls

    if cacert or cert or key:
        for flag, path in (("--etcd-cacert", cacert), ("--etcd-cert", cert), ("--etcd-key", key)):
            if path and not os.path.isfile(path):
                raise UsageError(f"{flag} {path}: no such file")
        if bool(cert) != bool(key):
            raise UsageError("--etcd-cert and --etcd-key go together")
    if user and not os.environ.get(ETCD_PASSWORD):
        raise UsageError(f"--etcd-user needs its password in ${ETCD_PASSWORD}")
    if not (wants_tls(endpoint) or cacert or cert):
        return None
    return {"ca": _abs(cacert), "cert": _abs(cert), "key": _abs(key)}


def _abs(path: str | None) -> str | None:
    return os.path.abspath(path) if path else None

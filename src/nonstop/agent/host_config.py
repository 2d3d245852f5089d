"""One host's settings for a job across hosts, as its launcher made them from the flags: what its
agent, its standby controller and the job's record in etcd are made from."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Any

from ..policy import Policy
from ..protocol import hosts as keys
from ..store.access import ETCD_PASSWORD


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
    failure_domain: str = ""  # its rack, switch... (--failure-domain); "": the host itself

    @functools.cached_property
    def rules(self) -> Policy:
        """The policy, validated into its schema: what the host's agent reads (never the dict,
        whose defaults would have to be restated)."""
        return Policy.model_validate(self.policy)

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

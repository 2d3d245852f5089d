"""One host's settings for a job across hosts (what its agent, its standby controller and the job
record are made from), and how to reach the job's etcd (``etcd_access``)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import json
import os
import re
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..policy import Policy
from ..protocol import hosts as keys

ETCD_PASSWORD = "NONSTOP_ETCD_PASSWORD"
FAILURE_DOMAIN = "NONSTOP_FAILURE_DOMAIN"  # a scheduler may say the host's rack here
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/=-]{0,127}")


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


def failure_domain(flag: str | None, env: Any = os.environ) -> str:
    """This host's failure domain: ``--failure-domain``, else ``$NONSTOP_FAILURE_DOMAIN``, else
    "" (the host itself). A label is 1 to 128 letters, digits and ``. _ : / = -``, starting
    with a letter or digit (a rack's name, a switch's, ``zone/rack``); else one line, exit 2."""
    label, where = (flag, "--failure-domain") if flag is not None else (
        env.get(FAILURE_DOMAIN), f"${FAILURE_DOMAIN}")
    if label is None:
        return ""
    if not _LABEL.fullmatch(label):
        raise UsageError(f"{where} {label!r}: a failure domain is 1 to 128 letters, digits and "
                         "'._:/=-', starting with a letter or digit (e.g. rack-3)")
    return label

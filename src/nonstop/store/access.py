"""How to reach a job's etcd, from the ``--etcd-*`` flags: its TLS files checked, its user's
password from the environment."""

from __future__ import annotations

import os

from ..errors import UsageError

ETCD_PASSWORD = "NONSTOP_ETCD_PASSWORD"


def etcd_access(endpoint: str, cacert: str | None, cert: str | None, key: str | None,
                user: str | None) -> dict[str, str | None] | None:
    """The TLS files of the ``--etcd-*`` flags, checked (a missing file, a certificate without
    its key, a user without a password: one line, exit 2); None without TLS."""
    from .etcd import wants_tls

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

"""``nonstop status --rdzv-endpoint ... --rdzv-id JOB``: a job across hosts, as the controller in
office last put it in etcd (``keys.STATUS``), and whether the job has ended (``keys.DONE``)."""

from __future__ import annotations

import json
import os
from typing import Any, Callable

from ..errors import UsageError
from ..protocol import hosts as keys


def etcd_fetcher(endpoint: str, job: str, cacert: str | None = None, cert: str | None = None,
                 key: str | None = None, user: str | None = None) -> Callable[[], dict[str, Any]]:
    """The job's status record as the controller in office last wrote it, read from its etcd
    (with TLS and a user, as the ``--etcd-*`` flags say)."""
    from ..store.etcd import TLS, Etcd, StoreError, StoreUnavailable, parse_endpoints
    from ..store.access import ETCD_PASSWORD, etcd_access

    tls = etcd_access(endpoint, cacert, cert, key, user)
    try:
        endpoints = parse_endpoints(endpoint)
        etcd = Etcd(endpoints, job, timeout_s=2.0, tls=TLS(**tls) if tls is not None else None,
                    user=user, password=os.environ.get(ETCD_PASSWORD) if user else None)
    except ValueError as exc:
        raise UsageError(f"--rdzv-endpoint: {exc}") from None

    def fetch() -> dict[str, Any]:
        try:
            raw, _ = etcd.get(keys.STATUS)
            done, _ = etcd.get(keys.DONE)
        except StoreUnavailable as exc:
            raise UsageError(f"cannot reach etcd at {endpoint}: {exc}") from None
        except StoreError as exc:
            raise UsageError(f"etcd at {endpoint} refused us: {exc}") from None
        if raw is None:
            raise UsageError(f"no job {job!r} running in etcd at {endpoint} (no status: not "
                             "started, or no controller in office yet)")
        try:
            st = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise UsageError(f"the status of {job!r} in etcd is not readable: {exc}") from None
        if done is not None and not st.get("over"):
            st.update(over=True, exit_code=keys.JobDone.read(done).code)
        return st

    return fetch

"""A host entering a job across hosts: its settings agreed with the hosts already in it through
the job's record in etcd (or refused, in one line that says why), its place among the job's
``--nnodes + --spare-nodes`` waited for while a gone host's record lingers, and - before the job
has formed - which secret most of its hosts hold (a host with the odd one out is refused, and
the record's creator may be that host)."""

from __future__ import annotations

import sys
import time
from typing import Any

from ..errors import UsageError
from ..protocol import hosts as keys
from .host_config import HostConfig

WAITING_SAY_S = 5.0  # a host waiting for the job to form says so this often


class JobEntry:
    def __init__(self, etcd: Any, cfg: HostConfig, secret: bytes):
        self.etcd = etcd
        self.cfg = cfg
        self.secret = secret

    def join(self) -> None:
        """Agree on the job's settings with the hosts already in it, or refuse clearly."""
        mine = self.cfg.job_record(self.secret)
        done, _ = self.etcd.get(keys.DONE)
        if done is not None:
            raise UsageError(f"job '{self.cfg.job_id}' has already ended "
                             f"({keys.JobDone.read(done).diagnosis or 'finished'}): use a new "
                             "--rdzv-id")
        while not self.etcd.create(keys.JOB, mine.dumps()):
            raw, _ = self.etcd.get(keys.JOB)
            if raw is None:
                continue  # its creator just gave it up (see ``outvoted``): ours now
            try:
                theirs = keys.JobRecord.loads(raw)
            except ValueError:
                raise UsageError(f"job '{self.cfg.job_id}' was started by another version of "
                                 "nonstop: refused (every host must run the same one)") from None
            diff = mine.differs(theirs)
            if diff == ["secret_check"] and self._outvote(mine):
                continue  # the job's first host had the odd secret out and gave way
            if "secret_check" in diff:
                raise UsageError(f"job '{self.cfg.job_id}' runs with another secret "
                                 "(NONSTOP_JOB_SECRET / --secret-file) than this host's: refused")
            if diff:
                raise UsageError(f"job '{self.cfg.job_id}' runs with other settings than this "
                                 f"host: {mine.describe(diff)} differ (every host must start "
                                 "the same job the same way; or another job uses this "
                                 "--rdzv-id?)")
            break
        hosts = self.etcd.get_prefix(keys.HOSTS)
        if any(k == keys.host_key(self.cfg.host_id) for k, *_ in hosts):
            raise UsageError(f"host '{self.cfg.host_id}' is already in job '{self.cfg.job_id}' "
                             "(two agents with one --node-id, or another job with this --rdzv-id)")
        limit = self.cfg.nnodes_max + self.cfg.spare_nodes
        # A full job may hold the record of a host that is gone, until its lease runs out (a
        # machine that replaces a dead one, started at once, would be refused for it): room is
        # waited for that long before this host is refused.
        linger = time.monotonic() + min(2 * self.cfg.lease_ttl_s + 1.0,
                                        self.cfg.rules.hosts.join_timeout_s)
        while len(hosts) >= limit and time.monotonic() < linger:
            time.sleep(0.2)
            hosts = self.etcd.get_prefix(keys.HOSTS)
        if len(hosts) >= limit:
            raise UsageError(f"job '{self.cfg.job_id}' already has {len(hosts)} host(s), the most "
                             f"it takes (--nnodes {self.cfg.nnodes_max} + --spare-nodes "
                             f"{self.cfg.spare_nodes})")

    def _outvote(self, mine: keys.JobRecord) -> bool:
        """The job's record holds another secret than ours. Before the job has the hosts it
        needs, its first host may be the odd one out: this host says which secret it holds
        (a vote, under a lease) and waits. True once the record is gone (its creator, outvoted,
        gave way: see ``outvoted``); False when the job formed without us, or the wait
        ran out (then this host is the one refused)."""
        lease = self.etcd.lease(self.cfg.lease_ttl_s)
        lease.keepalive()
        vote = keys.vote_key(self.cfg.host_id)
        self.etcd.put(vote, mine.secret_check, lease=lease)
        deadline = time.monotonic() + self.cfg.rules.hosts.join_timeout_s
        say = time.monotonic() + WAITING_SAY_S
        try:
            while time.monotonic() < deadline:
                raw, _ = self.etcd.get(keys.JOB)
                if raw is None:
                    return True
                if keys.JobRecord.loads(raw).secret_check == mine.secret_check:
                    return True  # recreated by a host with our secret
                if len(self.etcd.get_prefix(keys.HOSTS)) >= self.cfg.nnodes_min:
                    return False  # the job has its hosts: ours is the odd secret
                if time.monotonic() >= say:
                    say = time.monotonic() + WAITING_SAY_S
                    print(f"nonstop: host {self.cfg.host_id}: job '{self.cfg.job_id}' was "
                          "started by a host with another secret; waiting to see which secret "
                          "most of its hosts hold", file=sys.stderr, flush=True)
                time.sleep(0.5)
            return False
        finally:
            try:
                lease.revoke()
            except Exception:  # noqa: BLE001 - it expires by itself
                lease.stop()

    def outvoted(self) -> tuple[int, str | None]:
        """While the job has not formed, hosts with another secret than the record's say so
        (``_outvote``). How many such hosts wait, and - outnumbered by the hosts of one other
        secret - why this host, the record's creator or a host that joined it, is the odd one
        out (the job's record goes with it if no other host holds it): None while it is not."""
        mine = self.cfg.job_record(self.secret).secret_check
        votes: dict[str, int] = {}
        for _, raw, _, _ in self.etcd.get_prefix(keys.VOTES):
            other = raw.decode(errors="replace")
            if other != mine:
                votes[other] = votes.get(other, 0) + 1
        ours = len(self.etcd.get_prefix(keys.HOSTS))  # every host registered holds our secret
        if not votes or max(votes.values()) <= ours:
            return sum(votes.values()), None
        if ours <= 1:  # no other host of ours holds the record: it goes with us
            self.etcd.delete(keys.JOB)
        return sum(votes.values()), (
            f"job '{self.cfg.job_id}': {max(votes.values())} other host(s) hold another secret "
            "(NONSTOP_JOB_SECRET / --secret-file) than this host's: this host is the one refused")

"""The job's time, counted (``observe.goodput``): when this controller took office, when the
job's first generation formed, and - across hosts, after a takeover - what the controllers
before this one counted. The summary, the metrics and the next controller's journal all count
the whole job from it, not one controller's term."""

from __future__ import annotations

import time
from typing import Any

from ..observe.progress import ProgressLog


class JobAccount:
    def __init__(self, progress: ProgressLog):
        self.progress = progress  # rank 0's steps: productive time, and what a fault undid
        self.t_start = time.time()  # this controller's start (its term in office)
        self.t_ready: float | None = None  # when the first generation formed on every rank
        # what the controllers before this one counted (Controller.journal's ``job``)
        self.before: dict[str, Any] | None = None

    def formed(self, t: float) -> None:
        """A generation formed on every rank at ``t``: the first one ends the start-up."""
        if self.t_ready is None:
            self.t_ready = t

    def adopt(self, job: dict[str, Any]) -> None:
        """The account a predecessor left in its journal: counted on from there."""
        self.before = job
        if isinstance(job.get("rank0"), dict):  # rank 0's time since is counted from it
            self.progress.rank0.insert(0, job["rank0"])

    @property
    def job_start(self) -> float:
        return self.before["t_start"] if self.before else self.t_start

    def earlier_incidents(self) -> list[dict[str, Any]]:
        return list((self.before or {}).get("incidents") or [])

    def count(self, now: float, records: list[dict[str, Any]], open_incident: Any = None,
              t_train_end: float | None = None, final_checkpoint: bool = False
              ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The goodput account of this controller's term (with the open incident), and its
        categories added to what the controllers before it counted: the whole job's."""
        from ..observe import goodput

        before = self.before
        t0 = before["t"] if before else self.t_start
        if open_incident is not None:
            records = records + [open_incident.to_record()]
        acct = goodput.account(t0, now, records, self.progress.rank0,
                               t0 if before else self.t_ready, t_train_end,
                               final_checkpoint=final_checkpoint)
        cats = goodput.merge(before["time_s"], acct["categories"]) if before \
            else acct["categories"]
        return acct, cats

    def so_far(self, now: float, own: list[dict[str, Any]], open_incident: Any = None
               ) -> dict[str, Any]:
        """What a controller taking over needs to count the whole job, not its own term: when
        the job started, its account so far, its closed incidents (``own``: this term's), rank
        0's newest progress sample (the next one, seen by the successor, is counted from it)."""
        _, cats = self.count(now, own, open_incident)
        rank0 = self.progress.rank0
        return {"t_start": self.job_start, "t": now, "time_s": cats,
                "incidents": self.earlier_incidents() + own,
                "rank0": rank0[-1] if rank0 else None}

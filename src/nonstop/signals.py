"""Health signals as the controller sees them: progress records turned into hang, straggler and
loss-rule faults, with the hung ranks named. The decisions live in ``detect`` (pure)."""

from __future__ import annotations

from typing import Any, Iterable

from .detect import HangTimer, RankView, StragglerWatch, describe_stall, hung_ranks
from .ladder import Fault
from .policy import Policy
from .workers import Worker


class Signals:
    def __init__(self, policy: Policy):
        self.policy = policy
        self.hang = HangTimer(policy.detect.hang)
        self.stragglers = StragglerWatch(policy.detect.straggler)
        self._last_straggler_check = 0.0
        self.last_limit = 0.0  # the timeout that the last hang exceeded
        self._logged_timeout = 0.0

    # -- observations ---------------------------------------------------------------------------
    def on_progress(self, w: Worker, rec: dict[str, Any], gen: int) -> None:
        """A rank's progress record (read from the store): heartbeat, where its main thread is,
        its slowest recent step, its compute time."""
        w.hb = rec.get("hb", w.hb)
        w.where, w.loc, w.same_s = rec.get("where", ""), rec.get("loc", ""), rec.get("same_s", 0.0)
        w.paused = rec.get("paused")
        if rec.get("gen") == gen:
            if rec.get("max_step_s"):
                self.hang.observe_step(rec["max_step_s"])
            if rec.get("compute_s") is not None:
                w.compute_s = rec["compute_s"]

    def on_first_step(self, w: Worker, t_first: float) -> None:
        """The first step of a generation on one rank: how long it took after the group formed."""
        if w.entered_ev is not None:
            self.hang.observe_first_step(t_first - w.entered_ev.get("t_restored", w.entered_ev["t"]))

    # -- checks ---------------------------------------------------------------------------------
    def check_hang(self, ranks: Iterable[Worker], gen: int, t_running: float,
                   now: float) -> tuple[Fault | None, dict[int, str]]:
        """A hang fault when some rank has completed no step for longer than its timeout, and the
        ranks that hold the job up (wid -> why): frozen, or stuck in Python code."""
        ranks = [w for w in ranks if w.done < gen]
        if not ranks or any(w.paused for w in ranks):
            return None, {}
        stalled, limit = [], 0.0
        for w in ranks:
            stepped = w.first_gen == gen
            timeout = self.hang.steady_timeout() if stepped else self.hang.first_step_timeout()
            since = w.t_step if stepped else t_running
            if now - since > timeout:
                stalled.append(w)
                limit = max(limit, timeout)
        if not stalled:
            return None, {}
        self.last_limit = limit
        frozen_s = min(self.policy.detect.hang.heartbeat_s, max(0.5, 0.5 * limit))
        views = [RankView(rank=w.rank, heartbeat_age_s=now - w.hb if w.hb else 0.0,
                          where=w.where, location=w.loc,
                          same_place_s=w.same_s + (now - w.hb if w.hb else 0.0))
                 for w in ranks if w.rank is not None]
        by_rank = {w.rank: w for w in ranks}
        hung = hung_ranks(views, frozen_s)
        culprits = {by_rank[r].wid: why for r, why in hung.items()}
        frozen = "; ".join(f"rank {r} {why}" for r, why in sorted(hung.items()))
        message = f"no step completed for {limit:.2f} s" + (f": {frozen}" if frozen else "")
        return Fault("hang", message=message, traceback=describe_stall(views)), culprits

    def timeout_changed(self) -> float | None:
        """The tuned steady-state timeout when it moved by more than 10% since last asked."""
        t = self.hang.steady_timeout()
        if abs(t - self._logged_timeout) > 0.1 * max(t, self._logged_timeout):
            self._logged_timeout = t
            return t
        return None

    def check_stragglers(self, ranks: Iterable[Worker], now: float) -> list[Fault]:
        """Stragglers among the ranks, once per observation period."""
        if now - self._last_straggler_check < 0.5:
            return []
        self._last_straggler_check = now
        compute = {w.rank: w.compute_s for w in ranks
                   if w.rank is not None and w.compute_s is not None}
        return [Fault("straggler", rank=rank,
                      message=f"compute time {ratio:.1f}x the median of the other ranks")
                for rank, ratio in self.stragglers.observe(compute)]


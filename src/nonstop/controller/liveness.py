"""Health signals as the controller sees them: progress records turned into hang, straggler and
loss-rule faults, with the hung ranks named. It keeps what it saw of each rank; the decisions
themselves live in ``decide.detect`` (pure)."""

from __future__ import annotations

from typing import Any, Iterable

from ..decide.detect import HangTimer, RankView, StragglerWatch, describe_stall, hung_ranks
from ..decide.ladder import Fault
from ..policy import Policy
from ..protocol.progress import Progress
from .workers import Worker


class Signals:
    def __init__(self, policy: Policy):
        self.policy = policy
        self.hang = HangTimer(policy.detect.hang)
        self.stragglers = StragglerWatch(policy.detect.straggler)
        self._last_straggler_check = 0.0
        self.last_limit = 0.0  # the timeout that the last hang exceeded
        self.last_progress = 0.0  # when the ranks of the last hang last made progress
        self._logged_timeout = 0.0
        self._life: dict[int, tuple[int, float]] = {}  # wid -> (gen, its last sign of life)
        self._stepless: set[int] = set()  # wids whose progress is marks, not ctx.steps steps
        # ranks past their step's timeout whose collectives still move data (a slow link or
        # step, not a hang), at the last check: (gen, rank -> seconds since its last step)
        self.slow: tuple[int, dict[int, float]] = (-1, {})

    # -- observations ---------------------------------------------------------------------------
    def on_progress(self, w: Worker, rec: Progress, gen: int) -> None:
        """A rank's progress record (read from the store): heartbeat, where its main thread is,
        its slowest recent step, its compute time."""
        w.take_liveness(rec.hb, rec.where, rec.loc, rec.same_s, rec.paused)
        if rec.life_gen == gen and rec.t_life is not None:
            self._life[w.wid] = (rec.life_gen, rec.t_life)
        if rec.gen == gen:
            if rec.max_step_s:
                self.hang.observe_step(rec.max_step_s)
            if rec.compute_s is not None:
                w.compute_s = rec.compute_s

    def on_first_step(self, w: Worker, t_first: float, stepless: bool = False) -> None:
        """The first step of a generation on one rank: how long it took after the group formed.
        ``stepless``: the rank's function runs without ctx.steps, its marks are its steps."""
        if stepless:
            self._stepless.add(w.wid)
        if w.entered_ev is not None:
            restored = w.entered_ev.t_restored
            self.hang.observe_first_step(t_first - (restored if restored is not None
                                                    else w.entered_ev.t))

    # -- checks ---------------------------------------------------------------------------------
    def check_hang(self, ranks: Iterable[Worker], gen: int, t_running: float, now: float,
                   silent: dict[int, float] | None = None) -> tuple[Fault | None, dict[int, str]]:
        """A hang fault when some rank has completed no step for longer than its timeout, and the
        ranks that hold the job up (wid -> why): frozen, or stuck in Python code.

        A rank that has not completed a step in this generation, or whose function runs without
        ctx.steps, is also judged by its signs of life: its group moving data (collectives
        completing), a reported loss, an optimizer step. Heartbeats are not among them. With only
        signs of life and no step, the first-step allowance applies from the last of them. A rank
        whose step runs past its timeout while its group still moves data is slow, not hung (a
        link that slowed: its peers' collectives still deliver bytes, where a hang's deliver
        none): judged from the generation's last sign of life (one rank's collective moving data
        is the whole group's: the others wait on it), and named in ``slow``.
        ``last_progress`` says when the stalled ranks last made progress: the hang began after.
        ``silent`` (node -> seconds its host's agent has said nothing): a host silent as long as
        its ranks is named as such (cut off, or frozen whole), not each of its ranks."""
        ranks = [w for w in ranks if w.done < gen]
        if not ranks or any(w.paused for w in ranks):
            return None, {}
        stalled, limit, last = [], 0.0, 0.0
        slow: dict[int, float] = {}
        steady, first = self.hang.steady_timeout(), self.hang.first_step_timeout()  # (once)
        settling, settle_steps = self.hang.settling_timeout(), self.policy.detect.hang.settle_steps
        # a rank still in its first step of the generation holds its peers' next step in its
        # collectives: until every rank has stepped, they wait as long as it may take
        waiting = any(w.first_gen != gen for w in ranks)
        # a collective moving data anywhere in the generation: the ranks past their first step
        # that wait on it wait on a slow link or step, not a hang (a reduction gathered to one
        # rank moves bytes on that rank's connections only; in a hang no rank's move at all)
        lives = [life[1] for w in ranks if (life := self._life.get(w.wid)) and life[0] == gen]
        group_life = max(lives) if lives else None
        for w in ranks:
            stepped = w.first_gen == gen
            timeout = steady if stepped else first
            if stepped and w.first_step is not None and \
                    (w.step or 0) - w.first_step + 1 < settle_steps:
                timeout = settling  # its next step is among the generation's first few
            if stepped and waiting:
                timeout = max(timeout, first)
            # (a step before the generation ran here is no later than its start: a controller
            # that took over a training job judges each rank from then until its progress comes)
            since = max(w.t_step, t_running) if stepped else t_running
            life = self._life.get(w.wid)
            if stepped and group_life is not None:
                life = (gen, group_life)
            if life is not None and life[0] == gen and life[1] > since:
                if stepped and w.wid not in self._stepless and now - since > timeout \
                        and w.rank is not None:
                    slow[w.rank] = now - since
                since = life[1]
            if now - since > timeout:
                stalled.append(w)
                limit = max(limit, timeout)
                last = max(last, since)
        held = {w.rank for w in stalled}
        self.slow = (gen, {r: t for r, t in slow.items() if r not in held})
        if not stalled:
            return None, {}
        self.last_limit = limit
        self.last_progress = last
        frozen_s = min(self.policy.detect.hang.heartbeat_s, max(0.5, 0.5 * limit))
        views = [RankView(rank=w.rank, heartbeat_age_s=now - w.hb if w.hb else 0.0,
                          where=w.where, location=w.loc,
                          same_place_s=w.same_s + (now - w.hb if w.hb else 0.0))
                 for w in ranks if w.rank is not None]
        by_rank = {w.rank: w for w in ranks}
        hung = hung_ranks(views, frozen_s)
        culprits = {by_rank[r].wid: why for r, why in hung.items()}
        frozen = "; ".join(silent_hosts_text(hung, {r: w.node for r, w in by_rank.items()},
                                             silent or {}, frozen_s))
        what = "no progress" if any(w.wid in self._stepless for w in stalled) else "no step completed"
        message = f"{what} for {limit:.2f} s" + (f": {frozen}" if frozen else "")
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


def silent_hosts_text(hung: dict[int, str], node_of: dict[int, Any], silent: dict[int, float],
                      frozen_s: float) -> list[str]:
    """What holds a hung job up, in words: a node whose host's agent has said nothing for as
    long as its ranks (the host cut off, or frozen whole) once, then each other frozen rank."""
    out, named = [], set()
    for node, quiet in sorted(silent.items()):
        ranks = sorted(r for r in hung if node_of.get(r) == node)
        if quiet > frozen_s and ranks:
            out.append(f"node {node}'s host does not answer (its agent silent for {quiet:.1f} s: "
                       f"cut off, or frozen) - rank(s) {', '.join(map(str, ranks))}")
            named.update(ranks)
    return out + [f"rank {r} {why}" for r, why in sorted(hung.items()) if r not in named]

"""A rank's snapshots: when one is due, taking it into the node's memory, and when it also goes to
disk. The interval is agreed by every rank (so all shards are snapshotted at the same steps) and,
by default, tuned from measured costs so that snapshots stay a small share of step time.

The costs that tune it are steady ones: the median of recent snapshots into memory already in
place (a first snapshot into new memory pays its allocation once), and of recent steps other than
a generation's first. The copy to the buddy node counts too: the node's keeper makes it with the
node's CPUs and memory bandwidth, which the ranks share.
"""

from __future__ import annotations

import collections
import math
import statistics
import time
from pathlib import Path
from typing import Any

from . import memory as mem
from . import packing, shm
from .digest import Digests
from .wire import KeeperError

# Steps into a generation when the interval is tuned: every step is snapshotted until then, so
# that by then the memory is in place on both nodes and the costs measured are steady ones.
TUNE_AFTER = (10,)
RETUNE_EVERY = 20  # and at every step index that is a multiple of this
MAX_EVERY = 10_000
_RECENT = 9  # measurements the medians are taken over


class Snapshots:
    """The snapshot schedule of one rank process, and its measurements."""

    def __init__(self, cfg: dict[str, Any], memory: mem.NodeMemory | None,
                 sdc: dict[str, Any] | None = None):
        snap, ckpt = cfg["snapshot"], cfg["checkpoint"]
        self.memory = memory
        # the replicas' parameters compared before each snapshot (detect.sdc): every snapshot
        # written is one whose digests agreed, the step a corruption is rolled back to
        self.digests = Digests(sdc) if sdc is not None and sdc.get("enabled", True) else None
        self.enabled = bool(snap["enabled"])
        self.auto = snap["every_steps"] == "auto"
        self.every = 1 if self.auto else int(snap["every_steps"])
        self.max_share = float(snap["max_overhead_pct"]) / 100
        self.root = Path(ckpt["dir"]) if ckpt.get("dir") else None
        self.persist_every = int(ckpt["every_steps"])
        self.at_end = bool(ckpt["at_end"])
        self.last_persist = 0  # newest step sent to disk (agreed: every rank moves it alike)
        self._costs: collections.deque[float] = collections.deque(maxlen=_RECENT)
        self._steps: collections.deque[float] = collections.deque(maxlen=_RECENT)
        self._first_cost: float | None = None  # a snapshot into new memory, until a steady one
        self.repl_s: float | None = None  # the last copy to the buddy node
        self.entry_step = 0
        self.anchor = 0  # the step of the last snapshot due (every rank's alike): the next is K on
        self.last_step: int | None = None  # newest step this process snapshotted
        self.taken = 0
        self.spent_s = 0.0
        self.error: str | None = None  # the last failure (the node's memory is gone...)
        self.requested: int | None = None  # the newest step this process asked to write to disk
        self.final_persist: int | None = None  # ...when the training loop ended

    @property
    def cost_s(self) -> float | None:
        """One snapshot into memory in place (median of the recent ones)."""
        return statistics.median(self._costs) if self._costs else self._first_cost

    @property
    def step_s(self) -> float | None:
        """One step without its snapshot (median of the recent ones)."""
        return statistics.median(self._steps) if self._steps else None

    # -- agreement ----------------------------------------------------------------------------
    @property
    def sdc_s(self) -> float | None:
        """One comparison of the replicas' parameters (median of the recent ones)."""
        return self.digests.cost_s if self.digests is not None else None

    def schedule(self) -> dict[str, Any]:
        return {"every": self.every, "cost_s": self.cost_s, "step_s": self.step_s,
                "repl_s": self.repl_s, "sdc_s": self.sdc_s, "last_persist": self.last_persist}

    def adopt(self, schedules: list[dict[str, Any]], step: int, from_disk: bool) -> None:
        """Take the schedule every rank agrees on, entering a generation at ``step``."""
        known = [s for s in schedules if s]
        if known:
            self.every = max(int(s["every"]) for s in known)
            self.last_persist = max(int(s.get("last_persist") or 0) for s in known)
            if self.auto:
                self.every = self._interval(*(max((s.get(k) or 0.0) for s in known)
                                              for k in ("cost_s", "step_s", "repl_s", "sdc_s")))
        if from_disk:
            self.last_persist = max(self.last_persist, step)
        self.entry_step = self.anchor = step
        if self.digests is not None:
            self.digests.entered()

    def _interval(self, cost: float, step_s: float, repl_s: float, sdc_s: float = 0.0) -> int:
        if not cost or not step_s:
            return self.every
        # One share of the steps for all a snapshot costs them: its copy, the copy to the buddy
        # (which shares the node, and must end before the next snapshot's slot) and the
        # comparison of the replicas' digests before it. (They had a share each: together,
        # up to 1.5% of a 25 ms step, and the overhead bench measured 2.5% for all of nonstop.)
        k = math.ceil((cost + (repl_s or 0.0) + (sdc_s or 0.0)) / (self.max_share * step_s))
        if self.digests is not None and sdc_s:  # ...and the comparison within its own share
            k = max(k, math.ceil(sdc_s / (self.digests.max_share * step_s)))
        return max(1, min(MAX_EVERY, k))

    def _tune(self) -> bool:
        """Every rank at the same step: agree on the interval from the largest costs seen."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([self.cost_s or 0.0, self.step_s or 0.0, self.repl_s or 0.0,
                          self.sdc_s or 0.0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        every = self._interval(*t.tolist())
        changed, self.every = every != self.every, every
        return changed

    # -- on the step path ---------------------------------------------------------------------
    def after_step(self, state: Any, rank: int, world: int, gen: int, step_s: float, first: bool,
                   injector: Any) -> tuple[float, bool]:
        """Called once a step completed (``state.step`` steps done). Returns (seconds spent on
        snapshots, whether the interval changed)."""
        if not self.enabled:
            return 0.0, False
        if not first:
            self._steps.append(step_s)
        step = state.step
        spent = 0.0
        if step - self.anchor >= self.every or self._disk_due(step):
            self.anchor = step
            if self.digests is not None:  # raises SilentCorruption: this step is not snapshotted
                spent += self.digests.check(state.modules(), step, world)
            spent += self.take(state, rank, world, gen, injector)
        changed = False  # tuned after the snapshot: its cost is then known
        if self.auto and (step - self.entry_step in TUNE_AFTER or step % RETUNE_EVERY == 0):
            changed = self._tune()
        return spent, changed

    def take(self, state: Any, rank: int, world: int, gen: int, injector: Any = None,
             final: bool = False) -> float:
        """Copy the state into the node's memory; returns the seconds it took (0: skipped)."""
        step = state.step
        sharded = bool(getattr(state, "sharded", False))
        # decided before anything can fail: every rank moves ``last_persist`` alike, whether its
        # own copy succeeds or not - or it has no memory at all (a rank whose memory is gone must
        # not think a checkpoint is still due at the next step: it would snapshot, and compare
        # digests, alone while the others step on)
        persist = self._persist(step, rank, world, sharded, gen, final)
        if self.memory is None:
            return 0.0
        t_start = time.perf_counter()
        lay = packing.layout(state.state_dict(), {"step": step, "rank": rank, "world": world,
                                                  "sharded": sharded, "gen": gen})
        size = shm.data_offset(len(lay.meta)) + lay.nbytes
        holder = mem.own(rank)
        midway = None
        if injector is not None and injector.has_point("snapshot"):
            midway = lambda: injector.check("snapshot", rank, step - 1)  # noqa: E731
        try:
            slot_i, seq, slot, reply = self.memory.alloc(holder, size)
            self.repl_s = reply.get("repl_s") or self.repl_s
            shm.write_tensors(slot, lay.meta, lay.tensors, lay.specs, lay.nbytes, step, rank, gen,
                              seq, midway)
            self.memory.commit(holder, slot_i, persist)
            if persist is not None:
                self.requested = step
            if injector is not None and injector.claim_kind("corrupt", rank, step - 1):
                self.memory.corrupt(holder)
        except (OSError, ConnectionError, KeeperError) as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            self.memory.reset()
            return 0.0
        t_end = time.perf_counter()
        # all of it is on the step's path: the layout, asking the keeper for a slot (0.8 ms of a
        # 2 ms snapshot of a small model here), the copy (while a replication holds the slot,
        # its time is counted twice: once here and once as repl_s; too few snapshots rather
        # than too many)
        cost = t_end - t_start
        if reply["fresh"]:
            self._first_cost = cost if self._first_cost is None else min(self._first_cost, cost)
        else:
            self._costs.append(cost)
        spent = t_end - t_start
        self.last_step = step
        self.taken += 1
        self.spent_s += spent
        self.error = None
        return spent

    def _disk_due(self, step: int) -> bool:
        """A disk checkpoint is due: the step gets a snapshot even between snapshot steps (every
        rank agrees: ``last_persist`` moves alike everywhere)."""
        return self.root is not None and step - self.last_persist >= self.persist_every

    def _persist(self, step: int, rank: int, world: int, sharded: bool, gen: int,
                 final: bool) -> dict[str, Any] | None:
        """Whether this snapshot also goes to disk (every rank moves ``last_persist`` alike; only
        the ranks whose part is needed ask for it: all of them for sharded state, else rank 0)."""
        if self.root is None or step <= self.last_persist:
            return None
        if not final and not self._disk_due(step):
            return None
        self.last_persist = step
        if not (sharded or rank == 0):
            return None
        return {"root": str(self.root), "rank": rank, "world": world, "sharded": sharded,
                "gen": gen, "reason": "final" if final else "periodic"}

    def finish(self, state: Any, rank: int, world: int, gen: int) -> None:
        """The training loop ended: the last step goes to disk (if checkpoints are on); the
        launcher waits for the newest checkpoint asked for before it ends the node's memory.
        The final weights are compared across replicas first (every rank ends at the same step)."""
        if self.enabled and self.digests is not None and self.digests.last_step != state.step:
            self.digests.check(state.modules(), state.step, world)
        if not self.enabled or self.root is None:
            return
        self._finish(state, rank, world, gen)
        self.final_persist = self.requested

    def _finish(self, state: Any, rank: int, world: int, gen: int) -> None:
        if not self.at_end or state.step <= self.last_persist:
            return
        if self.last_step == state.step and self.memory is not None:
            job = self._persist(state.step, rank, world, bool(getattr(state, "sharded", False)),
                                gen, final=True)
            if job is not None:
                try:
                    self.memory.client.tell(dict(job, op="persist", holder=mem.own(rank),
                                                 step=state.step))
                    self.requested = state.step
                except OSError as exc:
                    self.error = f"{type(exc).__name__}: {exc}"
            return
        self.take(state, rank, world, gen, final=True)

    def stats(self) -> dict[str, Any]:
        return {"every": self.every, "cost_s": self.cost_s, "step_s": self.step_s,
                "repl_s": self.repl_s, "last": self.last_step, "taken": self.taken,
                "spent_s": round(self.spent_s, 6), "error": self.error}

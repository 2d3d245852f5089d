"""A rank's snapshots: when one is due, taking it into the node's memory, and when it also goes to
disk. The interval is agreed by every rank (so all shards are snapshotted at the same steps) and,
by default, tuned from measured costs so that snapshots stay a small share of step time.

The costs that tune it are steady ones: the median of recent snapshots into memory already in
place (a first snapshot into new memory pays its allocation once), and of recent steps other than
a generation's first. The copy to the buddy node counts too: the node's keeper makes it with the
node's CPUs and memory bandwidth, which the ranks share.

State on a GPU is staged (``staging.py``): the step pays for starting the copy to a pinned mirror
only, and a thread of this object writes the mirror into the node's memory once the copy is done.
One snapshot is in flight at a time; it counts (``last_step``, ``taken``, the offers of a restore)
only once committed, and whatever ends or re-forms a generation settles it first, within a
deadline.
"""

from __future__ import annotations

import atexit
import collections
import math
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from ..protocol.keeper_messages import DiskPart
from ..protocol.rank_policy import RankSdc, RankState
from . import memory as mem
from . import packing, shm
from .digest import Digests
from .replay import ReplayCheck
from .wire import KeeperError

# Steps into a generation when the interval is tuned: every step is snapshotted until then, so
# that by then the memory is in place on both nodes and the costs measured are steady ones.
TUNE_AFTER = (10,)
RETUNE_EVERY = 20  # and at every step index that is a multiple of this
MAX_EVERY = 10_000
_RECENT = 9  # measurements the medians are taken over
# Deadlines of a staged snapshot (state on a GPU). A snapshot due while the one before is still
# being written waits for it this long (then is skipped, and counted): the interval is tuned so
# that this does not happen, and a stuck write must not stall training.
IN_FLIGHT_S = 10.0
SETTLE_S = 30.0  # a generation's end or a new one's start waits this long for the one in flight
COPY_S = 60.0  # the copy from the GPU into the pinned mirror
AT_EXIT_S = 10.0


class _Job:
    """A staged snapshot between its copy's start and its commit (or its failure)."""

    def __init__(self, step: int, meta: bytes, nbytes: int, persist: DiskPart | None,
                 rank: int, gen: int, midway: Any, injector: Any):
        self.step, self.meta, self.nbytes, self.persist = step, meta, nbytes, persist
        self.rank, self.gen, self.midway, self.injector = rank, gen, midway, injector
        self.may_commit: Any = None  # the generation's guard, as it was when the copy started
        self.certified = False  # its step's replicas agreed (the check before it)
        self.lock = threading.Lock()  # the commit against a drop: one or the other
        self.dropped = False
        self.departure = False  # a departure snapshot (``Snapshots.depart``), not a staged one
        self.thread: threading.Thread | None = None


class Snapshots:
    """The snapshot schedule of one rank process, and its measurements."""

    def __init__(self, policy: RankState, memory: mem.NodeMemory | None,
                 sdc: RankSdc | None = None):
        snap, ckpt = policy.snapshot, policy.checkpoint
        self.memory = memory
        # the replicas' parameters compared before each snapshot (detect.sdc): every snapshot
        # written is one whose digests agreed, the step a corruption is rolled back to
        self.digests = Digests(sdc) if sdc is not None and sdc.enabled else None
        # a step run twice in place every ``replay_every`` steps (detect.sdc: state/replay.py)
        self.replay = ReplayCheck(sdc.replay_every, self.digests) \
            if self.digests is not None and sdc.replay_every > 0 else None
        self.enabled = snap.enabled
        self.auto = snap.every_steps == "auto"
        self.every = 1 if snap.every_steps == "auto" else snap.every_steps
        self.max_share = snap.max_overhead_pct / 100
        self.root = Path(ckpt.dir) if ckpt.dir else None
        self.persist_every = ckpt.every_steps
        self.at_end = ckpt.at_end
        self.last_persist = 0  # newest step sent to disk (agreed: every rank moves it alike)
        self._costs: collections.deque[float] = collections.deque(maxlen=_RECENT)
        self._steps: collections.deque[float] = collections.deque(maxlen=_RECENT)
        self._first_cost: float | None = None  # a snapshot into new memory, until a steady one
        self.repl_s: float | None = None  # the last copy to the buddy node
        self.entry_step = 0
        self.anchor = 0  # the step of the last snapshot due (every rank's alike): the next is K on
        self.recheck: int | None = None  # a step to compare (and snapshot) whatever the interval
        # steps between the replicas' comparisons (``detect.sdc``) when no snapshot is due, from
        # the agreed costs (every rank alike: a comparison is a collective); None: compared at
        # snapshots only, until the costs are agreed
        self.check_every: int | None = None
        self.last_step: int | None = None  # newest step this process snapshotted
        self.taken = 0
        self.spent_s = 0.0
        self.error: str | None = None  # the last failure (the node's memory is gone...)
        self.requested: int | None = None  # the newest step this process asked to write to disk
        self.final_persist: int | None = None  # ...when the training loop ended
        # None: state on one CUDA device is staged; True: any state is (on the host, with the
        # same thread, commit and deadlines: how it is tested without a GPU); False: none is
        self.staged: bool | None = None
        self.skipped = 0  # staged snapshots not taken: the one before was still being written
        self.in_flight_s, self.settle_s = IN_FLIGHT_S, SETTLE_S
        self._staging: Any = None
        self._job: _Job | None = None
        self._writes: collections.deque[float] = collections.deque(maxlen=_RECENT)
        self._wmem: Any = None  # the writing thread's own connection to the keeper
        self._lock = threading.Lock()  # what the writing thread moves at commit
        self._atexit = False
        # set by the runtime for each generation: whether a snapshot of a step may still be
        # committed (an aborted NCCL collective returns no error and leaves whatever had arrived:
        # a copy that may have read such a step is dropped; see GenerationGroup.may_commit)
        self.may_commit: Any = None
        self.slot_bytes: int | None = None  # one snapshot of this rank in its node's memory

    @property
    def cost_s(self) -> float | None:
        """One snapshot into memory in place (median of the recent ones)."""
        return statistics.median(self._costs) if self._costs else self._first_cost

    @property
    def steady_cost_s(self) -> float | None:
        """``cost_s`` without a first snapshot into new memory: what the interval is agreed
        from. A process that has taken only that one (a spare promoted, a memory restarted)
        offered it before - page faults and all, tens of times a steady snapshot's - and the
        largest offer wins: the interval went to hundreds of steps after every replacement."""
        return statistics.median(self._costs) if self._costs else None

    @property
    def write_s(self) -> float | None:
        """A staged snapshot from its copy's start to its commit, in the background (median of
        the recent ones into memory in place)."""
        return statistics.median(self._writes) if self._writes else None

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
        """What this rank brings to a new generation's agreement. Asked as the generation forms,
        before its restore: the snapshot in flight is settled first, so that the offers name
        committed snapshots only and nothing copies the state while the restore loads it."""
        self.settle()
        return {"every": self.every, "cost_s": self.steady_cost_s, "step_s": self.step_s,
                "repl_s": self.repl_s, "sdc_s": self.sdc_s, "write_s": self.write_s,
                "last_persist": self.last_persist}

    def adopt(self, schedules: list[dict[str, Any]], step: int, from_disk: bool) -> None:
        """Take the schedule every rank agrees on, entering a generation at ``step``.

        The next snapshot is counted from the newest one every rank can still be restored from
        (``held``, which the restore adds to every rank's schedule alike), not from the entry:
        counted from each entry, a job whose faults come more often than its interval never
        took another snapshot, and a corruption found later rolled back to the last one there
        was - or, its memory lost meanwhile, to step 0. None held (a memory lost, a new one
        empty) and past step 0: the first step of the generation takes one."""
        known = [s for s in schedules if s]
        self.check_every = None  # (from what every rank brought, or at snapshots only)
        if known:
            self.every = max(int(s["every"]) for s in known)
            self.last_persist = max(int(s.get("last_persist") or 0) for s in known)
            costs = [max((s.get(k) or 0.0) for s in known)
                     for k in ("cost_s", "step_s", "repl_s", "sdc_s", "write_s")]
            if self.auto:
                self.every = self._interval(*costs)
            self._space_checks(costs[1], costs[3])
        if from_disk:
            self.last_persist = max(self.last_persist, step)
        self.entry_step = self.anchor = step
        said = [s for s in known if "held" in s]
        self.recheck = None
        if said:  # (the same on every rank: from the offers every rank gathered)
            held = said[0]["held"]
            self.anchor = min(int(held), step) if held is not None else \
                step - self.every if step > 0 else step
            # a step where the replicas were found to differ, rolled back from: compared (and
            # snapshotted) again when reached, whatever the interval
            recheck = said[0].get("recheck")
            self.recheck = int(recheck) if recheck is not None and recheck > step else None
        if self.digests is not None:
            self.digests.entered(step)

    def _interval(self, cost: float, step_s: float, repl_s: float, sdc_s: float = 0.0,
                  write_s: float = 0.0) -> int:
        if not cost or not step_s:
            return self.every
        # One share of the steps for all a snapshot costs them: its copy, the copy to the buddy
        # (which shares the node, and must end before the next snapshot's slot) and the
        # comparison of the replicas' digests before it. (They had a share each: together,
        # up to 1.5% of a 25 ms step, and the overhead bench measured 2.5% for all of nonstop.)
        k = math.ceil((cost + (repl_s or 0.0) + (sdc_s or 0.0)) / (self.max_share * step_s))
        if self.digests is not None and sdc_s:  # ...and the comparison within its own share
            k = max(k, math.ceil(sdc_s / (self.digests.max_share * step_s)))
        if write_s:  # staged: the next one is due once this one is written, so the step never
            k = max(k, math.ceil(write_s / step_s))  # waits for it
        return max(1, min(MAX_EVERY, k))

    def _agree(self, rank: int, world: int) -> tuple[bool, bool]:
        """Every rank at the same step: agree on the interval from the largest costs seen (with
        ``auto``; the comparisons' too), and on whether some rank's memory no longer holds its newest snapshot (its
        keeper died and came back empty, a write failed): then every rank takes one now, rather
        than up to an interval later - until then a corruption found would have nothing certified
        to roll back to. Returns (whether an interval changed, whether to snapshot now)."""
        import torch
        import torch.distributed as dist

        lost = self._memory_lost(rank)
        t = torch.tensor([self.steady_cost_s or 0.0, self.step_s or 0.0, self.repl_s or 0.0,
                          self.sdc_s or 0.0, self.write_s or 0.0, float(lost)],
                         dtype=torch.float64)
        if world > 1:
            if not (dist.is_available() and dist.is_initialized()):
                return False, False  # no group to agree over (a unit test): nothing unagreed
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        *costs, lost_any = t.tolist()
        changed = False
        if self.auto:
            every = self._interval(*costs)
            changed, self.every = every != self.every, every
        check_every = self.check_every
        self._space_checks(costs[1], costs[3])
        return changed or self.check_every != check_every, lost_any > 0

    def _space_checks(self, step_s: float, sdc_s: float) -> None:
        """The comparisons' own interval, from the agreed step time and comparison cost (the
        same on every rank: a comparison is a collective), as often as keeps them under
        ``detect.sdc.max_overhead_pct``; every snapshot is compared besides. Compared at the
        snapshots alone, a corruption was found only at the next one, an interval that follows
        the copy's cost and differs from layout to layout: a flip at step 30 was found at step
        53 in a pipeline, at 32 in HSDP, of the same model - while a check costs a digest and
        an all-gather of three words."""
        if self.digests is not None and step_s > 0:
            self.check_every = self.digests.interval(step_s, sdc_s)

    def _memory_lost(self, rank: int) -> bool:
        """Whether this rank's node memory lost (or never got) its newest snapshot."""
        if self.memory is None or not self.enabled:
            return False
        if self.error is not None:  # the last one failed: the memory is gone, or refused it
            return True
        if self.last_step is None:  # none taken by this process yet: nothing to miss
            return False
        try:
            return self.last_step not in self.memory.steps(mem.own(rank))
        except (OSError, ConnectionError, KeeperError):
            self.memory.reset()
            return True

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
        due = step - self.anchor >= self.every or self._disk_due(step) or step == self.recheck
        if due:
            spent += self._checked_take(state, rank, world, gen, injector)
        elif self.digests is not None and self.check_every is not None \
                and step % self.check_every == 0:  # (the same steps on every rank)
            spent += self.digests.check(state.modules(), step, world, state.twins, state.meshed,
                                        recheck=self.recheck)
        changed = False  # agreed after the snapshot: its cost is then known
        if step - self.entry_step in TUNE_AFTER or step % RETUNE_EVERY == 0:
            changed, lost = self._agree(rank, world)
            if lost and not due:  # (the same on every rank: the agreement's result)
                spent += self._checked_take(state, rank, world, gen, injector)
        return spent, changed

    def _checked_take(self, state: Any, rank: int, world: int, gen: int, injector: Any) -> float:
        """The replicas compared, then the snapshot: every snapshot written is one whose
        digests agreed. Raises SilentCorruption (nothing written) when they differ."""
        step = state.step
        self.anchor = step
        spent = 0.0
        if self.digests is not None:
            spent += self.digests.check(state.modules(), step, world, state.twins,
                                        state.meshed, recheck=self.recheck)
            self.digests.trace.keep_from(step)  # (agreed: no rollback goes back before it)
        return spent + self.take(state, rank, world, gen, injector)

    def take(self, state: Any, rank: int, world: int, gen: int, injector: Any = None,
             final: bool = False) -> float:
        """Copy the state into the node's memory; returns the seconds it took (0: skipped)."""
        step = state.step
        sharded = bool(getattr(state, "sharded", False))
        # decided before anything can fail: every rank moves ``last_persist`` alike, whether its
        # own copy succeeds or not - or it has no memory at all (a rank whose memory is gone must
        # not think a checkpoint is still due at the next step: it would snapshot, and compare
        # digests, alone while the others step on)
        persist = self._persist(step, rank, world, sharded, final)
        if self.memory is None:
            return 0.0
        t_start = time.perf_counter()
        lay = packing.layout(state.state_dict(), {"step": step, "rank": rank, "world": world,
                                                  "sharded": sharded, "gen": gen})
        size = shm.data_offset(len(lay.meta)) + lay.nbytes
        self.slot_bytes = size  # what one snapshot of this rank takes in its node's memory
        holder = mem.own(rank)
        midway = None
        if injector is not None and injector.has_point("snapshot"):
            midway = lambda: injector.check("snapshot", rank, step - 1)  # noqa: E731
        staged, device = self._stages(lay.tensors)
        if staged:
            job = _Job(step, lay.meta, lay.nbytes, persist, rank, gen, midway, injector)
            job.may_commit = self.may_commit
            # certified as the copy starts (the next check may have moved on by its commit)
            job.certified = self.digests is not None and self.digests.last_step is not None \
                and step <= self.digests.last_step
            return self._take_staged(state, lay, job, device, t_start)
        try:
            slot_i, seq, slot, reply = self.memory.alloc(holder, size)
            self.repl_s = reply.repl_s or self.repl_s
            shm.write_tensors(slot, lay.meta, lay.tensors, lay.specs, lay.nbytes, step, rank, gen,
                              seq, midway)
            if not self._may_commit(step):
                slot.invalidate()
                self.memory.reset()
                return 0.0
            self.memory.commit(holder, slot_i, persist)
            self.memory.kept = None  # the memory holds a newer certified one
            if self.digests is not None:
                self.digests.committed(step)
            if persist is not None:
                self.requested = step
            if injector is not None and injector.claim_kind("corrupt", rank, step - 1):
                self.memory.corrupt(holder)
        except (OSError, ConnectionError, KeeperError) as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            self.memory.reset()
            self._keep(state, step, rank, world, sharded, gen)
            return 0.0
        t_end = time.perf_counter()
        # all of it is on the step's path: the layout, asking the keeper for a slot (0.8 ms of a
        # 2 ms snapshot of a small model here), the copy (while a replication holds the slot,
        # its time is counted twice: once here and once as repl_s; too few snapshots rather
        # than too many)
        cost = t_end - t_start
        if reply.fresh:
            self._first_cost = cost if self._first_cost is None else min(self._first_cost, cost)
        else:
            self._costs.append(cost)
        spent = t_end - t_start
        self.last_step = step
        self.taken += 1
        self.spent_s += spent
        self.error = None
        return spent

    def _keep(self, state: Any, step: int, rank: int, world: int, sharded: bool,
              gen: int) -> None:
        """The node's memory could not take a snapshot whose replicas agreed (it died, and a new
        one is not up yet): keep a copy in this process instead, until the memory takes a newer
        one. Its certified snapshots died with it: a corruption found before a new memory holds
        one would otherwise go back to step 0 (a job restart), though every rank that survives
        it holds the certified step here. One copy of the state, only while the memory is out;
        state on a GPU (staged) is not kept."""
        if self.digests is None or self.digests.last_step != step or self.memory is None:
            return
        try:
            self.memory.keep(state, step, rank, world, sharded, gen)
        except Exception as exc:  # noqa: BLE001 - no copy: said, and training goes on
            self.error = f"{self.error}; no copy kept in the process: {type(exc).__name__}: {exc}"
            return
        self.digests.certified, self.digests.certified_t = step, time.time()

    # -- a departure snapshot ---------------------------------------------------------------------
    def depart(self, state: Any, rank: int, world: int, gen: int) -> int | None:
        """This rank left a failed generation cleanly, at a step its node's memory does not
        hold: a thread writes that step there (a departure snapshot, ``SlotInfo.departure``)
        while the rank waits for its next generation, whose restore waits for it (``settle``,
        in ``schedule``) before the offers are made and before anything loads into the state.
        Where the rank's live state was the only copy of its part left (a pipeline stage's or
        an HSDP shard's twin, after the other twin was lost), a second fault during the
        recovery now finds that step in node memory, not only the last periodic snapshot.
        State on a GPU is not kept so: its copy would wait behind the aborted generation's
        work. Returns the step, or None when no snapshot is taken."""
        step = state.step
        if not self.enabled or self.memory is None or step == self.last_step:
            return None
        lay = packing.layout(state.state_dict(), {"step": step, "rank": rank, "world": world,
                                                  "sharded": bool(getattr(state, "sharded",
                                                                          False)),
                                                  "gen": gen})
        if self._stages(lay.tensors)[0]:
            return None
        self.settle()  # one in flight at a time
        job = _Job(step, lay.meta, lay.nbytes, None, rank, gen, None, None)
        job.departure = True
        self._job = job
        job.thread = threading.Thread(target=self._depart, args=(job, lay), daemon=True,
                                      name="nonstop-departure")
        job.thread.start()
        return step

    def _depart(self, job: _Job, lay: Any) -> None:
        """The departure snapshot's thread: the live tensors into the node's memory, committed
        unless given up meanwhile (``settle``: the restore then goes on without it)."""
        memory = slot = None
        try:
            memory = self._writer_memory()
            holder = mem.own(job.rank)
            if job.step in memory.steps(holder):  # restored from it, and left before a step
                return
            slot_i, seq, slot, _ = memory.alloc(holder, shm.data_offset(len(lay.meta))
                                                + lay.nbytes)
            shm.write_tensors(slot, lay.meta, lay.tensors, lay.specs, lay.nbytes, job.step,
                              job.rank, job.gen, seq, departure=True)
            with job.lock:
                if job.dropped:
                    slot.invalidate()
                    memory.reset()
                    return
                memory.commit(holder, slot_i)
                with self._lock:
                    self.last_step = job.step
        except Exception as exc:  # noqa: BLE001 - the recovery goes on without it: said
            with self._lock:
                self.error = f"departure snapshot of step {job.step}: {type(exc).__name__}: {exc}"
            if memory is not None:
                memory.reset()

    def departing(self) -> bool:
        """Whether a departure snapshot is still being written."""
        job = self._job
        return job is not None and job.departure and job.thread is not None and \
            job.thread.is_alive()

    def _disk_due(self, step: int) -> bool:
        """A disk checkpoint is due: the step gets a snapshot even between snapshot steps (every
        rank agrees: ``last_persist`` moves alike everywhere)."""
        return self.root is not None and step - self.last_persist >= self.persist_every

    def _persist(self, step: int, rank: int, world: int, sharded: bool,
                 final: bool) -> DiskPart | None:
        """Whether this snapshot also goes to disk (every rank moves ``last_persist`` alike; only
        the ranks whose part is needed ask for it: all of them for sharded state, else rank 0)."""
        if self.root is None or step <= self.last_persist:
            return None
        if not final and not self._disk_due(step):
            return None
        self.last_persist = step
        if not (sharded or rank == 0):
            return None
        return DiskPart(holder=mem.own(rank), step=step, root=str(self.root), rank=rank,
                        world=world, sharded=sharded, reason="final" if final else "periodic")

    def finish(self, state: Any, rank: int, world: int, gen: int) -> None:
        """The training loop ended: the last step goes to disk (if checkpoints are on); the
        launcher waits for the newest checkpoint asked for before it ends the node's memory.
        The final weights are compared across replicas first (every rank ends at the same step)."""
        if self.enabled and self.digests is not None and self.digests.last_step != state.step:
            self.digests.check(state.modules(), state.step, world, state.twins, state.meshed)
        self.settle()  # the snapshot in flight is committed (or given up) before the end is seen
        if not self.enabled or self.root is None:
            return
        self._finish(state, rank, world, gen)
        self.settle()  # ...and the last one, which the launcher waits for on disk
        self.final_persist = self.requested

    def _finish(self, state: Any, rank: int, world: int, gen: int) -> None:
        if not self.at_end or state.step <= self.last_persist:
            return
        if self.last_step == state.step and self.memory is not None:
            job = self._persist(state.step, rank, world, bool(getattr(state, "sharded", False)),
                                final=True)
            if job is not None:
                try:
                    self.memory.persist(job)
                    self.requested = state.step
                except (OSError, KeeperError) as exc:
                    self.error = f"{type(exc).__name__}: {exc}"
            return
        self.take(state, rank, world, gen, final=True)

    def stats(self) -> dict[str, Any]:
        return {"every": self.every, "cost_s": self.cost_s, "step_s": self.step_s,
                "repl_s": self.repl_s, "last": self.last_step, "taken": self.taken,
                "spent_s": round(self.spent_s, 6), "error": self.error,
                "staged": self._staging is not None, "write_s": self.write_s,
                "skipped": self.skipped, "slot_bytes": self.slot_bytes,
                "check_every": self.check_every}

    # -- staged snapshots (state on a GPU) ------------------------------------------------------
    def _stages(self, tensors: list[Any]) -> tuple[bool, Any]:
        """(whether this snapshot is staged, on which CUDA device: None for the host)."""
        if self.staged is False:
            return False, None
        import torch

        if self.staged is None and not torch.cuda.is_initialized():
            return False, None  # no tensor of this process is on a GPU: nothing to look at
        from .staging import device_of

        device = device_of(tensors)
        return (device is not None or self.staged is True), device

    def _take_staged(self, state: Any, lay: Any, job: _Job, device: Any, t_start: float) -> float:
        """The step's part of a staged snapshot: start the copy to the mirror, hand the rest to a
        thread. Returns the seconds the step spent."""
        from . import staging

        t_wait = time.perf_counter()
        if not self._wait_in_flight():  # the mirror is still being written from
            self.skipped += 1
            with self._lock:
                self.error = (f"snapshot of step {job.step} skipped: the one before was still "
                              f"being written after {self.in_flight_s:g} s")
            return 0.0
        waited = time.perf_counter() - t_wait
        if self._staging is None or self._staging.device != device:
            self._staging = staging.Staging(device)
        fresh = self._staging.stage(lay.tensors, lay.specs, lay.nbytes, staging.late_ptrs(state))
        if hasattr(state, "_fence"):  # its optimizers' next steps wait (on the GPU) for the copy
            state._fence = self._staging.fence
        self._job = job
        job.thread = threading.Thread(target=self._write, args=(job,), daemon=True,
                                      name="nonstop-snapshot")
        job.thread.start()
        if not self._atexit:
            self._atexit = True
            atexit.register(self._at_exit)
        spent = time.perf_counter() - t_start
        # the wait for the one before is not this snapshot's cost: the interval leaves the
        # write its time (``write_s``), and counted here it would space snapshots out for good
        cost = spent - waited
        if fresh:  # a mirror allocated (pinned) now: once per layout, not a steady cost
            self._first_cost = cost if self._first_cost is None else min(self._first_cost, cost)
        else:
            self._costs.append(cost)
        self.spent_s += spent
        return spent

    def _may_commit(self, step: int, guard: Any = None) -> bool:
        guard = self.may_commit if guard is None else guard
        if guard is None or guard(step):
            return True
        with self._lock:
            self.error = (f"snapshot of step {step} dropped: its generation's NCCL "
                          "communicators were aborted before its copy was known to be whole")
        return False

    def _wait_in_flight(self) -> bool:
        """Whether the snapshot before, if any, is done (waiting for it up to ``in_flight_s``)."""
        job = self._job
        if job is None or job.thread is None:
            return True
        job.thread.join(self.in_flight_s)
        return not job.thread.is_alive()

    def _writer_memory(self) -> Any:
        if self._wmem is None:  # a connection of its own: the keeper answers one call at a time
            twin = getattr(self.memory, "twin", None)
            self._wmem = twin() if twin is not None else self.memory
        return self._wmem

    def _write(self, job: _Job) -> None:
        """The writing thread: once the copy has landed in the mirror, the mirror goes into the
        node's memory with the same hashed write as any snapshot, and is committed."""
        import torch

        t0 = time.perf_counter()
        memory = slot = None
        try:
            self._staging.wait(time.monotonic() + COPY_S)
            if job.dropped:
                return
            memory = self._writer_memory()
            holder = mem.own(job.rank)
            slot_i, seq, slot, reply = memory.alloc(holder, shm.data_offset(len(job.meta))
                                                    + job.nbytes)
            mirror = self._staging.mirror
            shm.write_tensors(slot, job.meta, [mirror], [(torch.uint8, (job.nbytes,), 0,
                                                          job.nbytes)],
                              job.nbytes, job.step, job.rank, job.gen, seq, job.midway)
            with job.lock:
                # given up meanwhile, or read past an NCCL abort: never published (the slot
                # is let go)
                if job.dropped or not self._may_commit(job.step, job.may_commit):
                    slot.invalidate()
                    memory.reset()
                    return
                memory.commit(holder, slot_i, job.persist)
                if job.certified and self.digests is not None:
                    self.digests.certified, self.digests.certified_t = job.step, time.time()
                with self._lock:
                    self.repl_s = reply.repl_s or self.repl_s
                    if job.persist is not None:
                        self.requested = job.step
                    self.last_step = job.step
                    self.taken += 1
                    self.error = None
                    if not reply.fresh:
                        self._writes.append(time.perf_counter() - t0)
            if job.injector is not None and job.injector.claim_kind("corrupt", job.rank,
                                                                    job.step - 1):
                memory.corrupt(holder)
        except Exception as exc:  # noqa: BLE001 - the step must not see it: said in ``error``
            with self._lock:
                self.error = f"{type(exc).__name__}: {exc}"
            if memory is not None:
                memory.reset()
        finally:
            job.midway = job.injector = None

    def _at_exit(self) -> None:
        """The process leaving (the interpreter's own end: ``os._exit`` skips it, and a slot
        left half-written is invalid anyway): the snapshot in flight gets a last chance."""
        try:
            self.settle(AT_EXIT_S)
        except Exception:  # noqa: BLE001 - CUDA may be going away too: nothing left to save
            pass

    def settle(self, timeout_s: float | None = None) -> bool:
        """The snapshot in flight committed (or failed) within ``timeout_s``; else given up: it
        is never committed, and whatever changes the state in place from now on waits (on the
        GPU) for its copy. Returns whether nothing is left in flight."""
        job = self._job
        if job is None or job.thread is None:
            return True
        job.thread.join(self.settle_s if timeout_s is None else timeout_s)
        if self._staging is not None and self._staging.device is not None:
            self._staging.fence()  # a copy that never reported done is still read past
        if not job.thread.is_alive():
            self._job = None
            return True
        if job.lock.acquire(timeout=1.0):
            job.dropped = True
            job.lock.release()
        with self._lock:
            self.error = f"snapshot of step {job.step} given up: not written within its deadline"
        return False

"""What the training function sees of its generation: rank, world, the step loop, reporting.

The step loop is where a step counts, where faults are injected, and where per-step numbers
(duration, compute time, loss) are handed to the background publisher.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Iterator

from ..protocol import events
from .registered import State


def step_seed(seed: int, step: int, rank: int) -> int:
    """A seed that is a pure function of (seed, step, rank): data order survives any restart."""
    return (seed * 1_000_003 + step * 7_919 + rank * 104_729) % (2**63 - 1)


class Context:
    """What the training function sees of its generation. Passed as its first argument."""

    def __init__(self, rank: int, world_size: int, generation: int, entries: int,
                 replacements: int, state: State, runtime: Any = None, resumed: Any = None,
                 loss_rules: Any = None, full_world_size: int | None = None,
                 scale_lr: bool = False, mesh: Any = None):
        self.rank = rank
        self.world_size = world_size
        # the world the job was started with: larger than world_size after a scale-in
        self.full_world_size = full_world_size or world_size
        # scale_in.batch: scale_lr - multiply the learning rate by this (1.0 at full size)
        self.lr_scale = world_size / self.full_world_size if scale_lr else 1.0
        self.local_rank = rank
        self.generation = generation
        self.entries = entries  # times this process has entered the training function (1 = first)
        self.replacements = replacements  # times this rank's process has been replaced
        self.resumed = resumed  # how this generation's state was agreed (step, source, receivers)
        self._state = state
        self._rt = runtime
        self._first_done = False
        self._loss: Any = None
        self._loss_rules = loss_rules
        self._mesh = mesh

    @property
    def mesh(self) -> Any:
        """The job's ``DeviceMesh`` (declared with ``nonstop.Mesh``): the same object in every
        generation, its groups those of the current one."""
        if self._mesh is None:
            raise RuntimeError("ctx.mesh: this job declared no mesh; give nonstop.wrap a "
                               "nonstop.Mesh(dims, shape, build) instead of a State")
        return self._mesh

    @property
    def state(self) -> State:
        """The registered state (what a ``nonstop.Mesh``'s build function returned):
        ``ctx.state["optimizer"]``."""
        return self._state

    def share(self, global_batch: int) -> range:
        """This rank's part of a global batch of ``global_batch`` samples, as positions in it:
        contiguous, sizes differing by at most one, whatever the world size (the same split
        ``GlobalBatchSampler`` makes). With ``reduction="sum"`` losses, multiply by
        ``ctx.world_size / global_batch`` before backward: the averaged gradient is then the
        global batch's mean, as in the run at full size."""
        if not isinstance(global_batch, int) or global_batch < 1:
            raise ValueError(f"ctx.share: global_batch must be a positive int, not {global_batch!r}")
        q, r = divmod(global_batch, self.world_size)
        begin = self.rank * q + min(self.rank, r)
        return range(begin, begin + q + (self.rank < r))

    def micro_batches(self, global_batch: int, micro_batch: int) -> list[range]:
        """This rank's share of a global batch cut into micro-batches of at most ``micro_batch``
        samples, for gradient accumulation: a rank that runs one at full size may run two after
        a scale-in, and the optimizer still steps once per step on the same global batch. Run
        all but the last under ``ddp.no_sync()``, so that every rank reduces once per step."""
        if not isinstance(micro_batch, int) or micro_batch < 1:
            raise ValueError(f"ctx.micro_batches: micro_batch must be a positive int, not "
                             f"{micro_batch!r}")
        share = self.share(global_batch)
        return [range(i, min(i + micro_batch, share.stop))
                for i in range(share.start, share.stop, micro_batch)]

    @property
    def step(self) -> int:
        """Steps completed (the index of the step running now, inside ``steps()``)."""
        return self._state.step

    def steps(self, total: int, *, reseed: int | None = None) -> Iterator[int]:
        """Yield step indices from the agreed step up to ``total``; a step counts when the body
        returns. With ``reseed``, torch's RNG is seeded from (reseed, step, rank) before each step
        so dropout and the like replay exactly after a restart."""
        state = self._state
        rt = self._rt
        if rt is not None:  # while the loop runs, its steps are the progress (not marks)
            rt.monitor.steps_seen = rt.monitor.in_steps = True
        try:
            while state.step < total:
                step = state.step
                if rt is not None:
                    if not self._first_done:
                        rt.injector.in_recovery("first_step", self.rank, self.generation)
                    # (a step to replay keeps the state it starts from before anything else)
                    rt.stall += rt.before_step(state, self.rank, self.world_size, step)
                    rt.injector.check("start", self.rank, step)
                    if rt.injector.claim_kind("bitflip", self.rank, step):
                        # one that strikes again here (``times``: its step replayed) flips
                        # another bit - a device that keeps failing, not the same flip replayed
                        again = rt.flips[step] = rt.flips.get(step, 0) + 1
                        where = state.flip_bit(seed=step if again == 1 else
                                               step * 1_000_003 + again)
                        rt.emit(events.BitFlipped(gen=self.generation, rank=self.rank, step=step,
                                                  where=where))
                if reseed is not None:
                    import torch

                    torch.manual_seed(step_seed(reseed, step, self.rank))
                state.begin_step()
                if rt is not None:
                    rt.stall += rt.step_begins(state, step)
                t0 = time.monotonic()
                yield step
                if rt is not None and rt.monitor.void_step():
                    raise RuntimeError(f"generation {self.generation} was aborted during step "
                                       f"{step}: its NCCL collectives did not complete")
                state.step = step + 1
                state.dirty = False
                if rt is not None:
                    step_s = time.monotonic() - t0
                    again, replayed = rt.replayed_step(state, self.rank, self.world_size,
                                                       self.generation, step, step_s)
                    if again:  # a replay check: the step runs again, from the same state
                        rt.stall += replayed  # (check time, not a step: goodput)
                        continue
                    # a snapshot is not a step that counts (goodput), but it is time between steps
                    # that the hang timeout must allow for
                    spent = replayed + rt.after_step(state, self.rank, self.world_size,
                                                     self.generation, step_s,
                                                     not self._first_done)
                    rt.busy += step_s
                    rt.stall += spent
                    rt.monitor.record_step(self.generation, self.rank, step + 1, rt.busy,
                                           step_s + spent, state.compute_s, self._loss,
                                           first=not self._first_done, stall=rt.stall)
                    if not self._first_done:
                        self._first_done = True
                        rt.release_closed_groups()  # the previous generation's group, now idle
                    elif rt.closed_groups:
                        rt.retry_closed_groups()  # one that was still busy then
                    if rt.monitor.regroup_due() and state.step < total:  # the world grows: leave here, between steps
                        from .registered import Regroup

                        rt.before_regroup(state, self.rank, self.world_size, self.generation)
                        raise Regroup(self.generation)
            if rt is not None and state.step >= total:
                rt.steps_done(state, self.rank, self.world_size, self.generation)
        finally:
            if rt is not None:
                rt.monitor.in_steps = False

    def report(self, loss: Any = None) -> None:
        """Note this step's loss (a tensor or number); published in the background. With loss
        rules in the policy, each reported loss is also checked against them here."""
        self._loss = loss.detach() if hasattr(loss, "detach") else loss
        if self._rt is not None:
            self._rt.last_loss = self._loss
            self._rt.monitor.mark("report", self._state.step)
        if self._loss_rules is not None and self._loss is not None and self._rt is not None:
            value = float(self._loss)
            for rule in self._loss_rules.observe(value):
                self._rt.emit(events.LossRuleFired(
                    rule=rule.name, action=rule.action, rank=self.rank, step=self._state.step,
                    loss=value if math.isfinite(value) else str(value), gen=self.generation))

    def progress(self) -> None:
        """Say that the training function made progress, for a loop that does not iterate
        ``steps()``: call it once per iteration. nonstop then sees a hang as no progress for
        longer than the tuned timeout (a loss passed to ``report()`` or an optimizer step of a
        registered optimizer counts the same). Inside ``steps()`` it does nothing: the steps are
        the progress."""
        if self._rt is not None:
            self._rt.monitor.mark("progress", self._state.step)

    @contextlib.contextmanager
    def pause(self, label: str = "paused") -> Iterator[None]:
        """Tell nonstop that this rank is busy with something long that is not a step (an
        evaluation, a checkpoint save), so that it is not taken for a hang.

        Example::

            with ctx.pause("evaluation"):
                evaluate(model)
        """
        if self._rt is None:
            yield
            return
        self._rt.monitor.pause(label)
        try:
            yield
        finally:
            self._rt.monitor.pause(None)

"""The policy's replay check (``detect.sdc.replay_every``): a step run twice, in place, from the
same state and inputs, for a layout whose parameters no twin holds (plain FSDP, FSDP x TP).

Every N steps the state a step starts from is copied into this process, the step runs, its
points are digested (the parameters it started from, its forward outputs, the parameters after
it: decide/sdc.py, ``POINTS``), the state is set back from the copy and the step runs again.
nonstop's training is reproducible bit for bit, so on every rank the two passes must agree at
every point. Where some rank's differ, every rank's first differing point is gathered and the
step runs a third time: the pass the other two outvote on every rank is the one a fault struck
(the state goes on from the third pass, which is the majority's), and the rank whose passes
part first is the faulty one (``attribute``). No two passes alike on every rank: the fault
recurs, or the step does not replay bit for bit - the rank named, or none, is raised as a
``SilentCorruption`` for the controller. Nothing here is a fault of the job: no generation
ends, no step is counted lost, and the time goes to the check (``Digests.replay_s``).

What it sees: a device that computes a step wrongly, at the sampled steps, and a flip that lands
in a replayed step; a flip at another step stays in the state (the replay starts from it), as
no twin holds the state to compare. It costs, every N steps, a copy of the rank's state in host
memory, four digests of its parameters and one step run again: about ``1/N`` of the step time.
"""

from __future__ import annotations

import time
from typing import Any

from ..decide import sdc as verdicts
from . import packing
from .digest import (END, OUTPUT, START, Digests, Replayed, SilentCorruption, alike, digest,
                     evidence_of, gather_words, word)


class ReplayCheck:
    """One rank process's replay checks, every ``every`` steps (a collective at the steps
    replayed: every rank replays the same ones)."""

    def __init__(self, every: int, digests: Digests):
        self.every = every
        self.digests = digests  # its counters, its trace of the step's outputs, what to report
        self._copy: tuple[int, bytes, Any] | None = None  # (step, meta, data): where it starts
        self._start: int | None = None  # this pass's digest of the parameters it started from
        self._passes: list[dict[int, Any]] = []  # each pass's points
        self._evidence: Any = None  # every rank's, after the second pass

    def reset(self) -> None:
        """A generation (or a retried step) begins: no replay under way."""
        self._copy, self._start, self._passes, self._evidence = None, None, [], None

    def due(self, step: int) -> bool:
        """Whether step ``step`` (the index of the step about to run) is replayed."""
        return self.every > 0 and (step + 1) % self.every == 0

    def before(self, state: Any, step: int, rank: int, world: int) -> float:
        """The top of step ``step``, before anything of it (a fault injected at its start
        included): the state it starts from is copied when it is to be replayed. Returns the
        seconds it took."""
        if self._copy is not None and self._copy[0] == step:
            return 0.0  # a pass run again
        self.reset()
        if not self.due(step):
            return 0.0
        t0 = time.perf_counter()
        meta, data = packing.pack(state.state_dict(), {
            "step": step, "rank": rank, "world": world, "gen": -1,
            "sharded": bool(getattr(state, "sharded", False))})
        self._copy = (step, meta, data)
        took = time.perf_counter() - t0
        self.digests.replay_s += took
        return took

    def started(self, state: Any, step: int) -> float:
        """Step ``step`` is about to run (its forward outputs counted afresh): a replayed one's
        parameters digested as it starts. Returns the seconds it took."""
        self.digests.trace.begin(step)
        if self._copy is None or self._copy[0] != step:
            return 0.0
        t0 = time.perf_counter()
        self._start = digest(state.modules())
        took = time.perf_counter() - t0
        self.digests.replay_s += took
        return took

    def after(self, state: Any, step: int, step_s: float, world: int) -> tuple[bool, float]:
        """Step ``step`` completed in ``step_s`` (``state.step`` is ``step + 1``). Returns
        (whether it runs again - the state set back to its start -, the seconds this check
        added, that pass included when it runs again). Raises ``SilentCorruption`` when no two
        of three passes agree on every rank."""
        copy = self._copy
        if copy is None or copy[0] != step:
            self.digests.stepped_s += step_s
            return False, 0.0
        t0 = time.perf_counter()
        self._passes.append({START: self._start,
                             OUTPUT: self.digests.trace.value(step, OUTPUT),
                             END: digest(state.modules())})
        again = len(self._passes) == 1 or (len(self._passes) == 2 and self._second(step, world))
        if len(self._passes) == 3:
            self._third(step, world)
        if again:
            self._rewind(state, step)
        else:
            self.digests.stepped_s += step_s
            self.digests.replays += 1
            self.reset()
        took = time.perf_counter() - t0 + (step_s if again else 0.0)
        self.digests.replay_s += took
        return again, took

    def _second(self, step: int, world: int) -> bool:
        """After the second pass: every rank's first point where its passes differ, gathered.
        Whether the step runs a third time (some rank's differ)."""
        first, second = self._passes
        at = next((p for p in (START, OUTPUT, END) if not alike(first[p], second[p])), None)
        words = [3, -1, -1, 0, 0] if at is None else \
            [3, step, at, word(first[at], second[at]), word(second[at], first[at])]
        self._evidence = evidence_of(gather_words(words, world))
        return any(e.step is not None for e in self._evidence)

    def _third(self, step: int, world: int) -> None:
        """After the third pass: the pass the other two outvote on every rank (the state goes on
        from this one, the majority's), for rank 0 to report; none, raised."""
        first, second, third = self._passes
        every = gather_words([int(third[END] == first[END]), int(third[END] == second[END]),
                              third[END] or 0], world)
        digests = [w[2] for w in every]
        struck = 1 if all(w[1] for w in every) else 2 if all(w[0] for w in every) else None
        evidence = self._evidence
        if struck is None:
            parted = {e.rank: (e.step, verdicts.POINTS.index(e.point)) if e.step is not None
                      else None for e in evidence}
            found = verdicts.attribute(step + 1, range(world), parted, agreed=False)
            suspects = [found.rank] if found is not None and found.rank is not None else \
                list(range(world))
            self.digests.replays += 1
            self.reset()
            corrupt = SilentCorruption(step + 1, suspects, digests, replay=evidence, scheduled=True)
            if not self.digests.report_only:
                raise corrupt
            self.digests.mismatch = corrupt
            return
        self.digests.replayed = Replayed(step + 1, evidence, digests, scheduled=True,
                                         struck=struck)

    def _rewind(self, state: Any, step: int) -> None:
        """The state set back to the start of step ``step``, from the copy. What a module copies
        into its parameters is read from the copy; what an optimizer (or a dict, a tensor) would
        keep is cloned first: its next step updates it in place, and the copy serves again."""
        import torch

        from .restore import load_into

        _, meta, data = self._copy  # type: ignore[misc]
        sd = packing.unpack(meta, data)
        sd = {name: value if state.copies_on_load(name) else
              packing.map_tree(value, lambda x: isinstance(x, torch.Tensor), lambda t: t.clone())
              for name, value in sd.items()}
        state.fence()  # (a snapshot's copy from a GPU under way reads the state first)
        load_into(state, sd)
        state.step, state.dirty = step, False

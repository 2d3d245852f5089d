"""Silent corruption or divergence: what the replicas' digests say when they differ. Pure logic,
no clock, no process.

Data-parallel replicas that start a step from the same state compute the same thing, bit for bit
(``nonstop.reproducible``). When their parameters differ, either a bit flipped somewhere - in one
replica, at one moment (a corruption: its rank is repaired, the steps since the newest snapshot
whose replicas agreed are redone) - or the replicas do not compute the same thing at all: the
ranks (or hosts) run different code, arguments or data (a divergence). The second is no fault of
any rank or node: replacing ranks or isolating nodes cannot cure it, and a rollback only replays
it. So it is told apart, and the job stops with a diagnosis.

Only ranks that hold the same state are compared: twins (``twins``: the part each rank holds; in
a sharded or pipelined job, the ranks at the same shard or stage of each replica group). Ranks
at different parts always hold different parameters: judged as one population, a job whose
twins all agree would look like camps of replicas agreeing among themselves. So each twin group
is judged on its own:

- **one replica differs, once**: a corruption. In each twin group that disagrees, a strict
  majority agrees and every other rank is alone in its digest; with two replicas (or no
  majority, each rank alone) which one is right cannot be told, and each is suspect. The ranks
  of the groups that agree are not.
- **replicas split into groups**: in one twin group, two ranks or more agree with each other on
  parameters other than the largest group's (a 2-2 split; two replicas of five with a learning
  rate of their own): a bit flip does not make two replicas agree on the same wrong value. A
  divergence.
- **they disagree again after a rollback**: the job rolled back for a corruption, and before any
  comparison agreed again the replicas differ again - with the very digests found before at that
  step (the redone steps came out the same way: after a rollback the step where the mismatch was
  found is always compared again), or with other ranks at odds than the one rank that differed.
  A divergence. The same single rank differing again, with other values each time, is that
  rank's device failing (a corruption again: the rules that isolate failing hardware see it).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

CORRUPTION = "corruption"
DIVERGENCE = "divergence"


@dataclasses.dataclass(frozen=True)
class Verdict:
    kind: str  # CORRUPTION or DIVERGENCE
    step: int
    suspects: tuple[int, ...]  # a corruption's ranks to repair (none for a divergence)
    # the ranks that agree with each other, largest first: in the twin groups that disagree
    groups: tuple[tuple[int, ...], ...]
    diagnosis: str  # one line (a divergence's: what the job ends with)


def groups(digests: dict[int, int]) -> tuple[tuple[int, ...], ...]:
    """The ranks by digest: each group the ranks that agree, largest first (then lowest rank)."""
    by: dict[int, list[int]] = {}
    for rank in sorted(digests):
        by.setdefault(digests[rank], []).append(rank)
    return tuple(sorted((tuple(g) for g in by.values()), key=lambda g: (-len(g), g[0])))


def twin_groups(digests: dict[int, int], twins: Mapping[int, int] | None = None
                ) -> list[dict[int, int]]:
    """The digests of each twin group (the ranks holding the same part, ``twins[rank]``; every
    rank one part without ``twins``), in the order of their lowest rank."""
    if twins is None:
        return [dict(digests)] if digests else []
    by: dict[int, dict[int, int]] = {}
    for rank in sorted(digests):
        by.setdefault(twins.get(rank, -1 - rank), {})[rank] = digests[rank]
    return list(by.values())


def suspects_of(digests: dict[int, int], twins: Mapping[int, int] | None = None
                ) -> tuple[int, ...]:
    """In each twin group, the ranks outside its strict majority; with none (two replicas, a
    tie), every rank of that group. The ranks of a group that agrees are never suspect."""
    out: list[int] = []
    for part in twin_groups(digests, twins):
        split = groups(part)
        if len(split) < 2:
            continue
        if len(split[0]) * 2 > len(part):
            out += [r for g in split[1:] for r in g]
        else:
            out += list(part)
    return tuple(sorted(out))


def _ranks(rs: Iterable[int]) -> str:
    rs = list(rs)
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


class Judge:
    """Every mismatch of one job, in the order found, and the comparisons that agreed after
    them. ``judge`` says what each mismatch is; ``agreed`` says a comparison agreed."""

    def __init__(self) -> None:
        self.found: dict[int, list[dict[int, int]]] = {}  # step -> the digests of each mismatch
        self.pending: tuple[int, tuple[int, ...]] | None = None  # (step, suspects) of the last
        # corruption, until a comparison of the steps redone after it agrees
        self.redo_gen: int | None = None  # ...the first generation that redoes them

    def agreed(self, gen: int) -> None:
        """Comparisons agreed in generation ``gen`` (a rank's report): one after a corruption's
        rollback closes it - the corruption happened once."""
        if self.pending is not None and self.redo_gen is not None and gen >= self.redo_gen:
            self.pending = self.redo_gen = None

    def judge(self, step: int, digests: dict[int, int], node_of: dict[int, int] | None = None,
              redo_gen: int | None = None, twins: Mapping[int, int] | None = None) -> Verdict:
        """A mismatch found at ``step`` among the ranks compared (rank -> digest; two distinct
        within some twin group). ``node_of`` (rank -> node or host) names where each group
        runs; ``redo_gen``: the first generation that redoes the steps after the rollback;
        ``twins`` (rank -> the part it holds): each twin group is judged on its own (None:
        every rank holds the same state)."""
        odd = [p for p in twin_groups(digests, twins) if len(set(p.values())) > 1]
        if not odd:
            raise ValueError(f"the digests at step {step} agree: nothing to judge")
        compared = {r: d for p in odd for r, d in p.items()}  # the groups at odds, only
        split = tuple(sorted((g for p in odd for g in groups(p)), key=lambda g: (-len(g), g[0])))
        suspects = suspects_of(compared, twins)
        where = _where(split, node_of)
        said = "; ".join(f"{_ranks(g)}{where.get(g, '')} agree with each other" if len(g) > 1
                         else f"{_ranks(g)}{where.get(g, '')} alone" for g in split)
        if twins is not None and len(set(twins.values())) > 1:
            said += (" - among the ranks holding the same part"
                     if len(odd) == 1 else " - each among the ranks holding the same part")
        replayed = any(_same(before, compared) for before in self.found.get(step, ()))
        systematic = any(sum(1 for g in groups(p) if len(g) >= 2) >= 2 for p in odd)
        pending = self.pending
        again = pending is not None and not (len(suspects) == 1 and suspects == pending[1])
        self.found.setdefault(step, []).append(compared)
        if systematic or replayed or again:
            if replayed:
                why = (f"redone after a rollback, step {step} came out with the very parameters "
                       f"it had before ({said})")
            elif systematic:
                why = (f"they split into groups at step {step} ({said}): a bit flip does not make "
                       "two replicas agree on the same wrong parameters")
            else:
                why = (f"they differ again at step {step} ({said}) after the job rolled back for "
                       f"the mismatch at step {pending[0]}, with no comparison agreeing between")
            return Verdict(DIVERGENCE, step, (), split, (
                f"the data-parallel replicas diverge - not a silent corruption: {why}. The ranks "
                "do not compute the same thing: they run different code, arguments or data (a "
                "learning rate or seed of their own, data that depends on the rank where it must "
                "not, another version of the script or of a library on some hosts). No rank or "
                "node is at fault: none was isolated for it"))
        self.pending, self.redo_gen = (step, suspects), redo_gen
        other = "the other replica" if all(len(p) == 2 for p in odd) else "their replicas"
        return Verdict(CORRUPTION, step, suspects, split,
                       f"{_ranks(suspects)}: parameters differ from {other} at step {step}")


def _same(before: dict[int, int], now: dict[int, int]) -> bool:
    """The ranks compared both times hold what they held before, and still disagree."""
    common = [r for r in now if r in before]
    return len({now[r] for r in common}) > 1 and all(before[r] == now[r] for r in common)


def _where(split: tuple[tuple[int, ...], ...], node_of: dict[int, int] | None
           ) -> dict[tuple[int, ...], str]:
    """`` (node 1)`` for each group, where the ranks span more than one node."""
    if not node_of or len({node_of.get(r) for g in split for r in g}) < 2:
        return {}
    out = {}
    for g in split:
        nodes = sorted({node_of[r] for r in g if r in node_of})
        if nodes:
            out[g] = f" ({'node' if len(nodes) == 1 else 'nodes'} {', '.join(map(str, nodes))})"
    return out

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

Which rank is at fault is not what the digests say: with two replicas neither side is the
majority, and in data-parallel training a flipped rank's gradients reach every replica at its
next reduction, so no replica holds the fault-free parameters when the mismatch is found. The
replay says it (``attribute``): every rank redoes the steps since the snapshot that agreed, from
the same inputs (nonstop's training is reproducible bit for bit), and compares, point by point,
what each step started from, its forward outputs and what it ended with (``POINTS``) with what
its first pass recorded. The faulty rank's passes part first: a peer took the fault in only
through a collective that came after it. Named so, and only so, a rank counts against its node.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

CORRUPTION = "corruption"
DIVERGENCE = "divergence"

# where in a step a rank's two passes are compared, in order: the parameters it started from,
# its forward outputs, the parameters after it
POINTS = ("start", "output", "end")
# what a replay found: a fault in the first pass alone (the replay agreed), one that recurred
# (the replay differed again), or no single rank to name
TRANSIENT, PERSISTENT, UNATTRIBUTED = "transient", "persistent", "unattributed"


@dataclasses.dataclass(frozen=True)
class Verdict:
    kind: str  # CORRUPTION or DIVERGENCE
    step: int
    suspects: tuple[int, ...]  # a corruption's ranks to repair (none for a divergence)
    # the ranks that agree with each other, largest first: in the twin groups that disagree
    groups: tuple[tuple[int, ...], ...]
    diagnosis: str  # one line (a divergence's: what the job ends with)


@dataclasses.dataclass(frozen=True)
class Attribution:
    """What a replay says of a corruption: the rank whose passes part first, or none."""

    step: int  # the comparison that found the corruption
    verdict: str  # TRANSIENT, PERSISTENT or UNATTRIBUTED
    rank: int | None  # the faulty rank (None: unattributed)
    candidates: tuple[int, ...]  # the ranks whose passes were ordered
    at: tuple[int, str] | None  # where the named rank's passes first differ: (step, point)
    why: str  # one line


def attribute(step: int, candidates: Iterable[int],
              parted: Mapping[int, tuple[int, int] | None], agreed: bool) -> Attribution | None:
    """The rank a replay names among ``candidates`` (the ranks of the twin groups at odds; with
    no twin, every rank). ``parted[r]``: where rank r's two passes over the same steps first
    differ, as (step, index in ``POINTS``); None where they agree at every point compared; a
    rank absent kept no record of its first pass (a new process). ``agreed``: the replay's
    comparison agreed (the twins, or a majority of three passes). The rank that parts strictly
    first is named - transient when the replay agreed, persistent when it differed again; two
    parting at the same point, or a rank without a record, name none. None when no rank's
    passes differ at all and the replay did not agree: the steps came out the same again (a
    divergence, ``Judge``)."""
    ranks = tuple(sorted(set(candidates)))
    known = {r: parted[r] for r in ranks if r in parted}
    differ = {r: at for r, at in known.items() if at is not None}
    if not differ:
        if not agreed:
            return None
        return Attribution(step, UNATTRIBUTED, None, ranks, None,
                           f"no rank's replay of the steps to {step} differs from its first "
                           "pass at any point compared")
    first = min(differ.values())
    at = (first[0], POINTS[first[1]])
    earliest = sorted(r for r, p in differ.items() if p == first)
    where = f"step {at[0]}'s {_point(at[1])}"
    if len(earliest) > 1:
        return Attribution(step, UNATTRIBUTED, None, ranks, at,
                           f"{_ranks(earliest)}: their passes part at the same point ({where}): "
                           "the fault reached them together (a collective before any other "
                           "point compared), or the step does not replay bit for bit")
    missing = [r for r in ranks if r not in known]
    if missing:
        return Attribution(step, UNATTRIBUTED, None, ranks, at,
                           f"{_ranks(missing)} kept no record of the first pass (a new "
                           "process): the ranks' passes cannot be ordered")
    rank = earliest[0]
    later = [r for r in differ if r != rank]
    after = (f", before {_ranks(sorted(later))}'s (a collective carried it on)" if later else "")
    if agreed:
        return Attribution(step, TRANSIENT, rank, ranks, at,
                           f"rank {rank}: its first pass parted from the replay at {where}"
                           f"{after}; the replay agreed - the fault did not recur")
    return Attribution(step, PERSISTENT, rank, ranks, at,
                       f"rank {rank}: its passes part at {where}{after}, and its replay "
                       "differs from its twins' again - the fault recurs")


def _point(name: str) -> str:
    return {"start": "parameters at its start", "output": "forward outputs",
            "end": "parameters at its end"}[name]


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

    def candidates(self, step: int) -> tuple[int, ...]:
        """The ranks of the twin groups at odds when a mismatch was first found at ``step`` -
        or, before the step of the corruption being redone, at that one (a fault that recurs
        shows on the way back to it): those a replay orders (none: no mismatch there)."""
        return tuple(sorted(self.original(step)))

    def original(self, step: int) -> dict[int, int]:
        """Their digests then (the first pass's)."""
        found = self.found.get(step)
        if not found and self.pending is not None and step < self.pending[0]:
            found = self.found.get(self.pending[0])
        return dict(found[0]) if found else {}

    def judge(self, step: int, digests: dict[int, int], node_of: dict[int, int] | None = None,
              redo_gen: int | None = None, twins: Mapping[int, int] | None = None,
              named: int | None = None) -> Verdict:
        """A mismatch found at ``step`` among the ranks compared (rank -> digest; two distinct
        within some twin group). ``node_of`` (rank -> node or host) names where each group
        runs; ``redo_gen``: the first generation that redoes the steps after the rollback;
        ``twins`` (rank -> the part it holds): each twin group is judged on its own (None:
        every rank holds the same state). ``named``: the rank a replay of the steps found
        faulty again (``attribute``, persistent): a corruption of that rank, though the
        replicas differ again - unless they split into camps."""
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
        if named is not None and not systematic:
            self.pending, self.redo_gen = (step, (named,)), redo_gen
            return Verdict(CORRUPTION, step, (named,), split,
                           f"rank {named}: its replay of the steps to {step} differs again")
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

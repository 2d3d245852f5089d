"""What a controller taking office finds, and what it makes of it: a pure function of the
journal (written by the controller before it) and of what the hosts say they run.

The hosts are the truth about processes: each knows which of its processes holds which rank in
which generation (it delivered the assignments). The journal is the truth about decisions that
are not in any process: the budgets spent, the nodes isolated, how often each rank was replaced.
It may lag one generation behind (it is written after the assignments are sent), so the newest
generation any live process was assigned wins over the journal's.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Seen:
    """One process, as its host reports it."""

    wid: int
    node: int
    alive: bool
    spare: bool
    rank: int | None = None
    gen: int | None = None  # the generation of its newest assignment
    seq: int = 0  # its next mailbox slot


@dataclasses.dataclass
class Adoption:
    gen: int  # the generation the job is in
    plan: dict[int, int]  # rank -> wid in that generation
    missing: list[int]  # ranks with no live process in it: a fault to recover from
    spares: list[int]  # live warm spares
    orphans: list[int]  # live processes that are neither (assigned to a generation that never
    # formed, or to an older one): ended at once
    steady: bool  # every rank has its process: the job goes on untouched


def adopt(journal: dict[str, Any] | None, seen: list[Seen], world: int) -> Adoption:
    live = [s for s in seen if s.alive]
    assigned = [s for s in live if s.rank is not None and s.gen is not None and not s.spare]
    j_gen = int(journal["gen"]) if journal else -1
    gen = max([s.gen for s in assigned] + [j_gen])
    plan: dict[int, int] = {}
    orphans: list[int] = []
    for s in sorted(assigned, key=lambda s: s.wid):
        if s.gen == gen and s.rank is not None and 0 <= s.rank < world and s.rank not in plan:
            plan[s.rank] = s.wid
        else:
            orphans.append(s.wid)
    j_plan = {int(r): int(w) for r, w in (journal or {}).get("plan", {}).items()}
    missing = [r for r in range(world) if r not in plan]
    for r in missing:  # the process the journal names (gone), or none at all
        plan[r] = j_plan.get(r, -1 - r)
    spares = sorted(s.wid for s in live if s.spare)
    return Adoption(gen=max(gen, 0), plan=plan, missing=missing, spares=spares,
                    orphans=sorted(orphans), steady=not missing and gen >= 0)

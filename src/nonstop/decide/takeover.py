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
from typing import Any, Callable, Iterable

from ..protocol.hosts import JournalRecord, LastWord


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
    keeper: str | None = None  # the host's node memory (not a rank's process): its name
    code: int | None = None  # its exit code, once it exited
    done: int | None = None  # the generation in which it said its training function returned

    def finished(self, managed: bool) -> bool:
        """It ran its rank to the end: exited 0 (a rank nonstop ended is killed, never 0) - and,
        in a wrapped script, after saying its training function returned in the generation it
        was last assigned (one that exits 0 in the middle of training has not finished it)."""
        return not self.alive and self.code == 0 and not self.spare and \
            (not managed or (self.done is not None and self.done == self.gen))


@dataclasses.dataclass
class Adoption:
    gen: int  # the newest generation any process was assigned
    plan: dict[int, int]  # rank -> wid: the live process with the rank's newest assignment
    missing: list[int]  # ranks with no live process at all: a fault to recover from
    spares: list[int]  # live warm spares
    orphans: list[int]  # live processes whose rank went to another since: ended at once
    steady: bool  # every rank's process is in the newest generation: the job goes on as it is
    # (not steady and nothing missing: a generation was being formed; it is formed again)
    finished: list[int] = dataclasses.field(default_factory=list)  # ranks whose process exited 0
    # in the newest generation: training ended for them (all of them: the job is over)

    @property
    def over(self) -> bool:
        """Every rank ran to the end: the predecessor died as the job finished."""
        return bool(self.plan) and len(self.finished) == len(self.plan)


def adopt(journal: JournalRecord | None, seen: list[Seen], world: int,
          managed: bool = True) -> Adoption:
    seen = [s for s in seen if s.keeper is None]
    live = [s for s in seen if s.alive]
    assigned = [s for s in live if s.rank is not None and s.gen is not None and not s.spare]
    j_gen = journal.gen if journal is not None else -1
    # a process that ran its rank to the end holds it still: not missing, not to be replaced
    # (its predecessor died as training ended, before it could say so in etcd)
    ended = [s for s in seen if s.finished(managed) and s.rank is not None and s.gen is not None]
    gen = max([s.gen for s in assigned + ended] + [j_gen])
    assigned += [s for s in ended if s.gen == gen]
    plan: dict[int, int] = {}
    newest: dict[int, Seen] = {}
    orphans: list[int] = []
    # the newest assignment of a rank wins; an older holder of the same rank was replaced
    for s in sorted(assigned, key=lambda s: (-(s.gen or 0), s.wid)):
        if s.rank is None or not 0 <= s.rank < world or s.rank in newest:
            orphans.append(s.wid)
            continue
        newest[s.rank] = s
        plan[s.rank] = s.wid
    j_plan = journal.plan if journal is not None else {}
    missing = [r for r in range(world) if r not in plan]
    for r in missing:  # the process the journal names (gone), or none at all
        plan[r] = j_plan.get(r, -1 - r)
    spares = sorted(s.wid for s in live if s.spare)
    steady = not missing and gen >= 0 and all(s.gen == gen for s in newest.values())
    finished = sorted(r for r, s in newest.items() if not s.alive)
    return Adoption(gen=max(gen, 0), plan=plan, missing=missing, spares=spares,
                    orphans=sorted(o for o in orphans if o in {s.wid for s in live}),
                    steady=steady, finished=finished)


def faults(adoption: Adoption, lost: set[int], node_of: dict[int, int]) -> list[Any]:
    """What the controller taking office recovers from: the ranks' hosts lost while no controller
    was in office, the ranks whose process is gone; else, a generation caught forming (every
    rank's process lives, not all in the newest generation) is formed again, from where they
    are. None: the job trains on untouched."""
    from .faults import Fault

    out = [Fault("node_lost", node=n, message=f"node {n} is gone (its lease expired while no "
                                              "controller was in office)")
           for n in sorted(lost & set(node_of.values()))]
    out += [Fault("crash", rank=r, node=node_of.get(r), message=(
        f"rank {r}'s process is gone (found by the controller taking over)"))
        for r in adoption.missing]
    if not out and not adoption.steady:
        out.append(Fault("takeover", message=(
            f"generation {adoption.gen} was forming when the controller changed")))
    return out


def newest_step(journal: JournalRecord | None, last: LastWord | None) -> int:
    """The newest step any rank had completed when the controller before this one left office:
    what an incident found at the takeover counts its lost steps from (a rank that survived it
    and reports a newer step moves it on). The journal holds the step of its last write (it is
    written at generations, not at steps); the predecessor's last status record, twice a second,
    a newer one. Neither known: the journal's default, 0."""
    return max(journal.max_step if journal is not None else 0,
               last.step if last is not None else 0)


@dataclasses.dataclass(frozen=True)
class Resumption:
    """What a controller taking office goes on from, once it adopted the processes."""

    max_step: int  # what an incident opened here counts its lost steps from (``newest_step``)
    faults: tuple[Any, ...]  # what it recovers from (``faults``); none: the job trains on
    t_fault: float | None  # when they began, where the predecessor's last word bounds it
    release: tuple[int, ...]  # isolated nodes whose host is still up: let go (the
    # predecessor had no time to)


def resume(adoption: Adoption, journal: JournalRecord | None, last: LastWord | None,
           lost: set[int], node_of: dict[int, int], isolated: Iterable[int],
           host_up: Callable[[int], bool], now: float) -> Resumption:
    """``node_of``: rank -> node as adopted; ``isolated``: the nodes given up (the journal's and
    those lost while no controller was in office); ``now``: time.time(). A last word older than
    a minute (or from the future: another host's clock) bounds nothing."""
    t = last.t if last is not None else None
    return Resumption(
        max_step=newest_step(journal, last),
        faults=tuple(faults(adoption, lost, node_of)),
        t_fault=t if t is not None and now - 60.0 < t < now else None,
        release=tuple(n for n in sorted(isolated) if host_up(n)))

"""What becomes of a host a scheduler told to stop, at the moment it is looked at: a pure
function of the job's state (the controller acts on the answer; ``controller.requests.
Preemptions`` says when to look again and when the grace is spent).

A host that holds no rank is let go at once. One with ranks is drained at a step boundary - to
spare nodes, or the world shrinks without it - but never while the job is busy (an incident
open, a regroup or a retry under way): then it is looked at again in a moment. A spare host
still warming up is waited for during the first half of the grace; after that the ranks go to a
spare host all the same (those without a warm spare start cold there).
"""

from __future__ import annotations

import enum
from typing import Iterable, Mapping


class Preempt(enum.Enum):
    FORGET = "forget"  # given up already (isolated): nothing left to do
    RELEASE = "release"  # it holds no rank: isolated and let go now
    LATER = "later"  # the job is busy, or a spare host is warming up: again in a moment
    DRAIN = "drain"  # its ranks leave it now (to spare nodes, or a smaller world)


def choose(node: int, *, isolated: Iterable[int], busy_nodes: Iterable[int], job_busy: bool,
           ranks_here: int, spare_nodes: Iterable[int], ready: Mapping[int, int],
           late: bool) -> Preempt:
    """``busy_nodes``: the nodes holding a rank; ``ranks_here``: how many ranks ``node`` holds;
    ``spare_nodes``: the nodes its ranks could go to, ``ready`` the warm spares on each;
    ``late``: half the grace is spent."""
    if node in set(isolated):
        return Preempt.FORGET
    if node not in set(busy_nodes):
        return Preempt.RELEASE
    if job_busy:
        return Preempt.LATER
    spares = list(spare_nodes)
    warming = bool(spares) and not any(ready.get(n, 0) >= ranks_here for n in spares)
    if warming and not late:
        return Preempt.LATER
    return Preempt.DRAIN

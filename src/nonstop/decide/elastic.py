"""Growing a degraded world back: when, and onto which processes. Pure logic.

A scale-in (``ladder.shrink``) leaves the job training with fewer ranks than it was started with.
Capacity comes back as warm spares: on a node that holds fewer ranks than it has places, the
process started for each lost rank; on a spare node (a healed or new host), a full node's worth.
Once the job has run degraded for ``scale_in.grow_after_s`` and such spares are ready, the ranks
leave their generation at a step boundary and the next one is larger, as large as the ready
spares allow up to the job's size, in steps the policy allows.
"""

from __future__ import annotations

import math
from typing import Any


def room(node_of: dict[int, int], total_nodes: int, slots: int, isolated: set[int],
         ready: dict[int, int]) -> list[int]:
    """A node for each rank that could join now, nodes in order: a node already holding ranks
    takes ready spares up to its places; a node holding none takes a whole node's worth, or none
    (the world grows by whole nodes there)."""
    held: dict[int, int] = {}
    for n in node_of.values():
        held[n] = held.get(n, 0) + 1
    out: list[int] = []
    for n in range(total_nodes):
        if n in isolated:
            continue
        free = max(slots - held.get(n, 0), 0)
        use = min(free, ready.get(n, 0))
        if n not in held and use < slots:
            continue
        out += [n] * use
    return out


def grow(world: int, target: int, nodes: list[int], policy: Any, unit: int = 1
         ) -> dict[int, int]:
    """The new ranks (numbered after the current ones) and the node of each: as many as ``nodes``
    offer, up to ``target``, the new world an allowed size (scale_in.multiple_of, and whole
    ``unit``s: a sharded job's replica groups). Empty: no growth possible now."""
    step = math.lcm(policy.levels.scale_in.multiple_of, max(1, unit))
    size = min(target, world + len(nodes))
    size -= size % step
    if size <= world:
        return {}
    return {world + i: nodes[i] for i in range(size - world)}


def due(degraded_since: float | None, now: float, policy: Any) -> bool:
    """Whether the job has run degraded long enough to try to grow back."""
    return degraded_since is not None and now - degraded_since >= policy.levels.scale_in.grow_after_s

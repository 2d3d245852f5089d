"""Where ranks go: the job's placement as the ladder sees it, and the node each moved rank goes
to for the level decided. Pure functions of what the controller saw (``observations.Seen``)."""

from __future__ import annotations

from ..decide.ladder import Decision, LadderView, Level
from .observations import Seen


def spare_nodes(node_of: dict[int, int], total_nodes: int, isolated: set[int]) -> list[int]:
    """Healthy nodes that hold no rank: they can take over a failed node's ranks."""
    busy = set(node_of.values())
    return [n for n in range(total_nodes) if n not in busy and n not in isolated]


def view(isolated: set[int], seen: Seen) -> LadderView:
    """The job as the ladder sees it, with these nodes isolated."""
    healthy = [n for n in range(seen.total_nodes) if n not in isolated]
    node_of = seen.node_of
    return LadderView(world=len(seen.ranks), managed=seen.managed, node_of=node_of,
                   spare_nodes=len(spare_nodes(node_of, seen.total_nodes, isolated)),
                   capacity=len(healthy) * seen.slots, slots=seen.slots,
                   ready_spares=dict(seen.ready_spares),
                   free_slots=free_slots(node_of, seen.slots, set(isolated)),
                   replica_groups=seen.replica_groups, regrid_unit=seen.regrid_unit)


def free_slots(node_of: dict[int, int], slots: int, isolated: set[int],
               leaving: frozenset[int] | set[int] = frozenset()) -> dict[int, int]:
    """Places left on the healthy nodes that hold ranks (not counting the ranks ``leaving``)."""
    held: dict[int, int] = {}
    for r, n in node_of.items():
        if r not in leaving:
            held[n] = held.get(n, 0) + 1
    return {n: slots - k for n, k in sorted(held.items()) if n not in isolated and slots > k}


def place(decision: Decision, seen: Seen, isolated: set[int]) -> dict[int, int]:
    """The node each replaced rank goes to: its own node for a rank replacement, a spare node
    for a node replacement (one that holds the node's replicas first), the healthy nodes in
    order for a job restart. ``isolated`` includes
    the nodes the decision isolates."""
    node_of = seen.node_of
    if decision.level is Level.SCALE_IN:
        return {}  # no rank moves: the others go on without the dropped ones
    if decision.level is Level.REPLACE_RANK:
        return {r: node_of[r] for r in decision.replace}
    if decision.level is Level.REPLACE_NODE:
        # the ranks of a node given up go to a spare node, together - one whose host is heard
        # from and that holds their replicas where there is one; a rank that died on a healthy
        # node meanwhile is replaced where it was
        spares = sorted(spare_nodes(node_of, seen.total_nodes, isolated),
                        key=lambda n: n in seen.away)
        # no whole node left: places free on the healthy nodes, those with warm spares first
        free = free_slots(node_of, seen.slots, set(isolated) | set(decision.isolate),
                          leaving=decision.replace)
        places = [n for n in sorted(free, key=lambda n: (-seen.ready_spares.get(n, 0), n))
                  for _ in range(free[n])]
        moved: dict[int, int | None] = {}
        left: dict[int, int] = {}  # places left on the spare nodes taken
        out = {}
        for r in sorted(decision.replace):
            old = node_of[r]
            if old not in decision.isolate:
                out[r] = old
                continue
            target = moved.get(old)
            if old not in moved or (target is not None and left[target] == 0 and spares):
                # a node holding more ranks than a node has places (ranks moved there before,
                # when no spare node was left) spreads over the next spare node
                holding = [n for n in seen.replicas_on.get(old, ())
                           if n in spares and n not in seen.away]
                target = moved[old] = (holding or spares or [None])[0]
                if target is not None:
                    spares.remove(target)
                    left[target] = seen.slots
            if target is not None and left[target] > 0:
                out[r] = target
                left[target] -= 1
            else:
                out[r] = places.pop(0) if places else target  # (none: crowded, as before)
        return out
    healthy = [n for n in range(seen.total_nodes) if n not in isolated]
    return {r: healthy[i // seen.slots] for i, r in enumerate(sorted(decision.replace))}

"""Where each node's snapshot replicas go: ``r`` other nodes, in failure domains other than its
own and each other's where the hosts' labels allow, spread so that no node holds much more than
its share. Pure: the controller's keepers (``controller/keepers.py``) carry it out.

Why per node and not per rank: a lost node's ranks move together, to one spare node, and a
replica is read where a rank runs (its own node's memory, or a peer's over the group), so the
spare node that holds a lost node's replicas restores all of its ranks locally.

The guarantee: with the rank's node and its ``r`` replicas in ``r + 1`` distinct domains, any
``r`` domains lost at once leave a copy of every snapshot (``tests/test_replica_placement.py``).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Mapping


@dataclasses.dataclass(frozen=True)
class Placement:
    """``targets``: node -> the nodes its ranks' snapshots are copied to, best first (the first
    is its buddy); ``short``: why some copies are fewer than asked, or share a failure domain
    (None: every node got ``r`` copies in distinct domains)."""

    targets: dict[int, tuple[int, ...]]
    short: str | None = None


def place(sources: Mapping[int, int], domains: Mapping[int, str], r: int,
          before: Mapping[int, tuple[int, ...]] | None = None) -> Placement:
    """The replicas of each node of ``sources`` (node -> its ranks: what its replicas weigh).

    ``domains``: every node whose memory can hold replicas now (node -> its failure domain);
    a source not among them sends none (its memory is gone). ``before``: the placement in
    force, kept where it is still as good (a new target holds nothing until the next snapshot).
    For each copy the candidates are the other nodes not chosen yet; the first rule that tells
    them apart decides: fewest copies already in the candidate's domain (the source's own
    counts), then a target kept from before unless it would hold more than a source's worth
    over the least loaded, then the least loaded, then the next after the source in node order
    (the old single buddy: the next node)."""
    before = before or {}
    nodes = sorted(domains)
    span = (max(nodes) + 1) if nodes else 1
    load = dict.fromkeys(nodes, 0)
    targets: dict[int, tuple[int, ...]] = {}
    fewer: set[int] = set()  # sources with fewer than r copies
    shared: set[int] = set()  # sources with copies in one domain
    for src in sorted((s for s in sources if s in domains), key=lambda s: (-sources[s], s)):
        weight = sources[src]
        kept_before = [n for n in before.get(src, ()) if n in domains and n != src]
        used = collections.Counter([domains[src]])
        mine: list[int] = []
        for _ in range(r):
            cands = [n for n in nodes if n != src and n not in mine]
            if not cands:
                fewer.add(src)
                break
            best = min(used[domains[n]] for n in cands)
            good = [n for n in cands if used[domains[n]] == best]
            least = min(load[n] for n in good)
            kept = [n for n in kept_before if n in good and load[n] <= least + weight]
            pick = kept[0] if kept else min(good, key=lambda n: (load[n], (n - src) % span))
            if best:
                shared.add(src)
            mine.append(pick)
            used[domains[pick]] += 1
            load[pick] += weight
        if mine:
            targets[src] = tuple(mine)
    return Placement(targets, _short(r, domains, fewer, shared))


def _short(r: int, domains: Mapping[int, str], fewer: set[int], shared: set[int]) -> str | None:
    """Why the placement falls short of ``r`` copies in distinct domains, in one line."""
    if not (fewer or shared):
        return None
    labels = sorted(set(domains.values()))
    parts = []
    if fewer:
        parts.append(f"{r} replica(s) asked, but node(s) {_nodes(fewer)} have only "
                     f"{len(domains) - 1} other node(s) to hold them")
    if shared:
        parts.append(f"{r} replica(s) in distinct failure domains need {r + 1} domains, there "
                     f"{'is' if len(labels) == 1 else 'are'} {len(labels)} "
                     f"({', '.join(labels[:6])}{', ...' if len(labels) > 6 else ''}): "
                     f"node(s) {_nodes(shared)} keep copies in one domain")
    return "; ".join(parts)


def _nodes(nodes: set[int]) -> str:
    ordered = sorted(nodes)
    return ", ".join(map(str, ordered[:8])) + (", ..." if len(ordered) > 8 else "")


"""How many hosts a job across hosts takes, and which: ``--nnodes + --spare-nodes`` places, each
held by one incarnation of a host (``HostKey``: its id and its incarnation).

A host registers as a new incarnation when it fenced itself (cut off, or given up) and offers
itself again, or when its machine was started again under the same name. Its older incarnation
can never come back (a host registers again as itself only while it holds its lease and is not
given up), so the place it holds is the new one's: the old one is given up at once, without the
grace a host that speaks is given while its lease lapsed, and the new one waits for that place -
it is never turned away for want of the place its own older incarnation holds.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

HostKey = tuple[str, str]  # (host id, incarnation)


@dataclasses.dataclass(frozen=True)
class Admission:
    """What becomes of the hosts that registered and are not in the job yet."""

    join: tuple[HostKey, ...] = ()  # taken in now: a spare host each
    turn_away: tuple[HostKey, ...] = ()  # the job is full: told to end
    wait: tuple[HostKey, ...] = ()  # its older incarnation still holds its place: next time


def superseded(held: Iterable[HostKey], registered: Iterable[HostKey]) -> list[HostKey]:
    """The places held by an incarnation whose host registered again as another one: to be
    given up now."""
    newest = dict(registered)  # host id -> the incarnation registered (one record per host)
    return [(host, inc) for host, inc in held if host in newest and newest[host] != inc]


def admit(limit: int, held: Iterable[HostKey], new: Iterable[HostKey]) -> Admission:
    """Which of the ``new`` hosts (registered, in the order etcd lists them; neither in the job
    nor being joined or turned away) the job takes, with ``held`` the places taken (hosts in the
    job and not lost, and hosts being joined)."""
    held = list(held)
    holders = {host for host, _ in held}
    room = limit - len(held)
    join: list[HostKey] = []
    away: list[HostKey] = []
    wait: list[HostKey] = []
    for key in new:
        if key[0] in holders:
            wait.append(key)
        elif room > 0:
            room -= 1
            join.append(key)
        else:
            away.append(key)
    return Admission(tuple(join), tuple(away), tuple(wait))

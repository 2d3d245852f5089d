"""The places of a job across hosts (decide/places.py): --nnodes + --spare-nodes, each held by
one incarnation of a host; a host that fenced itself and registered again takes the place its
older incarnation frees, never turned away for it. Pure: no process, no etcd."""

from __future__ import annotations

from nonstop.decide.places import Admission, admit, superseded

A, B, S = ("a", "1"), ("b", "1"), ("s", "1")
B2 = ("b", "2")  # host b, registered again after fencing itself


def test_a_host_registered_again_supersedes_the_incarnation_that_holds_its_place():
    assert superseded([A, B, S], [A, B2, S]) == [B]
    assert superseded([A, B, S], [A, S]) == []  # its record gone alone: a lease that lapsed
    assert superseded([A, B, S], [A, B, S]) == []


def test_a_full_job_takes_a_healed_host_once_its_old_place_is_given_up():
    # the old incarnation still holds the place: the new one waits (it is not turned away)
    assert admit(3, [A, B, S], [B2]) == Admission(wait=(B2,))
    # given up: the place is free, and the new incarnation takes it as a spare host
    assert admit(3, [A, S], [B2]) == Admission(join=(B2,))


def test_hosts_beyond_the_places_are_turned_away_and_joins_in_flight_count():
    c, d = ("c", "1"), ("d", "1")
    assert admit(3, [A, B], [c, d]) == Admission(join=(c,), turn_away=(d,))
    assert admit(3, [A, B, c], [d]) == Admission(turn_away=(d,))  # c still connecting
    # a new incarnation of a place holder waits even in a full job; others are turned away
    assert admit(3, [A, B, S], [d, B2]) == Admission(turn_away=(d,), wait=(B2,))

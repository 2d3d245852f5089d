"""Where snapshot replicas go (``decide/replicas.py``): pure, on small topologies. The property:
with every node's snapshots and its ``r`` replicas in ``r + 1`` distinct failure domains, any
``r`` domains lost at once (so any ``r`` hosts) leave a copy of every node's snapshots."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nonstop.controller import machine as mc
from nonstop.decide.ladder import Decision, Level
from nonstop.decide.replicas import place
from nonstop.errors import UsageError
from nonstop.launch.config import FAILURE_DOMAIN, failure_domain
from nonstop.protocol.hosts import HostRecord


def copies(sources, targets):
    """source -> every node holding a copy of its ranks' snapshots (its own first)."""
    return {s: (s, *targets.get(s, ())) for s in sources}


def lost_whole(sources, targets, domains, lost):
    """The sources left with no copy when the domains ``lost`` go at once."""
    return {s for s, held in copies(sources, targets).items()
            if all(domains[n] in lost for n in held)}


def test_one_replica_goes_to_the_next_node_as_the_single_buddy_did():
    # two nodes of ranks and a spare node: 0 -> 1, 1 -> the spare (the next after it)
    p = place({0: 2, 1: 2}, {0: "h0", 1: "h1", 2: "h2"}, 1)
    assert p.targets == {0: (1,), 1: (2,)} and p.short is None
    assert place({0: 2, 1: 2}, {0: "h0", 1: "h1", 2: "h2"}, 0).targets == {}


def test_two_replicas_avoid_the_sources_rack_and_each_others():
    # racks a (nodes 0, 1), b (2, 3), c (4): each node's two copies in the two other racks
    domains = {0: "a", 1: "a", 2: "b", 3: "b", 4: "c"}
    p = place({0: 1, 1: 1, 2: 1, 3: 1}, domains, 2)
    assert p.short is None
    for src, to in p.targets.items():
        assert len(to) == 2 and len({domains[src], *(domains[t] for t in to)}) == 3, (src, to)


def test_too_few_domains_or_nodes_fall_back_and_say_why_once():
    two_racks = {0: "a", 1: "a", 2: "b", 3: "b"}
    p = place({0: 1, 1: 1}, two_racks, 2)
    # the first copy leaves the rack; the second must share one: another host, at least
    assert all(len(set(to)) == 2 and src not in to for src, to in p.targets.items())
    assert all(two_racks[to[0]] != two_racks[src] for src, to in p.targets.items())
    assert "need 3 domains, there are 2 (a, b)" in p.short
    q = place({0: 1, 1: 1}, {0: "a", 1: "b"}, 3)
    assert q.targets == {0: (1,), 1: (0,)}
    assert "3 replica(s) asked, but node(s) 0, 1 have only 1 other node(s)" in q.short


def test_no_node_holds_much_more_than_its_share():
    # 6 nodes of 4 ranks, 2 spare nodes, one domain each: 12 copies of 4 ranks over 8 nodes
    domains = {n: f"h{n}" for n in range(8)}
    p = place({n: 4 for n in range(6)}, domains, 2)
    load = {n: 0 for n in domains}
    for src, to in p.targets.items():
        for t in to:
            load[t] += 4
    assert max(load.values()) - min(load.values()) <= 4, load


def test_a_placement_in_force_is_kept_where_it_is_still_as_good():
    domains = {n: f"h{n}" for n in range(5)}
    before = {0: (3, 4), 1: (4, 2)}
    assert place({0: 2, 1: 2}, domains, 2, before).targets == before
    # node 4 lost: only its copies move
    del domains[4]
    after = place({0: 2, 1: 2}, domains, 2, before).targets
    assert after[0][0] == 3 and after[1][0] == 2 and 4 not in after[0] + after[1]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_r_domains_lost_leave_a_copy_of_every_nodes_snapshots(data):
    """Property over small topologies: nodes with domain labels, some holding ranks, r asked.
    Where the labels allow (r + 1 domains at least), every source's copies are in r + 1
    distinct domains on r + 1 distinct nodes, so no set of r domains - nor of r nodes - takes
    all of a source's copies. Wherever the nodes allow (r + 1 at least), no r nodes do."""
    n = data.draw(st.integers(2, 7), "nodes")
    labels = data.draw(st.lists(st.sampled_from("abcdef"), min_size=n, max_size=n), "labels")
    domains = dict(enumerate(labels))
    sources = data.draw(st.dictionaries(st.integers(0, n - 1), st.integers(1, 4), min_size=1),
                        "ranks per source node")
    r = data.draw(st.integers(0, 3), "r")
    before = data.draw(st.dictionaries(st.integers(0, n - 1), st.tuples(
        st.integers(0, n - 1), st.integers(0, n - 1)), max_size=3), "placement in force")
    p = place(sources, domains, r, before)
    for src, to in p.targets.items():
        assert src not in to and len(set(to)) == len(to) == min(r, n - 1)
    if r == 0:
        assert p.targets == {} and p.short is None
        return
    if len(set(labels)) >= r + 1:
        assert p.short is None
        for lost in itertools.combinations(sorted(set(labels)), r):
            assert not lost_whole(sources, p.targets, domains, set(lost)), lost
    if n >= r + 1:
        per_node = {k: f"node {k}" for k in domains}
        for lost in itertools.combinations(range(n), r):
            names = {per_node[k] for k in lost}
            assert not lost_whole(sources, p.targets, per_node, names), lost
    else:
        assert "have only" in p.short


def test_a_lost_nodes_ranks_go_to_a_spare_node_that_holds_their_replicas():
    """Nodes 0, 1 hold ranks 0-3, nodes 2 and 3 are spare: node 1's replicas are on node 3,
    so its ranks go there (restored from that node's own memory), not to the first spare."""
    rs = tuple(mc.RankSeen(rank=r, wid=100 + r, node=r // 2, joining=0, entered=0)
               for r in range(4))
    s = mc.Seen(now=0.0, ranks=rs, total_nodes=4, slots=2,
                replicas_on={0: (1, 2), 1: (3, 0)})
    lost = Decision(Level.REPLACE_NODE, replace=frozenset({2, 3}), isolate=frozenset({1}))
    assert mc.place(lost, s, {1}) == {2: 3, 3: 3}
    # both lost: each to a spare node of its own, the one holding its replicas
    both = Decision(Level.REPLACE_NODE, replace=frozenset(range(4)), isolate=frozenset({0, 1}))
    s2 = mc.Seen(now=0.0, ranks=rs, total_nodes=4, slots=2, replicas_on={0: (1, 3), 1: (2, 0)})
    assert mc.place(both, s2, {0, 1}) == {0: 3, 1: 3, 2: 2, 3: 2}
    # no spare node holds them: the first spare, as before
    s3 = mc.Seen(now=0.0, ranks=rs, total_nodes=4, slots=2, replicas_on={1: (0,)})
    assert mc.place(lost, s3, {1}) == {2: 2, 3: 2}
    # the spare node that holds them has been silent (killed with node 1, its lease not yet
    # expired): the other spare node, whose host is heard from; the replica is read on node 0
    s4 = mc.Seen(now=0.0, ranks=rs, total_nodes=4, slots=2, replicas_on={1: (3, 0)},
                 away=frozenset({3}))
    assert mc.place(lost, s4, {1}) == {2: 2, 3: 2}
    s5 = dataclasses.replace(s4, replicas_on={1: (2, 0)}, away=frozenset({2}))
    assert mc.place(lost, s5, {1}) == {2: 3, 3: 3}


# -- the hosts' labels ------------------------------------------------------------------------------
def test_a_hosts_failure_domain_travels_in_its_record_and_an_older_record_is_still_read():
    rec = HostRecord(host_id="h1", addr="10.0.0.1", ctl_port=1, rdzv_port=2, pid=3, slots=2,
                     incarnation="i", domain="rack-3")
    assert HostRecord.loads(rec.dumps()) == rec and rec.failure_domain == "rack-3"
    old = {k: v for k, v in json.loads(rec.dumps()).items() if k != "domain"}
    assert HostRecord.loads(json.dumps(old)).failure_domain == "h1"  # its own host
    for bad, said in ((dict(old, domain=3), "domain: 3 is not str"),
                      (dict(old, rack="r"), "unknown field(s) ['rack']"),
                      ({k: v for k, v in old.items() if k != "pid"}, "'pid' is missing")):
        with pytest.raises(ValueError, match=re.escape(said)):
            HostRecord.loads(json.dumps(bad))


def test_a_failure_domain_from_the_flag_else_the_environment_else_the_host():
    assert failure_domain("rack-3", {FAILURE_DOMAIN: "rack-9"}) == "rack-3"
    assert failure_domain(None, {FAILURE_DOMAIN: "zone-a/rack-9"}) == "zone-a/rack-9"
    assert failure_domain(None, {}) == ""  # the host itself
    for flag, env, said in (("rack 3", {}, "--failure-domain 'rack 3'"), ("", {}, "--failure"),
                            (None, {FAILURE_DOMAIN: "-x"}, f"${FAILURE_DOMAIN} '-x'"),
                            ("r" * 129, {}, "1 to 128")):
        with pytest.raises(UsageError, match=re.escape(said)):
            failure_domain(flag, env)

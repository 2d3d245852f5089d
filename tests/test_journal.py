"""The controller's journal in a real etcd: after 100 recoveries (a host lost, a host joined, a
new generation journaled each time) the job's keys and etcd's database stay bounded."""

from __future__ import annotations

import json
import threading

import pytest

from nonstop.protocol import hosts as keys
from nonstop.controller.journal import Journal
from nonstop.store.etcd import Etcd, Fenced
from nonstop.store.etcd_server import EtcdCluster

pytestmark = pytest.mark.integration  # starts processes


@pytest.fixture
def etcd(tmp_path):
    cluster = EtcdCluster([("e0", "127.0.0.1", [])], tmp_path / "etcd").start()
    client = Etcd([("127.0.0.1", cluster.members[0].client_port)], "bounded")
    yield client
    client.close()
    cluster.stop()


def _record(gen: int, world: int = 512) -> str:
    """A journal as big as a job of 512 ranks writes."""
    return json.dumps({"gen": gen, "plan": {str(r): 100_000 + gen * world + r for r in range(world)},
                       "node_of": {str(r): r // 8 for r in range(world)},
                       "replacements": [gen] * world, "isolated": list(range(gen % 7))})


def _recoveries(etcd: Etcd, journal: Journal, start: int, n: int, compact: bool) -> None:
    host = etcd.lease(5)
    etcd.put(keys.host_key(f"h{start}"), "{}", lease=host)
    for gen in range(start, start + n):
        new = etcd.lease(5)  # a host joins...
        etcd.put(keys.host_key(f"h{gen + 1}"), json.dumps({"gen": gen}), lease=new)
        host.revoke()  # ...and one is lost
        host = new
        if compact:
            journal.write(_record(gen))
            journal.prune(etcd.revision(), force=True)
        else:
            etcd.guarded(keys.LEADER, journal.epoch, puts={keys.JOURNAL: _record(gen)})
    host.revoke()


def test_keys_and_database_stay_bounded_over_100_recoveries(etcd):
    stop = threading.Event()
    lead = etcd.campaign(keys.LEADER, "c", 5, stop, on_lost=lambda: None)
    journal = Journal(etcd, lead.epoch)
    etcd.put(keys.JOB, "{}")
    _recoveries(etcd, journal, 0, 50, compact=True)  # etcd's history reaches its steady size
    keys_before, size_before = etcd.count(), etcd.db_size()
    _recoveries(etcd, journal, 50, 100, compact=True)
    assert etcd.count() == keys_before == 3  # job, leader, journal: no key per recovery
    grown = etcd.db_size() - size_before
    assert journal.compactions >= 100
    # without compaction the same 100 recoveries grow the database by their whole history
    before = etcd.db_size()
    _recoveries(etcd, journal, 150, 100, compact=False)
    unbounded = etcd.db_size() - before
    assert unbounded > 1 << 20 and grown < unbounded / 4, (grown, unbounded)
    lead.resign()


def test_a_deposed_controller_cannot_write_the_journal(etcd):
    stop = threading.Event()
    first = etcd.campaign(keys.LEADER, "a", 5, stop, on_lost=lambda: None)
    old = Journal(etcd, first.epoch)
    old.write(_record(0, 4))
    first.resign()
    second = etcd.campaign(keys.LEADER, "b", 5, stop, on_lost=lambda: None)
    assert second.epoch > first.epoch
    with pytest.raises(Fenced):
        old.write(_record(1, 4))
    raw, _ = etcd.get(keys.JOURNAL)
    assert json.loads(raw)["gen"] == 0
    Journal(etcd, second.epoch).write(_record(2, 4))
    second.resign()

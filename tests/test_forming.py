"""A new job's first hosts (controller/forming.py), against a real etcd member and real
listeners standing in for the hosts' agents (their ``OfficeLink``): the hosts that join first
hold the ranks, those registered at once beyond the job's size are to be turned away, and a job
whose hosts do not join, or do not answer on their address, says why."""

from __future__ import annotations

import json
import socket
import time

import pytest

from nonstop.agent.office import OfficeLink
from nonstop.controller.forming import Formed, Forming, NotFormed
from nonstop.protocol import hosts as keys
from nonstop.store.etcd import Etcd
from nonstop.store.etcd_server import EtcdCluster

pytestmark = pytest.mark.integration  # an etcd member

SECRET = b"forming-test-secret-0123456789abcd"


@pytest.fixture
def etcd(tmp_path):
    cluster = EtcdCluster([("e0", "127.0.0.1", [])], tmp_path / "etcd")
    client = None
    try:
        cluster.start()
        m = cluster.members[0]
        client = Etcd([(m.addr, m.client_port)], "forming")
        yield client
    finally:
        if client is not None:
            client.close()
        cluster.stop()


def _register(etcd: Etcd, host_id: str, port: int) -> None:
    rec = keys.HostRecord(host_id=host_id, addr="127.0.0.1", ctl_port=port, rdzv_port=1,
                          pid=1, slots=1, incarnation=f"{host_id}-1")
    etcd.put(keys.host_key(host_id), rec.dumps())


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


def test_the_first_hosts_hold_the_ranks_and_those_beyond_the_jobs_size_are_turned_away(etcd):
    links = [OfficeLink("127.0.0.1", SECRET, 5.0, now=time.time, wake=lambda: None).start()
             for _ in range(4)]
    statuses: list[str] = []
    try:
        for i, link in enumerate(links):
            _register(etcd, f"h{i}", link.port)
        # two hosts hold ranks, one is a spare host: the fourth registered beyond the job's size
        formed = Forming("forming", 2, 3, SECRET, etcd, statuses.append).first_hosts(10.0)
        assert isinstance(formed, Formed), formed
        assert [h.host_id for h in formed.hosts] == ["h0", "h1", "h2"]  # the order they joined
        assert [h.host_id for h in formed.beyond] == ["h3"]
        assert sorted(formed.channels) == ["h0", "h1", "h2"]  # the one turned away: closed
        assert all(inc == f"{h}-1" for h, (inc, _) in formed.channels.items())
        waiting = json.loads(statuses[0])
        assert (waiting["phase"], waiting["hosts_joined"], waiting["hosts_wanted"]) == \
            ("waiting for hosts", 4, 2)
        for _, ch in formed.channels.values():
            ch.close()
    finally:
        for link in links:
            link.close()


def test_a_job_whose_hosts_do_not_join_or_do_not_answer_says_which_and_why(etcd):
    t0 = time.monotonic()
    alone = Forming("forming", 2, 2, SECRET, etcd, lambda text: None).first_hosts(0.5)
    assert isinstance(alone, NotFormed)
    assert "only 0 of 2 host(s) joined job 'forming' within 0.5 s" in alone.diagnosis
    link = OfficeLink("127.0.0.1", SECRET, 5.0, now=time.time, wake=lambda: None).start()
    try:
        _register(etcd, "up", link.port)
        _register(etcd, "silent", _closed_port())  # registered, but nothing answers there
        mute = Forming("forming", 2, 2, SECRET, etcd, lambda text: None).first_hosts(1.0)
        assert isinstance(mute, NotFormed), mute
        assert "only 1 of 2 host(s) of job 'forming' answered on their address (silent at " \
            "127.0.0.1 did not)" in mute.diagnosis
        assert time.monotonic() - t0 < 10
    finally:
        link.close()

"""Test hosts as network namespaces (nonstop_bench.netns): real namespaces, a real bridge, real sockets.
Each test proves one multi-host behaviour the fault-tolerance tests rely on: hosts reach each
other by address, a cut host's packets vanish (no reset), a killed host has no process left, and
nothing of ours outlives a run."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from nonstop_bench import netns

# connect and say what happened: ok <data> / refused / timeout / error <errno>
PROBE = r"""
import socket, sys
s = socket.socket()
s.settimeout(float(sys.argv[3]))
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    print("ok", s.recv(64).decode())
except socket.timeout:
    print("timeout")
except ConnectionRefusedError:
    print("refused")
except OSError as e:
    print("error", e.errno)
"""

SERVER = r"""
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen()
print("ready", flush=True)
while True:
    c, _ = s.accept()
    c.sendall(sys.argv[2].encode())
    c.close()
"""

HEALTH = r"""
import json, sys, urllib.request
with urllib.request.urlopen(sys.argv[1] + "/health", timeout=5) as r:
    print(json.loads(r.read())["health"])
"""

PORT = 7000


def probe(host: netns.Host, addr: str, port: int = PORT, timeout: float = 1.0) -> str:
    r = host.run([sys.executable, "-c", PROBE, addr, str(port), str(timeout)],
                 timeout=timeout + 10, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def serve(host: netns.Host, reply: str, port: int = PORT) -> subprocess.Popen:
    p = host.popen([sys.executable, "-c", SERVER, str(port), reply], stdout=subprocess.PIPE,
                   text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def connect_here(addr: str, port: int = PORT, timeout: float = 1.0) -> str:
    """The same as PROBE, from the test process (the root namespace)."""
    with socket.socket() as s:
        s.settimeout(timeout)
        try:
            s.connect((addr, port))
            return "ok " + s.recv(64).decode()
        except socket.timeout:
            return "timeout"
        except ConnectionRefusedError:
            return "refused"


def ours() -> tuple[list[str], list[str]]:
    """Namespaces and interfaces this process made (the pid is in every name)."""
    mark = f"{os.getpid()}s"
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return ([line.split()[0] for line in spaces.splitlines() if mark in line],
            [line.split(": ")[1] for line in links.splitlines() if mark in line])


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.integration
def test_hosts_reach_each_other_and_the_root_namespace(test_hosts):
    th = test_hosts(3)
    h0, h1, h2 = th.hosts
    assert len({h.addr for h in th.hosts} | {th.gateway}) == 4
    assert all(h.addr.startswith("198.1") for h in th.hosts)  # RFC 2544 only
    serve(h0, "hello")
    assert probe(h1, h0.addr) == "ok hello"
    assert probe(h2, h0.addr) == "ok hello"
    assert probe(h1, h2.addr) == "refused"  # reached: the host itself answered
    for h in th.hosts:  # the root namespace reaches every host through the bridge
        assert connect_here(h.addr, port=9) == "refused"
    assert connect_here(h0.addr) == "ok hello"
    # lo is up in every namespace
    r = h2.run(["ip", "-o", "link", "show", "lo"], timeout=5, capture_output=True, text=True)
    assert "UP" in r.stdout


@pytest.mark.integration
def test_two_test_host_sets_do_not_collide(test_hosts):
    a, b = test_hosts(1), test_hosts(1)
    assert a.network != b.network and a.bridge != b.bridge
    # another process (a second pytest) at the same time gets yet another subnet
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom nonstop_bench.netns import TestHosts\n"
         "with TestHosts(1) as t:\n print(t.network, flush=True)\n sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        other = child.stdout.readline().strip()
    finally:
        child.communicate("", timeout=30)
    assert other and other not in {str(a.network), str(b.network)}
    assert child.returncode == 0
    serve(a.hosts[0], "a")
    serve(b.hosts[0], "b")
    assert connect_here(a.hosts[0].addr) == "ok a"
    assert connect_here(b.hosts[0].addr) == "ok b"


@pytest.mark.integration
def test_etcd_member_in_a_host_reached_from_another(test_hosts, tmp_path):
    from nonstop.store.etcd_server import EtcdCluster, EtcdUnavailable, etcd_binary, healthy

    try:
        etcd_binary()
    except EtcdUnavailable as e:
        pytest.skip(str(e))
    h0, h1 = test_hosts(2).hosts
    # every namespace has its own ports: the well-known ones are free in each
    cluster = EtcdCluster([("e0", h0.addr, h0.prefix)], tmp_path, ports=lambda addr: (2379, 2380))
    try:
        cluster.start(timeout_s=20)
        url = cluster.member("e0").client_url
        assert url == f"http://{h0.addr}:2379"
        r = h1.run([sys.executable, "-c", HEALTH, url], timeout=10, capture_output=True,
                   text=True)
        assert r.stdout.strip() == "true", r.stderr
        assert healthy(url)
        assert cluster.member("e0").proc.pid in h0.pids()
    finally:
        cluster.stop()
    assert not h0.pids()


@pytest.mark.integration
def test_cut_drops_packets_and_heal_restores(test_hosts):
    th = test_hosts(3)
    h0, h1, h2 = th.hosts
    serve(h0, "hello")
    assert probe(h1, h0.addr) == "ok hello"
    assert probe(h1, h0.addr, port=PORT + 1) == "refused"
    h0.cut()
    # a partition: no reset, no refusal, no "no route to host" - the connect just times out
    assert probe(h1, h0.addr) == "timeout"
    assert probe(h1, h0.addr, port=PORT + 1) == "timeout"
    assert connect_here(h0.addr, timeout=0.5) == "timeout"
    # the others still reach each other
    assert probe(h1, h2.addr) == "refused"
    t0 = time.monotonic()
    h0.heal()
    assert time.monotonic() - t0 < 5
    assert probe(h1, h0.addr) == "ok hello"
    assert probe(h2, h0.addr, port=PORT + 1) == "refused"
    assert connect_here(h0.addr) == "ok hello"
    serve(h1, "back", port=PORT + 2)
    assert probe(h0, h1.addr, port=PORT + 2) == "ok back"  # and from the healed host out


@pytest.mark.integration
def test_kill_all_ends_every_process_of_the_host(test_hosts):
    th = test_hosts(2)
    h0, h1 = th.hosts
    # a child, a child of a child, and one in its own session (outside the process group)
    top = h0.popen(["sh", "-c", "sleep 300 & sh -c 'sleep 300 & wait' & setsid sleep 300 & "
                    "wait"])
    survivor = h1.popen(["sleep", "300"])
    deadline = time.monotonic() + 10
    while len(h0.pids()) < 5 and time.monotonic() < deadline:
        time.sleep(0.02)
    before = h0.pids()
    assert len(before) == 5, before  # sh, sleep, sh, sleep, the setsid sleep
    assert top.pid in before and survivor.pid not in before
    h0.kill_all()
    assert h0.pids() == []
    r = subprocess.run(["ip", "netns", "pids", h0.ns], capture_output=True, text=True)
    assert r.stdout.strip() == ""
    assert all(gone(p) for p in before)
    assert top.returncode == -signal.SIGKILL
    assert survivor.poll() is None and h1.pids() == [survivor.pid]


@pytest.mark.integration
def test_destroy_removes_everything_also_when_the_body_raised():
    ok, why = netns.available()
    if not ok:
        pytest.skip(why)
    with pytest.raises(RuntimeError, match="boom"):
        with netns.TestHosts(2) as th:
            names = [th.bridge, *(h.veth for h in th.hosts), *(h.ns for h in th.hosts)]
            spaces, links = ours()
            assert set(names) <= set(spaces) | {n.split("@")[0] for n in links}
            p = th.hosts[0].popen(["sleep", "300"])
            q = th.hosts[1].popen(["sh", "-c", "setsid sleep 300 & wait"])
            raise RuntimeError("boom")
    assert ours() == ([], [])
    assert p.returncode is not None and q.returncode is not None
    th.destroy()  # idempotent: all already gone, no error
    assert th not in netns._live


@pytest.mark.integration
def test_sweep_stale_removes_only_leftovers_of_dead_creators():
    ok, why = netns.available()
    if not ok:
        pytest.skip(why)
    with open("/proc/sys/kernel/pid_max") as f:
        dead = int(f.read()) + 1  # above pid_max: no process can have it
    live = os.getpid()
    # a tag of this test process alone: its sweep touches no one else's hosts, and no other
    # pytest running this test at the same time sweeps (or collides with) these names
    tag = "q" + "".join(chr(97 + live // 26 ** i % 26) for i in range(3))
    stale_ns, stale_veth, stale_br = f"{tag}{dead}s0h0", f"{tag}{dead}s0v0", f"{tag}{dead}s0br"
    live_ns = f"{tag}{live}s0h0"
    proc = None
    try:
        for cmd in (["ip", "netns", "add", stale_ns], ["ip", "netns", "add", live_ns],
                    ["ip", "link", "add", "name", stale_br, "type", "bridge"],
                    ["ip", "link", "add", "name", stale_veth, "type", "veth", "peer", "name",
                     "eth0", "netns", stale_ns]):
            subprocess.run(cmd, check=True, capture_output=True)
        # a process a crashed run left running in its namespace
        proc = subprocess.Popen(["ip", "netns", "exec", stale_ns, "sleep", "300"],
                                start_new_session=True)
        deadline = time.monotonic() + 5
        while proc.pid not in netns._ns_pids(stale_ns) and time.monotonic() < deadline:
            time.sleep(0.01)
        removed = netns.sweep_stale(tag)
        assert sorted(removed) == sorted([stale_ns, stale_veth, stale_br])
        assert proc.wait(5) == -signal.SIGKILL
        spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert stale_ns not in spaces and live_ns in spaces
        assert stale_br not in links and stale_veth not in links
        assert netns.sweep_stale(tag) == []
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        for cmd in (["ip", "link", "del", "dev", stale_veth],
                    ["ip", "link", "del", "dev", stale_br],
                    ["ip", "netns", "delete", stale_ns], ["ip", "netns", "delete", live_ns]):
            subprocess.run(cmd, capture_output=True)


def test_names_fit_and_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        netns.TestHosts(2, tag="NST")
    with pytest.raises(ValueError):
        netns.TestHosts(2, tag="toolong")
    with pytest.raises(ValueError):
        netns.TestHosts(0)
    th = netns.TestHosts(100)
    th.pid = 4194304  # the largest pid Linux hands out
    br, veths, _ = th._names(9)
    assert max(len(br), *map(len, veths)) <= 15  # IFNAMSIZ

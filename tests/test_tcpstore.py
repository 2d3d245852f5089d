"""The job's store: torch's TCPStore protocol served from Python. torch's own client (in another
process, as the ranks are) does every operation it has against it; a gloo group forms on it;
the process that serves it reads and writes the same keys without importing torch."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from nonstop.agent import loopback
from nonstop.store.tcpstore import MAGIC, StoreServer


@pytest.fixture
def server():
    s = StoreServer(loopback.listen())
    yield s
    s.close()


def test_in_process_operations_see_the_same_keys_as_torchs_store_object_would(server):
    server.set("a", "1")
    assert server.get("a") == b"1"
    assert server.add("n", 5) == 5 and server.add("n", -2) == 3
    assert server.check(["a", "n"]) and not server.check(["a", "missing"])
    server.multi_set(["x", "y"], [b"1", "2"])
    assert server.multi_get(["x", "y", "missing"]) == [b"1", b"2", b""]
    assert server.compare_set("c", "", "new") == b"new"
    assert server.compare_set("c", "old", "other") == b"new"  # not what was expected: unchanged
    assert server.compare_set("c", "new", "newer") == b"newer"
    assert server.delete_key("c") and not server.delete_key("c")
    assert server.num_keys() == 4
    with pytest.raises(TimeoutError):
        server.get("missing", timeout=0.05)
    threading.Timer(0.1, lambda: server.set("late", "v")).start()
    assert server.get("late", timeout=5) == b"v"


@pytest.mark.integration  # starts a process
def test_the_server_needs_no_torch():
    code = ("import sys; from nonstop.launch import one_host; from nonstop.agent import host; "
            "from nonstop.agent import loopback; s = loopback.master_store(); s.set('k', 'v'); "
            "assert s.get('k') == b'v'; s.close(); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


CLIENT = textwrap.dedent("""
    import datetime, os, sys, threading
    import torch, torch.distributed as dist
    port = int(sys.argv[1])
    def client(timeout=10):
        return dist.TCPStore("127.0.0.1", port, is_master=False,
                             timeout=datetime.timedelta(seconds=timeout))
    c = client()
    assert c.get("from-server") == b"hello"  # set by the server's process
    c.set("from-client", "1")
    assert c.add("n", 5) == 5 and c.add("n", 0) == 5
    assert c.check(["from-client"]) and not c.check(["missing"])
    c.multi_set(["m1", "m2"], ["v1", "v2"])
    assert c.multi_get(["m1", "m2"]) == [b"v1", b"v2"]
    assert c.compare_set("cs", "", "a") == b"a" and c.compare_set("cs", "a", "b") == b"b"
    c.append("ap", "x"); c.append("ap", "y"); assert c.get("ap") == b"xy"
    assert c.delete_key("ap") and not c.delete_key("ap")
    n = c.num_keys()
    assert sorted(c.list_keys()) == sorted(["from-server", "from-client", "n", "m1", "m2", "cs"])
    # a wait that times out is cancelled, and the connection serves on
    try:
        c.wait(["never"], datetime.timedelta(seconds=0.2))
        raise SystemExit("the wait did not time out")
    except dist.DistStoreError:
        pass
    assert c.get("n") == b"5"
    # a key another client sets later wakes the one waiting for it
    other = client()
    threading.Timer(0.2, lambda: other.set("later", "v")).start()
    c.wait(["later"]); assert c.get("later") == b"v"
    # queues
    c.queue_push("q", "1"); c.queue_push("q", "2"); assert c.queue_len("q") == 2
    assert c.queue_pop("q") == b"1" and c.queue_pop("q", block=False) == b"2"
    # a value of megabytes
    big = os.urandom(3 << 20); c.set("big", big); assert c.get("big") == big
    # a barrier of two clients
    threading.Timer(0.2, lambda: other.barrier("bar", 2)).start()
    c.barrier("bar", 2)
    # a process group of two ranks
    out = {}
    def rank(r):
        pg = dist.ProcessGroupGloo(dist.PrefixStore("pg", client()), r, 2)
        t = torch.tensor([r + 1.0]); pg.allreduce([t]).wait(); out[r] = t.item()
    ts = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    [t.start() for t in ts]; [t.join(30) for t in ts]
    assert out == {0: 3.0, 1: 3.0}, out
    c.set("done", "yes")
    print("ok", n)
""")


@pytest.mark.integration  # starts a process
def test_torchs_client_does_every_operation_and_a_gloo_group_forms_on_it(server):
    server.set("from-server", "hello")
    run = subprocess.run([sys.executable, "-c", CLIENT, str(server.port)], capture_output=True,
                         text=True, timeout=120, env={"GLOO_SOCKET_IFNAME": "lo",
                                                      "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr[-3000:]
    assert server.get("done") == b"yes" and server.get("from-client") == b"1"
    assert server.get("bar") == b"2"


def _raw_client(server: StoreServer) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    s.sendall(bytes([0]) + struct.pack("<I", MAGIC))
    return s


def _key(k: str) -> bytes:
    return struct.pack("<Q", len(k)) + k.encode()


def test_a_malformed_or_vanished_client_is_dropped_and_the_others_are_served(server):
    bad = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    bad.sendall(b"GET / HTTP/1.1\r\n\r\n")  # not the protocol: closed without an answer
    assert bad.recv(10) == b""
    huge = _raw_client(server)
    huge.sendall(bytes([3]) + struct.pack("<Q", 1 << 40))  # a key of a terabyte: refused
    assert huge.recv(10) == b""
    waiter = _raw_client(server)  # waits for a key, then goes away: forgotten
    waiter.sendall(bytes([6]) + struct.pack("<Q", 1) + _key("/gone"))
    time.sleep(0.1)
    waiter.close()
    good = _raw_client(server)
    good.sendall(bytes([4]) + _key("/n") + struct.pack("<q", 7))  # ADD
    assert struct.unpack("<q", good.recv(8))[0] == 7
    server.set("gone", "now")  # wakes no one, and fails nothing
    good.sendall(bytes([13]) + struct.pack("<I", 42))  # PING
    assert struct.unpack("<I", good.recv(4))[0] == 42
    good.close()

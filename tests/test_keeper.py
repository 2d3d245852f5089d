"""The node's memory (a real keeper process per node): double-buffered slots that outlive their
writer, replication to a buddy node before the older slot is overwritten, leases, corruption
injection, disk parts written by the keeper's writer process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

from nonstop.net.channel import SECRET_ENV
from nonstop.protocol import keeper_messages as km
from nonstop.state import checkpoint, packing, shm, wire
from nonstop.state.memory import NodeMemory, own, replica

pytestmark = pytest.mark.integration  # starts processes


@pytest.fixture
def keepers():
    """Start keepers by node; all are killed (by pid) at the end."""
    procs: list[subprocess.Popen] = []
    logs: list = []

    job_token = uuid.uuid4().hex  # one job: every keeper started here shares it

    def start(node: int, writer: bool = False, token: str | None = None, secret: str | None = None,
              log=None) -> NodeMemory:
        """``secret``: the job's secret (replicas over the authenticated channel); ``log``: a
        path the keeper's output goes to."""
        name = f"nonstop-test-{uuid.uuid4().hex[:8]}-n{node}"
        cmd = [sys.executable, "-m", "nonstop.keeper", name, "--node", str(node),
               "--parent", str(os.getpid())] + (["--writer"] if writer else [])
        env = dict(os.environ, NONSTOP_KEEPER_TOKEN=job_token if token is None else token)
        env.pop(SECRET_ENV, None)
        if secret is not None:
            env[SECRET_ENV] = secret
        out = None
        if log is not None:
            out = open(log, "wb")
            logs.append(out)
        procs.append(subprocess.Popen(cmd, start_new_session=True, env=env, stdout=out,
                                      stderr=out))
        deadline = time.time() + 15
        while True:
            try:
                mem = NodeMemory(name, timeout_s=30)
                mem.listing()
                return mem
            except (FileNotFoundError, ConnectionRefusedError):
                assert time.time() < deadline, "keeper did not start"
                time.sleep(0.02)

    yield start
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
    for f in logs:
        f.close()


def snapshot(mem: NodeMemory, rank: int, sd: dict, step: int, persist=None) -> shm.SlotInfo:
    lay = packing.layout(sd, {"step": step})
    size = shm.data_offset(len(lay.meta)) + lay.nbytes
    i, seq, slot, _ = mem.alloc(own(rank), size)
    info = shm.write_tensors(slot, lay.meta, lay.tensors, lay.specs, lay.nbytes, step, rank, 0, seq)
    mem.commit(own(rank), i, persist)
    return info


def wait_for(pred, timeout=10.0):
    deadline = time.time() + timeout
    while not pred():
        assert time.time() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_two_newest_snapshots_are_kept_and_outlive_the_writer(keepers):
    mem = keepers(0)
    sd = {"w": torch.zeros(1000)}
    for step in (1, 2, 3):
        sd["w"].fill_(step)
        snapshot(mem, 0, sd, step)
    assert mem.steps(own(0)) == [3, 2]
    other = NodeMemory(mem.name)  # another process's view (a replacement rank)
    with other.lease(own(0), 2) as (info, slot):
        assert slot.verify(info)
        assert torch.equal(packing.unpack(*slot.read(info))["w"], torch.full((1000,), 2.0))


def test_a_leased_slot_is_not_overwritten(keepers):
    mem = keepers(0)
    sd = {"w": torch.ones(10)}
    snapshot(mem, 0, sd, 1)
    snapshot(mem, 0, sd, 2)
    reader = NodeMemory(mem.name, timeout_s=0.5)
    with reader.lease(own(0), 1) as found:  # the older slot is being read (a restore, a disk write)
        assert found is not None
        with pytest.raises(TimeoutError):  # the next snapshot must wait for it...
            snapshot(NodeMemory(mem.name, timeout_s=0.5), 0, sd, 3)
    wait_for(lambda: mem.steps(own(0)) == [2, 1])
    snapshot(mem, 0, sd, 4)  # ...and goes ahead once it is released
    assert mem.steps(own(0)) == [4, 2]


def test_snapshots_reach_the_buddy_node_before_the_older_slot_is_reused(keepers):
    a, b = keepers(0), keepers(1)
    tcp_b = b.client.call(km.Ping())[0].tcp
    a.client.call(km.Configure(replicate={own(0): [tcp_b]}))
    sd = {"w": torch.randn(200_000)}
    for step in range(1, 6):
        sd["w"].add_(1)
        info = snapshot(a, 0, sd, step)
        if step > 1:  # this write waited for the previous snapshot to be on the buddy node
            assert step - 1 in b.steps(replica(0))
    wait_for(lambda: b.steps(replica(0)) == [5, 4])
    with b.lease(replica(0), 5) as (rinfo, slot):
        assert rinfo.checksum == info.checksum and slot.verify(rinfo)
        assert torch.equal(packing.unpack(*slot.read(rinfo))["w"], sd["w"])
    # the sender hears the buddy's ack a moment after the buddy has the replica
    wait_for(lambda: a.listing()[own(0)].replicated_step == 5)
    assert a.listing()[own(0)].repl_error is None


def test_snapshots_reach_every_buddy_and_each_says_what_its_replicas_cost(keepers):
    """``replicas: 2``: each snapshot is on both buddies before the older slot is written
    again, and each buddy reports the memory its replicas take (both slots)."""
    a, b, c = keepers(0), keepers(1), keepers(2)
    heard = wire.Client(b.name)
    heard.call(km.Subscribe())
    to = [m.client.call(km.Ping())[0].tcp for m in (b, c)]
    a.client.call(km.Configure(replicate={own(0): to}))
    sd = {"w": torch.randn(100_000)}
    for step in range(1, 5):
        sd["w"].add_(1)
        info = snapshot(a, 0, sd, step)
        if step > 1:  # this write waited for the previous snapshot to be on both buddies
            assert step - 1 in b.steps(replica(0)) and step - 1 in c.steps(replica(0))
    for m in (b, c):
        wait_for(lambda: m.steps(replica(0)) == [4, 3])
        with m.lease(replica(0), 4) as (rinfo, slot):
            assert rinfo.checksum == info.checksum and slot.verify(rinfo)
    wait_for(lambda: a.listing()[own(0)].replicated_step == 4)
    entry = a.listing()[own(0)]
    assert entry.buddies == to and entry.repl_error is None
    heard.sock.settimeout(30)
    held = km.decode_report(wire.recv(heard.sock)[0])
    while not isinstance(held, km.ReplicasHeld) or held.bytes < 2 * info.total:
        held = km.decode_report(wire.recv(heard.sock)[0])
    assert held == km.ReplicasHeld(bytes=2 * info.total, holders=1)


def test_a_buddy_cut_off_holds_up_neither_the_snapshots_nor_the_other_buddy(keepers):
    """Across hosts (the job's secret): one buddy takes connections and never answers (a host
    cut off without a reset). Writes wait for it 0.5 s once, then go on; the other buddy's
    sender is its own, and takes every snapshot meanwhile."""
    import socket

    silent = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nobody answers
    try:
        a, c = keepers(0, secret=SECRET), keepers(2, secret=SECRET)
        stuck = f"127.0.0.1:{silent.getsockname()[1]}"
        a.client.call(km.Configure(replicate={own(0): [stuck, c.client.call(km.Ping())[0].tcp]}))
        sd = {"w": torch.ones(1000)}
        t0 = time.monotonic()
        for step in range(1, 7):
            snapshot(a, 0, sd, step)
            wait_for(lambda: step in c.steps(replica(0)), timeout=5)
        assert time.monotonic() - t0 < 5  # (a connect to the cut-off buddy waits 10 s)
        assert f"{stuck}: the buddy did not take step" in a.listing()[own(0)].repl_error
        assert a.listing()[own(0)].replicated_step is None  # the stuck one holds none
    finally:
        silent.close()


def test_a_replica_without_the_jobs_token_is_refused(keepers):
    a, b = keepers(0, token="right"), keepers(1, token="other job")
    a.client.call(km.Configure(replicate={own(0): [b.client.call(km.Ping())[0].tcp]}))
    for step in (1, 2, 3):
        snapshot(a, 0, {"w": torch.ones(10)}, step)
    wait_for(lambda: a.listing()[own(0)].repl_error is not None)
    assert replica(0) not in b.listing()  # nothing was written into the other job's memory


SECRET = "keeper-test-secret-0123456789abcdef"


def test_replicas_across_hosts_travel_over_the_authenticated_channel(keepers):
    # different tokens: the replica can only have come through the channel (the job's secret)
    a = keepers(0, token="one", secret=SECRET)
    b = keepers(1, token="two", secret=SECRET)
    tcp_b = b.client.call(km.Ping())[0].tcp
    host, _, port = tcp_b.rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0  # "host:port" as before
    a.client.call(km.Configure(replicate={own(0): [tcp_b]}))
    sd = {"w": torch.randn(300_000)}
    for step in (1, 2, 3):
        sd["w"].add_(1)
        info = snapshot(a, 0, sd, step)
    wait_for(lambda: b.steps(replica(0)) == [3, 2])
    with a.lease(own(0), 3) as (oinfo, oslot), b.lease(replica(0), 3) as (rinfo, rslot):
        assert rinfo == oinfo == info and rslot.verify(rinfo)
        assert bytes(rslot.buffer[:info.total]) == bytes(oslot.buffer[:info.total])
        assert torch.equal(packing.unpack(*rslot.read(rinfo))["w"], sd["w"])
    wait_for(lambda: a.listing()[own(0)].replicated_step == 3)  # (its ack comes a moment later)
    assert a.listing()[own(0)].repl_error is None


def test_a_replica_without_the_jobs_secret_is_refused_and_logged(keepers, tmp_path):
    log = tmp_path / "b.log"
    b = keepers(1, secret=SECRET, log=log)
    tcp_b = b.client.call(km.Ping())[0].tcp
    other = keepers(0, secret="another-jobs-secret-0123456789abcdef")
    plain = keepers(2)  # no secret at all: the one-host token path
    for sender in (other, plain):
        sender.client.call(km.Configure(replicate={own(0): [tcp_b]}))
        snapshot(sender, 0, {"w": torch.ones(10)}, 1)
        wait_for(lambda: sender.listing()[own(0)].repl_error is not None)
    assert "refused" in other.listing()[own(0)].repl_error
    assert replica(0) not in b.listing()  # nothing was written into this job's memory
    wait_for(lambda: log.read_text().count("refused") >= 2)
    lines = [line for line in log.read_text().splitlines() if "refused" in line]
    assert len(lines) == 2, lines  # one line each
    assert "wrong secret" in lines[0] and "bad hello" in lines[1]


@pytest.mark.parametrize("env, said", [({SECRET_ENV: " \n", "NONSTOP_KEEPER_TOKEN": "t"}, "no job secret"),
                                       ({"NONSTOP_KEEPER_TOKEN": " "}, "no keeper token"),
                                       ({}, "no keeper token")])
def test_an_empty_job_secret_or_token_is_no_keeper(env, said):
    """Set but empty, or not set, fails closed: no keeper, rather than one taking
    unauthenticated replicas."""
    env = {k: v for k, v in dict(os.environ, **env).items()
           if k not in (SECRET_ENV, "NONSTOP_KEEPER_TOKEN") or k in env}
    out = subprocess.run([sys.executable, "-m", "nonstop.keeper",
                          f"nonstop-test-{uuid.uuid4().hex[:8]}-n0"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and said in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_a_replica_is_refused_rather_than_written_into_a_slot_leased_to_a_restore(keepers):
    a, b = keepers(0), keepers(1)
    b.client.call(km.Configure(free_within_s=0.3))
    a.client.call(km.Configure(replicate={own(0): [b.client.call(km.Ping())[0].tcp]}))
    sd = {"w": torch.zeros(50_000)}
    for step in (1, 2):
        sd["w"].fill_(step)
        snapshot(a, 0, sd, step)
    wait_for(lambda: b.steps(replica(0)) == [2, 1])
    reader = NodeMemory(b.name)
    with reader.lease(replica(0), 1) as (info, slot):  # a restore loads step 1 from the replica
        sd["w"].fill_(3)
        snapshot(a, 0, sd, 3)  # its replica would go to the leased slot: refused, not written
        wait_for(lambda: a.listing()[own(0)].repl_error is not None)
        assert "leased" in a.listing()[own(0)].repl_error
        assert slot.verify(info)  # the bytes under the lease are still step 1's
        assert torch.equal(packing.unpack(*slot.read(info))["w"], torch.full((50_000,), 1.0))
    sd["w"].fill_(4)
    snapshot(a, 0, sd, 4)  # the lease given back: replication goes on, over the same connection
    wait_for(lambda: b.steps(replica(0)) == [4, 2])
    # (the buddy lists step 4 a moment before the sender has read its reply)
    wait_for(lambda: a.listing()[own(0)].repl_error is None)


def test_a_dead_buddy_does_not_stop_snapshots(keepers):
    a = keepers(0)
    a.client.call(km.Configure(replicate={own(0): ["127.0.0.1:1"]}))  # nothing listens
    sd = {"w": torch.ones(10)}
    for step in range(1, 5):
        snapshot(a, 0, sd, step)
    assert a.steps(own(0)) == [4, 3]
    assert "Error" in a.listing()[own(0)].repl_error


def test_corruption_is_caught_by_the_checksum(keepers):
    mem = keepers(0)
    snapshot(mem, 0, {"w": torch.ones(10_000)}, 1)
    out = mem.corrupt(own(0))
    assert out.step == 1
    with mem.lease(own(0), 1) as (info, slot):
        assert not slot.verify(info)


def test_the_keepers_death_is_the_nodes_memory_lost(keepers):
    mem = keepers(0)
    snapshot(mem, 0, {"w": torch.ones(10)}, 1)
    os.kill(mem.keeper_pid, signal.SIGKILL)
    with pytest.raises((ConnectionError, OSError)):
        mem.listing()
    with pytest.raises((ConnectionError, OSError)):
        NodeMemory(mem.name).listing()


def test_a_snapshot_goes_to_disk_as_a_dcp_part(keepers, tmp_path):
    mem = keepers(0, writer=True)
    events = wire.Client(mem.name)
    events.call(km.Subscribe())
    model = torch.nn.Linear(4, 3)
    persist = km.DiskPart(holder=own(0), step=10, root=str(tmp_path), rank=0, world=1,
                          sharded=False, reason="periodic")
    snapshot(mem, 0, {"model": model.state_dict()}, 10, persist)
    snapshot(mem, 0, {"model": model.state_dict()}, 11)  # the slot is free again at once...
    snapshot(mem, 0, {"model": model.state_dict()}, 12)  # ...the part comes from a staged copy
    events.sock.settimeout(60)
    msg = km.decode_report(wire.recv(events.sock)[0])
    while not isinstance(msg, km.PartDone):
        assert not isinstance(msg, km.PartFailed), msg
        msg = km.decode_report(wire.recv(events.sock)[0])
    assert msg.job.step == 10
    checkpoint.finalize(tmp_path, 10, {0: km.encode(msg.part)}, world=1, sharded=False)
    sd, info = checkpoint.read_part(tmp_path, 10, 0)
    assert info["step"] == 10 and torch.equal(sd["model"]["weight"], model.weight.detach())


def test_a_keeper_that_only_answers_slowly_is_alive_one_on_its_way_out_is_not(keepers):
    """The controller's probe after a node's ranks die (``KeeperLink.answers``): a keeper
    stopped (not answering) is alive; killed, it is not - nor is a process in its exit, or a
    zombie, whose sockets may still be open (``pids.dying``)."""
    from nonstop.pids import dying

    mem = keepers(0)
    link = wire.KeeperLink(mem.name)
    pid = link.client.pid
    assert link.answers(0.3) and not dying(pid) and not dying(os.getpid())
    os.kill(pid, signal.SIGSTOP)
    try:
        assert link.answers(0.3) and not dying(pid)  # slow is alive
    finally:
        os.kill(pid, signal.SIGKILL)  # a stopped process dies of it too
    wait_for(lambda: dying(pid))
    assert not link.answers(0.3)
    link.close()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_for(lambda: _state(child.pid) == "Z")  # exited, not yet reaped: a zombie
    assert dying(child.pid)  # (it counts as dying before that, from the start of its exit)
    assert os.waitpid(child.pid, os.WNOHANG) != (0, 0)
    assert dying(child.pid)  # reaped: gone


def _state(pid):
    """The process's state letter in /proc (R, S, Z...)."""
    with open(f"/proc/{pid}/stat") as fh:
        stat = fh.read()
    return stat[stat.rfind(")") + 2:].split()[0]

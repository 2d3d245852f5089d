"""Bad input across hosts: one clear line, exit code 2, nothing left running. The hosts here are
agents on loopback with their own names (the rendezvous checks need no network namespaces)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import TRAIN, policy_file

from nonstop.protocol.hosts import JOURNAL, host_key
from nonstop.store.etcd import Etcd, parse_endpoints
from nonstop.store.etcd_server import EtcdCluster

pytestmark = pytest.mark.integration

SECRET = "input-test-secret-0123456789abcdef"


@pytest.fixture
def etcd(tmp_path):
    cluster = EtcdCluster([("e0", "127.0.0.1", [])], tmp_path / "etcd").start()
    yield cluster
    cluster.stop()


def launch(tmp_path, name: str, *flags: str, secret: str | None = SECRET,
           script: str = str(TRAIN), steps: tuple = ("--steps", "4000", "--sleep-ms", "5"),
           env: dict[str, str] | None = None) -> subprocess.Popen:
    env = dict(os.environ, **(env or {}))
    env.pop("NONSTOP_JOB_SECRET", None)
    if secret is not None:
        env["NONSTOP_JOB_SECRET"] = secret
    cmd = [sys.executable, "-m", "nonstop", "run", "--no-live", "--quiet", "--node-addr",
           "127.0.0.1", "--node-id", name, f"--run-dir={tmp_path / name}", *flags, script,
           *steps]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def refused(proc: subprocess.Popen, timeout: float = 60) -> str:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # not refused: ended whole, not left to the next tests
        end(proc)
        raise
    assert proc.returncode == 2, out + err
    lines = [x for x in err.splitlines() if x.strip()]
    # on a loaded machine the host may first say that etcd was slow to answer (its lease not
    # refreshed in time, registered again), or that it waits for the other hosts (they were
    # slow to start): notices, not errors; the one error line comes last
    notices = [x for x in lines[:-1] if x.startswith("nonstop: host ") and (
        "etcd" in x or "lease" in x or "waiting for the others" in x)]
    assert lines and lines[-1].startswith("nonstop: error: "), err
    assert len(notices) == len(lines) - 1, err
    assert "Traceback" not in out + err
    return lines[-1]


def end(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, 9)
        p.communicate(timeout=30)


@pytest.mark.parametrize("flags, secret, says", [
    (["--nnodes", "2", "--rdzv-endpoint", "etcd://127.0.0.1:1", "--rdzv-id", "j"], SECRET,
     "cannot reach etcd at 127.0.0.1:1"),
    (["--nnodes", "2", "--rdzv-endpoint", "etcd://127.0.0.1"], SECRET, "--rdzv-endpoint"),
    (["--nnodes", "2", "--rdzv-endpoint", "etcd://127.0.0.1:2379"], SECRET, "--rdzv-id"),
    (["--nnodes", "2"], SECRET, "needs --rdzv-endpoint"),
    (["--nnodes", "2:1", "--rdzv-endpoint", "etcd://127.0.0.1:2379", "--rdzv-id", "j"], SECRET,
     "--nnodes"),
    (["--nnodes", "2", "--rdzv-endpoint", "etcd://127.0.0.1:2379", "--rdzv-id", "j"], None,
     "NONSTOP_JOB_SECRET"),
    (["--nnodes", "2", "--rdzv-endpoint", "etcd://127.0.0.1:2379", "--rdzv-id", "j",
      "--node-addr", "198.18.255.77"], SECRET, "not an address of this host"),
    (["--nnodes", "2", "--rdzv-endpoint", "etcd://127.0.0.1:2379", "--rdzv-id", "j",
      "--failure-domain", "rack 3"], SECRET, "--failure-domain 'rack 3': a failure domain is"),
])
def test_bad_rendezvous_flags(tmp_path, flags, secret, says):
    t0 = time.time()
    line = refused(launch(tmp_path, "h0", *flags, secret=secret))
    assert says in line
    assert time.time() - t0 < 20


def test_a_host_the_job_has_no_room_for_a_host_with_another_secret_or_other_settings(tmp_path,
                                                                                   etcd):
    # (leases of 5 s: while two hosts import torch at once on a loaded machine, one of them
    # could miss its 2 s lease - then it is gone, and a third host rightly takes its place)
    pol = policy_file(tmp_path, "hosts:\n  lease_ttl_s: 5\n")
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", etcd.url,
              "--rdzv-id", "full", "--policy", pol]
    a, b = launch(tmp_path, "a", *common), launch(tmp_path, "b", *common)
    try:
        # the job is up once both are registered and its controller has published its first
        # generation (the journal): a third host has no place in it
        store = Etcd(parse_endpoints(etcd.url), "full")
        deadline = time.time() + 60
        while (len(store.get_prefix("hosts/")) < 2 or store.get(JOURNAL)[0] is None) \
                and time.time() < deadline:
            time.sleep(0.1)
        store.close()
        assert a.poll() is None and b.poll() is None
        # every host turned away is started at once: each is refused on its own (none of them
        # registers), the one with no room only after the room it waits for (a lapsing record)
        # did not come
        turned = {
            "c": launch(tmp_path, "c", *common),
            # another secret is refused before anything else
            "d": launch(tmp_path, "d", *common, secret="another-secret-0123456789abcdef"),
            # the same id with other settings: another job
            "e": launch(tmp_path, "e", "--nnodes", "3", "--nproc-per-node", "1",
                        "--rdzv-endpoint", etcd.url, "--rdzv-id", "full"),
            # the same job with other script arguments (a spare host started with --steps 150
            # where the others have 4000): it would train another job once it takes ranks
            "f": launch(tmp_path, "f", *common, steps=("--steps", "150", "--sleep-ms", "5")),
            # a variable that changes the numbers, set on one host only
            "g": launch(tmp_path, "g", *common, env={"OMP_NUM_THREADS": "3"}),
            # the same host name twice
            "a": launch(tmp_path, "a", *common),
        }
        try:
            said = {name: refused(p) for name, p in turned.items()}
        finally:  # (refused ends one that is not: a failure, the others still running)
            end(*[p for p in turned.values() if p.returncode is None])
        assert "already has 2 host(s)" in said["c"]
        assert "another secret" in said["d"]
        assert "other settings" in said["e"] and "nnodes" in said["e"]
        assert "the script or its arguments differ" in said["f"]
        assert "environment variables that change the numbers" in said["g"]
        assert "already in job" in said["a"]
    finally:
        end(a, b)


def test_a_machine_replacing_a_dead_host_at_once_is_let_in_when_its_record_lapses(tmp_path,
                                                                                  etcd):
    """A full job loses a host (killed whole: its record stays in etcd until its lease runs
    out) and a new machine is started in its place at once: it waits for that room rather
    than being refused as one host too many."""
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", etcd.url,
              "--rdzv-id", "again"]
    a, b = launch(tmp_path, "a", *common), launch(tmp_path, "b", *common)
    c = None
    try:
        store = Etcd(parse_endpoints(etcd.url), "again")
        deadline = time.time() + 30
        while len(store.get_prefix("hosts/")) < 2 and time.time() < deadline:
            time.sleep(0.1)
        assert a.poll() is None and b.poll() is None
        os.killpg(b.pid, signal.SIGKILL)
        b.communicate(timeout=30)
        assert len(store.get_prefix("hosts/")) == 2  # b's record lingers in its lease
        c = launch(tmp_path, "c", *common)
        deadline = time.time() + 30
        while time.time() < deadline and c.poll() is None and \
                not any(k == host_key("c") for k, *_ in store.get_prefix("hosts/")):
            time.sleep(0.1)
        store.close()
        assert c.poll() is None, c.communicate(timeout=30)
    finally:
        end(*[p for p in (a, b, c) if p is not None])


def test_a_host_alone_under_its_own_job_id_gives_up_clearly(tmp_path, etcd):
    pol = policy_file(tmp_path, "hosts:\n  join_timeout_s: 3\n")
    p = launch(tmp_path, "lonely", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint",
               etcd.url, "--rdzv-id", "typo", "--policy", pol)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2, out + err
    assert "only 1 of 2 host(s) joined job 'typo' within 3 s" in out + err
    assert "Traceback" not in out + err
    # the job id is spent: running it again says so at once
    line = refused(launch(tmp_path, "again", "--nnodes", "2", "--nproc-per-node", "1",
                          "--rdzv-endpoint", etcd.url, "--rdzv-id", "typo", "--policy", pol))
    assert "has already ended" in line


def test_a_host_that_registers_into_a_full_job_is_turned_away(tmp_path, etcd):
    """Three hosts start at once for a job of two: the third may register before it can see the
    job full; the controller then turns it away (one clear line, exit 2)."""
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", etcd.url,
              "--rdzv-id", "race"]
    procs = [launch(tmp_path, f"r{i}", *common) for i in range(3)]
    try:
        deadline = time.time() + 60
        while time.time() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.1)
        gone = [p for p in procs if p.poll() is not None]
        if len(gone) > 1 and all(p.returncode == 0 for p in gone):
            # the race went the other way: the third registered in time to be the job's spare
            # host, and the job ran to its end on the two others (it then ends with them)
            rest = [p for p in procs if p not in gone]
            assert all(p.wait(timeout=60) == 0 for p in rest)
            pytest.skip("all three hosts registered before the job formed: one was its spare")
        if len(gone) != 1:  # what each host said (ended first: their pipes end with them)
            said = []
            for i, p in enumerate(procs):
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                out, err = p.communicate(timeout=30)
                said.append(f"== r{i} (exit {p.returncode})\n{(out + err)[-1500:]}")
                for log in sorted((tmp_path / f"r{i}").rglob("controller.log")):
                    said.append(f"-- {log.relative_to(tmp_path)}\n{log.read_text()[-3000:]}")
            pytest.fail(f"{len(gone)} host(s) ended, not the one turned away:\n" + "\n".join(said))
        out, err = gone[0].communicate(timeout=60)
        assert gone[0].returncode == 2 and "Traceback" not in out + err, out + err
        lines = [x for x in err.splitlines() if x.strip()]
        assert lines[-1].startswith("nonstop: error: ") and "already has 2 host(s)" in lines[-1]
        # before it, only what a loaded machine makes a host say of etcd's leases
        assert all("etcd" in x for x in lines[:-1]), err
    finally:
        end(*procs)


def test_a_host_obeys_an_order_whose_controller_closed_before_its_answer(tmp_path, etcd):
    """A controller turning a host away says hello and its end, and closes the channel: a host
    whose loop reads them only then (stopped here; a loaded machine, or a host still importing
    torch) cannot send its answer to the hello, yet it must still end as told - not wait,
    silent, for the rest of the job."""
    from nonstop.net.channel import connect
    from nonstop.protocol import messages as m
    from nonstop.protocol.hosts import HostRecord

    c = launch(tmp_path, "c", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint",
               etcd.url, "--rdzv-id", "late")
    store = Etcd(parse_endpoints(etcd.url), "late")
    try:
        deadline = time.time() + 30
        while time.time() < deadline and not store.get_prefix("hosts/"):
            time.sleep(0.05)
        (_, raw, *_), = store.get_prefix("hosts/")
        rec = HostRecord.loads(raw)
        ch = connect(rec.addr, rec.ctl_port, SECRET.encode(), timeout_s=10)
        os.kill(c.pid, signal.SIGSTOP)
        try:
            ch.send(m.encode(m.Hello(epoch=1 << 40)))
            ch.send(m.encode(m.End(epoch=1 << 40, code=2, why="turned away by the test")))
            ch.close()
        finally:
            os.kill(c.pid, signal.SIGCONT)
        out, err = c.communicate(timeout=30)
    finally:
        store.close()
        end(c)
    assert c.returncode == 2, out + err
    assert [x for x in err.splitlines() if x.strip()][-1] == "nonstop: error: turned away by the test"


def test_a_host_slow_to_answer_at_the_start_is_waited_for(tmp_path, etcd):
    """A host registered in etcd that does not answer when the job starts (stopped here for 6 s:
    its lease expires meanwhile, it fences itself and registers again) is waited for, as etcd
    lists it, up to hosts.join_timeout_s: the job then runs on every host rather than placing
    ranks on a host it never reached."""
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", etcd.url,
              "--rdzv-id", "slow"]
    a = launch(tmp_path, "a", *common, steps=("--steps", "30"))
    store = Etcd(parse_endpoints(etcd.url), "slow")
    deadline = time.time() + 30
    while not store.get_prefix("hosts/") and time.time() < deadline:
        time.sleep(0.05)
    os.kill(a.pid, signal.SIGSTOP)  # registered, not answering
    b = launch(tmp_path, "b", *common, steps=("--steps", "30"))
    time.sleep(6)
    os.kill(a.pid, signal.SIGCONT)
    store.close()
    try:
        out_a, err_a = a.communicate(timeout=120)
        out_b, err_b = b.communicate(timeout=120)
    finally:
        end(a, b)
    assert a.returncode == 0 and b.returncode == 0, err_a[-2000:] + err_b[-2000:]


def test_the_first_host_with_the_odd_secret_out_is_the_one_refused(tmp_path, etcd):
    """The first host to join holds another secret than the two after it: it created the job's
    record, but it is outnumbered before the job formed. It is the one refused (one line, exit
    2); the two with the same secret run the job."""
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", etcd.url,
              "--rdzv-id", "secrets"]
    odd = launch(tmp_path, "odd", *common, secret="another-secret-0123456789abcdef",
                 steps=("--steps", "30"))
    store = Etcd(parse_endpoints(etcd.url), "secrets")
    try:
        deadline = time.time() + 30
        while store.get("job")[0] is None and time.time() < deadline:
            time.sleep(0.05)
        assert store.get("job")[0] is not None  # the odd one created the job's record
        a = launch(tmp_path, "a", *common, steps=("--steps", "30"))
        b = launch(tmp_path, "b", *common, steps=("--steps", "30"))
        try:
            line = refused(odd)
            assert "this host is the one refused" in line and "another secret" in line
            for p in (a, b):
                out, err = p.communicate(timeout=120)
                assert p.returncode == 0, out + err
        finally:
            end(a, b)
    finally:
        end(odd)
        store.close()

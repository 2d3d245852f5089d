"""etcd that pauses (a VM paused, a disk stalled, a long GC: SIGSTOP, then SIGCONT) and a
controller's host cut off, across test hosts: a lease that expired because etcd itself was away is
not evidence that a host is gone. Every host registers again as itself and keeps its ranks, its
memory and its steps; a host is given up only when the job moved on without it (in etcd, in one
transaction that its registering again also checks); a host cut off comes back as a spare. Each
run ends with the fault-free weights. (A controller's host paused or deaf:
tests/test_hosts_office.py.)"""

from __future__ import annotations

import threading
import time

import pytest
from conftest import EXAMPLES, bitwise_equal

from nonstop_bench import netns
from nonstop_bench.hostjob import HostJob
from nonstop_bench.hosts import _etcd, _wait_etcd
from nonstop.protocol import hosts as keys

pytestmark = pytest.mark.integration

ok, why = netns.available()
if not ok:
    pytest.skip(f"test hosts unavailable: {why}", allow_module_level=True)

STEPS = 300  # the reference of tests/test_hosts.py: one fault-free run serves both files
# train_ddp.py's job (the same weights, the same reference), slowed only while its slow file is
# there: slow while a fault is in flight, at full speed for the steps left once it is judged
TIMED = EXAMPLES / "train_timed.py"


@pytest.fixture
def job(tmp_path):
    made = []

    def make(hosts: int, etcd_members: int = 1) -> HostJob:
        j = HostJob(tmp_path / f"job{len(made)}", hosts, etcd_members).__enter__()
        made.append(j)
        return j

    yield make
    for j in made:
        j.close()


def _start(j: HostJob, hosts: int, *flags: str, sleep_ms: float) -> None:
    """Steps of ``sleep_ms`` more until ``_hurry``."""
    slow = j.base / "slow"
    slow.touch()
    for i in range(hosts):
        j.start(i, "--nnodes", "2", "--nproc-per-node", "2", *flags, script=str(TIMED),
                script_args=["--steps", str(STEPS), "--slow-file", str(slow), "--slow-ms",
                             str(sleep_ms), "--save", str(j.base / "final.pt")])


def _hurry(j: HostJob) -> None:
    """The faults are judged: the job runs its last steps at full speed."""
    (j.base / "slow").unlink()


def _step(j: HostJob) -> int:
    """The newest step any host's status line shows."""
    best = 0
    for i in j.outs:
        for line in j.output(i).splitlines():
            if "| step " in line:
                word = line.split("| step ", 1)[1].split()[0]
                if word.isdigit():
                    best = max(best, int(word))
    return best


def _until_step(j: HostJob, step: int, timeout: float) -> None:
    step = min(step, STEPS)
    deadline = time.monotonic() + timeout
    while _step(j) < step:
        if time.monotonic() > deadline:
            raise TimeoutError(f"step {step} not reached within {timeout} s")
        time.sleep(0.1)


def _finished(j: HostJob, hosts: int, reference) -> str:
    codes = j.wait(180)
    both = "\n".join(j.output(i) for i in range(hosts))
    assert set(codes.values()) == {0}, "\n".join(j.output(i)[-3000:] for i in codes)
    saved = [p for p in [j.base / "final.pt"] if p.exists()]
    assert len(saved) == 1 and bitwise_equal(saved[0], reference(4, "--steps", str(STEPS)))
    return both


def test_etcd_paused_5_s_then_8_s_costs_the_job_nothing(job, reference):
    """One member, paused twice while the job trains: no host fences itself, every host
    registers again as itself, a standby may take office (the leader's lease lapsed too) and
    finds the job steady: no incident, no step lost, the fault-free weights."""
    j = job(2)
    _start(j, 2, sleep_ms=150)  # 0.15 s steps: the job trains through both pauses
    _until_step(j, 30, 120)
    for pause in (5, 8):  # 8 s: the leases (2 s) lapse four times over
        j.etcd.pause_member("e0")
        time.sleep(pause)
        j.etcd.resume_member("e0")
        j.wait_output("registered again", 30)
        seen = _step(j)
        _until_step(j, seen + 10, 60)  # it trains on
    _hurry(j)
    both = _finished(j, 2, reference)
    assert "fenced" not in both
    assert both.count("registered again: its ranks train on") >= 2
    assert not j.of("incident") and not j.of("node_lost") and not j.of("fault")


def test_etcd_of_three_its_leader_then_a_follower_paused(job, reference):
    """Three members: the leader paused (the others elect another and extend every lease), then
    a follower: the clients fail over, nothing lapses, nothing happens to the job."""
    j = job(2, etcd_members=3)
    _start(j, 2, sleep_ms=60)
    _until_step(j, 30, 120)
    for name in ("e0", "e1"):  # e0 led the first election (members start in order)
        j.etcd.pause_member(name)
        time.sleep(5)
        j.etcd.resume_member(name)
        seen = _step(j)
        _until_step(j, seen + 10, 60)
    _hurry(j)
    both = _finished(j, 2, reference)
    assert "fenced" not in both
    assert not j.of("incident") and not j.of("node_lost")


def test_a_host_cut_off_while_etcd_is_paused_is_the_one_given_up(job, reference):
    """etcd paused, and meanwhile a training host cut off: when etcd wakes every lease has
    expired. The hosts that still speak to the controller register again; the cut one does not
    speak: the controller gives it up in etcd and moves its ranks to the spare host. The cut
    host, healed, finds itself given up, fences itself and comes back as a spare."""
    j = job(3)
    _start(j, 3, "--spare-nodes", "1", sleep_ms=60)
    _until_step(j, 40, 120)
    leader = j.of("leader")[0]
    order = list(leader["hosts"])  # the hosts in node order: nodes 0 and 1 hold the ranks
    name = next(h for h in order[:2] if h != leader["host"])  # not the controller's host
    victim = int(name.removeprefix("host"))
    j.etcd.pause_member("e0")
    time.sleep(1)
    j.hosts[victim].cut()
    time.sleep(4)
    j.etcd.resume_member("e0")
    j.wait_output("registered again", 30)
    j.wait_output("fenced", 60, hosts=[victim])
    j.hosts[victim].heal()
    _hurry(j)
    _finished(j, 3, reference)
    # given up by the controller in office, or by a standby that took office when the leader's
    # lease lapsed with everyone's (and found the host silent)
    lost = [e["node"] for e in j.of("node_lost")] + [n for e in j.of("takeover")
                                                     for n in e["lost"]]
    assert order.index(name) in lost
    incidents = j.of("incident")
    assert incidents and all(inc["steps_lost"] == 0 for inc in incidents)


def _lease_of(j: HostJob, key: str) -> int:
    """The lease a key of the job is held under in etcd."""
    import base64
    import json
    import urllib.request

    raw = base64.b64encode(f"/nonstop/{j.job_id}/{key}".encode()).decode()
    req = urllib.request.Request(f"{j.etcd.members[0].client_url}/v3/kv/range",
                                 data=json.dumps({"key": raw}).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=5) as r:
        (kv,) = json.loads(r.read())["kvs"]
    return int(kv["lease"])


def test_the_controllers_host_cut_off_and_healed_rejoins_as_a_spare(job, reference):
    """The controller's host cut off; it fences itself. A standby takes office while that
    host's old record is still in etcd, so it holds the old incarnation as a host of the job and
    says hello to it - and the host, healed, registers again as a new incarnation and answers
    that hello as the new one. The old incarnation is given up at once and the new one joins as a
    spare host (before, it was turned away: 'already has 3 host(s)'): the job has its spare
    again, and ends with the fault-free weights. The order is pinned from outside: the cut
    host's leases kept alive in etcd (as when their last refreshes reached etcd just before the
    cut) until it fenced itself, then the controller's revoked; the host healed but kept from
    etcd (a blackhole route) until the new controller has said hello to it."""
    j = job(3)
    _start(j, 3, "--spare-nodes", "1", sleep_ms=40)
    _until_step(j, 30, 120)
    name = j.of("leader")[0]["host"]
    victim = int(name.removeprefix("host"))
    with _etcd(j) as etcd:
        old = keys.HostRecord.loads(etcd.get(keys.host_key(name))[0]).incarnation
    leader_lease = _lease_of(j, keys.LEADER)
    leases = {_lease_of(j, keys.host_key(name)): threading.Event(),
              leader_lease: threading.Event()}

    def keep_alive() -> None:
        with _etcd(j) as etcd:
            while not all(done.is_set() for done in leases.values()):
                for lease, done in leases.items():
                    if not done.is_set():
                        try:
                            etcd.keepalive_once(lease, time.monotonic() + 1.0)
                        except Exception:  # noqa: BLE001 - asked again
                            pass
                time.sleep(0.3)

    keeper = threading.Thread(target=keep_alive, daemon=True)
    keeper.start()
    host = j.hosts[victim]
    route = ["ip", "route", "add", "blackhole", f"{j.etcd_hosts[0].addr}/32"]
    try:
        host.cut()
        j.wait_output("fenced (it reaches neither etcd nor any other host)", 60, hosts=[victim])
        host.run(route, timeout=10, check=True)
        host.heal()
        leases[leader_lease].set()
        with _etcd(j) as etcd:
            epoch = etcd.leader(keys.LEADER)[1]
            etcd.revoke_lease(leader_lease)  # (its controller was ended with the fence)
            deadline = time.monotonic() + 60
            while (etcd.leader(keys.LEADER) or ("", epoch))[1] == epoch:  # a standby in office
                assert time.monotonic() < deadline, "no controller took office"
                time.sleep(0.02)
        time.sleep(1.5)  # it has read the job's hosts and said hello to the healed one
    finally:
        for done in leases.values():
            done.set()
        keeper.join(10)
        host.run(["ip", "route", "del", *route[3:]], timeout=10)
        host.heal()
    _wait_etcd(j, "the healed host taken in by the new controller", lambda etcd: any(
        h.host == name and h.incarnation != old
        for h in keys.JournalRecord.loads(etcd.get(keys.JOURNAL)[0]).nodes.values()), 60)
    second = j.of("leader")[1]
    deadline = time.monotonic() + 30
    while not [e for e in j.of("node_joined") if e["t"] > second["t"]]:
        assert time.monotonic() < deadline, "the healed host did not join as a spare"
        time.sleep(0.1)
    _hurry(j)
    _finished(j, 3, reference)
    out = j.output(victim)
    assert "the most it takes" not in out and out.count("fenced") == 1, out[-3000:]
    assert name in second["hosts"] and second["takeover"], second

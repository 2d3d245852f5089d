"""etcd that pauses (a VM paused, a disk stalled, a long GC: SIGSTOP, then SIGCONT) and a
controller's host frozen, across test hosts: a lease that expired because etcd itself was away is
not evidence that a host is gone. Every host registers again as itself and keeps its ranks, its
memory and its steps; a host is given up only when the job moved on without it (in etcd, in one
transaction that its registering again also checks); a controller that cannot prove its lease
acts on nothing. Each run ends with the fault-free weights."""

from __future__ import annotations

import time

import pytest
from conftest import TRAIN, bitwise_equal

from nonstop.bench import netns
from nonstop.bench.hostjob import HostJob
from nonstop.bench.hosts import _wait_etcd
from nonstop.protocol import hosts as keys

pytestmark = pytest.mark.integration

ok, why = netns.available()
if not ok:
    pytest.skip(f"test hosts unavailable: {why}", allow_module_level=True)

STEPS = 300  # the reference of tests/test_hosts.py: one fault-free run serves both files


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
    for i in range(hosts):
        j.start(i, "--nnodes", "2", "--nproc-per-node", "2", *flags, script=str(TRAIN),
                script_args=["--steps", str(STEPS), "--sleep-ms", str(sleep_ms),
                             "--save", str(j.base / "final.pt")])


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


def test_etcd_paused_5_s_then_15_s_costs_the_job_nothing(job, reference):
    """One member, paused twice while the job trains: no host fences itself, every host
    registers again as itself, a standby may take office (the leader's lease lapsed too) and
    finds the job steady: no incident, no step lost, the fault-free weights."""
    j = job(2)
    _start(j, 2, sleep_ms=150)  # 45 s of steps: the job trains through both pauses
    _until_step(j, 30, 120)
    for pause in (5, 15):  # 15 s: the leases (2 s) lapse many times over
        j.etcd.pause_member("e0")
        time.sleep(pause)
        j.etcd.resume_member("e0")
        j.wait_output("registered again", 30)
        seen = _step(j)
        _until_step(j, seen + 10, 60)  # it trains on
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
    _finished(j, 3, reference)
    # given up by the controller in office, or by a standby that took office when the leader's
    # lease lapsed with everyone's (and found the host silent)
    lost = [e["node"] for e in j.of("node_lost")] + [n for e in j.of("takeover")
                                                     for n in e["lost"]]
    assert order.index(name) in lost
    incidents = j.of("incident")
    assert incidents and all(inc["steps_lost"] == 0 for inc in incidents)


def test_the_controllers_host_frozen_and_woken_steps_down_and_orders_nothing(job, reference):
    """The controller's host paused until a standby takes office and gives that host up
    (its ranks move to the spare host). Woken, the old controller cannot confirm its lease: it
    sends nothing, and its host, given up, fences itself and comes back as a spare - never
    'the controller failed'."""
    j = job(3)
    _start(j, 3, "--spare-nodes", "1", sleep_ms=60)
    _until_step(j, 40, 120)
    first = j.of("leader")[0]
    victim = int(first["host"].removeprefix("host"))
    j.hosts[victim].freeze()
    try:  # frozen until a standby took office and gave that host up in etcd (its gone/ key,
        # which the host's registering again checks): 10 s or so, more on a slow machine
        _wait_etcd(j, "the frozen host given up", lambda etcd: any(
            k.startswith(keys.GONE + first["host"] + "/") for k, *_ in etcd.get_prefix(keys.GONE)),
            60)
    finally:
        j.hosts[victim].thaw()
    both = _finished(j, 3, reference)
    leaders = j.of("leader")
    assert len(leaders) == 2 and leaders[1]["host"] != first["host"]
    assert "the controller failed" not in both and "a bug in nonstop" not in both
    out = j.output(victim)
    # woken, it could not confirm its lease (whatever it decided - a hang of its own frozen
    # ranks - waited: tests/test_cluster_office.py), and its host, given up while it was
    # frozen, fenced itself and its controller with it
    assert "fenced (the job gave this host up" in out
    assert not [e for e in j.of("decision") if e["t"] < leaders[1]["t"]]

"""nonstop across test hosts (network namespaces with their own addresses, etcd on a host of its
own): the same ``nonstop run`` on every host, faults on remote hosts and of whole hosts, checked
bitwise against the fault-free run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import EXAMPLES, PLAIN, TRAIN, bitwise_equal

from nonstop_bench import netns
from nonstop_bench.hostjob import HostJob

pytestmark = pytest.mark.integration

ok, why = netns.available()
if not ok:
    pytest.skip(f"test hosts unavailable: {why}", allow_module_level=True)

METRICS_PORT = 9400  # each test host has its own addresses: a fixed port is free on each
STEPS = 300  # one fault-free reference serves every test (the sleep changes no number)
SHARDED = EXAMPLES / "train_sharded.py"  # each rank's state is its own: only its copies hold it
SHARDED_STEPS = 150  # its own reference: a shorter run
LINGERS = Path(__file__).parent / "scripts" / "lingers.py"  # train_ddp.py, then a while longer
# train_ddp.py's job (the same weights, the same reference), its steps slower only while its slow
# file is there (``_timed``): slow while a fault is in flight, at full speed once it is judged
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


def _saved(j: HostJob, hosts: int) -> list:
    return [p for p in [j.base / "final.pt"] if p.exists()]


def _train(j: HostJob, i: int, *flags: str, steps: int = STEPS, sleep_ms: float = 0.0,
           script=TRAIN):
    return j.start(i, *flags, script=str(script),
                   script_args=["--steps", str(steps), "--sleep-ms", str(sleep_ms),
                                "--save", str(j.base / "final.pt")])


def _timed(j: HostJob, i: int, *flags: str, slow_ms: float, env: dict[str, str] | None = None):
    """train_ddp.py's job of STEPS steps on host ``i``, each ``slow_ms`` longer until ``_hurry``."""
    slow = j.base / "slow"
    slow.touch()
    return j.start(i, *flags, script=str(TIMED), env=env,
                   script_args=["--steps", str(STEPS), "--slow-file", str(slow), "--slow-ms",
                                str(slow_ms), "--save", str(j.base / "final.pt")])


def _hurry(j: HostJob) -> None:
    """The fault is judged: the job runs its last steps at full speed."""
    (j.base / "slow").unlink()


def _wait_event(j: HostJob, what: str, pred, timeout: float) -> dict:
    """The first event of the job that matches."""
    deadline = time.monotonic() + timeout
    while True:
        found = [e for e in j.events() if pred(e)]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"{what} not seen within {timeout} s"
        time.sleep(0.1)


def test_a_host_killed_whole_moves_its_ranks_to_the_spare_host(job, reference):
    """A sharded job (no rank holds another's state) with a snapshot every step: the host's
    ranks move to the spare host and take their state from the replicas their buddy host holds,
    sent keeper to keeper over the hosts' addresses on the job's authenticated channel."""
    j = job(3)
    for i in range(3):
        _train(j, i, "--nnodes", "2", "--nproc-per-node", "2", "--spare-nodes", "1",
               "--snapshot-every", "1", steps=SHARDED_STEPS, sleep_ms=10, script=SHARDED)
    j.wait_output("step 50 ", 90)
    leader = j.of("leader")[0]
    order = list(leader["hosts"])  # node order: the order the hosts joined
    # the host of node 1, unless the controller is there (that is another test): then node 0's
    victim_node = 1 if order[1] != leader["host"] else 0
    victim = order[victim_node]
    spare_node = 2
    j.kill_host(int(victim.removeprefix("host")))
    codes = j.wait(120)
    alive = {i: c for i, c in codes.items() if f"host{i}" != victim}
    assert set(alive.values()) == {0}, "\n".join(j.output(i)[-3000:] for i in alive)
    incidents = j.of("incident")
    # the newest snapshot of the lost ranks may still have been on its way to their buddy
    assert len(incidents) == 1 and incidents[0]["steps_lost"] <= 1
    # the survivors' collectives fail at once (the host's kernel resets their connections) and
    # the ranks that cannot leave are given up at the teardown deadline; or the lease expires
    # first: either way the ranks go to the spare host within the lease's TTL and a second
    assert incidents[0]["levels"][0] in ("rank replacement", "node replacement")
    assert incidents[0]["mttr_s"] <= 2 + 1
    spawns = {e["wid"]: e["node"] for e in j.of("spawn")}
    first, last = ({int(r): w for r, w in g["ranks"].items()}
                   for g in (j.of("generation")[0], j.of("generation")[-1]))
    on_victim = sorted(r for r, w in first.items() if spawns[w] == victim_node)
    assert len(on_victim) == 2
    assert sorted(r for r, w in last.items() if spawns[w] == spare_node) == on_victim
    assert [e["node"] for e in j.of("node_lost")] == [victim_node]  # its lease expired
    (rest,) = [e for e in j.of("restore") if e["gen"] > 0]
    assert {rest["sources"][str(r)] for r in on_victim} == {"buddy"}, rest
    assert {rest["sources"][str(r)] for r in set(first) - set(on_victim)} <= {"live", "memory"}
    # the replicas went on after it: every rank's buddy is a host that is alive
    buddies = j.of("replication")[-1]["buddies"]
    assert all(victim_node not in to for to in buddies.values()) and len(buddies) == 4, buddies
    saved = _saved(j, 3)
    assert len(saved) == 1 and bitwise_equal(saved[0], reference(4, "--steps", str(SHARDED_STEPS),
                                                                 script=SHARDED))


def test_a_host_and_its_buddy_killed_together_lose_nothing_with_two_replicas(job, reference):
    """``replicas: 2``: a sharded job on two hosts of ranks and two spare hosts, each host its
    own failure domain (named by the flag, by the environment, or the host itself). A host
    and its buddy are killed in the same second, while every rank pauses in a step (its
    snapshot is on both buddies by then): the host's ranks go to the spare host that holds
    their other replica (or read it where it is), 0 steps lost, the weights bitwise the
    fault-free run's. With one replica the same kill leaves no copy of the host's shards."""
    j = job(4)
    pol = j.base / "policy.yaml"
    pol.write_text("state:\n  snapshot:\n    replicas: 2\n")
    labels = [(["--failure-domain", "rack-a"], {}), ([], {"NONSTOP_FAILURE_DOMAIN": "rack-b"}),
              (["--failure-domain", "rack-c"], {}), ([], {})]
    # every rank pauses 1.5 s in steps 51 and 101 (and again if one is redone): the kill lands
    # in the first pause the whole job is in place for
    pauses = "slow:rank=all,step=51,ms=1500,steps=1;slow:rank=all,step=101,ms=1500,steps=1"
    for i, (flags, env) in enumerate(labels):
        j.start(i, "--nnodes", "2", "--nproc-per-node", "2", "--spare-nodes", "2",
                "--snapshot-every", "1", "--policy", str(pol), "--hang-timeout", "30",
                "--inject", pauses, *flags, script=str(SHARDED), env=env,
                script_args=["--steps", str(SHARDED_STEPS), "--sleep-ms", "10",
                             "--save", str(j.base / "final.pt")])
    for pause in ("step 50 ", "step 100 "):
        j.wait_output(pause, 120)
        placed = j.of("replication")[-1]
        if len(placed["domains"]) == 4:  # the spare hosts are in, their memory too
            break
    else:
        raise AssertionError(f"the spare hosts did not join in time: {placed}")
    t_seen = time.monotonic()
    leader = int(j.of("leader")[0]["host"].removeprefix("host"))
    host_of = _hosts_of_nodes(j)
    spawns = {e["wid"]: e["node"] for e in j.of("spawn")}
    first = {int(r): w for r, w in j.of("generation")[0]["ranks"].items()}
    # a host of ranks and its buddy, neither the controller's host (that is another test)
    pairs = [(v, b) for v in (1, 0) if host_of[v] != leader
             for b in placed["buddies"][str(min(r for r, w in first.items() if spawns[w] == v))]
             if host_of[b] != leader]
    assert pairs, (placed, host_of, leader)
    victim, buddy = pairs[0]
    time.sleep(max(0.0, 0.3 - (time.monotonic() - t_seen)))  # the replicas of the paused step
    j.kill_host(host_of[victim])
    j.kill_host(host_of[buddy])
    codes = j.wait(150)
    alive = {i: c for i, c in codes.items() if i not in (host_of[victim], host_of[buddy])}
    assert set(alive.values()) == {0}, "\n".join(j.output(i)[-3000:] for i in alive)
    # (one replica: the same kill took both copies of a host's shards, and the job started
    # over from step 0, 51 steps lost)
    incidents = j.of("incident")
    assert incidents and all(i["outcome"] == "recovered" for i in incidents), incidents
    assert sum(i["steps_lost"] for i in incidents) == 0, incidents
    # the lost ranks' state came from the replica that was left, named by the node it was on
    last = j.of("generation")[-1]["ranks"]
    lost = {r for r, w in first.items() if spawns[w] in (victim, buddy)}
    rest = j.of("restore")[-1]
    assert rest["gen"] == j.of("generation")[-1]["gen"]
    assert {rest["sources"][str(r)] for r in lost} == {"buddy"}, rest
    assert all(rest["buddy_nodes"][str(r)] not in (victim, buddy) for r in lost), rest
    assert {spawns[w] for w in last.values()}.isdisjoint({victim, buddy})
    # two copies of every rank's snapshots, each in a domain of its own: the labels as given
    assert placed["copies"] == 2 and placed["short"] is None
    assert sorted(placed["domains"].values()) == ["host3", "rack-a", "rack-b", "rack-c"]
    assert all(len(set(n)) == 2 and spawns[first[int(r)]] not in n
               for r, n in placed["buddies"].items()), placed
    # what the replicas cost: each holding node said its bytes, and the summary has them
    held = [e for e in j.of("replica_memory") if e["nodes"]]
    assert held and all(b > 0 for b in held[0]["nodes"].values())
    (end,) = j.of("run_end")
    reps = end["state"]["replicas"]
    assert reps["copies"] == 2 and reps["held_bytes"]
    saved = _saved(j, 4)
    assert len(saved) == 1 and bitwise_equal(saved[0], reference(4, "--steps", str(SHARDED_STEPS),
                                                                 script=SHARDED))


def _hosts_of_nodes(j: HostJob) -> dict[int, int]:
    """node -> the test host it is, by the address its memory takes replicas at."""
    addrs = [h.addr for h in j.hosts]
    return {int(n): addrs.index(k["replicas_at"].rpartition(":")[0])
            for e in j.of("keepers") for n, k in e["nodes"].items()}


def _listeners(host) -> set[str]:
    """The local addresses of the TCP listeners in a test host (its processes are the job's)."""
    out = host.run(["ss", "-ltnH"], timeout=10, capture_output=True, text=True).stdout
    return {line.split()[3].rsplit(":", 1)[0].strip("[]") for line in out.splitlines() if line.strip()}


def _victim(j: HostJob) -> tuple[int, int]:
    """A host that holds ranks and not the controller: (test host index, node)."""
    leader = j.of("leader")[0]
    order = list(leader["hosts"])  # node order: the order the hosts joined
    node = 1 if order[1] != leader["host"] else 0
    return int(order[node].removeprefix("host")), node


def test_a_partitioned_host_fences_itself_and_comes_back_as_a_spare(job, reference):
    j = job(3)
    for i in range(3):
        _timed(j, i, "--nnodes", "2", "--nproc-per-node", "2", "--spare-nodes", "1",
               slow_ms=25)
    j.wait_output("step 50 ", 90)
    victim, node = _victim(j)
    t_cut = time.time()
    j.hosts[victim].cut()  # no packets either way, no resets
    j.wait_output("fenced", 30, hosts=[victim])
    j.hosts[victim].heal()
    _wait_event(j, "spares started on the healed host",
                lambda e: e["type"] == "spawn" and e["node"] == 3 and e["spare"], 60)
    _hurry(j)
    codes = j.wait(150)
    assert set(codes.values()) == {0}, "\n".join(j.output(i)[-3000:] for i in codes)
    assert [e["node"] for e in j.of("node_lost")] == [node]
    # (on a loaded machine the spare host, slow to start, may join after the job started too)
    joined = [e for e in j.of("node_joined") if e["t"] > t_cut]
    assert len(joined) == 1 and joined[0]["node"] == 3  # the healed host, as a new spare node
    # its spares were started there: the pool of spare hosts is full again
    assert any(e["node"] == 3 and e["spare"] for e in j.of("spawn"))
    # no split brain: no process of the cut host's joined any generation after the first
    spawns = {e["wid"]: e["node"] for e in j.of("spawn")}
    assert not [e for e in j.of("rank_joining") if e["gen"] > 0 and spawns[e["wid"]] == node]
    incidents = j.of("incident")
    assert len(incidents) == 1 and incidents[0]["steps_lost"] == 0
    saved = _saved(j, 3)
    assert len(saved) == 1 and bitwise_equal(saved[0], reference(4, "--steps", str(STEPS)))


def test_the_controller_killed_training_goes_on_then_a_crash_on_a_remote_host(job, reference):
    """The controller is SIGKILLed: the ranks train on and a standby takes office within the
    lease's TTL and a second. Then a rank crashes: the new controller replaces it from the warm
    spare on its host, nothing lost. Meanwhile one host's clock is 30 s ahead (its agent and its
    ranks report times that far off): no decision compares two hosts' clocks, so nothing is judged
    hung or late for it. And every listener of the job binds its host's address or loopback."""
    j = job(2)
    for i in range(2):
        _timed(j, i, "--nnodes", "2", "--nproc-per-node", "2", "--spares", "1",
               "--inject", "crash:rank=3,step=250", "--metrics-port", str(METRICS_PORT),
               "--metrics-addr", j.hosts[i].addr, slow_ms=20,
               env={"NONSTOP_TEST_CLOCK_SHIFT_S": "30" if i == 1 else "0"})
    j.wait_output("step 50 ", 90)
    for h in j.hosts:
        listening = _listeners(h)
        assert listening and listening <= {h.addr, "127.0.0.1"}, (h.addr, listening)
    first = j.of("leader")[0]
    _observed_from_outside(j, first)
    t_kill = time.time()
    os.kill(first["pid"], signal.SIGKILL)
    _wait_event(j, "a standby in office", lambda e: e["type"] == "takeover", 60)
    _hurry(j)  # on to the crash at full speed
    codes = j.wait(150)
    assert codes == {0: 0, 1: 0}, j.output(0)[-3000:] + j.output(1)[-3000:]
    leaders = j.of("leader")
    assert len(leaders) == 2 and leaders[1]["takeover"] and leaders[1]["epoch"] > first["epoch"]
    # in office within the lease's TTL and a second (the events' times are the test host's)
    assert leaders[1]["t"] - t_kill <= 2 + 1
    take = j.of("takeover")
    assert len(take) == 1 and take[0]["steady"] and not take[0]["missing"]
    incidents = j.of("incident")
    assert len(incidents) == 1 and incidents[0]["levels"] == ["rank replacement"]
    assert incidents[0]["steps_lost"] == 0
    assert 0 <= incidents[0]["mttr_s"] < 5 and all(0 <= v < 5 for v in incidents[0]["phases_s"].values())
    assert not [f for f in j.of("fault") if f["kind"] not in ("crash", "peer")]  # no false hang
    replace = j.of("replace")
    assert [r["rank"] for r in replace] == [3] and replace[0]["warm"]
    spawns = {e["wid"]: e["node"] for e in j.of("spawn")}
    gen0 = {int(r): w for r, w in j.of("generation")[0]["ranks"].items()}
    assert spawns[replace[0]["wid"]] == spawns[gen0[3]]  # the spare on rank 3's own host
    saved = _saved(j, 2)
    assert len(saved) == 1 and bitwise_equal(saved[0], reference(4, "--steps", str(STEPS)))


def test_the_controller_killed_as_the_job_ends(job, reference):
    """The controller SIGKILLed once training is over, while the ranks' script still runs (it
    lingers after training, as one that uploads its results would): the ranks exit 0 with no
    controller in office. The standby taking office finds every rank ran to the end and ends the
    job well - no crash to recover, no restart, exit 0 everywhere."""
    j = job(2)
    for i in range(2):
        j.start(i, "--nnodes", "2", "--nproc-per-node", "2", script=str(LINGERS),
                env={"LINGER_S": "0.3"},
                script_args=["--steps", str(STEPS), "--save", str(j.base / "final.pt")])
    j.wait_output("lingering", 120)
    first = j.of("leader")[0]
    os.kill(first["pid"], signal.SIGKILL)
    codes = j.wait(120)
    assert codes == {0: 0, 1: 0}, j.output(0)[-3000:] + j.output(1)[-3000:]
    leaders = j.of("leader")
    assert len(leaders) == 2 and leaders[1]["takeover"]
    (take,) = j.of("takeover")
    assert take["finished"] == [0, 1, 2, 3] and not take["missing"], take
    assert not j.of("incident") and not j.of("fault") and len(j.of("generation")) == 1
    saved = _saved(j, 2)
    assert len(saved) == 1 and bitwise_equal(saved[0], reference(4, "--steps", str(STEPS)))


def _observed_from_outside(j: HostJob, leader: dict) -> None:
    """Each host's metrics on its port, the job's on the next one of the controller's host,
    and nonstop status through etcd: the same job of 4 ranks on 2 hosts."""
    from test_observe_live import scrape, value

    for h in j.hosts:
        host = scrape(f"http://{h.addr}:{METRICS_PORT}/metrics")
        assert value(host, "nonstop_host_processes", role="rank") == 2, host
        assert value(host, "nonstop_host_etcd_reachable") == 1
    office = j.hosts[int(leader["host"].removeprefix("host"))]
    deadline = time.monotonic() + 10
    while True:  # the gauges are set at the controller's first progress tick
        jobm = scrape(f"http://{office.addr}:{METRICS_PORT + 1}/metrics")
        if value(jobm, "nonstop_ranks", state="alive") == 4 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert value(jobm, "nonstop_ranks", state="alive") == 4 and value(jobm, "nonstop_world_size") == 4
    r = subprocess.run([sys.executable, "-m", "nonstop", "status", "--rdzv-endpoint", j.etcd.url,
                        "--rdzv-id", j.job_id, "--json"], capture_output=True, text=True,
                       timeout=60)
    st = json.loads(r.stdout)
    assert st["world"] == 4 and st["nodes"]["total"] == 2 and not st["over"], st
    assert sorted(x["node"] for x in st["ranks"]) == [0, 0, 1, 1]


def test_the_controllers_host_killed_whole(job, reference):
    """The host of the controller in office dies with its ranks: a standby on another host takes
    office within the lease's TTL and a second, finds the ranks gone and moves them to the spare
    host."""
    j = job(3)
    for i in range(3):
        _timed(j, i, "--nnodes", "2", "--nproc-per-node", "2", "--spare-nodes", "1",
               slow_ms=10)
    j.wait_output("step 50 ", 90)
    first = j.of("leader")[0]
    order = list(first["hosts"])
    victim = int(first["host"].removeprefix("host"))
    # (its own host, registered last of the three on a loaded machine, joined as the spare node)
    victim_node = order.index(first["host"]) if first["host"] in order else len(order)
    t_kill = time.time()
    j.kill_host(victim)
    take = _wait_event(j, "a standby in office", lambda e: e["type"] == "takeover", 60)
    if victim_node in take["lost"] and victim_node < 2:  # its ranks move to the spare host
        _wait_event(j, "the incident closed", lambda e: e["type"] == "incident", 60)
    _hurry(j)
    codes = j.wait(150)
    alive = {i: c for i, c in codes.items() if i != victim}
    assert set(alive.values()) == {0}, "\n".join(j.output(i)[-3000:] for i in alive)
    leaders = j.of("leader")
    assert len(leaders) == 2 and leaders[1]["takeover"] and leaders[1]["host"] != first["host"]
    assert leaders[1]["t"] - t_kill <= 2 + 1
    take = j.of("takeover")[0]
    assert victim_node in take["lost"]
    if victim_node < 2:  # it held ranks: they moved to the spare host, nothing lost
        assert not take["steady"]
        incidents = j.of("incident")
        assert len(incidents) == 1 and incidents[0]["steps_lost"] == 0
        # timed from the predecessor's last status (twice a second), not from the takeover
        assert incidents[0]["t_fault"] <= t_kill + 0.1
        assert incidents[0]["mttr_s"] >= leaders[1]["t"] - t_kill
        spawns = {e["wid"]: e["node"] for e in j.of("spawn")}
        last = j.of("generation")[-1]["ranks"].values()
        assert {spawns[w] for w in last} == {0, 1, 2} - {victim_node}
    saved = _saved(j, 3)
    assert len(saved) == 1 and bitwise_equal(saved[0], reference(4, "--steps", str(STEPS)))
    # the summary is the whole job's, from the first controller's start, not the last one's term
    (end,) = j.of("run_end")
    (start,) = [e for e in j.of("run_start")][:1]
    assert abs(end["wall_s"] - (end["t"] - start["t"])) < 2.0, (end["wall_s"], end["t"] - start["t"])
    assert end["in_office_s"] < end["wall_s"] - 1.0
    assert end["incidents"] == len(j.of("incident"))  # the takeover's own, when it held ranks
    from nonstop.observe import goodput
    assert abs(goodput.total(end["time_s"]) - end["wall_s"]) < 0.05


def test_a_health_check_fails_on_one_host_its_ranks_move_to_the_spare_host(job, reference):
    """Health checks run on each host, by its agent: a failing one on a host that holds ranks
    moves them to the spare host and isolates the host."""
    j = job(3)
    marker = j.base / "bad"
    pol = j.base / "policy.yaml"
    pol.write_text("detect:\n  health_checks:\n"
                   f"    - {{name: disk, command: 'test ! -e {marker}-$NONSTOP_TEST_HOST', "
                   "every_s: 0.3, timeout_s: 5}\n")
    for i in range(3):
        _timed(j, i, "--nnodes", "2", "--nproc-per-node", "2", "--spare-nodes", "1",
               "--policy", str(pol), slow_ms=10, env={"NONSTOP_TEST_HOST": f"host{i}"})
    j.wait_output("step 50 ", 90)
    victim, node = _victim(j)
    marker.with_name(f"bad-host{victim}").write_text("")
    _wait_event(j, "the incident closed", lambda e: e["type"] == "incident", 60)
    _hurry(j)
    codes = j.wait(120)
    assert set(codes.values()) == {0}, "\n".join(j.output(i)[-3000:] for i in codes)
    health = [e for e in j.of("health") if e.get("check") == "disk"]
    assert health and {e["node"] for e in health} == {node}
    incidents = j.of("incident")
    assert len(incidents) == 1 and incidents[0]["levels"] == ["node replacement"]
    assert [e["node"] for e in j.of("isolate")] == [node]
    saved = _saved(j, 3)
    assert len(saved) == 1 and bitwise_equal(saved[0], reference(4, "--steps", str(STEPS)))


def test_etcd_a_member_lost_quorum_lost_for_5_s_then_for_good(job):
    """etcd of three members: one lost goes unnoticed; the quorum lost for 5 s (as etcd stopped
    and started again) does not stop training, and the control plane resumes; lost for longer
    than hosts.store_outage_s, the job ends with a diagnosis (no host fenced: they reached each
    other, etcd was what was down), and the state saved first: the newest step every rank holds
    in the hosts' memory, written by each host's keeper into the checkpoint directory they share."""
    from nonstop.state import checkpoint

    j = job(2, etcd_members=3)
    pol = j.base / "policy.yaml"
    pol.write_text("hosts:\n  store_outage_s: 7\n")
    ckpt = j.base / "ckpt"
    for i in range(2):
        # no periodic checkpoint: the emergency save has the newest step to write
        _train(j, i, "--nnodes", "2", "--nproc-per-node", "2", "--policy", str(pol),
               "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1000000", steps=100_000,
               sleep_ms=20, script=SHARDED)
    j.wait_output("step 50 ", 90)
    j.etcd.stop_member("e0")  # one of three: a quorum is left
    j.wait_output("step 100 ", 60)
    j.etcd.stop_member("e1")  # no quorum
    time.sleep(5)
    j.etcd.start_member("e0")
    j.etcd.start_member("e1")
    j.wait_output("etcd is back: the control plane resumes", 30)
    assert not j.of("fault") and all(p.poll() is None for p in j.procs.values())
    j.etcd.stop_member("e0")
    j.etcd.stop_member("e1")  # and now for good
    t0 = time.time()
    codes = j.wait(90)
    assert codes == {0: 1, 1: 1}, j.output(0)[-3000:] + j.output(1)[-3000:]
    # the tolerance, the lease's TTL, the emergency save (its grace, 20 s, at most) and ending
    assert time.time() - t0 < 7 + 2 + 20 + 5
    both = j.output(0) + j.output(1)
    assert "unreachable for" in both and "hosts.store_outage_s=7" in both
    assert "fenced" not in both
    ends = j.of("run_end")
    assert ends and ends[-1]["exit_code"] == 1 and "etcd" in ends[-1]["diagnosis"]
    assert not j.of("incident")  # nothing was recovered from: training never stopped
    (saved,) = j.of("emergency_checkpoint")
    assert saved["complete"] and saved["step"] > 100, saved
    # every rank's part (a sharded job: four parts), from the keepers of both hosts
    assert {v.rsplit(" ", 1)[-1] for v in saved["sources"].values()} == {"0", "1"}
    assert checkpoint.complete_steps(ckpt)[0] == saved["step"]


def test_a_plain_torchrun_script_across_hosts_is_restarted_whole(job, reference):
    """A script without nonstop.wrap: each generation rendezvouses through MASTER_ADDR/PORT on a
    fresh store of its rank 0's host; a rank killed restarts every rank."""
    reference.ahead(4, "--steps", "600", script=PLAIN)  # computed while the job runs
    j = job(2)
    for i in range(2):
        j.start(i, "--nnodes", "2", "--nproc-per-node", "2", script=str(PLAIN),
                script_args=["--steps", "600", "--save", str(j.base / "final.pt")])
    at = j.wait_output("step 100 ", 90)
    victim = j.hosts[1 - at]  # a rank on the host that does not print rank 0's lines
    pids = [p for p in victim.pids()  # rank processes, forked from the zygote, are named so
            if open(f"/proc/{p}/comm").read().startswith("nonstop-w")]
    assert pids
    os.kill(pids[0], signal.SIGKILL)
    codes = j.wait(150)
    assert codes == {0: 0, 1: 0}, j.output(0)[-3000:] + j.output(1)[-3000:]
    incidents = j.of("incident")
    assert len(incidents) == 1 and incidents[0]["levels"] == ["job restart"]
    assert "(restart 1)" in j.output(0) + j.output(1)
    saved = _saved(j, 2)
    assert len(saved) == 1 and bitwise_equal(saved[0], reference(4, "--steps", "600",
                                                                 script=PLAIN))


def test_a_link_that_slows_in_the_middle_of_a_run_is_waited_for_not_taken_for_a_hang(job, reference):
    """Steps of 20 ms tune the hang timeout to its floor (1 s); then one host's link drops to 128
    kbit/s for a few seconds, and a step takes several seconds. The ranks' groups still deliver
    bytes: a slow link, said once, and waited for - no rank is replaced (a restart cannot speed a
    link), nothing is lost, the weights are the fault-free run's."""
    j = job(2)
    args = ["--steps", "250", "--hidden", "512", "--sleep-ms", "20"]
    for i in range(2):
        j.start(i, "--nnodes", "2", "--nproc-per-node", "1", script=str(TRAIN),
                script_args=[*args, "--save", str(j.base / "final.pt")])
    deadline = time.monotonic() + 90
    while len(j.of("rank_first_step")) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(2.0)  # steps enough for the timeout to be tuned to its floor
    slowed = j.hosts[1]
    slowed.throttle(128)
    try:
        deadline = time.monotonic() + 30
        while not j.of("slow_step") and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)
    finally:
        slowed.unthrottle()
    codes = j.wait(120)
    assert set(codes.values()) == {0}, "\n".join(j.output(i)[-3000:] for i in codes)
    assert j.of("slow_step"), "the link never slowed a step past the timeout"
    assert not j.of("hang_detected") and not j.of("incident") and not j.of("fault")
    assert "not a hang" in j.output(0) + j.output(1)
    assert bitwise_equal(j.base / "final.pt", reference(2, *args))

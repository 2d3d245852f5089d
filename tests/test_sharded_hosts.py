"""A sharded job across test hosts (network namespaces with their own addresses, etcd on a host
of its own): HSDP with one replica group per host, a host killed whole, its ranks moved to the
spare host, each receiving its shard from its twin on the surviving host - checked bitwise."""

from __future__ import annotations

import pytest
from conftest import EXAMPLES, bitwise_equal

from nonstop_bench import netns
from nonstop_bench.hostjob import HostJob

pytestmark = pytest.mark.integration

ok, why = netns.available()
if not ok:
    pytest.skip(f"test hosts unavailable: {why}", allow_module_level=True)

HSDP = EXAMPLES / "train_hsdp.py"
ARGS = ("--steps", "60", "--dim", "16", "--blocks", "1")


def start_and_kill(j: HostJob, script, args, sleep_ms: int, *flags: str
                   ) -> tuple[int, str, dict]:
    """2 hosts of 2 ranks and a spare host train ``script``; at step 25 the job host that does
    not hold the controller (wherever the election put it) is killed whole. Returns its node,
    its name and the first leader's record."""
    for i in range(3):
        j.start(i, "--nnodes", "2", "--nproc-per-node", "2", "--spare-nodes", "1", *flags,
                script=str(script), script_args=[*args, "--sleep-ms", str(sleep_ms), "--save",
                                                 str(j.base / "final.pt")])
    j.wait_output("step 25 ", 120)
    leader = j.of("leader")[0]
    order = list(leader["hosts"])  # node order: the order the hosts joined
    victim_node = 1 if order[1] != leader["host"] else 0
    j.kill_host(int(order[victim_node].removeprefix("host")))
    return victim_node, order[victim_node], leader


def run_and_kill_a_host(j: HostJob, script, args, snapshot_every: int) -> int:
    """``start_and_kill``, then the job runs to its end. Returns the killed node; the surviving
    hosts must have ended well. (No hang is injected: a fixed 10 s hang timeout keeps a step
    slowed by a loaded machine from counting as one - the 1 s floor of the tuned timeout once
    did, after the recovery, and made a second generation.)"""
    victim_node, victim, _ = start_and_kill(j, script, args, 15, "--snapshot-every",
                                            str(snapshot_every), "--hang-timeout", "10")
    codes = j.wait(150)
    alive = {i: c for i, c in codes.items() if f"host{i}" != victim}
    assert set(alive.values()) == {0}, "\n".join(j.output(i)[-3000:] for i in alive)
    return victim_node


def kill_then_cut(j: HostJob, script, args, snapshot_every: int, pol: str, *flags: str) -> int:
    """``start_and_kill`` (the killed host's ranks go to the spare host), then at step 50 the
    other job host that is not the controller's is cut off (no spare host is left: the job
    shrinks), fences itself, is healed and joins again as a new host (the job grows back onto
    it). Returns the killed host's node; the surviving hosts must have ended well, through a
    node replacement, a scale-in and a scale-out."""
    victim_node, killed, leader = start_and_kill(j, script, args, 25, "--snapshot-every",
                                                 str(snapshot_every), "--policy", pol, *flags)
    j.wait_output("incident 1 recovered", 60)
    # the spare host holds the killed host's ranks now; cut the job host that is not the
    # controller's (the first leader's list may predate the spare host's joining: all three by
    # name)
    (cut,) = [h for h in (f"host{i}" for i in range(3)) if h not in (killed, leader["host"])]
    cut_i = int(cut.removeprefix("host"))
    j.wait_output("step 50 ", 90)  # (90-100 steps left: the world shrinks and grows back first)
    j.hosts[cut_i].cut()
    j.wait_output("fenced", 30, hosts=[cut_i])
    j.hosts[cut_i].heal()  # it joins again, as a new host
    codes = j.wait(180)
    alive = {i: c for i, c in codes.items() if f"host{i}" != killed}
    assert set(alive.values()) == {0}, "\n".join(j.output(i)[-3000:] for i in alive)
    levels = [d["level"] for d in j.of("decision")]
    assert levels == ["node replacement", "scale-in", "scale-out"], levels
    return victim_node


def test_an_hsdp_host_killed_whole_its_shards_come_from_their_twins_on_the_other_host(
        tmp_path, reference):
    """2 hosts of 2 ranks and a spare host; the mesh (2 replica groups x 2 shards) puts one
    replica group on each host. The host of node 1 (not the controller's) is killed: its two
    ranks go to the spare host and take their shards live from their twins on node 0, across
    the hosts' addresses - no snapshot needed, no step lost beyond the one in flight."""
    reference.ahead(4, *ARGS, script=HSDP)  # computed while the job runs
    with HostJob(tmp_path / "job", 3) as j:
        victim_node = run_and_kill_a_host(j, HSDP, ARGS, snapshot_every=10)
        (incident,) = j.of("incident")
        left = {e["rank"]: e["step"] for e in j.of("rank_left") if e["gen"] == 0}
        spawns = {e["wid"]: e["node"] for e in j.of("spawn")}
        first = {int(r): w for r, w in j.of("generation")[0]["ranks"].items()}
        on_victim = sorted(r for r, w in first.items() if spawns[w] == victim_node)
        assert len(on_victim) == 2
        (rest,) = [e for e in j.of("restore") if e["gen"] > 0]
        survivors = {left[r] for r in left if r not in on_victim}
        if len(survivors) == 1:  # they left at one step: the lost shards come from their twins
            assert incident["steps_lost"] == 0, incident
            assert {rest["sources"][str(r)] for r in range(4)} == {"live"}, rest
        else:
            # a step in flight: gloo's ring completed on one survivor and not on the other, so
            # the two shard positions ended a step apart and no twin holds the older one: the job
            # goes back to the newest snapshot every shard has (known weak: docs/design.md)
            assert incident["steps_lost"] <= 10 + 1, incident
        assert bitwise_equal(j.base / "final.pt", reference(4, *ARGS, script=HSDP))


PP = EXAMPLES / "train_pp.py"
PP_ARGS = ("--steps", "150", "--dim", "8", "--blocks", "1")


def test_a_pipeline_across_hosts_moves_to_the_spare_host_then_shrinks_without_one(tmp_path,
                                                                                   reference):
    """(dp, pp) = (2, 2) on 2 hosts of 2 ranks and a spare host: one data-parallel group - a
    whole pipeline, both stages - on each host. Two faults of the outside world:
    1. a job host that is not the controller's is killed: its two ranks go to the spare host
       and take their stages live from their twins on node 0, across the hosts' addresses;
       every step commits (one flag all-reduced), so the two surviving stages leave at one
       step: nothing lost - unless the host died between the two stages' gradient reductions
       of a step: the stage whose reduction completed took that step on its own verdict (its
       commit failed as its peers went), keeping the state before it, and goes back to that
       copy; the step the other stage never reached is redone;
    2. then the other job host that is not the controller's is cut off: no spare host is left,
       so the job shrinks by its pipeline and goes on with one; the host fences itself, is
       healed, joins again as a new host, and the pipeline grows back onto it, its stages from
       their twins.
    The weights end within the elastic oracle's tolerance of the fault-free run (a world of
    one pipeline takes both groups' samples: the same global batch)."""
    from conftest import policy_file
    from elastic_oracle import TOLERANCE, max_rel_diff

    pol = policy_file(tmp_path, "recover:\n  levels:\n    scale_in: {when: no_warm_spare}\n")
    with HostJob(tmp_path / "job", 3) as j:
        kill_then_cut(j, PP, PP_ARGS, 10, pol)
        first = j.of("incident")[0]
        (rest,) = [e for e in j.of("restore") if e["gen"] == 1]
        sources = {rest["sources"][str(r)] for r in range(4)}
        assert (first["steps_lost"], sources) in ((0, {"live"}), (1, {"live", "kept"})), \
            (first, rest)
        (shrunk,) = j.of("scale_in")
        assert shrunk["world"] == 2 and shrunk["dropped"] in ([0, 1], [2, 3])  # a pipeline
        (grown,) = j.of("scale_out")
        assert grown["world"] == 4
        regrown = [e for e in j.of("restore") if e["gen"] == j.of("generation")[-1]["gen"]]
        assert regrown and set(regrown[-1]["sources"].values()) == {"live"}  # from the twins
        diff = max_rel_diff(j.base / "final.pt", reference(4, *PP_ARGS, script=PP))
        assert diff < TOLERANCE, diff


TWO_D = EXAMPLES / "train_2d.py"
TWO_D_ARGS = ("--steps", "140", "--dim", "8", "--blocks", "1")


def test_a_tensor_parallel_host_killed_then_another_cut_off_with_no_spare_host_left(
        tmp_path, reference):
    """FSDP2 x tensor parallel, (dp_shard, tp) = (2, 2) on 2 hosts of 2 ranks and a spare host:
    each tensor-parallel group within a host, the data-parallel dimension across them. Two
    faults of the outside world:
    1. a job host that is not the controller's is killed: it takes a whole shard position (both
       its tensor-parallel parts, and the node's memory), which no twin holds. Its ranks go to
       the spare host and take their parts from the replicas of their snapshots on the other
       node (the buddy), across the hosts' addresses; every rank resumes at that snapshot's
       step - at most the interval lost;
    2. then the other job host that is not the controller's is cut off: no spare host is left,
       so the job shrinks by that tensor-parallel group to (1, 2). Its processes cannot be
       sharded again: both ranks that stay are new processes, cutting their shards out of the
       old world's snapshots - their own node's memory, and the cut host's replicas there. The
       host fences itself, is healed, joins again as a new host, and the world grows back onto
       it, resharded again.
    The weights end within the elastic oracle's tolerance of the fault-free run."""
    from conftest import policy_file
    from elastic_oracle import TOLERANCE, max_rel_diff

    pol = policy_file(tmp_path, "recover:\n  levels:\n    scale_in: {when: no_warm_spare}\n")
    reference.ahead(4, *TWO_D_ARGS, script=TWO_D)  # computed while the job runs
    with HostJob(tmp_path / "job", 3) as j:
        victim_node = kill_then_cut(j, TWO_D, TWO_D_ARGS, 5, pol, "--hang-timeout", "10")
        first = j.of("incident")[0]
        assert first["steps_lost"] <= 5 + 1, first  # the interval, and a step in flight
        spawns = {e["wid"]: e["node"] for e in j.of("spawn")}
        gens = j.of("generation")
        ranks0 = {int(r): w for r, w in gens[0]["ranks"].items()}
        on_victim = sorted(r for r, w in ranks0.items() if spawns[w] == victim_node)
        (rest,) = [e for e in j.of("restore") if e["gen"] == 1]
        assert {rest["sources"][str(r)] for r in on_victim} == {"buddy"}, rest
        (shrunk,) = j.of("scale_in")
        assert shrunk["world"] == 2 and shrunk["dropped"] in ([0, 1], [2, 3])  # a tp group
        small = [g for g in gens if len(g["ranks"]) == 2]
        before = {w for g in gens if len(g["ranks"]) == 4 and g["gen"] < small[0]["gen"]
                  for w in g["ranks"].values()}
        assert not before & set(small[0]["ranks"].values())  # every rank a new process
        (resharded,) = [e for e in j.of("restore") if e["gen"] == small[0]["gen"]]
        assert set(resharded["sources"].values()) == {"memory+buddy, resharded"}, resharded
        (grown,) = j.of("scale_out")
        assert grown["world"] == 4
        regrown = [e for e in j.of("restore") if e["gen"] == gens[-1]["gen"]]
        assert regrown and all(v.endswith("resharded") for v in regrown[-1]["sources"].values())
        diff = max_rel_diff(j.base / "final.pt", reference(4, *TWO_D_ARGS, script=TWO_D))
        assert diff < TOLERANCE, diff

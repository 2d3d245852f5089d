"""Elastic across test hosts: a host lost with no spare host shrinks the world by that host; the
host, healed, joins again and the world grows back onto it; then a rank crashes with no warm spare
and its host's ranks leave the world until processes there are ready again. Checked with the
elastic oracle (elastic_oracle.py) against the fault-free run at full size."""

from __future__ import annotations

import pytest
import time

from conftest import EXAMPLES, finish, policy_file
from elastic_oracle import BATCH, SAMPLES, TOLERANCE, check_samples, max_rel_diff, segments
from test_hosts import _victim, job  # noqa: F401 - the fixture

from nonstop_bench import netns

pytestmark = pytest.mark.integration

ok, why = netns.available()
if not ok:
    pytest.skip(f"test hosts unavailable: {why}", allow_module_level=True)

ELASTIC = EXAMPLES / "train_elastic.py"
STEPS = 420  # the crash at step 280: 200 steps (~10 s) after the world grew back the first time


def test_a_host_lost_then_a_rank_crashed_with_no_spare_the_world_shrinks_and_grows_back(
        job, alongside, tmp_path):
    # the fault-free run at full size, on one host, meanwhile (the job mostly waits)
    ref = tmp_path / "ref"
    t0 = time.time()
    reference = alongside(ref / "run", "--nproc=4", str(ELASTIC), "--steps", str(STEPS),
                      "--global-batch", str(BATCH), "--samples", str(SAMPLES),
                      "--save", str(ref / "final.pt"))
    j = job(2)
    samples = tmp_path / "samples"
    pol = policy_file(tmp_path, "recover:\n  levels:\n    scale_in: {when: no_warm_spare}\n")
    for i in range(2):
        j.start(i, "--nnodes", "2", "--nproc-per-node", "2", "--policy", pol,
                "--inject", "crash:rank=3,step=280", script=str(ELASTIC),
                script_args=["--steps", str(STEPS), "--sleep-ms", "25", "--log-samples",
                             str(samples), "--global-batch", str(BATCH), "--samples",
                             str(SAMPLES), "--save", str(j.base / "final.pt")])
    j.wait_output("step 50 ", 90)
    victim, node = _victim(j)
    j.hosts[victim].cut()  # no packets either way: its lease expires
    j.wait_output("fenced", 30, hosts=[victim])
    j.hosts[victim].heal()  # it joins again, as a new host
    codes = j.wait(180)
    assert set(codes.values()) == {0}, "\n".join(j.output(i)[-3000:] for i in codes)
    assert [e["level"] for e in j.of("decision")] == ["scale-in", "scale-out"] * 2
    shrunk, crashed = j.of("scale_in")
    assert shrunk["world"] == 2 and len(shrunk["dropped"]) == 2
    # given up as soon as its memory did not answer either, before its lease expired
    assert [e["node"] for e in j.of("isolate")] == [node]
    assert [e["node"] for e in j.of("node_lost")] == [node]
    (joined,) = j.of("node_joined")
    grown, regrown = j.of("scale_out")
    assert grown["world"] == 4 and set(grown["ranks"]) == {"2", "3"}
    spawns = {e["wid"]: e["node"] for e in j.of("spawn")}
    assert {spawns[w] for w in grown["ranks"].values()} == {joined["node"]}  # onto the new host
    # the crash: its host's two ranks leave (host granularity); the healthy one waits as a spare
    # with the new process started for the crashed one, and both come back together
    assert crashed["dropped"] == [2, 3] and crashed["world"] == 2
    assert regrown["world"] == 4
    assert {spawns[w] for w in regrown["ranks"].values()} == {joined["node"]}
    worlds = check_samples(samples, STEPS)
    assert [w for w, _, _ in segments(worlds)] == [4, 2, 4, 2, 4]
    saved = [p for p in [j.base / "final.pt"] if p.exists()]
    assert len(saved) == 1
    run = finish(reference, ref / "run", t0)
    assert run.code == 0, run.stderr[-3000:]
    assert max_rel_diff(ref / "final.pt", saved[0]) < TOLERANCE

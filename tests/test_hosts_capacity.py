"""Across test hosts, a job whose healthy hosts cannot hold its ranks (a host lost with no spare
host, and the world may not shrink) waits for a host to join rather than ending: the new machine
takes the lost ranks, nothing is lost, the weights are the fault-free run's."""

from __future__ import annotations

import time

import pytest
from conftest import TRAIN, bitwise_equal

from nonstop_bench import netns
from nonstop_bench.hostjob import HostJob

pytestmark = pytest.mark.integration

ok, why = netns.available()
if not ok:
    pytest.skip(f"test hosts unavailable: {why}", allow_module_level=True)

STEPS = 300
NO_SCALE_IN = "recover:\n  levels:\n    scale_in: {enabled: false}\n"


def test_a_host_lost_with_no_spare_host_waits_for_a_new_machine_then_moves_there(tmp_path, reference):
    policy = tmp_path / "policy.yaml"
    policy.write_text(NO_SCALE_IN)
    args = ["--steps", str(STEPS), "--sleep-ms", "20"]
    with HostJob(tmp_path / "job", hosts=3) as j:
        def start(i: int) -> None:
            j.start(i, "--nnodes", "2", "--nproc-per-node", "1", "--spare-nodes", "0",
                    f"--policy={policy}", script=str(TRAIN),
                    script_args=[*args, "--save", str(j.base / "final.pt")])

        start(0)
        start(1)
        j.wait_output("step 50 ", 90)
        office = j.of("leader")[0]["host"]
        victim = 1 if office == "host0" else 0
        j.kill_host(victim)
        deadline = time.monotonic() + 60
        while not j.of("waiting_for_hosts") and time.monotonic() < deadline:
            time.sleep(0.1)
        (wait,) = j.of("waiting_for_hosts")
        assert wait["wanting"] == 1 and wait["limit_s"] == 300
        assert not j.of("give_up") and not j.of("run_end")
        start(2)  # a new machine, as a scheduler starts one in the lost one's place
        codes = j.wait(120)
        alive = {i: c for i, c in codes.items() if i != victim}
        assert set(alive.values()) == {0}, "\n".join(j.output(i)[-3000:] for i in alive)
        assert "waiting up to 300 s for hosts to join" in j.output(1 - victim)
        (inc,) = j.of("incident")
        assert inc["levels"] == ["node replacement"] and inc["steps_lost"] == 0, inc
        # nodes are numbered as the hosts joined: the lost one's rank is on the new machine's, 2
        lost = list(j.of("leader")[0]["hosts"]).index(f"host{victim}")
        spawns = {e["wid"]: e["node"] for e in j.of("spawn")}
        last = j.of("generation")[-1]["ranks"]
        assert sorted(spawns[w] for w in last.values()) == sorted({0, 1, 2} - {lost}), last
        assert (j.base / "final.pt").exists()
        assert bitwise_equal(j.base / "final.pt", reference(2, *args))

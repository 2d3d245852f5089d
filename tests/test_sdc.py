"""Silent data corruption with real processes: one bit of one rank's parameters flips; the
replicas' digests, compared before the next snapshot, name that rank; it is replaced, every rank
resumes from the last snapshot whose digests agreed, and the run ends with the fault-free weights
and a certificate in its summary."""

from __future__ import annotations

import pytest

from conftest import bitwise_equal, policy_file, train

pytestmark = pytest.mark.integration

ARGS = ("--steps", "40", "--sleep-ms", "10")


def test_a_flipped_bit_is_found_named_repaired_and_the_weights_are_the_fault_free_ones(
        tmp_path, reference):
    run, out = train(tmp_path, "--spares=1", "--inject=bitflip:rank=1,step=12", args=ARGS)
    (flip,) = run.of("rank_bitflip")
    assert flip["rank"] == 1 and flip["step"] == 12
    (fault,) = [f for f in run.of("fault") if f["kind"] == "sdc"]
    assert fault["rank"] == 1 and fault["attribution"] == "infrastructure"
    (d,) = run.of("decision")
    assert d["level"] == "rank replacement" and d["replace"] == [1]
    (inc,) = run.of("incident")
    # the mismatch is found at the first snapshot step after the flip; every rank resumes from
    # the snapshot before it (which agreed), so the steps in between are redone
    found = run.summary["sdc"]["found"]
    assert [(f["suspects"], f["repaired"]) for f in found] == [([1], True)]
    assert inc["resume_step"] <= 12 < found[0]["step"]
    assert inc["steps_lost"] == found[0]["step"] - inc["resume_step"]
    (restore,) = [e for e in run.of("restore") if e["gen"] == 1]
    assert set(restore["sources"].values()) <= {"memory", "buddy", "live"}
    assert restore["step"] == inc["resume_step"]
    sdc = run.summary["sdc"]
    assert sdc["checks"] > 0 and sdc["last_step"] == 40 and len(sdc["chain"]) == 64
    assert "every step's weights agreed across replicas" in run.stdout
    assert bitwise_equal(out, reference(3, *ARGS))


def test_report_only_warns_and_certifies_nothing(tmp_path):
    pol = policy_file(tmp_path, "detect:\n  sdc: {action: report}\n")
    run, _ = train(tmp_path, "--policy", pol, "--inject=bitflip:rank=0,step=5",
                   args=("--steps", "12"), world=2)
    assert not run.of("decision")  # training went on
    (m,) = run.of("rank_sdc_mismatch")[:1]
    assert m["suspects"] == [0, 1]  # two replicas: which one is right cannot be told
    assert run.summary["sdc"]["found"][0]["repaired"] is False
    assert "reported only" in run.stdout and "differ" in run.stderr


def test_a_fault_free_run_is_certified(tmp_path):
    run, _ = train(tmp_path, args=("--steps", "12"), world=2)
    sdc = run.summary["sdc"]
    assert sdc["mismatches"] == 0 and sdc["checks"] >= 6 and sdc["last_step"] == 12

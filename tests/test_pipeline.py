"""Pipeline-parallel jobs (torch.distributed.pipelining on a (dp, pp) mesh) under nonstop: a lost
stage's rank is replaced in-process, its weights live from its twin in the other data-parallel
group, bitwise; a mesh that does not say its ranks hold different stages is refused at the start."""

from __future__ import annotations

import pytest
from conftest import EXAMPLES, bitwise_equal, rank_wids, run_nonstop, train

from nonstop.runtime.mesh import Mesh, MeshError

PP = EXAMPLES / "train_pp.py"
ARGS = ("--steps", "12", "--dim", "8", "--blocks", "1")


def test_a_mesh_names_its_stages_dimension_among_its_dims():
    assert Mesh(("dp", "pp"), (-1, 2), lambda m: None, stages="pp").stages == "pp"
    with pytest.raises(MeshError, match="stages names one of the dims"):
        Mesh(("dp", "pp"), (-1, 2), lambda m: None, stages="tp")


@pytest.mark.integration
@pytest.mark.parametrize("fault, rank", [
    ("crash", 1),  # the last stage of the first data-parallel group, killed at the step's start
    ("hang", 2),   # the first stage of the second, frozen: its neighbour waits in a receive
])
def test_a_pipeline_stage_is_replaced_with_its_weights_live_from_its_twin(tmp_path, reference,
                                                                          fault, rank):
    """(dp, pp) = (2, 2), a GPipe schedule of 2 micro-batches, a snapshot every 5 steps: one rank
    is lost three steps after the last snapshot. A warm spare builds its stage alone and
    receives the stage's weights and optimizer state live from its twin (the same stage in the
    other data-parallel group); the three others keep theirs in their processes, their schedule
    made again for the new generation. A frozen rank's pipeline neighbour, blocked in a receive
    that no closed socket ends, is released by the abort. The job resumes at the step it failed
    in: nothing lost, every stage's weights bitwise those of the fault-free run."""
    run, out = train(tmp_path, "--spares=1", "--snapshot-every=5",
                     f"--inject={fault}:rank={rank},step=8", args=ARGS, world=4, script=PP)
    assert [d["level"] for d in run.of("decision")] == ["rank replacement"]
    held = rank_wids(run)
    assert len(held[rank]) == 2 and all(len(held[r]) == 1 for r in range(4) if r != rank)
    left = {e["rank"]: e["reason"] for e in run.of("rank_left") if e["gen"] == 0}
    assert set(left) == set(range(4)) - {rank}, left  # every survivor left on its own
    (restore,) = [r for r in run.of("restore") if r["gen"] == 1]
    assert restore["step"] == 8 and restore["sources"] == {str(r): "live" for r in range(4)}
    (inc,) = run.summary["incident_list"]
    assert inc["steps_lost"] == 0
    sdc = run.summary["sdc"]
    assert sdc["checks"] > 0 and sdc["mismatches"] == 0, sdc  # the twins' stages agreed
    assert bitwise_equal(out, reference(4, *ARGS, script=PP))


@pytest.mark.integration
@pytest.mark.parametrize("pp, what", [
    ("2", "parameters of other names or shapes"),  # the last stage has the head
    ("3", "other parameter values"),  # stages 0 and 1: the same blocks, their own weights
])
def test_a_pipeline_that_does_not_declare_its_stages_is_refused_at_its_start(tmp_path, pp, what):
    """A user's pipeline script whose mesh leaves out ``stages=``: nonstop would take the ranks
    along ``pp`` for copies of each other (a plain tensor carries no placement), compare their
    digests and give a lost rank another stage's weights. The first generation compares the
    ranks it takes for copies - the names and shapes of their parameters, then their values -
    and the job stops with one line saying what to declare, before any step."""
    script = tmp_path / "undeclared_pp.py"
    script.write_text(PP.read_text().replace(', build, stages="pp",', ", build,"))
    run = run_nonstop(tmp_path / "run", f"--nproc={pp}", str(script), *ARGS, "--pp", pp,
                      timeout=120)
    assert run.code == 2, run.stdout[-3000:] + run.stderr[-3000:]
    (line,) = [x for x in run.stderr.splitlines() if x.startswith("nonstop: error:")]
    assert what in line and "differ only along 'pp'" in line and "stages=NAME" in line, line
    assert not run.of("first_step")


@pytest.mark.integration
def test_a_pipeline_without_a_spare_shrinks_by_a_data_parallel_group_and_grows_back(tmp_path,
                                                                                   reference):
    """No spare (``scale_in.when: no_warm_spare``): rank 1 (the last stage of the first
    data-parallel group) is killed and its whole group - a pipeline - leaves; the other goes on
    alone at once, renumbered, its two stages kept in their processes, the global batch kept
    (it runs both groups' samples). Once new processes are up the group comes back at a step
    boundary, its stages from their twins. The weights end within the elastic oracle's
    tolerance of the fault-free run."""
    from conftest import policy_file
    from elastic_oracle import SCALE_IN, assert_shrank_by_a_group_and_grew_back

    args = ("--steps", "40", "--dim", "8", "--blocks", "1", "--sleep-ms", "30")
    run, out = train(tmp_path, "--spares=0", f"--policy={policy_file(tmp_path, SCALE_IN)}",
                     "--inject=crash:rank=1,step=10", args=args, world=4, script=PP)
    assert_shrank_by_a_group_and_grew_back(run, out, reference(4, *args, script=PP), step=10)


@pytest.mark.integration
def test_a_pipeline_redoes_a_nan_step_in_every_stage_and_finds_a_flipped_bit_by_its_twin(
        tmp_path, reference):
    """Two incidents in one run of (dp, pp) = (2, 2), snapshots every 4 steps:
    1. the last stage's output turns NaN at step 3 on rank 1 (in the first of its 2
       micro-batches: the second's output is finite): the NaN reaches stage 0's gradients too,
       but each stage checks only its own, so the verdict is all-reduced (the step's commit):
       every stage of every group redoes the step in place, none steps alone - and the
       decision names rank 1, whose forward went non-finite (its last output alone said
       "finite");
    2. a bit of rank 2's stage flips at step 6: compared with its twin (rank 0, the same stage
       in the other data-parallel group) at the next check (8), the two differ: the pair is
       suspect, and only the pair (the other stage's twins agree). Every rank goes back in
       place to the snapshot of 4, which the twins certified, and the replay names rank 2 (its
       stage's outputs parted from its first pass at step 6, rank 0's later); no process is
       replaced.
    The final weights bitwise those of the fault-free run; no rank's log has a FutureWarning."""
    run, out = train(tmp_path, "--spares=1", "--snapshot-every=4",
                     "--inject=nan:rank=1,step=3;bitflip:rank=2,step=6", args=ARGS, world=4,
                     script=PP)
    decisions = run.of("decision")
    assert decisions[0]["level"] == "step retry" and decisions[0]["step"] == 3, decisions
    assert "non-finite forward output on rank(s) 1)" in decisions[0]["reason"], decisions[0]
    (sdc,) = [f for f in run.of("fault") if f["kind"] == "sdc"]
    assert sdc["rank"] is None and "rank(s) 0, 2" in sdc["message"]  # the pair, no other rank
    assert [(d["level"], sorted(d["replace"])) for d in decisions[1:]] == [
        ("in-process restart", [])], decisions
    assert [(f["step"], f["suspects"]) for f in run.summary["sdc"]["found"]] == [(8, [0, 2])]
    (named,) = run.of("sdc_attributed")
    assert (named["rank"], named["verdict"], named["candidates"]) == (2, "transient", [0, 2])
    sdc_inc = run.summary["incident_list"][-1]
    assert sdc_inc["resume_step"] == 4 and sdc_inc["steps_lost"] == 4  # one interval
    logs = [p.read_text(errors="replace") for p in (run.run_dir / "logs").glob("worker-*.log")]
    assert logs and not [x for x in logs if "FutureWarning" in x]
    assert bitwise_equal(out, reference(4, *ARGS, script=PP))


@pytest.mark.integration
def test_a_stage_whose_twin_is_lost_in_its_recovery_loses_no_step(tmp_path, reference):
    """(dp, pp) = (2, 2), a snapshot every 5 steps; two incidents, each struck again inside its
    recovery by the rank the first fault left holding the only live copy of a stage:

    1. rank 0 is killed at step 8; its twin, rank 2, is killed once the restore of the next
       generation has agreed what to move (``at=restore``), before rank 0's replacement got its
       stage. Stage 0 at step 8 was then in no live process; before, the job went back to the
       snapshot of step 5. Rank 2 kept step 8 in its node's memory as it left the failed
       generation (a departure snapshot): its own replacement reads it there, rank 0's receives
       it from that one, and the job resumes at 8.
    2. rank 1 is killed at step 11; its replacement receives its stage from rank 3 and then
       fails (``at=restored``: an exception, the process lives on) before the ranks confirm the
       restore. It holds step 11 already: the next generation restores it in place, nothing
       sent again.

    Nothing lost; every stage's weights bitwise those of the fault-free run."""
    from conftest import policy_file

    faults = ("crash:rank=0,step=8;crash:rank=2,at=restore,gen=1;"
              "crash:rank=1,step=11;exception:rank=1,at=restored,gen=3")
    # a survivor gets 3 s to leave a failed generation (a loaded machine may not schedule it
    # within the default): killed at the deadline, it would be replaced too
    pol = policy_file(tmp_path, "recover:\n  timeouts:\n    teardown_s: 3\n")
    run, out = train(tmp_path, "--spares=1", "--snapshot-every=5", f"--inject={faults}",
                     f"--policy={pol}", args=ARGS, world=4, script=PP)
    assert {e["fault"] for e in run.of("rank_inject")} == set(faults.split(";"))
    left = {(e["gen"], e["rank"]): e.get("departure") for e in run.of("rank_left")}
    assert left[(0, 2)] == 8, left  # rank 0's twin, as it left the first failed generation
    restores = {r["gen"]: r for r in run.of("restore")}
    assert restores[2]["step"] == 8 and restores[2]["sources"]["2"] == "memory", restores[2]
    entered = {(e["gen"], e["rank"]): e for e in run.of("rank_entered")}
    assert entered[(2, 0)].get("holder") == 2  # rank 0's stage: its twin's departure snapshot
    assert restores[4]["step"] == 11
    assert (entered[(4, 1)]["source"], entered[(4, 1)].get("holder")) == ("live", None)
    incidents = run.summary["incident_list"]
    assert len(incidents) == 2 and len(incidents[0]["faults"]) == 2, incidents
    assert [i["steps_lost"] for i in incidents] == [0, 0] and run.summary["steps_lost"] == 0
    assert bitwise_equal(out, reference(4, *ARGS, script=PP))

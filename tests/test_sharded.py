"""Sharded training (FSDP2): the mesh declared with ``nonstop.Mesh`` outlives generations, each
rank's shards are kept as local tensors and restored at the same coordinates, and a lost rank's
replacement ends the run bitwise where a fault-free run of the same mesh ends."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import EXAMPLES, SCRIPTS, bitwise_equal, rank_wids, train

from nonstop.runtime.mesh import Mesh, MeshError, coordinates, group_ranks

FSDP = EXAMPLES / "train_fsdp.py"
ARGS = ("--steps", "16", "--dim", "16", "--blocks", "1")
TWO_D = EXAMPLES / "train_2d.py"  # FSDP2 x tensor parallel, (dp_shard, tp) = (2, 2)
ARGS_2D = ("--steps", "12", "--dim", "8", "--blocks", "1")


# -- the mesh's arithmetic ----------------------------------------------------------------------
def test_a_mesh_fills_in_its_one_free_size_from_the_world():
    mesh = Mesh(("dp_replicate", "dp_shard"), (2, -1), lambda m: None)
    assert mesh.sizes(4) == (2, 2) and mesh.sizes(8) == (2, 4)
    with pytest.raises(MeshError, match="multiple of 2 ranks; the job has 3"):
        mesh.sizes(3)
    with pytest.raises(MeshError, match="needs 4 ranks; the job has 6"):
        Mesh(("a", "b"), (2, 2), lambda m: None).sizes(6)


@pytest.mark.parametrize("dims, shape, build, match", [
    ((), (), print, "distinct non-empty names"),
    (("a", "a"), (1, 2), print, "distinct"),
    (("a",), (2, 2), print, "1 dims"),
    (("a", "b"), (-1, -1), print, "at most one of them -1"),
    (("a",), (0,), print, "positive sizes"),
    (("a",), (True,), print, "positive sizes"),
    (("a",), (2,), "fully_shard", "build must be a function"),
])
def test_a_malformed_mesh_is_refused_with_what_is_wrong(dims, shape, build, match):
    with pytest.raises(MeshError, match=match):
        Mesh(dims, shape, build)


def test_ranks_take_row_major_coordinates_and_groups_run_along_one_dimension():
    # the layout of init_device_mesh: rank = ((i * n1) + j) * n2 + k
    layout = torch.arange(12).reshape(2, 3, 2)
    for rank in range(12):
        c = coordinates(rank, (2, 3, 2))
        assert layout[c].item() == rank
        assert group_ranks(rank, (2, 3, 2), 0) == layout[:, c[1], c[2]].tolist()
        assert group_ranks(rank, (2, 3, 2), 1) == layout[c[0], :, c[2]].tolist()
        assert group_ranks(rank, (2, 3, 2), 2) == layout[c[0], c[1], :].tolist()


# -- FSDP2 jobs, real processes -----------------------------------------------------------------
@pytest.mark.integration
def test_an_fsdp2_rank_is_replaced_by_a_warm_spare_with_nothing_lost(tmp_path, reference):
    """Rank 1 of an FSDP2 job is killed; a warm spare takes its place: it builds the same
    sharded model at rank 1's coordinates and receives rank 1's shard from its node's memory
    (a snapshot every step), while rank 0 keeps its shard in memory. No step lost; the final
    (gathered) weights are those of a fault-free run, bit for bit."""
    run, out = train(tmp_path, "--spares=1", "--snapshot-every=1", "--inject=crash:rank=1,step=9",
                     args=ARGS, world=2, script=FSDP)
    assert [d["level"] for d in run.of("decision")] == ["rank replacement"]
    held = rank_wids(run)
    assert len(held[1]) == 2 and len(held[0]) == 1  # the survivor never left its process
    (inc,) = run.summary["incident_list"]
    assert inc["steps_lost"] == 0
    assert {e["sharded"] for e in run.of("rank_entered")} == {True}
    (restore,) = [r for r in run.of("restore") if r["gen"] == 1]
    assert restore["sources"] == {"0": "live", "1": "memory"} and restore["step"] == 9
    assert bitwise_equal(out, reference(2, *ARGS, script=FSDP))


@pytest.mark.integration
def test_a_rank_of_an_fsdp_and_tensor_parallel_job_is_replaced_with_nothing_lost(
        tmp_path, reference):
    """A 2-D mesh (dp_shard, tp) = (2, 2): rank 3, whose tensor-parallel peer is rank 2 and whose
    data-parallel peer is rank 1, is killed. A warm spare builds the same TP + FSDP2 structure at
    its coordinates, alone, and receives its part from its node's memory (a snapshot every
    step) while the others keep theirs; nothing lost, the gathered weights bitwise.

    While it waited, the spare made the DTensor sharding decisions the ranks recorded in their
    first steps (the steps here last 0.4 s until it has, so that a loaded machine's spare has
    made them all before the fault: it looks every 0.2 s), on meshes of its own that the job's
    DTensors then carry: the weights say they work."""
    from conftest import finish, start, wait_for_event

    pace = tmp_path / "pace"
    pace.touch()
    run_dir, out = tmp_path / "run", tmp_path / "final.pt"
    t0 = time.time()
    proc = start(run_dir, "--nproc=4", "--spares=1", "--snapshot-every=1",
                 "--inject=crash:rank=3,step=9", str(TWO_D), *ARGS_2D, "--slow-ms", "400",
                 "--slow-file", str(pace), "--save", str(out))
    try:
        wait_for_event(run_dir, lambda e: e["type"] == "rank_prewarmed" and e["decided"] > 0,
                       timeout=120)
    finally:
        pace.unlink()
        run = finish(proc, run_dir, t0)
    assert run.code == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert [d["level"] for d in run.of("decision")] == ["rank replacement"]
    held = rank_wids(run)
    assert len(held[3]) == 2 and all(len(held[r]) == 1 for r in (0, 1, 2))
    (inc,) = run.summary["incident_list"]
    assert inc["steps_lost"] == 0
    (first,) = [g for g in run.of("generation") if g["gen"] == 0]
    (spare,) = held[3] - {first["ranks"]["3"]}
    warmed = [e for e in run.of("rank_prewarmed") if e["wid"] == spare]
    assert warmed and warmed[0]["decided"] > 0 and not any(e["refused"] for e in warmed), warmed
    assert warmed[0]["records"] >= 1 and warmed[0]["t"] < run.of("decision")[0]["t"]
    assert bitwise_equal(out, reference(4, *ARGS_2D, script=TWO_D))


THREE_D = EXAMPLES / "train_3d.py"


@pytest.mark.integration
def test_a_tensor_parallel_rank_of_a_3d_job_receives_its_part_live_from_its_twin(
        tmp_path, reference):
    """A 3-D mesh (dp_replicate, dp_shard, tp) = (2, 2, 2), eight ranks: rank 5 - tensor-parallel
    peer of rank 4, its (dp_shard, tp) position held by rank 1 in the other replica group - is
    killed three steps after the last snapshot. A warm spare builds the TP + HSDP structure at its
    coordinates, alone, and receives its part live from its twin; the seven others keep theirs
    in their processes. The job resumes at the step it failed in: nothing lost, the gathered
    weights bitwise, the twins' digests equal at every check."""
    run, out = train(tmp_path, "--spares=1", "--snapshot-every=5", "--inject=crash:rank=5,step=8",
                     args=ARGS_2D, world=8, script=THREE_D)
    assert [d["level"] for d in run.of("decision")] == ["rank replacement"]
    held = rank_wids(run)
    assert len(held[5]) == 2 and all(len(held[r]) == 1 for r in range(8) if r != 5)
    (restore,) = [r for r in run.of("restore") if r["gen"] == 1]
    assert restore["step"] == 8 and restore["sources"] == {str(r): "live" for r in range(8)}
    (inc,) = run.summary["incident_list"]
    assert inc["steps_lost"] == 0
    sdc = run.summary["sdc"]
    assert sdc["checks"] > 0 and sdc["mismatches"] == 0, sdc
    assert bitwise_equal(out, reference(8, *ARGS_2D, script=THREE_D))


@pytest.mark.integration
def test_a_tensor_parallel_part_whose_twin_freezes_in_its_recovery_loses_no_step(tmp_path,
                                                                                 reference):
    """HSDP x TP, (dp_replicate, dp_shard, tp) = (2, 1, 2), a snapshot every 5 steps: rank 0 is
    killed at step 8, and its twin (rank 2: the same tensor-parallel part in the other replica
    group) freezes (SIGSTOP) once the next generation's restore has agreed what to move, before
    rank 0's replacement got its part. The frozen rank is killed and replaced in turn. Its part
    at step 8 was in no live process; before, the job went back to the snapshot of step 5. Rank
    2 kept step 8 in its node's memory as it left the first failed generation (a departure
    snapshot): its replacement reads it there, rank 0's receives it from that one, and the job
    resumes at 8: nothing lost, the weights bitwise those of the fault-free run."""
    from conftest import policy_file

    # a survivor gets 3 s to leave a failed generation (a loaded machine may not schedule it
    # within the default): killed at the deadline, it would be replaced too
    pol = policy_file(tmp_path, "recover:\n  timeouts:\n    teardown_s: 3\n")
    run, out = train(tmp_path, "--spares=1", "--snapshot-every=5", f"--policy={pol}",
                     "--inject=crash:rank=0,step=8;stop:rank=2,at=restore,gen=1", args=ARGS_2D,
                     world=4, script=THREE_D)
    assert [f["kind"] for f in run.of("fault") if f["rank"] == 2 and f["gen"] == 1] == ["hang"]
    left = {(e["gen"], e["rank"]): e.get("departure") for e in run.of("rank_left")}
    assert left[(0, 2)] == 8, left
    restores = {r["gen"]: r for r in run.of("restore")}
    assert restores[2]["step"] == 8 and restores[2]["sources"]["2"] == "memory", restores[2]
    (inc,) = run.summary["incident_list"]
    assert len(inc["faults"]) == 2 and inc["steps_lost"] == 0, inc
    assert bitwise_equal(out, reference(4, *ARGS_2D, script=THREE_D))


@pytest.mark.integration
def test_an_fsdp2_job_without_a_spare_rolls_back_to_its_shards_last_common_snapshot(
        tmp_path, reference):
    """Rank 0 is killed and no spare waits: a new process takes rank 0; every rank resumes from
    the newest step whose snapshot every shard has, and the run ends bitwise.

    The job writes its last step to disk: its step directory is one plain DCP checkpoint (one
    metadata file for every rank's shards), and a script that imports nothing of nonstop builds
    the model afresh on one rank and loads it with ``dcp.load`` - DCP reshards 2 shards into 1
    - and ends with the run's final weights, bit for bit. (One job for both: a job of its own
    for the checkpoint cost as much again.)"""
    import subprocess
    import sys

    ckpt = tmp_path / "ckpt"
    run, out = train(tmp_path, "--spares=0", "--snapshot-every=4", "--inject=crash:rank=0,step=10",
                     f"--checkpoint-dir={ckpt}", args=ARGS, world=2, script=FSDP)
    (inc,) = run.summary["incident_list"]
    assert inc["resume_step"] == 8 and inc["steps_lost"] == 2
    assert bitwise_equal(out, reference(2, *ARGS, script=FSDP))
    (step_dir,) = sorted(ckpt.glob("step-*"))
    assert step_dir.name == "step-0000000016" and (step_dir / ".metadata").is_file()
    loaded = tmp_path / "loaded.pt"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "load_dcp.py"), str(step_dir),
                           str(loaded), "--dim", "16", "--blocks", "1", "--example", str(FSDP)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nonstop" not in proc.stderr
    assert bitwise_equal(out, loaded)


HSDP = EXAMPLES / "train_hsdp.py"


@pytest.mark.integration
@pytest.mark.parametrize("at, resume", [("start", 9), ("commit", 10)])
def test_an_hsdp_rank_receives_its_shard_live_from_its_twin_with_nothing_lost(tmp_path,
                                                                               reference, at,
                                                                               resume):
    """HSDP, 2 replica groups x 2 shards: rank 1 is killed between snapshots (every 5 steps).
    Its twin - rank 3, the same shard position in the other replica group - sends its live
    state peer to peer: the job resumes at the step it failed in, no step lost, where a plain
    FSDP job would roll back to the snapshot. The survivors' FSDP2 modules, left in the middle
    of the failed step (parameters gathered, gradients not yet reduced), are set back to rest
    first. Final weights bitwise those of the fault-free run; the twins' digests agree at every
    check after.

    At the step's start (after the step before completed everywhere), or at its commit: every
    gradient reduced, rank 1 gone before the ranks agreed to take the step. The survivors'
    commit fails; each takes the step on its own verdict (keeping the state before it), so
    every shard is at the newer step: nothing is redone. (Without that, a commit that completed
    on some survivors and failed on others left shard positions a step apart, and the job went
    back to its last snapshot.)"""
    run, out = train(tmp_path, "--spares=1", "--snapshot-every=5",
                     f"--inject=crash:rank=1,step=9,at={at}", args=ARGS, world=4, script=HSDP)
    (restore,) = [r for r in run.of("restore") if r["gen"] == 1]
    left = {e["rank"]: e["step"] for e in run.of("rank_left") if e["gen"] == 0}
    lost = 0
    if at == "commit" and min(left.values()) < resume:
        # the abort caught a survivor before its commit (still reducing with another survivor,
        # on a loaded machine): its shard is a step behind. Those that took the step on their
        # own verdict go back to the state they kept before it, and redo that one step
        assert restore["step"] == resume - 1 == min(left.values()), (restore, left)
        assert restore["sources"] == {str(r): "kept" if left.get(r) == resume else "live"
                                      for r in range(4)}, (restore, left)
        lost = 1
    else:
        assert restore["step"] == resume
        assert restore["sources"] == {str(r): "live" for r in range(4)}
    (inc,) = run.summary["incident_list"]
    assert inc["steps_lost"] == lost
    sdc = run.summary["sdc"]
    assert sdc["checks"] > 0 and not sdc.get("uncompared"), sdc
    assert bitwise_equal(out, reference(4, *ARGS, script=HSDP))


@pytest.mark.integration
def test_a_bit_flipped_in_an_hsdp_shard_is_found_by_its_twins_digest(tmp_path, reference):
    """A bit of rank 1's shard flips. Compared with its twin (rank 3) at the next check, the two
    differ: with two replica groups which one is right the digests cannot tell, so the pair is
    suspect - and only the pair: shard 0's twins (ranks 0 and 2) agree (judged across the whole
    world, they were suspects too). No process is replaced: the job rolls back in place to the
    last snapshot whose twins agreed, the replay names rank 1 of the pair (its replica group's
    outputs parted first), and the run ends bitwise."""
    run, out = train(tmp_path, "--spares=1", "--inject=bitflip:rank=1,step=6", args=ARGS,
                     world=4, script=HSDP)
    (fault,) = [f for f in run.of("fault") if f["kind"] == "sdc"]
    assert fault["rank"] is None and "rank(s) 1, 3" in fault["message"], fault
    assert [(d["level"], sorted(d["replace"])) for d in run.of("decision")] == [
        ("in-process restart", [])]
    (named,) = run.of("sdc_attributed")
    assert (named["rank"], named["verdict"], named["candidates"]) == (1, "transient", [1, 3])
    assert bitwise_equal(out, reference(4, *ARGS, script=HSDP))


@pytest.mark.integration
def test_an_error_in_the_scripts_build_function_stops_the_job_like_an_import_error(tmp_path):
    """The build function is the script's own setup: its error, before any step, is the same on
    every attempt (and leaves the model half sharded: ``fully_shard`` takes a module once, so
    no retry in the process could build it again). The job stops at once, exit code 2, the
    script's traceback shown once - not retried into 'fully_shard has already been applied'."""
    from conftest import run_nonstop

    run = run_nonstop(tmp_path / "run", "--nproc=2", "--spares=0",
                      str(SCRIPTS / "mesh_bad_build.py"), timeout=180)
    assert run.code == 2, run.stdout[-3000:] + run.stderr[-3000:]
    # (the other rank's collective may fail on the one that left first: a 'peer' symptom)
    assert {f["kind"] for f in run.of("fault")} - {"peer"} == {"import_error"}
    assert len(run.of("decision")) == 1
    last = run.stderr.strip().splitlines()[-1]
    assert "nonstop.Mesh's build function raised ValueError: reshard_after_forward" in last
    assert "already been applied" not in run.stderr
    assert run.stderr.count("Traceback") == 1


@pytest.mark.integration
def test_a_build_function_that_communicates_stops_the_job_at_its_start_saying_what_to_pass(
        tmp_path):
    """``parallelize_module`` at its default scatters rank 0's weights over the tp group: at the
    first generation it works, but a replacement builds alone and would wait for its peers (in
    the restore) forever - a 120 s hang, then a job restart. It is refused at the job's start
    instead: exit code 2, the line says to pass src_data_rank=None."""
    from conftest import run_nonstop

    run = run_nonstop(tmp_path / "run", "--nproc=2", "--spares=0",
                      str(SCRIPTS / "tp_build_scatters.py"), timeout=180)
    assert run.code == 2, run.stdout[-3000:] + run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert "build function of nonstop.Mesh communicated on the mesh (scatter)" in last
    assert "src_data_rank=None" in last
    assert len(run.of("decision")) == 1 and not run.of("rank_entered")


@pytest.mark.integration
@pytest.mark.parametrize("mistake, said", [
    ("no_mesh", ("model.0.weight is sharded over a mesh other than",
                 "pass it the build function's mesh")),
    ("stale_optimizer", ("the optimizer 'optimizer' holds none of the sharded model's parameters",
                         "make it in the build function, after the sharding"))])
def test_a_build_that_would_train_wrongly_stops_the_job_saying_so(tmp_path, mistake, said):
    """Two builds that would start training, wrongly, found when the build function returns,
    before any step: exit code 2, one line naming what is wrong and what to change.
    - ``fully_shard(model)`` with no mesh builds its own on the generation's default group: it
      would train, then hang or fail after the first fault;
    - an optimizer made before ``fully_shard`` holds the parameters it replaced: it would step
      tensors the model no longer uses, and the model would not train at all."""
    from conftest import run_nonstop

    run = run_nonstop(tmp_path / "run", "--nproc=2", "--spares=0",
                      str(SCRIPTS / "mesh_bad_build.py"), "--mistake", mistake, timeout=180)
    assert run.code == 2, run.stdout[-3000:] + run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert all(s in last for s in said), last
    assert "Traceback" not in run.stderr


@pytest.mark.integration
def test_an_hsdp_job_whose_failure_domain_is_the_replica_group_replaces_the_whole_group(
        tmp_path, reference):
    """``recover.failure_domain: replica_group`` (torchft's model, for comparison): rank 1 is
    killed, and its whole replica group (ranks 0 and 1) gets new processes, rank 1's shard
    coming live from its twin in the other group, rank 0's too - or from the step rank 0's old
    process kept in its node's memory as it left (a departure snapshot), when that was written
    before the process was ended; bitwise, nothing lost."""
    from conftest import policy_file

    pol = policy_file(tmp_path, "recover:\n  failure_domain: replica_group\n")
    run, out = train(tmp_path, "--spares=1", "--snapshot-every=5", f"--policy={pol}",
                     "--inject=crash:rank=1,step=9", args=ARGS, world=4, script=HSDP)
    (inc,) = run.summary["incident_list"]
    assert sorted(inc["replaced"]) == [0, 1] and inc["steps_lost"] == 0
    held = rank_wids(run)
    assert len(held[0]) == 2 and len(held[1]) == 2 and len(held[2]) == 1 and len(held[3]) == 1
    (restore,) = [r for r in run.of("restore") if r["gen"] == 1]
    assert restore["step"] == 9 and restore["sources"]["0"] in ("live", "memory"), restore
    assert {r: restore["sources"][str(r)] for r in (1, 2, 3)} == {1: "live", 2: "live", 3: "live"}
    assert {e["rank"]: e["replica_group"] for e in run.of("rank_entered") if e["gen"] == 0} == {
        0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    assert bitwise_equal(out, reference(4, *ARGS, script=HSDP))


@pytest.mark.integration
def test_an_hsdp_job_without_a_spare_shrinks_by_a_replica_group_and_grows_back(tmp_path,
                                                                                reference):
    """No spare (``scale_in.when: no_warm_spare``): rank 0 is killed and its whole replica group
    leaves - a world of 2 ranks, one of each shard, goes on at once, nothing lost (the other
    group's ranks keep their shards, renumbered, their mesh's replica dimension one group
    smaller); once new processes are up, the group comes back at a step boundary, its shards
    from their twins. Rank 1, set aside alive, holds shard position 1 already built: it comes
    back at that position (rank 3), the new process at position 0 - not in the order they
    became ready. The global batch is kept (``ctx.share``), so the weights end within the
    elastic oracle's tolerance of the fault-free run. Snapshots every 2 steps: the twins'
    digests are compared while the job is shrunk too (there are none then: no check), and again
    once it has grown back, by every rank (a survivor that had stopped checking for good left
    its new twins alone in the check's collective: a hang)."""
    from conftest import policy_file
    from elastic_oracle import SCALE_IN, assert_shrank_by_a_group_and_grew_back

    # (scale_in.multiple_of left at 1: the job leaves and comes back by whole replica groups)
    args = ("--steps", "40", "--dim", "16", "--blocks", "1", "--sleep-ms", "30")
    run, out = train(tmp_path, "--spares=0", f"--policy={policy_file(tmp_path, SCALE_IN)}",
                     "--snapshot-every=2", "--inject=crash:rank=0,step=10", args=args, world=4,
                     script=HSDP)
    assert_shrank_by_a_group_and_grew_back(run, out, reference(4, *args, script=HSDP), step=10)


@pytest.mark.integration
def test_a_2d_job_without_a_spare_shrinks_by_a_tensor_parallel_group_and_grows_back_resharded(
        tmp_path, reference):
    """FSDP2 x tensor parallel, (dp_shard, tp) = (2, 2), no spare: rank 2 is killed at step 10.
    Nothing holds a copy of its part and FSDP2 cannot be applied again to a process's model, so
    its tensor-parallel group leaves (tp degree is the model's) and the job goes on at (1, 2) in
    new processes that cut their shards out of the old world's snapshots in node memory. One of
    them is killed in the middle of that (``at=restore``): the generation that follows cuts them
    again, from the same snapshots. Once new processes are ready the world grows back to (2, 2)
    at a step boundary, resharded again from the small world's shards of that very step (kept
    as the ranks left, between the snapshots every 5 steps): nothing lost, every step once, the weights within the elastic oracle's
    tolerance of the fault-free run."""
    from conftest import policy_file
    from elastic_oracle import SCALE_IN, TOLERANCE, max_rel_diff

    args = ("--steps", "30", "--dim", "8", "--blocks", "1", "--sleep-ms", "30")
    run, out = train(tmp_path, "--spares=0", f"--policy={policy_file(tmp_path, SCALE_IN)}",
                     "--snapshot-every=5",
                     "--inject=crash:rank=2,step=10;crash:rank=1,at=restore,gen=1",
                     args=args, world=4, script=TWO_D)
    levels = [d["level"] for d in run.of("decision")]
    assert levels[0] == "scale-in" and levels[-1] == "scale-out", levels
    worlds = [len(g["ranks"]) for g in run.of("generation")]
    assert worlds[0] == 4 and worlds[1] == 2 and worlds[-1] == 4, worlds
    shrunk = [r for r in run.of("restore") if 0 < r["gen"] < len(worlds) - 1]
    assert shrunk and shrunk[-1]["step"] == 10
    assert set(shrunk[-1]["sources"].values()) == {"memory, resharded"}, shrunk
    (grown,) = [r for r in run.of("restore") if r["gen"] == len(worlds) - 1]
    assert set(grown["sources"].values()) == {"memory, resharded"} and grown["bytes"] > 0
    # (a snapshot every 5 steps: the step the ranks left at is kept as they leave)
    (done,) = run.of("scale_out_done")
    assert grown["step"] == done["step"]
    assert run.summary["steps_lost"] == 0
    diff = max_rel_diff(out, reference(4, *args, script=TWO_D))
    assert diff < TOLERANCE, diff


@pytest.mark.integration
def test_a_shrunk_hsdp_job_whose_last_group_loses_a_rank_restarts_from_the_full_worlds_copies(
        tmp_path, reference):
    """HSDP, 2 replica groups of 2, no spare, rank replacement off and one scale-in allowed:
    rank 0 is killed at step 10 and its group leaves (the other goes on at world 2); the new
    rank 1 is killed while it enters that generation, so its part is nowhere in this world (no
    twin left, no snapshot of world 2 yet). The job restarts at world 2, and each rank takes
    its part from the full world's snapshot of step 10 held by an old rank at the same shard
    position, in node memory: nothing lost. Before, the copies of the other world size were
    offered, refused one by one, and the job started again from step 0 without a word. The
    run ends within the elastic oracle's tolerance of the fault-free run."""
    from conftest import policy_file
    from elastic_oracle import TOLERANCE, max_rel_diff

    pol = policy_file(tmp_path, "recover:\n  levels:\n    rank_replacement: {enabled: false}\n"
                                "    scale_in:\n      when: no_warm_spare\n"
                                "      grow_after_s: 1000\n      budget: 1\n")
    args = ("--steps", "20", "--dim", "16", "--blocks", "1", "--sleep-ms", "30")
    run, out = train(tmp_path, "--spares=0", f"--policy={pol}", "--snapshot-every=5",
                     "--inject=crash:rank=0,step=10;crash:rank=1,at=restore,gen=1", args=args,
                     world=4, script=HSDP)
    assert [d["level"] for d in run.of("decision")] == ["scale-in", "job restart"]
    (again,) = [r for r in run.of("restore") if r["gen"] == 2]
    assert again["step"] == 10 and set(again["sources"].values()) == {"memory, resharded"}
    assert run.summary["steps_lost"] == 0
    diff = max_rel_diff(out, reference(4, *args, script=HSDP))
    assert diff < TOLERANCE, diff

"""A mesh job started again at another world size resumes from its newest checkpoint: each rank
reads its new shards out of the old ranks' parts (DCP's resharding), parameters and optimizer
state alike, and holds exactly what the old job held - compared tensor by tensor, gathered whole."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import EXAMPLES, SCRIPTS, bitwise_equal, run_nonstop

REGRID = SCRIPTS / "regrid.py"
PP = EXAMPLES / "train_pp.py"


def job(tmp_path, name, world, ckpt, *args, script=REGRID, code=0, flags=()):
    out = tmp_path / f"{name}.pt"
    run = run_nonstop(tmp_path / name, f"--nproc={world}", f"--checkpoint-dir={ckpt}",
                      "--checkpoint-every=4", *flags, str(script), *args, "--save", str(out),
                      timeout=150)
    assert run.code == code, run.stdout[-3000:] + run.stderr[-3000:]
    return run, out


@pytest.fixture(scope="session")
def four_ranks_at_8(tmp_path_factory):
    """The first job of both FSDP2 tests below (4 ranks, 8 steps, a checkpoint every 4), run
    once for the session (shared by pytest's workers, as the references are): each test gets a
    copy of its checkpoints and its final state."""
    import fcntl
    import os
    import shutil

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    d = base / "regrid-4-at-8"
    d.mkdir(exist_ok=True)
    with open(d / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (d / "first.pt").exists():
            for name in ("first", "ckpt"):
                shutil.rmtree(d / name, ignore_errors=True)  # what a failed attempt left
            job(d, "first", 4, d / "ckpt", "--steps", "8", "--tp", "1")

    def copy(tmp_path):
        shutil.copytree(d / "ckpt", tmp_path / "ckpt")
        shutil.copy(d / "first.pt", tmp_path / "first.pt")
        return tmp_path / "ckpt", tmp_path / "first.pt"

    return copy


def same(a, b) -> list[str]:
    """The names of the tensors that differ (or are missing) between two saved states."""
    x, y = torch.load(a), torch.load(b)
    names = [f"{part}/{k}" for part in ("params", "optimizer") for k in x[part].keys() | y[part].keys()
             if k not in x[part] or k not in y[part] or not torch.equal(x[part][k], y[part][k])]
    return sorted(names)


@pytest.mark.integration
@pytest.mark.parametrize("before, after, tp", [(4, 2, 1), (2, 4, 2)],
                         ids=["fsdp-4-to-2", "fsdp-tp-2-to-4"])
def test_a_mesh_job_resumes_at_another_world_size_holding_exactly_what_it_checkpointed(
        tmp_path, four_ranks_at_8, before, after, tp):
    """FSDP2 shrinks from 4 ranks to 2, FSDP2 x tensor parallel grows from (1, 2) to (2, 2): the
    first job trains 8 steps and checkpoints; the second, at the other size, resumes at step 8
    and trains no further. Its parameters and optimizer state, gathered whole, are the first
    job's bit for bit (moments and step counters too). Growing, a rank killed in the middle of
    the read changes nothing of that. With a part of step 8 damaged, a third job passes it over
    for step 4."""
    args = ("--steps", "8", "--tp", str(tp))
    if before == 4:
        ckpt, first = four_ranks_at_8(tmp_path)
    else:
        ckpt = tmp_path / "ckpt"
        _, first = job(tmp_path, "first", before, ckpt, *args)
    manifest = json.loads((ckpt / "step-0000000008" / "manifest.json").read_text())
    assert manifest["world"] == before and manifest["dcp"]
    # growing, rank 1 is killed while the ranks read the checkpoint: the generation that follows
    # (a warm spare in its place) reads it again - the survivors' half-read state is offered
    # to no one
    fault = ("--spares=1", "--inject=crash:rank=1,at=restore,gen=0") if before < after else ()
    run, second = job(tmp_path, "second", after, ckpt, *args, flags=fault)
    (restore,) = run.of("restore")
    assert restore["gen"] == (1 if fault else 0) and restore["step"] == 8
    assert set(restore["sources"].values()) == {"disk, resharded"}, restore
    assert fault or "resumed at step 8 (from disk, resharded)" in run.stderr + run.stdout
    assert torch.load(second)["optimizer"], "no optimizer state was compared"
    assert same(first, second) == []
    if before < after:
        return
    # a part of step 8 damaged on disk: every rank passes the step over for step 4
    (data,) = (ckpt / "step-0000000008" / "rank-3").glob("*.distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    run, _ = job(tmp_path, "third", after, ckpt, *args)
    (restore,) = run.of("restore")
    assert restore["step"] == 4 and set(restore["sources"].values()) == {"disk, resharded"}


@pytest.mark.integration
def test_a_pipeline_resumes_at_another_data_parallel_size_each_stage_from_a_rank_that_held_it(
        tmp_path):
    """A pipeline's stages are plain tensors, whole in every data-parallel group: 2 groups x 2
    stages checkpoint at step 4; a job of 1 group (2 ranks) resumes there, each rank reading its
    stage from the part of an old rank that held it, and ends (no further step) with the
    weights of every stage the first job ended with, bit for bit."""
    ckpt = tmp_path / "ckpt"
    args = ("--steps", "4", "--dim", "8", "--blocks", "1")
    _, first = job(tmp_path, "first", 4, ckpt, *args, script=PP)
    run, second = job(tmp_path, "second", 2, ckpt, *args, script=PP)
    (restore,) = run.of("restore")
    assert restore["step"] == 4 and set(restore["sources"].values()) == {"disk, resharded"}
    assert bitwise_equal(first, second)


def test_which_old_part_holds_a_stage_and_what_cannot_be_read_at_another_size(tmp_path):
    """Pure: a pipeline's rank reads the part of the first old rank at its stage; a state that is
    neither DTensor shards nor stages, or a pipeline of sharded stages, stops the job saying to
    start it with the checkpoint's size."""
    from types import SimpleNamespace

    from nonstop.errors import ScriptSetupError
    from nonstop.state.regrid import _stage_part

    # (dp, pp) = (2, 2) before, (1, 2) now: rank r held stage r % 2
    old = {4: (0, 1, 0, 1)}
    pipeline = SimpleNamespace(stage_twins=old.get, twins=(0, 1))
    assert [_stage_part(pipeline, r, 8, 4, 2, {}, tmp_path) for r in (0, 1)] == [0, 1]
    mesh = SimpleNamespace(stage_twins=None, twins=None)
    assert _stage_part(mesh, 0, 8, 4, 2, {"dcp": {"bytes": 1}}, tmp_path) is None
    for state, manifest, why in [(mesh, {}, "neither DTensor shards nor"),
                                 (pipeline, {"dcp": {"bytes": 1}}, "stages are sharded too")]:
        with pytest.raises(ScriptSetupError, match=why) as err:
            _stage_part(state, 0, 8, 4, 2, manifest, tmp_path)
        assert "written by a job of 4 ranks and this one has 2" in str(err.value)
        assert "start the job with 4 ranks" in str(err.value)


@pytest.mark.integration
def test_an_fsdp2_job_without_a_spare_shrinks_to_an_uneven_world_its_shards_cut_in_memory(
        tmp_path, four_ranks_at_8):
    """No spare, ``scale_in.when: no_warm_spare``, the growth held off: rank 2 of 4 is killed at
    step 8. Plain FSDP has no copy of a rank's shard, and its processes cannot be sharded again,
    so the job goes on at 3 ranks in new processes, each cutting its new (uneven) shards out of
    the old world's snapshots in node memory - nothing read from disk. What it then holds is
    what a job at 3 ranks resumed from a checkpoint of step 8 holds (DCP's resharding, shown
    exact above), bit for bit: parameters, moments and step counters, after 4 more steps."""
    from conftest import policy_file

    ckpt, _ = four_ranks_at_8(tmp_path)
    _, reference = job(tmp_path, "second", 3, ckpt, "--steps", "12")
    pol = policy_file(tmp_path, "recover:\n  levels:\n    scale_in:\n      when: no_warm_spare\n"
                                "      grow_after_s: 1000\n")
    out = tmp_path / "shrunk.pt"
    run = run_nonstop(tmp_path / "shrunk", "--nproc=4", "--spares=0", f"--policy={pol}",
                      "--snapshot-every=1", "--inject=crash:rank=2,step=8", str(REGRID),
                      "--steps", "12", "--save", str(out), timeout=150)
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (decision,) = run.of("decision")
    assert decision["level"] == "scale-in"
    gens = run.of("generation")
    assert [len(g["ranks"]) for g in gens] == [4, 3]
    assert not set(gens[0]["ranks"].values()) & set(gens[1]["ranks"].values())  # all new
    (restore,) = [r for r in run.of("restore") if r["gen"] == 1]
    assert restore["step"] == 8 and set(restore["sources"].values()) == {"memory, resharded"}
    assert restore["bytes"] > 0
    assert run.summary["steps_lost"] == 0
    assert torch.load(out)["optimizer"], "no optimizer state was compared"
    assert same(reference, out) == []

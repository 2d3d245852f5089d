"""A mesh job started again at another world size resumes from its newest checkpoint: each rank
reads its new shards out of the old ranks' parts (DCP's resharding), parameters and optimizer
state alike, and holds exactly what the old job held - compared tensor by tensor, gathered whole."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import EXAMPLES, SCRIPTS, run_nonstop

REGRID = SCRIPTS / "regrid.py"
PP = EXAMPLES / "train_pp.py"


def job(tmp_path, name, world, ckpt, *args, script=REGRID, code=0):
    out = tmp_path / f"{name}.pt"
    run = run_nonstop(tmp_path / name, f"--nproc={world}", f"--checkpoint-dir={ckpt}",
                      "--checkpoint-every=4", str(script), *args, "--save", str(out), timeout=150)
    assert run.code == code, run.stdout[-3000:] + run.stderr[-3000:]
    return run, out


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
        tmp_path, before, after, tp):
    """FSDP2 shrinks from 4 ranks to 2, FSDP2 x tensor parallel grows from (1, 2) to (2, 2): the
    first job trains 8 steps and checkpoints; the second, at the other size, resumes at step 8
    and trains no further. Its parameters and optimizer state, gathered whole, are the first
    job's bit for bit (moments and step counters too). With a part of step 8 damaged, a third
    job passes it over for step 4."""
    ckpt = tmp_path / "ckpt"
    args = ("--steps", "8", "--tp", str(tp))
    _, first = job(tmp_path, "first", before, ckpt, *args)
    manifest = json.loads((ckpt / "step-0000000008" / "manifest.json").read_text())
    assert manifest["world"] == before and manifest["dcp"]
    run, second = job(tmp_path, "second", after, ckpt, *args)
    (restore,) = run.of("restore")
    assert restore["step"] == 8
    assert set(restore["sources"].values()) == {"disk, resharded"}, restore
    assert "resumed at step 8 (from disk, resharded)" in run.stderr + run.stdout
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
def test_a_pipeline_checkpoint_at_another_world_size_stops_the_job_saying_why(tmp_path):
    """A pipeline's stages are plain tensors, not DTensor shards: a job of 2 ranks started on a
    checkpoint of 4 cannot read it yet. It stops at once, exit code 2, with one line that says
    so and what to run - it never trains from scratch beside a checkpoint."""
    ckpt = tmp_path / "ckpt"
    args = ("--steps", "4", "--dim", "8", "--blocks", "1")
    job(tmp_path, "first", 4, ckpt, *args, script=PP)
    run, _ = job(tmp_path, "second", 2, ckpt, *args, script=PP, code=2)
    (line,) = [x for x in run.stderr.splitlines() if x.startswith("nonstop: error:")]
    assert "written by a job of 4 ranks and this one has 2" in line and "start the job with 4" in line
    assert not run.of("first_step")

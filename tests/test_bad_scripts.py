"""A script that fails before reaching its training function stops the job at once: exit code 2,
its traceback once, no rank replaced, nothing left running. A warm spare that fails there because
it has no rank yet does not stop the job."""

from __future__ import annotations

import pytest

from conftest import assert_none_left, run_nonstop

pytestmark = pytest.mark.integration  # starts processes

WRAPPED_TAIL = """
model = torch.nn.Linear(4, 1)
state = nonstop.State(model=model)


@nonstop.wrap(state)
def train(ctx):
    for step in ctx.steps(3):
        ctx.report(model(torch.ones(1, 4)).sum())


train()
"""

CASES = {
    "runtime_error": ("import torch\nimport nonstop\nraise RuntimeError('boom at import')\n"
                      + WRAPPED_TAIL, "RuntimeError: boom at import (bad.py, line 3)", True),
    "name_error": ("import torch\nimport nonstop\nsize = undefined_size * 2\n" + WRAPPED_TAIL,
                   "NameError: name 'undefined_size' is not defined", True),
    "syntax_error_in_a_module": ("import torch\nimport nonstop\nimport broken_helper\n" + WRAPPED_TAIL,
                                 "SyntaxError", True),
    "sys_exit": ("import sys\nimport torch\nimport nonstop\nsys.exit(3)\n" + WRAPPED_TAIL,
                 "SystemExit: 3 (bad.py, line 4)", False),
    # a plain torchrun script: its data is missing before it reaches init_process_group
    "plain_missing_file": ("import torch.distributed as dist\n"
                           "data = open('/nonexistent/nonstop-test/data.bin', 'rb').read()\n"
                           "dist.init_process_group('gloo')\ndist.barrier()\n",
                           "FileNotFoundError", True),
}


@pytest.mark.parametrize("case, spares", [
    ("runtime_error", 0), ("name_error", 1),
    ("syntax_error_in_a_module", 0), ("sys_exit", 1), ("plain_missing_file", 1),
])
def test_a_script_failing_at_import_stops_the_job_at_once(tmp_path, case, spares):
    source, words, traceback = CASES[case]
    script = tmp_path / "bad.py"
    script.write_text(source)
    (tmp_path / "broken_helper.py").write_text("def f(:\n    pass\n")
    run = run_nonstop(tmp_path / "run", "--nproc=2", f"--spares={spares}", str(script), timeout=60)
    out = run.stdout + run.stderr
    assert run.code == 2, out
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("nonstop: error: the script failed at import:") and words in last, out
    assert out.count("Traceback (most recent call last)") == (1 if traceback else 0), out
    if traceback:
        assert 'bad.py", line' in run.stderr and "bootstrap.py" not in run.stderr, out
    assert {f["kind"] for f in run.of("fault")} == {"import_error"}
    assert [d["level"] for d in run.of("decision")] == ["fail"]
    assert not run.of("replace") and len(run.of("generation")) == 1
    assert "nonstop summary" not in out  # a usage error: no summary table
    # at once: from the first failure to the end of the run
    failed = min(e["t"] for e in run.of("rank_exit"))
    (end,) = run.of("run_end")
    assert end["t"] - failed < 2.0, end["t"] - failed
    assert_none_left(timeout=2.0)


NEEDS_RANK = """
import os
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import nonstop

RANK = int(os.environ["RANK"])  # a warm spare has no rank yet: it fails here
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
state = nonstop.State(model=model, optimizer=opt)


@nonstop.wrap(state)
def train(ctx):
    ddp = DDP(model)
    for step in ctx.steps(60):
        loss = ddp(torch.ones(2, 4)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.report(loss)
        time.sleep(0.05)


train()
"""


def test_a_spare_failing_at_import_for_want_of_a_rank_does_not_stop_the_job(tmp_path):
    script = tmp_path / "needs_rank.py"
    script.write_text(NEEDS_RANK)
    run = run_nonstop(tmp_path / "run", "--nproc=2", "--spares=1", "--inject=crash:rank=1,step=45",
                      str(script), timeout=120)
    out = run.stdout + run.stderr
    assert run.code == 0, out
    assert "Traceback" not in out
    (lost,) = run.of("spare_lost")  # the first spare, once: its refill waits for a rank
    assert lost["at_import"]
    (mode,) = run.of("spare_mode")
    assert mode["mode"] == "import" and "KeyError" in mode["error"]
    spares = [e for e in run.of("spawn") if e["spare"]]
    assert spares[0]["mode"] == "script" and all(e["mode"] == "import" for e in spares[1:])
    assert len(spares) <= 3  # the first, its refill, the refill after the replacement
    assert all(e["mode"] == "rank" for e in run.of("spawn") if not e["spare"])
    assert [d["level"] for d in run.of("decision")] == ["rank replacement"]
    assert {f["kind"] for f in run.of("fault")} - {"peer"} == {"crash"}  # peer: its symptom


TRAINER = """
import torch

import nonstop

model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
state = nonstop.State(model=model, optimizer=opt)


@nonstop.wrap(state)
def main(ctx):
    for step in ctx.steps(5):
        loss = model(torch.ones(2, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.report(loss)
    return ctx.rank
"""


def test_a_script_whose_own_module_uses_nonstop_runs_wrapped(tmp_path):
    """``train.py`` only calls ``main()`` from a package of the user's beside it, which wraps it
    with nonstop: the job is a wrapped one (its steps counted), not taken for a plain script
    whose ranks would wait for a generation that never comes."""
    (tmp_path / "mylib").mkdir()
    (tmp_path / "mylib" / "__init__.py").write_text("")
    (tmp_path / "mylib" / "trainer.py").write_text(TRAINER)
    script = tmp_path / "train.py"
    script.write_text("from mylib.trainer import main\n\nmain()\n")
    run = run_nonstop(tmp_path / "run", "--nproc=2", str(script), timeout=60)
    assert run.code == 0, run.stdout + run.stderr
    assert run.summary["steps"] == 5 and len(run.of("rank_wrapped")) == 2


def test_a_script_that_reaches_nonstop_unseen_stops_at_once_saying_so(tmp_path):
    """A script that runs another through ``runpy``: nothing in its source or its modules
    imports nonstop, so it runs as a plain script; when it reaches ``nonstop.wrap`` the rank
    says what to change (exit code 2, one line) instead of waiting for ever."""
    (tmp_path / "trainer_main.py").write_text(TRAINER + "\nmain()\n")
    script = tmp_path / "launch.py"
    script.write_text("import os\nimport runpy\n\nrunpy.run_path(os.path.join(os.path.dirname("
                      "os.path.abspath(__file__)), 'trainer_main.py'), run_name='__main__')\n")
    run = run_nonstop(tmp_path / "run", "--nproc=2", str(script), timeout=60)
    assert run.code == 2, run.stdout + run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert "reached nonstop.wrap" in last and "add 'import nonstop' to the script" in last
    assert "Traceback" not in run.stderr
    assert_none_left(timeout=2.0)

"""Bad input: one clear line on stderr, exit code 2, no traceback, nothing left running."""

from __future__ import annotations

import subprocess

import pytest

from conftest import SCRIPTS, TRAIN, nonstop_cmd, run_nonstop

pytestmark = pytest.mark.integration  # starts processes


def nonstop(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(nonstop_cmd(*args), capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess, words: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    err = proc.stderr.strip()
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    assert len(err.splitlines()) == 1, err
    assert err.startswith("nonstop: error:") and words in err, err


@pytest.mark.parametrize("args, words", [
    (["run", "--nproc", "2", "missing_script.py"], "script not found: missing_script.py"),
    (["run", "--nproc", "0", str(TRAIN)], "--nproc must be at least 1"),
    (["run", "--spares", "-1", str(TRAIN)], "--spares must be 0 or more"),
    (["run", "--bogus", str(TRAIN)], "unrecognized arguments: --bogus"),
    (["run", "--nproc", "two", str(TRAIN)], "invalid int value"),
    (["run", "--hang-timeout", "0", str(TRAIN)], "must be > 0"),
    (["run", "--inject", "meteor:rank=0,step=1", str(TRAIN)], "unknown fault 'meteor'"),
    (["run", "--inject", "crash:rank=0", str(TRAIN)], "missing step="),
    (["run", "--nproc", "2", "--inject", "crash:rank=5,step=1", str(TRAIN)], "rank 5 does not exist"),
    (["run", "--inject", "", str(TRAIN)], "--inject '': no fault given"),
    (["run", "--inject", " ; ;", str(TRAIN)], "--inject ' ; ;': no fault given"),
    (["run"], "the following arguments are required: script"),
    (["bench", "crash", "--systems", "slurm"], "unknown system(s) slurm"),
    (["bench", "crash", "--parallel", "ddp,tp"], "--parallel: unknown layout(s) tp"),
    (["bench", "crash", "--systems", "torchft"], "torchft runs the hsdp layout"),
    (["bench", "hang", "--parallel", "fsdp"], "--parallel is for bench crash, elastic and overhead (not hang)"),
    (["bench", "overhead", "--parallel", "fsdp,hsdp"], "overhead measures one layout"),
    (["bench", "overhead", "--parallel", "fsdp", "--systems", "reproducible"],
     "systems plain, nonstop only (not reproducible)"),
    (["report", "/nonexistent/run"], "no run at /nonexistent/run"),
    (["run", "--failure-domain", "rack-3", str(TRAIN)],
     "--failure-domain labels one host of a job across hosts"),
])
def test_bad_input(args, words):
    assert_one_line_error(nonstop(*args), words)


def test_bad_policy_names_the_field(tmp_path):
    p = tmp_path / "policy.yaml"
    p.write_text("recover:\n  timeouts:\n    teardown: 2\n")
    assert_one_line_error(nonstop("run", "--policy", str(p), str(TRAIN)),
                          "unknown key 'recover.timeouts.teardown'")


def test_directory_as_script(tmp_path):
    assert_one_line_error(nonstop("run", str(tmp_path)), "not a file")


def test_syntax_error_in_script(tmp_path):
    s = tmp_path / "broken.py"
    s.write_text("def f(:\n  pass\n")
    assert_one_line_error(nonstop("run", str(s)), "broken.py:1: syntax error")


def test_missing_module_is_caught_before_any_process_starts(tmp_path):
    s = tmp_path / "needs.py"
    s.write_text("import os\nimport definitely_not_installed_pkg\n")
    proc = nonstop("run", "--run-dir", str(tmp_path / "run"), str(s))
    assert_one_line_error(proc, "needs.py:2: imports 'definitely_not_installed_pkg'")
    assert not (tmp_path / "run").exists()


def test_script_failing_at_import_in_every_rank(tmp_path):
    """Not bad input to nonstop but a bad script: its traceback once, then one line (more cases in
    test_bad_scripts.py)."""
    run = run_nonstop(tmp_path / "run", "--nproc=2", str(SCRIPTS / "fails_at_import.py"))
    assert run.code == 2, run.stdout + run.stderr
    err = run.stderr.strip().splitlines()
    assert "failed at import" in err[-1] and "no_such_name_in_torch" in err[-1], err
    assert (run.stdout + run.stderr).count("Traceback (most recent call last)") == 1
    assert "fails_at_import.py\", line 4" in run.stderr


def test_help_works():
    proc = nonstop("run", "--help")
    assert proc.returncode == 0 and "--spares" in proc.stdout

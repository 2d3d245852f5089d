"""A job of the user's own (here the example script, run as a user would: its own flags, ``{out}``
for where it writes). ``nonstop chaos SCRIPT``: a seeded fault schedule thrown at it, judged by
completion, incidents closed, nothing left running, every fault fired, the steps-lost bound and
the file it writes against a fault-free run's. ``nonstop bench crash --script SCRIPT``: what a
recovery costs it. Bad input gets one line and exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import EXAMPLES, nonstop_cmd
from test_cli import assert_one_line_error

pytestmark = pytest.mark.integration

TRAIN = EXAMPLES / "train_ddp.py"


def test_a_schedule_thrown_at_the_users_own_script_and_its_weights_against_a_fault_free_run(
        tmp_path):
    proc = subprocess.run(nonstop_cmd(
        "chaos", "--nproc", "2", "--faults", "3", "--seed", "4", "--steps", "60", "--kinds",
        "crash,hang,crash_dirty", "--compare", "final.pt", "--json", "--out", str(tmp_path),
        str(TRAIN), "--steps", "60", "--sleep-ms", "5", "--save", "{out}/final.pt"),
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    kinds = [f["kind"] for f in result["schedule"]]
    assert len(kinds) == 3 and len(set(kinds)) == 3  # every kind in turn before any repeats
    assert result["completed"] and result["compared"] and result["orphans"] == 0
    assert result["unfired"] == [] and result["steps_lost_bound"]["held"]
    assert result["incidents"] == 3 and result["incidents_closed"] == 3  # one each
    assert (tmp_path / "reference" / "final.pt").is_file()  # {out}: each run its own
    assert "the file it wrote equals the fault-free run's: True" in proc.stderr


@pytest.mark.parametrize("args, words", [
    (["missing.py"], "no such script: missing.py"),
    ([str(TRAIN)], "--steps: the steps your script runs is needed"),
    (["--steps", "20", "--faults", "5", str(TRAIN)], "5 faults need a job of 45 steps"),
    (["--steps", "200", "--kinds", "crash,bogus", str(TRAIN)], "unknown fault kind(s) bogus"),
    (["--steps", "200", "--compare", "final.pt", str(TRAIN)], "with {out} in its arguments"),
    (["--steps", "200", "--nproc", "1", str(TRAIN)], "--nproc must be at least 2"),
    (["--steps", "200", "--hosts", "2", str(TRAIN)], "chaos SCRIPT runs on one host"),
    (["--steps", "200", "--kinds", "crash_two", str(TRAIN)], "give --nproc 3 or more"),
    (["--steps", "200", "--faults", "3", "--kinds", "crash_in_restore", str(TRAIN)],
     "cannot be drawn from crash_in_restore"),
])
def test_bad_input_to_chaos_on_a_users_script_is_one_line_and_exit_2(tmp_path, args, words):
    proc = subprocess.run([sys.executable, "-m", "nonstop", "chaos", "--out", str(tmp_path),
                           *args], capture_output=True, text=True, timeout=60)
    assert_one_line_error(proc, words)
    assert not (tmp_path / "chaos").exists()  # nothing was run


def test_bench_crash_measures_a_recovery_of_the_users_own_job(tmp_path):
    proc = subprocess.run(nonstop_cmd(
        "bench", "crash", "--ranks", "2", "--repeat", "1", "--kill-step", "20", "--json",
        "--out", str(tmp_path), "--script", str(TRAIN), "--steps", "40", "--sleep-ms", "5"),
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["fault_free"]["exit_code"] == 0 and result["fault_free"]["steps"] == 40
    assert result["fault_free"]["steps_per_s"] > 0
    (run,) = result["runs"]
    assert run["completed"] and run["recovered"] and run["levels"] == ["rank replacement"]
    assert run["steps_lost"] == 0 and 0 < run["mttr_s"] < 30 and run["mttr_by_phase_s"]
    assert result["mttr_s"]["median"] == round(run["mttr_s"], 3) and result["orphans"] == 0


@pytest.mark.parametrize("args, words", [
    (["crash", "--script", "missing.py"], "no such script: missing.py"),
    (["state", "--script", str(TRAIN)], "bench state measures nonstop's own example job"),
    (["crash", "--ranks", "1", "--script", str(TRAIN)], "--ranks must be at least 2"),
    (["crash", "--script"], "--script: give the training script"),
])
def test_bad_input_to_bench_on_a_users_script_is_one_line_and_exit_2(args, words):
    proc = subprocess.run([sys.executable, "-m", "nonstop", "bench", *args],
                          capture_output=True, text=True, timeout=60)
    assert_one_line_error(proc, words)


def test_two_ranks_crashed_at_once_are_drawn_only_where_a_rank_survives_them():
    """In a 2-rank job they are every rank: it starts over from its newest snapshot, the steps
    since lost - not what the schedule holds to losing none."""
    from nonstop.chaos import OWN_KINDS, _kinds

    assert "crash_two" in _kinds(None, 3) and _kinds(None, 3) == OWN_KINDS
    assert "crash_two" not in _kinds(None, 2)

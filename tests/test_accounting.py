"""What a run reports about itself when it does not simply complete: an interrupted run and one
that gave up count the work they did; a job started again in the same run directory keeps one
history and counts the steps it redid."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from conftest import TRAIN, finish, nonstop_cmd, policy_file, run_nonstop, start, wait_for_event

pytestmark = pytest.mark.integration


def test_an_interrupted_run_counts_the_steps_it_did(tmp_path):
    t0 = time.time()
    proc = start(tmp_path / "run", "--nproc=2", "--quiet", str(TRAIN), "--steps", "100000",
                 "--sleep-ms", "5")
    wait_for_event(tmp_path / "run", lambda e: e["type"] == "rank_first_step")
    time.sleep(1.0)
    os.kill(proc.pid, signal.SIGTERM)
    run = finish(proc, tmp_path / "run", t0, timeout=60)
    assert run.code == 128 + signal.SIGTERM
    s = run.summary
    # the ranks were ended by nonstop before the summary: what they had reported still counts
    assert s["steps"] > 0 and 0 < s["goodput"] < 1, s


def test_a_job_started_again_in_its_run_directory_keeps_one_history(tmp_path):
    ckpt = tmp_path / "ckpt"
    # attempt 1 gives up at step 37 (the same exception every time), without an emergency save:
    # the newest checkpoint on disk is older than the step it reached
    pol = policy_file(tmp_path, "state:\n  emergency: {on_give_up: false, on_signal: false}\n")
    common = ("--nproc=2", "--quiet", "--policy", pol, f"--checkpoint-dir={ckpt}",
              "--checkpoint-every=10")
    first = run_nonstop(tmp_path / "run", *common, "--inject=exception:rank=0,step=37,times=9",
                        str(TRAIN), "--steps", "45")
    assert first.code == 1, first.stdout[-3000:] + first.stderr[-3000:]
    s1 = first.summary
    assert s1["attempt"] == 1 and s1["continues"] is None and s1["steps"] == 37
    assert s1["goodput"] > 0  # giving up ends the ranks first: their work still counts
    wid = first.of("generation")[0]["ranks"]["0"]
    log_path = tmp_path / "run" / "logs" / f"worker-{wid}.log"
    log1 = log_path.read_text()
    assert "step 0 loss" in log1

    second = run_nonstop(tmp_path / "run", *common, str(TRAIN), "--steps", "45")
    assert second.code == 0, second.stdout[-3000:] + second.stderr[-3000:]
    starts = second.of("run_start")
    assert [e["attempt"] for e in starts] == [1, 2] and len(second.of("run_end")) == 2
    resumed = [e for e in second.events if e["type"] == "restore" and e["t"] > starts[1]["t"]][0]
    assert resumed["step"] in (0, 10, 20, 30)
    s2 = second.summary
    cont = s2["continues"]
    assert s2["attempt"] == 2 and cont["previous_step"] == 37 and cont["previous_exit_code"] == 1
    assert cont["resumed_step"] == resumed["step"]
    assert cont["steps_lost"] == 37 - resumed["step"] > 0
    assert s2["steps_lost"] == cont["steps_lost"] and s2["incidents"] == 0
    # the earlier attempt's output is still there, followed by this one's
    log2 = log_path.read_text()
    assert log2.startswith(log1) and "attempt 2 of this run directory" in log2
    report = subprocess.run(nonstop_cmd("report", str(tmp_path / "run")), capture_output=True,
                            text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    assert "attempt 1 (" in report.stdout and "exit 1, reached step 37" in report.stdout
    assert "attempt 2 (" in report.stdout and f"resumed at step {resumed['step']}" in report.stdout

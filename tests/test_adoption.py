"""Each step of the adoption path (docs/usage.md) does what the docs promise, and no more: real
processes, 2 ranks, a tiny model, a rank killed or hung; the exit code, the summary, the optimizer
steps done and, where promised, the weights against the fault-free run."""

from __future__ import annotations

import json

import pytest

from conftest import SCRIPTS, bitwise_equal, policy_file, rank_wids, run_nonstop

pytestmark = pytest.mark.integration

ADOPTION = SCRIPTS / "adoption.py"
PLAIN = SCRIPTS / "adoption_plain.py"
# A first-step allowance shorter than the loops below: only progress seen without ctx.steps keeps
# them from being taken for hung.
SHORT_ALLOWANCE = "detect:\n  hang:\n    first_step: {initial_s: 3, floor_s: 1}\n"
WARNING = "does not iterate ctx.steps"


def optimizer_steps(out) -> int:
    """The optimizer steps rank 0's last process did (written by the test scripts)."""
    return json.loads(open(str(out) + ".json").read())["optimizer_steps"]


def run(tmp_path, script, *args, flags=(), timeout=180):
    out = tmp_path / "final.pt"
    r = run_nonstop(tmp_path / "run", "--nproc=2", "--quiet", *flags, str(script), *args,
                    "--save", str(out), timeout=timeout)
    return r, out


def test_step1_a_plain_script_is_restarted_whole_and_nothing_is_claimed(tmp_path, reference):
    args = ("--steps", "40", "--sleep", "0.02")
    r, out = run(tmp_path, PLAIN, *args, "--die-at", "10", flags=("--spares=1",))
    assert r.code == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert [d["level"] for d in r.of("decision")] == ["job restart"]
    assert all(len(w) == 2 for w in rank_wids(r).values())  # every rank restarted
    s = r.summary
    assert s["incidents"] == 1
    # a plain script reports no steps: nonstop cannot know what was lost, nor the goodput
    assert s["steps_lost"] is None and s["incident_list"][0]["steps_lost"] is None
    assert s["goodput"] is None and s["steps"] is None
    assert "steps lost: unknown" in r.stdout and "goodput: unknown" in r.stdout
    # it started again from scratch (it loads no checkpoint): the whole schedule, once
    assert optimizer_steps(out) == 40
    assert bitwise_equal(out, reference(2, *args, script=PLAIN))


def test_step2_wrapped_without_state_restarts_in_process_from_its_beginning(tmp_path):
    pol = policy_file(tmp_path, SHORT_ALLOWANCE)
    # 80 iterations of 50 ms: longer than the first-step allowance, with no ctx.steps, no
    # ctx.report and no State: its collectives are all nonstop sees of its progress
    r, out = run(tmp_path, ADOPTION, "--steps", "80", "--sleep", "0.05", "--die-at", "10",
                 flags=("--spares=1", "--policy", pol))
    assert r.code == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert not r.of("hang_detected")
    assert [d["level"] for d in r.of("decision")] == ["rank replacement"]
    held = rank_wids(r)
    assert len(held[0]) == 1 and len(held[1]) == 2  # only the dead rank got a new process
    # the survivor re-entered the function from its beginning: 10 steps, then all 80 again
    assert optimizer_steps(out) == 10 + 80
    s = r.summary
    assert s["steps_lost"] is None and s["incident_list"][0]["steps_lost"] is None
    assert s["goodput"] is None
    assert WARNING not in r.stderr  # nothing registered: restarting from the beginning is the promise


def test_a_state_made_inside_the_function_and_given_to_nothing_is_warned_of_once(tmp_path):
    """A first draft makes its nonstop.State inside the training function and passes it to
    nothing: the job trains, but nothing would keep that state across a restart. Each rank says
    so once; the run warns once, naming the function and what to do."""
    r, _ = run(tmp_path, ADOPTION, "--state-inside", "--steps", "10")
    assert r.code == 0, r.stdout[-3000:] + r.stderr[-3000:]
    said = r.of("rank_state_not_kept")
    assert sorted(e["rank"] for e in said) == [0, 1]
    assert said[0]["names"] == ["model", "optimizer"] and said[0]["function"] == "train"
    assert r.stderr.count("without giving it to nonstop.wrap") == 1
    assert "train() makes nonstop.State(model, optimizer)" in r.stderr


def test_step2_with_state_but_without_ctx_steps_warns_and_claims_nothing(tmp_path):
    # the loop of the issue: nonstop.State registered, `for i in range(n)`, ctx.report. Rank 1
    # dies at iteration 10, then hangs in its own code at iteration 20 of the next generation.
    pol = policy_file(tmp_path, SHORT_ALLOWANCE)
    r, out = run(tmp_path, ADOPTION, "--state", "--report", "--steps", "120", "--sleep", "0.03",
                 "--die-at", "10", "--hang-at", "20", "--hang-gen", "1",
                 flags=("--spares=2", "--policy", pol))
    assert r.code == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stderr.count(WARNING) == 1 and "ctx.steps(total)" in r.stderr
    assert [e["via"] for e in r.of("rank_no_steps")][:1] in (["optimizer"], ["report"])
    # the hang is found from the optimizer steps and reports (not heartbeats), once
    (hang,) = r.of("hang_detected")
    assert hang["timeout_s"] < 3  # tuned from the gaps between them, not the allowance
    assert hang["last_progress"] < hang["t"] - 0.9 * hang["timeout_s"]
    s = r.summary
    assert s["incidents"] == 2 and [i["steps_lost"] for i in s["incident_list"]] == [None, None]
    assert s["steps_lost"] is None and s["goodput"] is None and s["steps"] is None
    # the hang's incident runs from the last progress, not from its detection
    assert s["incident_list"][1]["phases_s"]["detect"] >= 0.9 * hang["timeout_s"]
    # rank 0 kept its weights and ran the loop from its beginning twice more: 150 optimizer
    # steps for a schedule of 120 (what the warning is about)
    assert len(rank_wids(r)[0]) == 1
    assert optimizer_steps(out) == 10 + 20 + 120


def test_a_step_keyed_injection_without_ctx_steps_is_refused(tmp_path):
    r, _ = run(tmp_path, ADOPTION, "--state", "--report", "--steps", "400", "--sleep", "0.05",
               flags=("--inject=crash:rank=1,step=5",), timeout=120)
    assert r.code == 2, r.stdout[-3000:] + r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("nonstop: error:")]
    assert len(errors) == 1 and "crash:rank=1,step=5 cannot fire" in errors[0]
    assert "ctx.steps" in errors[0] and "Traceback" not in r.stderr
    assert not r.of("rank_done")  # stopped as soon as the loop was seen, not at its end
    assert r.summary["exit_code"] == 2


def test_step3_state_and_ctx_steps_lose_nothing(tmp_path, reference):
    args = ("--state", "--ctx-steps", "--report", "--steps", "40")
    # a crash injected at step 10; the replacement hangs in its own code at step 25; a fault
    # past the end of the run never fires, and says so
    r, out = run(tmp_path, ADOPTION, *args, "--sleep", "0.01", "--hang-at", "25", "--hang-gen", "1",
                 flags=("--spares=2", "--hang-timeout=1",
                        "--inject=crash:rank=1,step=10;exception:rank=0,step=999"))
    assert r.code == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = r.summary
    assert [i["steps_lost"] for i in s["incident_list"]] == [0, 0] and s["steps_lost"] == 0
    assert s["steps"] == 40 and 0 < s["goodput"] <= 1
    (hang,) = r.of("hang_detected")
    assert s["incident_list"][1]["phases_s"]["detect"] >= 0.9 * hang["timeout_s"]
    assert optimizer_steps(out) == 40  # the survivor did every step once: none redone
    assert bitwise_equal(out, reference(2, *args, script=ADOPTION))
    assert WARNING not in r.stderr
    (unfired,) = r.of("inject_unfired")
    assert unfired["fault"] == "exception:rank=0,step=999"
    assert "exception:rank=0,step=999 never fired" in r.stderr


def test_a_step_keyed_injection_into_a_plain_script_is_refused(tmp_path):
    """A plain torchrun script (no nonstop.wrap): nonstop sees no steps in it, so a fault keyed
    to a step could never fire - said once its ranks reach their process group, not left to a
    run that ends 'incidents: 0' as if the fault had been survived."""
    r, _ = run(tmp_path, PLAIN, "--steps", "400", flags=("--inject=crash:rank=1,step=30",),
               timeout=120)
    assert r.code == 2, r.stdout[-3000:] + r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("nonstop: error:")]
    assert len(errors) == 1 and "crash:rank=1,step=30 cannot fire" in errors[0]
    assert "nonstop.wrap" in errors[0] and "Traceback" not in r.stderr
    assert [e["via"] for e in r.of("rank_no_steps")] == ["plain"]  # rank 1's; rank 0 has none
    assert r.summary["exit_code"] == 2

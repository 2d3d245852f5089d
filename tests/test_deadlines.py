"""Every deadline that fires is a ``deadline`` event: real waits on real processes running out."""

from __future__ import annotations

import pytest

import os
import time
from pathlib import Path

from conftest import TRAIN, policy_file, run_nonstop

from nonstop.observe import hooks
from nonstop.observe.events import EventLog, read
from nonstop.policy import GiveUpHook

pytestmark = pytest.mark.integration  # starts processes

SLEEP = "sleep 37.25"  # a command nothing else runs: found by its arguments afterwards


def _sleepers() -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if args[:2] == [b"sleep", b"37.25"]:
            out.append(int(pid))
    return out


def test_a_give_up_hook_out_of_time_is_killed_and_its_deadline_logged(tmp_path):
    from nonstop.observe.metrics import JobMetrics, registry
    from nonstop.policy import Policy

    log = EventLog(tmp_path)
    reg = registry()
    log.listeners.append(JobMetrics(reg, Policy()).on_event)  # as the controller feeds them
    shown = []
    display = type("D", (), {"info": lambda self, line: shown.append(line)})()
    t0 = time.monotonic()
    hooks.on_give_up(GiveUpHook(command=SLEEP, timeout_s=0.4), log, display, {"why": "test"})
    assert time.monotonic() - t0 < 5
    log.close()
    (hook,) = [e for e in read(tmp_path) if e["type"] == "hook"]
    (missed,) = [e for e in read(tmp_path) if e["type"] == "deadline"]
    assert not hook["ok"] and hook["timed_out"]
    assert missed["what"] == "give_up_hook" and missed["limit_s"] == 0.4
    assert missed["waited_s"] >= 0.4 and missed["action"] == "command"
    assert shown and not _sleepers()
    assert reg.get_sample_value("nonstop_deadlines_total", {"what": "give_up_hook"}) == 1.0


def test_a_health_check_and_the_give_up_hook_out_of_time_in_a_real_run(tmp_path):
    # a user exception with no retry allowed: the job gives up. Meanwhile a health check never
    # answers in its time, and at the end the give-up hook does not either: two deadlines fire
    pol = policy_file(tmp_path, f"""
detect:
  health_checks:
    - {{name: stuck, command: "{SLEEP}", every_s: 0.2, timeout_s: 0.3, action: drain}}
rules: {{user_error_retries: 0}}
hooks:
  on_give_up: {{command: "{SLEEP}", timeout_s: 0.5}}
""")
    run = run_nonstop(tmp_path / "run", "--nproc=2", "--policy", pol,
                      "--inject=exception:rank=1,step=30", str(TRAIN), "--steps", "60",
                      "--sleep-ms", "40", timeout=120)
    assert run.code == 1, run.stderr[-3000:]
    missed = run.of("deadline")
    checks = [d for d in missed if d["what"] == "health_check"]
    assert checks and all(d["limit_s"] == 0.3 and d["check"] == "stuck" for d in checks)
    assert all(d["waited_s"] >= 0.3 for d in checks)
    (hook,) = [d for d in missed if d["what"] == "give_up_hook"]
    assert hook["limit_s"] == 0.5
    events = run.events
    assert events.index(run.of("hook")[0]) < events.index(hook)  # logged with what it ended
    assert not _sleepers()  # the checks and the hook were killed, not left behind

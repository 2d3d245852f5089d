"""A running job seen from outside: its Prometheus metrics scraped and checked against its event
log, and ``nonstop status`` against it."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request

import pytest

from conftest import TRAIN, finish, nonstop_cmd, start, wait_for_event
from nonstop.observe.metrics import ACCOUNT_EVERY_S

pytestmark = pytest.mark.integration


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples, name, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def events(run_dir) -> list[dict]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # the line being written
            pass
    return out


def test_metrics_and_status_of_a_running_job(tmp_path):
    run_dir = tmp_path / "run"
    t0 = time.time()
    proc = start(run_dir, "--nproc=2", "--spares=1", "--metrics-port=0",
                 "--inject=crash:rank=1,step=30", str(TRAIN), "--steps", "200", "--sleep-ms", "20")
    try:
        url = wait_for_event(run_dir, lambda e: e["type"] == "metrics")["url"]
        inc = wait_for_event(run_dir, lambda e: e["type"] == "incident", timeout=90)
        time.sleep(1.0)  # a few progress ticks after it: the gauges are set
        # the goodput account is recomputed every ACCOUNT_EVERY_S: the first may predate the
        # first productive step (then it says 0)
        deadline = time.time() + 2 * ACCOUNT_EVERY_S
        samples = scrape(url)
        while not samples.get(("nonstop_goodput_ratio", ())) and time.time() < deadline:
            time.sleep(0.2)
            samples = scrape(url)
        evs = events(run_dir)
        st = json.loads(subprocess.run(nonstop_cmd("status", str(run_dir), "--json"),
                                       capture_output=True, text=True, timeout=60).stdout)
    finally:
        run = finish(proc, run_dir, t0, timeout=120)
    assert run.code == 0, run.stderr[-3000:]

    # counters and histograms: what the event log says
    fault = next(e for e in evs if e["type"] == "fault")
    assert value(samples, "nonstop_faults_total", kind=fault["kind"], code=fault["code"]) == 1
    assert value(samples, "nonstop_incidents_total", kind=fault["kind"], code=fault["code"],
                 level=inc["levels"][-1]) == 1
    for phase, secs in inc["phases_s"].items():
        assert value(samples, "nonstop_recovery_seconds_sum", phase=phase) == pytest.approx(secs)
        assert value(samples, "nonstop_recovery_seconds_count", phase=phase) == 1
    assert value(samples, "nonstop_mttr_seconds_sum") == pytest.approx(inc["mttr_s"])
    assert value(samples, "nonstop_steps_lost_total") == inc["steps_lost"]
    gens = [e for e in evs if e["type"] == "generation"]
    assert value(samples, "nonstop_generation") == gens[-1]["gen"] == 1
    restores = [e for e in evs if e["type"] == "restore"]
    by_source: dict[str, int] = {}
    for e in restores:
        for src in e["sources"].values():
            by_source[src] = by_source.get(src, 0) + 1
    for src, n in by_source.items():
        assert value(samples, "nonstop_restores_total", source=src) == n
    # gauges: the job as it ran then
    assert value(samples, "nonstop_ranks", state="alive") == 2
    assert value(samples, "nonstop_world_size") == 2
    assert value(samples, "nonstop_phase", phase="running") == 1
    assert value(samples, "nonstop_budget_remaining", level="rank replacement") == 49
    assert value(samples, "nonstop_step") >= inc["resume_step"]
    assert 0 < value(samples, "nonstop_goodput_ratio") < 1
    spent = sum(v for (name, _), v in samples.items() if name == "nonstop_time_seconds")
    assert spent > 1.0  # the account so far: seconds since the start

    # nonstop status --json, from another process, while it ran
    assert st["gen"] == 1 and st["world"] == 2 and st["incidents"] == 1 and not st["over"]
    assert st["step"] > 0 and [r["rank"] for r in st["ranks"]] == [0, 1]
    assert st["budgets"]["rank replacement"] == 49 and st["incident"] is None
    # and once it ended: over, with its exit code
    end = json.loads(subprocess.run(nonstop_cmd("status", str(run_dir), "--json"),
                                    capture_output=True, text=True, timeout=60).stdout)
    assert end["over"] and end["exit_code"] == 0 and end["step"] == 200


def test_a_metrics_port_taken_is_one_line_and_exit_2(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run(nonstop_cmd("run", "--nproc=1", f"--metrics-port={port}",
                                       f"--run-dir={tmp_path / 'run'}", str(TRAIN)),
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"--metrics-port {port}" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()  # nothing started


def test_status_of_nothing_is_one_line_and_exit_2(tmp_path):
    for args in ((str(tmp_path / "none"),), (), (str(tmp_path),)):
        r = subprocess.run(nonstop_cmd("status", *args), capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r

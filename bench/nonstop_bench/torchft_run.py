"""``nonstop bench crash --parallel hsdp``'s torchft side: the HSDP job written for torchft 0.2.0
(``torchft_job.py``) run as torchft runs it - a Lighthouse, and one torchrun per replica group that
restarts its group when a rank dies - with one rank of replica group 1 killed.

torchft is not a dependency of nonstop: it runs when it can be imported, from this environment or
from a directory named in ``NONSTOP_TORCHFT_PATH`` (``pip install --target DIR torchft==0.2.0``
and its OpenTelemetry packages, never letting pip touch torch); otherwise the bench says why it
was left out.

Measured like the other systems: MTTR is the kill until every rank has logged a step after it
(here: the restarted group healed and stepped), steps lost are steps done before the kill that
were done again. torchft's survivors do not wait for that: the other replica group goes on alone
(``degraded_steps``: the steps it took while the killed group was away, on half the global
batch), after a pause of about the Lighthouse's heartbeat timeout (``survivors_pause_s``). Its
weights are not a fault-free run's, by design.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import common

PATH_ENV = "NONSTOP_TORCHFT_PATH"
JOB = Path(__file__).resolve().parent / "torchft_job.py"
LIGHTHOUSE = Path(__file__).resolve().parent / "torchft_lighthouse.py"
GROUPS = 2
# the killed group's restart takes 8-16 s on 2 cores (Python and torch start again): the
# survivors' run must outlast it, or the restarted group finds no quorum to heal from
MIN_STEPS_AFTER_KILL = 400


def _env() -> dict[str, str]:
    env = dict(os.environ)
    extra = os.environ.get(PATH_ENV)
    if extra:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra, env.get("PYTHONPATH")) if p)
    return env


def unavailable() -> str | None:
    """Why torchft cannot run here (None: it can)."""
    try:
        proc = subprocess.run([sys.executable, "-c", "import torchft"], env=_env(),
                              capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "importing torchft did not finish in 120 s"
    if proc.returncode == 0:
        return None
    last = (proc.stderr.strip().splitlines() or ["?"])[-1]
    return (f"torchft cannot be imported ({last[:200]}): install torchft==0.2.0, or name a "
            f"directory holding it in {PATH_ENV}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def run_once(ranks: int, steps: int, kill_step: int, out: Path, timeout_s: float
             ) -> dict[str, Any]:
    """One run: ``ranks`` ranks in 2 replica groups; the last rank of group 1 killed at
    ``kill_step`` (the run lasts at least ``MIN_STEPS_AFTER_KILL`` steps more)."""
    common.fresh(out)
    per_group = ranks // GROUPS
    steps = max(steps, kill_step + MIN_STEPS_AFTER_KILL)
    victim = ranks - 1
    env = _env()
    port = _free_port()
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        log = open(out / "lighthouse.log", "wb")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, str(LIGHTHOUSE), "--bind", f"[::]:{port}", "--min_replicas", "1",
             "--join_timeout_ms", "5000", "--heartbeat_timeout_ms", "1000",
             "--quorum_tick_ms", "100"], stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, env=env))
        groups = []
        for g in range(GROUPS):
            log = open(out / f"group{g}.log", "wb")
            logs.append(log)
            genv = dict(env, REPLICA_GROUP_ID=str(g), NUM_REPLICA_GROUPS=str(GROUPS),
                        TORCHFT_LIGHTHOUSE=f"http://localhost:{port}")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={per_group}", "--max-restarts=3", "--monitor-interval=0.1",
                   str(JOB), "--out", str(out), "--steps", str(steps),
                   "--kill-rank", str(victim), "--kill-step", str(kill_step)]
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, env=genv)
            procs.append(proc)
            groups.append(proc)
        deadline = time.monotonic() + timeout_s
        codes = []
        for proc in groups:
            try:
                codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(-9)
    finally:
        for proc in procs:
            _end(proc)
        for log in logs:
            log.close()
    result: dict[str, Any] = {"system": "torchft", "exit_code": max(codes, key=abs),
                              "steps": steps}
    kill_file = out / "kill.txt"
    t_fault = float(kill_file.read_text()) if kill_file.exists() else None
    result.update(recovery(common.read_steps(out), t_fault, per_group))
    return result


def recovery(steps: dict[int, list[tuple[int, float, int]]], t_kill: float | None,
             per_group: int) -> dict[str, Any]:
    """MTTR and steps lost as the other systems count them (every rank's first step after the
    kill; the steps done before it that were done again), and what torchft does instead of
    waiting: the survivors' longest pause and the steps they took while the killed group was
    away."""
    none = {"mttr_s": None, "lost_steps": None}
    if t_kill is None or not steps:
        return none
    done_before = max((s for rows in steps.values() for s, t, _ in rows if t < t_kill), default=0)
    firsts, resumed = {}, []
    for rank, rows in steps.items():
        after = [(s, t) for s, t, _ in rows if t > t_kill]
        if not after:
            return none
        s, t = min(after, key=lambda x: x[1])
        firsts[rank] = t
        resumed.append(s - 1)
    t_back = max(firsts.values())
    survivors = [r for r in steps if r < per_group]  # replica group 0's ranks
    times = sorted(t for r in survivors for _, t, _ in steps[r] if t > t_kill - 5)
    gaps = [b - a for a, b in zip(times, times[1:]) if b > t_kill]
    degraded = {s for r in survivors for s, t, _ in steps[r] if t_kill < t < t_back}
    return {"mttr_s": t_back - t_kill, "lost_steps": max(0, done_before - min(resumed)),
            "done_before": done_before, "resumed_at": min(resumed),
            "survivors_pause_s": round(max(gaps), 4) if gaps else None,
            "degraded_steps": len(degraded)}

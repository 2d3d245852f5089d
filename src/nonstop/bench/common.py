"""What every benchmark needs: run a job as a child process, read its step log, compare weights."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

JOB = Path(__file__).resolve().parent / "job.py"


def run_child(cmd: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None) -> int:
    """Run a command in its own session, output to ``log``; end it (and its children) on timeout."""
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            return -9
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def read_steps(out: Path) -> dict[int, list[tuple[int, float, int]]]:
    """rank -> [(steps done, time, generation)] in file order (attempts append to one file)."""
    result: dict[int, list[tuple[int, float, int]]] = {}
    for f in sorted(out.glob("steps-r*.txt")):
        rank = int(f.stem.split("-r")[1])
        rows = []
        for line in f.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3:
                rows.append((int(parts[0]), float(parts[1]), int(parts[2])))
        result[rank] = rows
    return result


def recovery(steps: dict[int, list[tuple[int, float, int]]], t_kill: float) -> dict[str, Any]:
    """MTTR (kill -> a step completed by every rank in a later generation than the one killed)
    and steps lost (steps done before the kill minus the step the job resumed from)."""
    killed_gen = max((g for rows in steps.values() for _, t, g in rows if t < t_kill), default=0)
    done_before = max((s for rows in steps.values() for s, t, g in rows if g <= killed_gen),
                      default=0)
    firsts, resumed = [], []
    for rows in steps.values():
        after = [(s, t) for s, t, g in rows if g > killed_gen]
        if not after:
            return {"mttr_s": None, "lost_steps": None}
        s, t = min(after, key=lambda x: x[1])
        firsts.append(t)
        resumed.append(s - 1)  # that step started from s-1 steps done
    return {"mttr_s": max(firsts) - t_kill, "lost_steps": max(0, done_before - min(resumed)),
            "done_before": done_before, "resumed_at": min(resumed)}


def params_equal(a: Path, b: Path) -> bool:
    import torch

    if not a.exists() or not b.exists():
        return False
    x, y = torch.load(a), torch.load(b)
    return x.keys() == y.keys() and all(
        x[k].dtype == y[k].dtype and x[k].shape == y[k].shape
        and torch.equal(x[k].reshape(-1).view(torch.uint8), y[k].reshape(-1).view(torch.uint8))
        for k in x)


def stats(values: list[float]) -> dict[str, float | None]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None}
    return {"median": round(statistics.median(vals), 4), "min": round(min(vals), 4),
            "max": round(max(vals), 4)}


def nonstop_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "nonstop", "run", "--quiet", *args]


def inject_time(run_dir: Path) -> float | None:
    events = run_dir / "events.jsonl"
    if not events.exists():
        return None
    for line in events.read_text().splitlines():
        ev = json.loads(line)
        if ev.get("type") == "rank_inject":
            return ev["t"]
    return None


def emit(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


def now_stamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")

"""``nonstop bench hang``: freeze one rank (SIGSTOP) mid-run; time the stop -> a step completed by
every rank, with nonstop's auto-tuned hang timeout; then a long fault-free run with jittery step
times, counting false alarms.

torchrun has no hang detection of its own: it is given what a careful user sets, a short gloo
timeout (``--collective-timeout``), after which the survivors fail and torchrun restarts them all.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from nonstop.errors import UsageError
from . import common

SYSTEMS = ("nonstop", "torchrun")
TIMEOUT_S = 600.0
STEP_MS = 50  # the job's stand-in for accelerator work: ~60 ms steps here


def _job(steps: int, out: Path, extra: list[str] | None = None) -> list[str]:
    return [str(common.JOB), "--steps", str(steps), "--out", str(out),
            "--sleep-ms", str(STEP_MS), *(extra or [])]


def run_once(system: str, ranks: int, steps: int, stop_step: int, out: Path,
             collective_timeout: float) -> dict[str, Any]:
    common.fresh(out)
    victim = ranks // 2
    if system == "torchrun":
        cmd = common.torchrun_cmd(ranks, *_job(steps, out, [
            "--mode", "torchrun", "--ckpt-every", "20", "--kill-rank", str(victim),
            "--kill-step", str(stop_step), "--kill-signal", "SIGSTOP",
            "--collective-timeout", str(collective_timeout)]))
    elif system == "reference":
        cmd = common.nonstop_cmd(f"--nproc={ranks}", f"--run-dir={out / 'run'}",
                                 *_job(steps, out, ["--mode", "nonstop"]))
    else:
        cmd = common.nonstop_cmd(f"--nproc={ranks}", "--spares=1", f"--run-dir={out / 'run'}",
                                 f"--inject=stop:rank={victim},step={stop_step}",
                                 *_job(steps, out, ["--mode", "nonstop"]))
    result = common.measure(system, cmd, out, TIMEOUT_S)
    if system != "reference":
        result["auto_timeout_s"] = None if system == "torchrun" else _detected_timeout(out / "run")
    return result


def _detected_timeout(run_dir: Path) -> float | None:
    for ev in common.events(run_dir):
        if ev.get("type") == "hang_detected":
            return ev.get("timeout_s")
    return None


def false_positive_run(ranks: int, minutes: float, out: Path) -> dict[str, Any]:
    """A fault-free run with jittery steps for about ``minutes``: every hang alarm is false."""
    common.fresh(out)
    steps = max(50, int(minutes * 60 / 0.13))  # ~0.13 s a jittery step here (measured)
    cmd = common.nonstop_cmd(f"--nproc={ranks}", f"--run-dir={out / 'run'}",
                             f"--inject=jitter:rank=all,ms={STEP_MS // 2}",
                             *_job(steps, out, ["--mode", "nonstop"]))
    code = common.run_child(cmd, out / "output.log", minutes * 60 * 3 + 300)
    evs = list(common.events(out / "run"))
    summary = json.loads((out / "run" / "summary.json").read_text()) if code == 0 else {}
    hangs = [e for e in evs if e.get("type") == "fault" and e.get("kind") == "hang"]
    timeouts = [e["timeout_s"] for e in evs if e.get("type") == "hang_timeout"]
    return {"exit_code": code, "steps": steps, "minutes": round(summary.get("wall_s", 0) / 60, 2),
            "false_positives": len(hangs) + (0 if code == 0 else 1),
            "stragglers_reported": sum(1 for e in evs if e.get("type") == "straggler"),
            "auto_timeout_s": timeouts[-1] if timeouts else None}


def main(args: argparse.Namespace) -> int:
    systems, base, say = common.setup(args, SYSTEMS)
    if args.false_positive_minutes < 0:
        raise UsageError("--false-positive-minutes must be 0 or more")
    steps, stop = args.steps, args.kill_step
    say(f"bench hang: {args.ranks} ranks, {steps} steps of ~60 ms, SIGSTOP rank {args.ranks // 2} "
        f"at step {stop}, {args.repeat} repeats; runs in {base}")
    ref_params = common.reference_weights(
        run_once("reference", args.ranks, steps, stop, base / "reference", args.collective_timeout),
        base / "reference", say)
    if ref_params is None:
        return 1
    results = []
    for system in systems:
        runs = []
        for i in range(args.repeat):
            out = base / system / f"run{i}"
            r = run_once(system, args.ranks, steps, stop, out, args.collective_timeout)
            r["params_match_reference"] = r["exit_code"] == 0 and common.params_equal(
                ref_params, out / "final.pt")
            runs.append(r)
            mttr = "-" if r["mttr_s"] is None else f"{r['mttr_s']:.3f} s"
            say(f"  {system:9s} run {i + 1}/{args.repeat}: exit {r['exit_code']}, MTTR {mttr}, "
                f"timeout {r['auto_timeout_s']}, steps lost {r['lost_steps']}, "
                f"weights match: {r['params_match_reference']}")
        results.append(common.aggregate(system, runs, extra=("auto_timeout_s",)))
    fp: dict[str, Any] = {"minutes": 0, "false_positives": None}
    if args.false_positive_minutes > 0:
        say(f"  false-positive run: ~{args.false_positive_minutes:g} min of jittery steps...")
        fp = false_positive_run(args.ranks, args.false_positive_minutes, base / "false-positive")
        say(f"  false-positive run: {fp['minutes']} min, {fp['false_positives']} false alarm(s), "
            f"auto timeout {fp['auto_timeout_s']} s, stragglers reported {fp['stragglers_reported']}")
    summary = {"scenario": "hang", "ranks": args.ranks, "repeat": args.repeat, "steps": steps,
               "stop_step": stop, "torchrun_collective_timeout_s": args.collective_timeout,
               "date": common.now_stamp(), "results": results,
               "false_positives": fp["false_positives"], "false_positive_minutes": fp["minutes"],
               "false_positive_run": fp}
    by = {r["system"]: r for r in results}
    if "torchrun" in by and "nonstop" in by:
        a, b = by["torchrun"]["mttr_s"]["median"], by["nonstop"]["mttr_s"]["median"]
        summary["torchrun_over_nonstop"] = round(a / b, 1) if a and b else None
    say(common.table(summary, extra=("auto_timeout_s",)))
    if not args.out:
        shutil.rmtree(base, ignore_errors=True)
    common.emit(summary, args.json)
    return 0

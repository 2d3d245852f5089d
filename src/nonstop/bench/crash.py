"""``nonstop bench crash``: kill one rank mid-run; time kill -> a step completed by every rank.

Systems, each on the same job (bench/job.py): nonstop with a warm spare, nonstop with no spare
(a new process), and torchrun with --max-restarts and a checkpoint every 20 steps.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..errors import UsageError
from . import common

SYSTEMS = ("nonstop-spare", "nonstop-cold", "torchrun")
TIMEOUT_S = 300.0


def _job_args(steps: int, out: Path) -> list[str]:
    return [str(common.JOB), "--steps", str(steps), "--out", str(out)]


def run_once(system: str, ranks: int, steps: int, kill_step: int, out: Path) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    victim = ranks // 2
    if system == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={ranks}", "--max-restarts=3", "--monitor-interval=0.1",
               *_job_args(steps, out), "--mode", "torchrun", "--ckpt-every", "20",
               "--kill-rank", str(victim), "--kill-step", str(kill_step)]
    elif system == "reference":
        cmd = common.nonstop_cmd(f"--nproc={ranks}", f"--run-dir={out / 'run'}",
                                 *_job_args(steps, out), "--mode", "nonstop")
    else:
        spares = "1" if system == "nonstop-spare" else "0"
        cmd = common.nonstop_cmd(f"--nproc={ranks}", f"--spares={spares}", f"--run-dir={out / 'run'}",
                                 f"--inject=crash:rank={victim},step={kill_step}",
                                 *_job_args(steps, out), "--mode", "nonstop")
    code = common.run_child(cmd, out / "output.log", TIMEOUT_S)
    result: dict[str, Any] = {"system": system, "exit_code": code}
    if system == "reference":
        return result
    if system == "torchrun":
        kill_file = out / "kill.txt"
        t_kill = float(kill_file.read_text()) if kill_file.exists() else None
    else:
        t_kill = common.inject_time(out / "run")
    if t_kill is None:
        result.update(mttr_s=None, lost_steps=None)
    else:
        result.update(common.recovery(common.read_steps(out), t_kill))
    return result


def main(args: argparse.Namespace) -> int:
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise UsageError(f"unknown system(s) {', '.join(unknown)} (known: {', '.join(SYSTEMS)})")
    if args.ranks < 2:
        raise UsageError("--ranks must be at least 2")
    if args.repeat < 1:
        raise UsageError("--repeat must be at least 1")
    if not 0 < args.kill_step < args.steps:
        raise UsageError("--kill-step must lie inside the run (0 < kill-step < steps)")
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="nonstop-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else print
    say(f"bench crash: {args.ranks} ranks, {args.steps} steps, kill rank {args.ranks // 2} at step "
        f"{args.kill_step}, {args.repeat} repeats; runs in {base}")
    ref = run_once("reference", args.ranks, args.steps, args.kill_step, base / "reference")
    if ref["exit_code"] != 0:
        say(f"the fault-free reference run failed; see {base / 'reference' / 'output.log'}")
        return 1
    ref_params = base / "reference" / "final.pt"
    results = []
    for system in systems:
        runs = []
        for i in range(args.repeat):
            out = base / system / f"run{i}"
            r = run_once(system, args.ranks, args.steps, args.kill_step, out)
            r["params_match_reference"] = r["exit_code"] == 0 and common.params_equal(
                ref_params, out / "final.pt")
            runs.append(r)
            mttr = "-" if r["mttr_s"] is None else f"{r['mttr_s']:.3f} s"
            say(f"  {system:14s} run {i + 1}/{args.repeat}: exit {r['exit_code']}, MTTR {mttr}, "
                f"steps lost {r['lost_steps']}, weights match: {r['params_match_reference']}")
        lost = [r["lost_steps"] for r in runs if r["lost_steps"] is not None]
        results.append({
            "system": system,
            "mttr_s": common.stats([r["mttr_s"] for r in runs]),
            "lost_steps": {"max": max(lost) if len(lost) == len(runs) else None},
            "params_match_reference": all(r["params_match_reference"] for r in runs),
            "runs": runs,
        })
    summary = {"scenario": "crash", "ranks": args.ranks, "repeat": args.repeat, "steps": args.steps,
               "kill_step": args.kill_step, "date": common.now_stamp(), "results": results}
    by = {r["system"]: r for r in results}
    if "torchrun" in by and "nonstop-spare" in by:
        a, b = by["torchrun"]["mttr_s"]["median"], by["nonstop-spare"]["mttr_s"]["median"]
        summary["torchrun_over_nonstop_spare"] = round(a / b, 1) if a and b else None
    say(table(summary))
    if not args.out:
        shutil.rmtree(base, ignore_errors=True)
    common.emit(summary, args.json)
    return 0


def table(summary: dict[str, Any]) -> str:
    lines = ["| system | MTTR median s | min | max | steps lost (max) | weights match |",
             "|---|---|---|---|---|---|"]
    for r in summary["results"]:
        m = r["mttr_s"]
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        lines.append(f"| {r['system']} | {fmt(m['median'])} | {fmt(m['min'])} | {fmt(m['max'])} | "
                     f"{r['lost_steps']['max']} | {r['params_match_reference']} |")
    if summary.get("torchrun_over_nonstop_spare"):
        lines.append(f"\ntorchrun / nonstop-spare MTTR ratio: {summary['torchrun_over_nonstop_spare']}")
    return "\n".join(lines)

"""``nonstop bench crash``: kill one rank mid-run; time kill -> a step completed by every rank.

Systems, each on the same job (bench/job.py): nonstop with a warm spare, nonstop with no spare
(a new process), and torchrun with --max-restarts and a checkpoint every 20 steps.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from . import common

SYSTEMS = ("nonstop-spare", "nonstop-cold", "torchrun")
# from the fault to a new warm spare ready (the pool refilled): nonstop-spare only
EXTRA = ("spare_refill_s",)
TIMEOUT_S = 300.0


def _job_args(steps: int, out: Path) -> list[str]:
    return [str(common.JOB), "--steps", str(steps), "--out", str(out)]


def run_once(system: str, ranks: int, steps: int, kill_step: int, out: Path) -> dict[str, Any]:
    common.fresh(out)
    victim = ranks // 2
    if system == "torchrun":
        cmd = common.torchrun_cmd(ranks, *_job_args(steps, out), "--mode", "torchrun",
                                  "--ckpt-every", "20", "--kill-rank", str(victim),
                                  "--kill-step", str(kill_step))
    elif system == "reference":
        cmd = common.nonstop_cmd(f"--nproc={ranks}", f"--run-dir={out / 'run'}",
                                 *_job_args(steps, out), "--mode", "nonstop")
    else:
        spares = "1" if system == "nonstop-spare" else "0"
        cmd = common.nonstop_cmd(f"--nproc={ranks}", f"--spares={spares}", f"--run-dir={out / 'run'}",
                                 f"--inject=crash:rank={victim},step={kill_step}",
                                 *_job_args(steps, out), "--mode", "nonstop")
    return common.measure(system, cmd, out, TIMEOUT_S)


def main(args: argparse.Namespace) -> int:
    systems, base, say = common.setup(args, SYSTEMS)
    say(f"bench crash: {args.ranks} ranks, {args.steps} steps, kill rank {args.ranks // 2} at step "
        f"{args.kill_step}, {args.repeat} repeats; runs in {base}")
    ref_params = common.reference_weights(
        run_once("reference", args.ranks, args.steps, args.kill_step, base / "reference"),
        base / "reference", say)
    if ref_params is None:
        return 1
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
            refill = r.get("spare_refill_s")
            say(f"  {system:14s} run {i + 1}/{args.repeat}: exit {r['exit_code']}, MTTR {mttr}, "
                f"steps lost {r['lost_steps']}, weights match: {r['params_match_reference']}"
                + ("" if refill is None else f", spare pool refilled in {refill:.3f} s"))
        results.append(common.aggregate(system, runs, EXTRA))
    summary = {"scenario": "crash", "ranks": args.ranks, "repeat": args.repeat, "steps": args.steps,
               "kill_step": args.kill_step, "date": common.now_stamp(), "results": results}
    ratio = common.mttr_ratio(results, "torchrun", "nonstop-spare")
    if ratio is not None or "torchrun" in systems and "nonstop-spare" in systems:
        summary["torchrun_over_nonstop_spare"] = ratio
    return common.conclude(summary, table(summary), base, args, say)


def table(summary: dict[str, Any]) -> str:
    text = common.table(summary, EXTRA)
    if summary.get("torchrun_over_nonstop_spare"):
        text += f"\n\ntorchrun / nonstop-spare MTTR ratio: {summary['torchrun_over_nonstop_spare']}"
    return text

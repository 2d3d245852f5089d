"""``nonstop bench crash``: kill one rank mid-run; time kill -> a step completed by every rank.

Systems, each on the same job (bench/job.py): nonstop with a warm spare, nonstop with no spare
(a new process), and torchrun with --max-restarts and a checkpoint every 20 steps. With
``--parallel ddp,fsdp,hsdp,2d,3d,pp`` each layout is its own job (DDP; FSDP2 over every rank;
HSDP, 2 replica groups of shards; FSDP2 or HSDP with tensor parallel of degree 2; 2 pipeline
stages with data parallel), run by every system, against a fault-free run of that layout;
torchrun's checkpoint of a sharded or split layout is DCP's. torchft (``torchft_run.py``) runs the HSDP layout, its own
way (a replica group is its failure domain: the group restarts and heals from another), when it
can be imported.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from . import common

SYSTEMS = ("nonstop-spare", "nonstop-cold", "torchrun", "torchft")
# torchft's extra measures: its survivors go on alone instead of waiting for the killed group
TORCHFT_EXTRA = ("survivors_pause_s", "degraded_steps")
LAYOUTS = ("ddp", "fsdp", "hsdp", "2d", "3d", "pp")
# from the fault to a new warm spare ready (the pool refilled): nonstop-spare only
EXTRA = ("spare_refill_s",)
TIMEOUT_S = 300.0


def _job_args(steps: int, out: Path, parallel: str = "ddp") -> list[str]:
    return [str(common.JOB), "--steps", str(steps), "--out", str(out), "--parallel", parallel]


def layouts(text: str) -> list[str]:
    """The layouts of ``--parallel``, checked (a UsageError names an unknown one)."""
    from nonstop.errors import UsageError

    chosen = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in chosen if x not in LAYOUTS]
    if unknown or not chosen:
        raise UsageError(f"--parallel: unknown layout(s) {', '.join(unknown) or '(none)'}; "
                         f"choose from {', '.join(LAYOUTS)}")
    return list(dict.fromkeys(chosen))


def run_once(system: str, ranks: int, steps: int, kill_step: int, out: Path,
             parallel: str = "ddp") -> dict[str, Any]:
    common.fresh(out)
    victim = ranks // 2
    job = _job_args(steps, out, parallel)
    if system == "torchrun":
        cmd = common.torchrun_cmd(ranks, *job, "--mode", "torchrun",
                                  "--ckpt-every", "20", "--kill-rank", str(victim),
                                  "--kill-step", str(kill_step))
    elif system == "reference":
        cmd = common.nonstop_cmd(f"--nproc={ranks}", f"--run-dir={out / 'run'}",
                                 *job, "--mode", "nonstop")
    else:
        spares = "1" if system == "nonstop-spare" else "0"
        cmd = common.nonstop_cmd(f"--nproc={ranks}", f"--spares={spares}", f"--run-dir={out / 'run'}",
                                 f"--inject=crash:rank={victim},step={kill_step}",
                                 *job, "--mode", "nonstop")
    result = common.measure(system, cmd, out, TIMEOUT_S)
    if system.startswith("nonstop"):  # where the replaced rank's state came from
        result["restore_source"] = common.restore_source(out / "run", victim)
    return result


def main(args: argparse.Namespace) -> int:
    chosen = layouts(args.parallel)
    if args.systems != ",".join(SYSTEMS) and "torchft" in args.systems.split(",") \
            and "hsdp" not in chosen:
        from nonstop.errors import UsageError

        raise UsageError("--systems torchft: torchft runs the hsdp layout (--parallel ...,hsdp)")
    systems, base, say = common.setup(args, SYSTEMS)
    say(f"bench crash: {args.ranks} ranks ({', '.join(chosen)}), {args.steps} steps, kill rank "
        f"{args.ranks // 2} at step {args.kill_step}, {args.repeat} repeats; runs in {base}")
    results = []
    torchft_missing = None
    if "torchft" in systems and "hsdp" in chosen:
        from . import torchft_run

        torchft_missing = torchft_run.unavailable()
    for parallel in chosen:
        where = base / parallel if len(chosen) > 1 else base
        ref_params = common.reference_weights(
            run_once("reference", args.ranks, args.steps, args.kill_step, where / "reference",
                     parallel), where / "reference", say)
        if ref_params is None:
            return 1
        for system in systems:
            if system == "torchft" and (parallel != "hsdp" or torchft_missing):
                why = torchft_missing or "torchft runs the hsdp layout here (its replica groups)"
                if parallel == "hsdp":
                    say(f"  {parallel:4s} torchft: left out: {why}")
                    results.append({"parallel": parallel, "system": "torchft", "skipped": why})
                continue
            runs = []
            for i in range(args.repeat):
                out = where / system / f"run{i}"
                if system == "torchft":
                    from . import torchft_run

                    r = torchft_run.run_once(args.ranks, args.steps, args.kill_step, out,
                                             TIMEOUT_S)
                    r["params_match_reference"] = False  # by design: steps on fewer replicas
                else:
                    r = run_once(system, args.ranks, args.steps, args.kill_step, out, parallel)
                    r["params_match_reference"] = r["exit_code"] == 0 and common.params_equal(
                        ref_params, out / "final.pt")
                runs.append(r)
                mttr = "-" if r["mttr_s"] is None else f"{r['mttr_s']:.3f} s"
                refill = r.get("spare_refill_s")
                say(f"  {parallel:4s} {system:14s} run {i + 1}/{args.repeat}: exit "
                    f"{r['exit_code']}, MTTR {mttr}, steps lost {r['lost_steps']}, weights "
                    f"match: {r['params_match_reference']}"
                    + ("" if refill is None else f", spare pool refilled in {refill:.3f} s")
                    + (f", restored from {r['restore_source']}" if r.get("restore_source")
                       else "")
                    + (f", survivors paused {r.get('survivors_pause_s')} s and took "
                       f"{r.get('degraded_steps')} steps alone" if system == "torchft" else ""))
            extra = EXTRA + (TORCHFT_EXTRA if system == "torchft" else ())
            result = {"parallel": parallel, **common.aggregate(system, runs, extra)}
            sources = sorted({r["restore_source"] for r in runs if r.get("restore_source")})
            result["restore_source"] = ",".join(sources) or None
            results.append(result)
    summary = {"scenario": "crash", "ranks": args.ranks, "repeat": args.repeat, "steps": args.steps,
               "kill_step": args.kill_step, "parallel": chosen, "date": common.now_stamp(),
               "results": results}
    ratios = {}
    for parallel in chosen:
        mine = [r for r in results if r["parallel"] == parallel and "skipped" not in r]
        ratio = common.mttr_ratio(mine, "torchrun", "nonstop-spare")
        if ratio is not None:
            ratios[parallel] = ratio
    if ratios:
        summary["torchrun_over_nonstop_spare"] = ratios if len(chosen) > 1 else ratios[chosen[0]]
    for parallel in chosen:  # torchft's heal against nonstop's spare, the same layout
        mine = [r for r in results if r["parallel"] == parallel and "skipped" not in r]
        ratio = common.mttr_ratio(mine, "torchft", "nonstop-spare")
        if ratio is not None:
            summary.setdefault("torchft_over_nonstop_spare", {})[parallel] = ratio
    ddp = {r["system"]: r for r in results if r["parallel"] == "ddp"}
    spare_ddp = (ddp.get("nonstop-spare") or {}).get("mttr_s", {}).get("median")
    if spare_ddp and len(chosen) > 1:  # the sharded layouts' MTTR against DDP's, same run
        summary["over_ddp_spare"] = {
            r["parallel"]: round(r["mttr_s"]["median"] / spare_ddp, 2) for r in results
            if r["system"] == "nonstop-spare" and r["parallel"] != "ddp" and r["mttr_s"]["median"]}
    return common.conclude(summary, table(summary), base, args, say)


def table(summary: dict[str, Any]) -> str:
    ran = dict(summary, results=[r for r in summary["results"] if "skipped" not in r])
    text = common.table(ran, EXTRA)
    for r in summary["results"]:
        if "skipped" in r:
            text += f"\n{r['parallel']} {r['system']}: left out ({r['skipped']})"
        elif r["system"] == "torchft":
            pause, alone = r.get("survivors_pause_s") or {}, r.get("degraded_steps") or {}
            text += (f"\n{r['parallel']} torchft: the other replica group paused "
                     f"{pause.get('median')} s, then trained alone for {alone.get('median')} "
                     "steps (half the global batch) until the killed group healed")
    if summary.get("torchrun_over_nonstop_spare"):
        text += f"\n\ntorchrun / nonstop-spare MTTR ratio: {summary['torchrun_over_nonstop_spare']}"
    if summary.get("torchft_over_nonstop_spare"):
        text += f"\ntorchft / nonstop-spare MTTR ratio: {summary['torchft_over_nonstop_spare']}"
    if summary.get("over_ddp_spare"):
        text += f"\nnonstop-spare MTTR over DDP's: {summary['over_ddp_spare']}"
    return text

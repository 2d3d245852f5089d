"""``nonstop bench overhead``: what a job that never fails pays for nonstop.

The same job (bench/job.py) without a fault, at a step of about 25 ms and of about 250 ms (a sleep
stands in for the accelerator's work, as in the other benches: what is measured is what nonstop
adds on the host's CPU and in the step's critical path):

- ``plain``: torchrun, DDP's own reduction, no checkpoint;
- ``nonstop``: ``nonstop run`` with everything on by default (``nonstop.wrap``, ``State``, memory
  snapshots at the tuned interval, the NaN check, heartbeats, a warm spare), DDP's own reduction;
- ``reproducible``: torchrun with ``nonstop.reproducible`` (fixed buckets): the cost of bit-for-bit
  reproducibility over DDP's buckets;
- ``nonstop_reproducible``: both.

With ``--parallel fsdp`` (or ``hsdp``) the job is sharded with FSDP2 and only ``plain`` and
``nonstop`` run (FSDP2's reduction order is its own: there is no DDP bucket layout to fix).

The step time is the mean over the steps after the first fifth (snapshot stalls included), from
rank 0's step log; the systems take turns, each ``--repeat`` times, and the median run counts.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from . import common

SYSTEMS = ("plain", "nonstop", "reproducible", "nonstop_reproducible")
STEP_MS = (25.0, 250.0)
RUN_S = 15.0  # of training per run
COMPUTE_MS = 3.0  # the job's own compute per step here (2 ranks on 2 cores), about
TARGET_PCT = 2.0
TARGET_REPRODUCIBLE_PCT = 5.0
TIMEOUT_S = 300.0


SHARDED_SYSTEMS = ("plain", "nonstop")


def _cmd(system: str, ranks: int, steps: int, sleep_ms: float, out: Path,
         parallel: str = "ddp") -> list[str]:
    job = [str(common.JOB), "--steps", str(steps), "--out", str(out), "--sleep-ms", f"{sleep_ms:g}",
           "--ddp", "reproducible" if system.endswith("reproducible") else "plain",
           "--parallel", parallel]
    if system.startswith("nonstop"):
        return common.nonstop_cmd(f"--nproc={ranks}", "--spares=1", f"--run-dir={out / 'run'}",
                                  *job, "--mode", "nonstop")
    return common.torchrun_cmd(ranks, *job, "--mode", "torchrun", "--ckpt-every", "0",
                               restarts=0)


def mean_step(rows: list[tuple[int, float, int]]) -> float | None:
    """Mean step time after the first fifth of the steps (start-up, the snapshot tuning)."""
    rows = sorted(rows)
    if len(rows) < 10:
        return None
    skip = len(rows) // 5
    (s0, t0, _), (s1, t1, _) = rows[skip], rows[-1]
    return (t1 - t0) / (s1 - s0) if s1 > s0 else None


def run_once(system: str, ranks: int, steps: int, sleep_ms: float, out: Path,
             parallel: str = "ddp") -> dict[str, Any]:
    common.fresh(out)
    code = common.run_child(_cmd(system, ranks, steps, sleep_ms, out, parallel),
                            out / "output.log", TIMEOUT_S)
    step = mean_step(common.read_steps(out).get(0, [])) if code == 0 else None
    result = {"system": system, "exit_code": code,
              "step_s": None if step is None else round(step, 6)}
    if system.startswith("nonstop"):  # one snapshot of rank 0 in its node's memory
        sizes = [e.get("slot_bytes") for e in common.events(out / "run")
                 if e.get("type") == "rank_snapshot_interval" and e.get("slot_bytes")]
        result["snapshot_bytes"] = sizes[-1] if sizes else None
    return result


def _pct(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else round((a / b - 1) * 100, 2)


def _paired(runs: list[dict[str, Any]] | None, base: list[dict[str, Any]] | None) -> float | None:
    """The median over turns of each run's step time against the base's run of the same turn."""
    pcts = [_pct(r["step_s"], b["step_s"]) for r, b in zip(runs or [], base or [])]
    pcts = [p for p in pcts if p is not None]
    return round(statistics.median(pcts), 2) if pcts else None


def table(results: list[dict[str, Any]]) -> str:
    fmt = lambda v, d=4: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    lines = ["| step (target) | plain s | nonstop s | overhead | overhead, paired by turn | "
             "reproducible s | reproducible overhead | nonstop + reproducible s | a rank's "
             "snapshot, bytes |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        # (a run of some of the systems, --systems: the others' columns are "-")
        lines.append(f"| {r['step_ms']:g} ms | {fmt(r.get('plain_s'))} | "
                     f"{fmt(r.get('nonstop_s'))} | {fmt(r['overhead_pct'], 2)}% | "
                     f"{fmt(r.get('overhead_paired_pct'), 2)}% | {fmt(r.get('reproducible_s'))} | "
                     f"{fmt(r['reproducible_overhead_pct'], 2)}% | "
                     f"{fmt(r.get('nonstop_reproducible_s'))} | "
                     f"{r.get('snapshot_bytes_per_rank') or '-'} |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from nonstop.errors import UsageError

    try:
        step_ms = tuple(float(v) for v in (args.step_ms or "").split(",") if v.strip()) or STEP_MS
    except ValueError:
        raise UsageError(f"--step-ms: a comma-separated list of milliseconds, not "
                         f"{args.step_ms!r}") from None
    if min(step_ms) <= COMPUTE_MS:
        raise UsageError(f"--step-ms: each step must be longer than the job's compute "
                         f"(about {COMPUTE_MS:g} ms)")
    args.ranks = args.ranks or 2
    args.repeat = args.repeat or 3
    steps_arg = args.steps  # None: chosen per step size
    if steps_arg is not None and steps_arg < 10:
        raise UsageError("--steps: at least 10")
    args.steps, args.kill_step = 10, 1  # no fault here: only to pass the common checks
    parallel = args.parallel
    if parallel not in ("ddp", "fsdp", "hsdp"):
        raise UsageError(f"--parallel: overhead measures one layout: ddp, fsdp or hsdp, not "
                         f"{parallel!r}")
    if parallel != "ddp":
        if args.systems == ",".join(SYSTEMS):  # the default: those that apply
            args.systems = ",".join(SHARDED_SYSTEMS)
        extra = set(args.systems.split(",")) - set(SHARDED_SYSTEMS)
        if extra:
            raise UsageError(f"--parallel {parallel}: systems {', '.join(SHARDED_SYSTEMS)} only "
                             f"(not {', '.join(sorted(extra))})")
    systems, base, say = common.setup(args, SYSTEMS)
    say(f"bench overhead ({parallel}): {args.ranks} ranks, steps of {', '.join(f'{s:g}' for s in step_ms)} ms, "
        f"systems {', '.join(systems)}, {args.repeat} turns; runs in {base}")
    results = []
    for ms in step_ms:
        steps = steps_arg or max(60, int(RUN_S * 1000 / ms))
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
        for i in range(args.repeat):
            # the order turns about every turn (A B, B A, ...): a machine that drifts one way
            # over the minutes a bench takes favours neither system
            for system in (systems if i % 2 == 0 else systems[::-1]):
                r = run_once(system, args.ranks, steps, ms - COMPUTE_MS,
                             base / f"step{ms:g}ms" / system / f"run{i}", parallel)
                runs[system].append(r)
                say(f"  {ms:g} ms, {system:21s} turn {i + 1}/{args.repeat}: exit {r['exit_code']}, "
                    f"step {r['step_s']} s")
        entry: dict[str, Any] = {"step_ms": ms, "steps": steps}
        for system in systems:
            vals = [r["step_s"] for r in runs[system] if r["step_s"] is not None]
            entry[f"{system}_s"] = round(statistics.median(vals), 6) if vals else None
        entry["step_s"] = entry.get("plain_s")
        held = [r.get("snapshot_bytes") for rs in runs.values() for r in rs if r.get("snapshot_bytes")]
        # a rank's node keeps its SLOTS newest snapshots (and, with a buddy node, as many of
        # another's): a host of R ranks holds about R x SLOTS x this, twice that with replicas
        entry["snapshot_bytes_per_rank"] = max(held) if held else None
        entry["overhead_pct"] = _pct(entry.get("nonstop_s"), entry.get("plain_s"))
        # each turn's nonstop run against the plain run beside it, the median of those: what
        # the machine's drift between turns (several % an hour on a small VM) does not move
        entry["overhead_paired_pct"] = _paired(runs.get("nonstop"), runs.get("plain"))
        entry["reproducible_overhead_pct"] = _pct(entry.get("reproducible_s"), entry.get("plain_s"))
        entry["runs"] = runs
        results.append(entry)
    met = [r["overhead_pct"] is not None and r["overhead_pct"] <= TARGET_PCT
           and (parallel != "ddp" or (r["reproducible_overhead_pct"] is not None
                                      and r["reproducible_overhead_pct"] <= TARGET_REPRODUCIBLE_PCT))
           for r in results]
    summary = {"scenario": "overhead", "parallel": parallel, "ranks": args.ranks,
               "repeat": args.repeat,
               "results": results, "target_pct": TARGET_PCT,
               "target_reproducible_pct": TARGET_REPRODUCIBLE_PCT, "targets_met": all(met)}
    say(table(results))
    common.emit(summary, args.json)
    failed = any(r["exit_code"] != 0 for e in results for rs in e["runs"].values() for r in rs)
    return 1 if failed else 0

"""``nonstop bench scale``: does a recovery grow with the job? One rank SIGKILLed (injected crash)
with a warm spare, at several world sizes: 2, 4, 8 and 16 ranks on this host (bench/job.py, the
crash bench's job), and 2, 4 and 8 test hosts x 2 ranks (examples/train_timed.py, the hosts
bench's job and its ``rank_crash`` case).

For each size: the MTTR (kill -> a step completed by every rank in the new generation) and its
phases (the incident's, from the event log), the job's own step time (the fault-free run's median),
and the MTTR in steps of the job. On one machine the job's step time grows with its size (more
processes than cores), and every phase of a recovery runs on the same loaded cores: what is
compared per doubling is the growth of the MTTR beyond the growth of the step time
(``mttr / step_s``), and the phases say where the rest goes.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path
from typing import Any

from . import common

SYSTEMS = ("one_host", "hosts")
SIZES = (2, 4, 8, 16)  # ranks on this host
HOST_SIZES = (2, 4, 8)  # test hosts x --ranks-per-host
TARGET_GROWTH = 0.10  # per doubling, beyond the step time's own growth


def _ints(text: str | None, default: tuple[int, ...], what: str) -> tuple[int, ...]:
    from nonstop.errors import UsageError

    if not text:
        return default
    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UsageError(f"{what}: a comma-separated list of whole numbers, not {text!r}") from None
    least = 2 if what == "--sizes" else 1
    if not vals or min(vals) < least:
        raise UsageError(f"{what}: sizes must be at least {least}")
    return tuple(sorted(set(vals)))


def step_time(steps: dict[int, list[tuple[int, float, int]]]) -> float | None:
    """The job's step time: the median interval between rank 0's completed steps (the first
    tenth left out: warm-up)."""
    rows = sorted(t for _, t, _ in steps.get(0, []))
    skip = max(1, len(rows) // 10)
    gaps = [b - a for a, b in zip(rows[skip:], rows[skip + 1:])]
    return round(statistics.median(gaps), 5) if gaps else None


def _phases(run_dir: Path) -> dict[str, float] | None:
    incs = [e for e in common.events(run_dir) if e.get("type") == "incident"]
    return incs[0].get("phases_s") if len(incs) == 1 else None


def _median_phases(runs: list[dict[str, Any]]) -> dict[str, float]:
    names: list[str] = []
    for r in runs:
        names += [k for k in (r.get("phases_s") or {}) if k not in names]
    return {k: round(statistics.median([r["phases_s"][k] for r in runs
                                        if r.get("phases_s") and k in r["phases_s"]]), 4)
            for k in names}


def _one_host(n: int, a: argparse.Namespace, base: Path, say: Any) -> dict[str, Any]:
    from . import crash

    ref_out = base / f"ranks{n}" / "reference"
    ref = crash.run_once("reference", n, a.steps, a.kill_step, ref_out)
    entry: dict[str, Any] = {"ranks": n, "hosts": 1, "step_s": step_time(common.read_steps(ref_out))}
    ref_params = common.reference_weights(ref, ref_out, say)
    runs = []
    for i in range(a.repeat if ref_params is not None else 0):
        out = base / f"ranks{n}" / f"run{i}"
        r = crash.run_once("nonstop-spare", n, a.steps, a.kill_step, out)
        r["phases_s"] = _phases(out / "run")
        r["params_match_reference"] = r["exit_code"] == 0 and common.params_equal(
            ref_params, out / "final.pt")
        runs.append(r)
        say(f"  {n:3d} ranks, run {i + 1}/{a.repeat}: exit {r['exit_code']}, "
            f"MTTR {_fmt(r['mttr_s'])} s, step {_fmt(entry['step_s'])} s")
    return _entry(entry, runs)


def _hosts(h: int, a: argparse.Namespace, base: Path, say: Any) -> dict[str, Any]:
    from . import hosts

    ha = argparse.Namespace(hosts=h, ranks_per_host=a.ranks_per_host, spare_hosts=0,
                            steps=a.steps, kill_step=a.kill_step, sleep_ms=a.sleep_ms)
    ref_out = base / f"hosts{h}" / "reference"
    ref = hosts.reference(ha, ref_out)
    entry: dict[str, Any] = {"ranks": h * a.ranks_per_host, "hosts": h, "step_s": None}
    ref_params = common.reference_weights(ref, ref_out, say)
    runs, steps = [], []
    for i in range(a.repeat if ref_params is not None else 0):
        out = base / f"hosts{h}" / f"run{i}"
        r = hosts.with_retries(hosts.nonstop_once, "rank_crash", ha, out, ref_out / "final.pt")
        rows = hosts.read_times(out / "steps.txt")
        before = sorted(t for st, t, _, _ in rows if st < a.kill_step)
        gaps = [y - x for x, y in zip(before[5:], before[6:])]
        if gaps:
            steps.append(statistics.median(gaps))
        r["exit_code"] = 0 if r["completed"] else 1
        runs.append(r)
        say(f"  {h} hosts x {a.ranks_per_host}, run {i + 1}/{a.repeat}: "
            f"{'completed' if r['completed'] else r['error']}, MTTR {_fmt(r['mttr_s'])} s")
    entry["step_s"] = round(statistics.median(steps), 5) if steps else None
    return _entry(entry, runs)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _entry(entry: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    mttr = common.stats([r["mttr_s"] for r in runs])
    lost = [r.get("lost_steps") for r in runs]
    step_s = entry["step_s"]
    entry.update(
        mttr_s=mttr,
        mttr_steps=round(mttr["median"] / step_s, 2) if mttr["median"] and step_s else None,
        phases_s=_median_phases(runs),
        lost_steps={"max": max(lost) if lost and None not in lost else None},
        params_match_reference=bool(runs) and all(r["params_match_reference"] for r in runs),
        runs=runs)
    return entry


def growth(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per doubling (size to next size, in each series): how much the MTTR grew, the step time
    grew, and the MTTR beyond the step time (its ratio in steps)."""
    out = []
    for hosts_series in (False, True):
        series = sorted((r for r in results if (r["hosts"] > 1) == hosts_series),
                        key=lambda r: r["ranks"])
        for a, b in zip(series, series[1:]):
            ma, mb = a["mttr_s"]["median"], b["mttr_s"]["median"]
            if not (ma and mb and a["step_s"] and b["step_s"]):
                continue
            doublings = max(1e-9, math.log2(b["ranks"] / a["ranks"]))
            beyond = (mb / b["step_s"]) / (ma / a["step_s"])
            out.append({"from": a["ranks"], "to": b["ranks"], "hosts": hosts_series,
                        "mttr_growth": round(mb / ma - 1, 3),
                        "step_growth": round(b["step_s"] / a["step_s"] - 1, 3),
                        "beyond_step_per_doubling": round(beyond ** (1 / doublings) - 1, 3)})
    return out


def table(results: list[dict[str, Any]]) -> str:
    phases: list[str] = []
    for r in results:
        phases += [k for k in r["phases_s"] if k not in phases]
    head = ("| ranks | hosts | step s | MTTR median s | min | max | MTTR in steps | "
            + " | ".join(phases) + " | lost | bitwise |")
    lines = [head, "|" + "---|" * (9 + len(phases))]
    for r in results:
        m = r["mttr_s"]
        lines.append(f"| {r['ranks']} | {r['hosts']} | {_fmt(r['step_s'])} | {_fmt(m['median'])} | "
                     f"{_fmt(m['min'])} | {_fmt(m['max'])} | {r['mttr_steps']} | "
                     + " | ".join(_fmt(r["phases_s"].get(k)) for k in phases)
                     + f" | {r['lost_steps']['max']} | {r['params_match_reference']} |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    sizes = _ints(args.sizes, SIZES, "--sizes")
    host_sizes = _ints(args.host_sizes, HOST_SIZES, "--host-sizes")
    if args.sleep_ms is None:
        args.sleep_ms = 15.0
    args.ranks = min(sizes)
    systems, base, say = common.setup(args, SYSTEMS)
    say(f"bench scale: a rank crash with a warm spare, {args.steps} steps, fault at step "
        f"{args.kill_step}, {args.repeat} repeats; sizes {list(sizes)} ranks on this host, "
        f"{list(host_sizes)} test hosts x {args.ranks_per_host}; runs in {base}")
    results = []
    if "one_host" in systems:
        for n in sizes:
            results.append(_one_host(n, args, base, say))
    if "hosts" in systems:
        for h in host_sizes:
            results.append(_hosts(h, args, base, say))
    steps = growth(results)
    worst = max((g["beyond_step_per_doubling"] for g in steps), default=None)
    summary = {"scenario": "scale", "steps": args.steps, "kill_step": args.kill_step,
               "repeat": args.repeat, "results": results, "growth": steps,
               "target_growth_per_doubling": TARGET_GROWTH,
               "target_met": worst is not None and worst <= TARGET_GROWTH,
               "params_match_reference": all(r["params_match_reference"] for r in results)}
    say(table(results))
    for g in steps:
        say(f"  {g['from']} -> {g['to']} ranks{' (hosts)' if g['hosts'] else ''}: MTTR "
            f"{g['mttr_growth']:+.0%}, step {g['step_growth']:+.0%}, beyond the step "
            f"{g['beyond_step_per_doubling']:+.0%} per doubling")
    common.emit(summary, args.json)
    return 0 if summary["params_match_reference"] else 1

"""``nonstop bench goodput``: a 4-rank job with one warm spare trains for ``--minutes``, hit by a
fault every ``--every`` seconds drawn from a seeded mix (a crash, a hang, NaN gradients, the
idle warm spare killed), against the same job without faults. The policy is the chaos soak's:
injected faults are not failing hardware, so no node is isolated for them and no level runs out
of budget.

Runs, one after the other on this machine:

1. calibration: a short fault-free run measures the step time, which sets the steps of a run of
   ``--minutes`` and the step of each fault (one every ``--every`` seconds of training);
2. ``reference``: the job without faults under nonstop (its weights, and its wall time: the
   fault-free throughput);
3. ``nonstop``: the same job with the faults;
4. ``torchrun``: the same job under torchrun with a checkpoint every 20 steps, a restart per
   fault (``--max-restarts`` as many), every fault a crash - the kind torchrun detects fastest;
   a hang would cost it its collective timeout.

Per system: ``goodput`` (the share of wall time rank 0 spent in steps that advanced the job; for
nonstop, its own goodput account, docs/observe.md; for torchrun the same measure from its step
log), and ``throughput_ratio_vs_fault_free`` (the reference's wall time over the run's: the same
steps, so the ratio of their throughputs). The target: nonstop at 0.95 or more.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from . import chaos, common

SYSTEMS = ("nonstop", "torchrun")
KINDS = {
    "crash": "crash:rank={r},step={s}",
    "hang": "hang:rank={r},step={s}",
    "nan": "nan:rank={r},step={s}",
    "spare_death": "",  # the harness SIGKILLs the idle warm spare once rank 0 passes the step
}
RANKS, SPARES = 4, 1
CALIBRATION_STEPS = 150
JOB = ("--sleep-ms", "20", "--hidden", "256")


def schedule(seed: int, steps: int, step_s: float, every_s: float) -> list[dict[str, Any]]:
    """A fault every ``every_s`` seconds of training (as steps), kinds in a seeded order (every
    kind in turn before any repeats), ranks drawn with the same seed."""
    rng = random.Random(seed)
    gap = max(10, round(every_s / step_s))
    out: list[dict[str, Any]] = []
    kinds: list[str] = []
    for s in range(gap, steps - gap // 2, gap):
        if not kinds:
            kinds = list(KINDS)
            rng.shuffle(kinds)
        kind, r = kinds.pop(), rng.randrange(RANKS)
        out.append({"kind": kind, "step": s, "rank": r, "spec": KINDS[kind].format(r=r, s=s)})
    return out


def kill_spares(out: Path, plan: list[dict[str, Any]], stop: threading.Event,
                killed: list[float]) -> None:
    """The spare deaths of the plan: once rank 0 has passed a spare death's step, SIGKILL the
    warm spare that is idle then (a spawned spare that holds no rank and has not ended)."""
    steps = sorted(f["step"] for f in plan if f["kind"] == "spare_death")
    log, run = out / "steps-r0.txt", out / "run"
    while steps and not stop.wait(0.2):
        try:
            lines = log.read_text().splitlines()
            step = int(lines[-1].split()[0]) if lines else 0
        except (OSError, ValueError, IndexError):
            continue
        if step < steps[0]:
            continue
        pid = _idle_spare(run)
        if pid is None:
            continue  # none ready yet (a refill under way): a moment later
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue
        killed.append(time.time())
        steps.pop(0)


def _idle_spare(run: Path) -> int | None:
    spares: dict[int, int] = {}
    taken: set[int] = set()
    for ev in common.events(run):
        if ev.get("type") == "spawn" and ev.get("spare"):
            spares[ev["wid"]] = ev["pid"]
        elif ev.get("type") == "generation":
            taken |= set((ev.get("ranks") or {}).values())
        elif ev.get("type") in ("exit", "spare_lost"):
            taken.add(ev.get("wid"))
    idle = [w for w in spares if w not in taken]
    return spares[max(idle)] if idle else None


def step_log_goodput(out: Path, t0: float, t1: float) -> float | None:
    """Rank 0's time in steps that advanced the job (a step completed for the first time, timed
    from the step before it in the same attempt) over the wall time ``t1 - t0``."""
    rows = common.read_steps(out).get(0) or []
    if not rows or t1 <= t0:
        return None
    productive, hwm, prev = 0.0, 0, None
    for step, t, gen in rows:
        if prev is not None and prev[2] == gen and step == prev[0] + 1 and step > hwm:
            productive += t - prev[1]
        hwm = max(hwm, step)
        prev = (step, t, gen)
    return round(productive / (t1 - t0), 4)


def _run(system: str, out: Path, steps: int, plan: list[dict[str, Any]], timeout_s: float
         ) -> dict[str, Any]:
    common.fresh(out)
    job = [str(common.JOB), "--steps", str(steps), "--out", str(out), *JOB]
    if system == "torchrun":
        kills = ",".join(str(f["step"]) for f in plan)
        cmd = common.torchrun_cmd(RANKS, *job, "--mode", "torchrun", "--ckpt-every", "20",
                                  "--kill-rank", str(RANKS // 2), "--kill-steps", kills,
                                  restarts=len(plan) + 1)
    else:
        (out / "policy.yaml").write_text(chaos.POLICY)  # injected faults: no node is to blame
        flags = [f"--nproc={RANKS}", f"--spares={SPARES}", f"--run-dir={out / 'run'}",
                 f"--policy={out / 'policy.yaml'}"]
        specs = [f["spec"] for f in plan if f["spec"]]
        if system == "nonstop" and specs:
            flags.append("--inject=" + ";".join(specs))
        cmd = common.nonstop_cmd(*flags, *job, "--mode", "nonstop")
    stop, killed = threading.Event(), []
    harness = None
    if system == "nonstop":
        harness = threading.Thread(target=kill_spares, args=(out, plan, stop, killed), daemon=True)
        harness.start()
    t0 = time.time()
    code = common.run_child(cmd, out / "output.log", timeout_s)
    t1 = time.time()
    stop.set()
    if harness is not None:
        harness.join(timeout=5)
    res: dict[str, Any] = {"system": system, "exit_code": code, "wall_s": round(t1 - t0, 3),
                           "goodput_step_log": step_log_goodput(out, t0, t1)}
    if system == "nonstop":
        res["spares_killed"] = len(killed)
    summary = out / "run" / "summary.json"
    if system != "torchrun" and summary.is_file():
        s = json.loads(summary.read_text())
        res.update(goodput=s.get("goodput"), time_s=s.get("time_s"), incidents=s.get("incidents"),
                   steps_lost=s.get("steps_lost"), mttr_s=s.get("mttr_s"))
    elif system == "torchrun":
        res["goodput"] = res["goodput_step_log"]
        gens = {g for _, _, g in common.read_steps(out).get(0) or []}
        res["restarts"] = max(gens) if gens else None
    return res


def _step_s(out: Path) -> float:
    rows = common.read_steps(out).get(0) or []
    gaps = [b[1] - a[1] for a, b in zip(rows, rows[1:]) if b[2] == a[2]]
    return statistics.median(gaps[len(gaps) // 3:]) if gaps else 0.05


def main(args: argparse.Namespace) -> int:
    from nonstop.errors import UsageError

    systems = [s.strip() for s in (args.systems or ",".join(SYSTEMS)).split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise UsageError(f"unknown system(s) {', '.join(unknown)} (known: {', '.join(SYSTEMS)})")
    if args.minutes <= 0 or args.every <= 0:
        raise UsageError("--minutes and --every must be positive")
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="nonstop-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else print
    say(f"bench goodput: {RANKS} ranks + {SPARES} spare, {args.minutes} min, a fault every "
        f"{args.every} s (seed {args.seed}); runs in {base}")
    cal = _run("reference", base / "calibration", CALIBRATION_STEPS, [], 600)
    if cal["exit_code"] != 0:
        say(f"the calibration run failed; see {base / 'calibration' / 'output.log'}")
        return 1
    step_s = _step_s(base / "calibration")
    steps = max(100, round(args.minutes * 60 / step_s))
    plan = schedule(args.seed, steps, step_s, args.every)
    say(f"  step {step_s * 1000:.1f} ms: {steps} steps, {len(plan)} faults: "
        + ", ".join(f"{f['kind']}@{f['step']}" for f in plan))
    timeout = max(900.0, args.minutes * 60 * 4)
    ref = _run("reference", base / "reference", steps, [], timeout)
    say(f"  reference: exit {ref['exit_code']}, {ref['wall_s']:.1f} s")
    if ref["exit_code"] != 0:
        say(f"the fault-free reference run failed; see {base / 'reference' / 'output.log'}")
        return 1
    results: dict[str, dict[str, Any]] = {}
    for system in systems:
        r = _run(system, base / system, steps, plan, timeout)
        r["throughput_ratio_vs_fault_free"] = (round(ref["wall_s"] / r["wall_s"], 4)
                                               if r["exit_code"] == 0 else None)
        r["params_match_reference"] = r["exit_code"] == 0 and common.params_equal(
            base / "reference" / "final.pt", base / system / "final.pt")
        results[system] = r
        say(f"  {system}: exit {r['exit_code']}, {r['wall_s']:.1f} s, goodput {r.get('goodput')}, "
            f"throughput x{r['throughput_ratio_vs_fault_free']} of fault-free, weights "
            f"{'bitwise equal' if r['params_match_reference'] else 'DIFFER'}")
    result = {
        "scenario": "goodput", "minutes": args.minutes, "faults": len(plan),
        "every_s": args.every, "seed": args.seed, "steps": steps, "step_s": round(step_s, 4),
        "goodput": {s: r.get("goodput") for s, r in results.items()},
        "throughput_ratio_vs_fault_free": {s: r["throughput_ratio_vs_fault_free"]
                                           for s, r in results.items()},
        "params_match_reference": bool(results.get("nonstop", {}).get("params_match_reference")),
        "reference_wall_s": ref["wall_s"], "results": results, "schedule": plan,
        "date": common.now_stamp(),
    }
    common.emit(result, args.json)
    ok = all(r["exit_code"] == 0 for r in results.values())
    return 0 if ok else 1

"""``nonstop bench crash|hang --script SCRIPT``: what a recovery costs a job of your own.

The comparison benchmarks beside the package measure nonstop against torchrun and torchft on
nonstop's own example job. This measures your job, on this host, as you run it: the script
under ``nonstop run --nproc N --spares 1`` with its default policy, one rank killed (``crash``)
or frozen in a step (``hang``: it must be found first) at ``--kill-step``, ``--repeat`` times,
and what each recovery cost - its time to recover (MTTR) by phase, the steps lost, whether the
job completed. A fault-free run first gives the job's own pace (steps per second, its start).
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from .chaos import orphans, run_job
from .errors import UsageError

SCENARIOS = {"crash": "crash:rank={r},step={s}", "hang": "hang:rank={r},step={s}"}


def own(args: Any) -> int:
    """The exit code: 0 when every run completed and recovered, with nothing left running."""
    script = Path(args.script)
    if not script.is_file():
        raise UsageError(f"no such script: {args.script}")
    if args.scenario not in SCENARIOS:
        raise UsageError(f"bench {args.scenario} measures nonstop's own example job; at a script "
                         f"of yours: {', '.join(SCENARIOS)}")
    ranks = args.ranks or 2
    repeat = args.repeat or 3
    step = args.kill_step or 50
    if ranks < 2 or repeat < 1 or step < 1:
        raise UsageError("--ranks must be at least 2, --repeat and --kill-step at least 1")
    script_args = list(args.script_args)
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="nonstop-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else print
    marker = uuid.uuid4().hex
    say(f"bench {args.scenario}: {script.name} on {ranks} ranks + 1 warm spare, rank "
        f"{ranks - 1} {'killed' if args.scenario == 'crash' else 'frozen'} at step {step}, "
        f"{repeat} run(s); runs in {base}")
    t0 = time.time()
    code = run_job(base / "fault-free", script, script_args, ranks, 1, None, marker,
                   chaos_policy=False)
    pace = _pace(base / "fault-free" / "run", time.time() - t0, code)
    say(f"  fault-free: exit {code}, {pace['steps']} steps, {pace['steps_per_s']} steps/s, "
        f"started in {pace['startup_s']} s")
    runs = []
    for i in range(repeat):
        spec = SCENARIOS[args.scenario].format(r=ranks - 1, s=step)
        t0 = time.time()
        code = run_job(base / f"run{i}", script, script_args, ranks, 1, spec, marker,
                       chaos_policy=False)
        runs.append(_recovery(base / f"run{i}" / "run", code, time.time() - t0))
        r = runs[-1]
        say(f"  run {i + 1}: exit {code}, MTTR {r['mttr_s']} s, steps lost {r['steps_lost']}, "
            f"levels {r['levels']}")
    left = orphans(marker)
    result = {"scenario": args.scenario, "script": str(script), "ranks": ranks,
              "kill_step": step, "fault_free": pace, "runs": runs,
              "mttr_s": _stats([r["mttr_s"] for r in runs if r["mttr_s"] is not None]),
              "steps_lost": _stats([r["steps_lost"] for r in runs
                                    if r["steps_lost"] is not None]),
              "completed": all(r["completed"] for r in runs), "orphans": len(left)}
    ok = result["completed"] and not left and all(r["recovered"] for r in runs) \
        and pace["exit_code"] == 0
    m = result["mttr_s"]
    say(f"bench {args.scenario}: MTTR median {m['median']} s (min {m['min']}, max {m['max']}), "
        f"steps lost {result['steps_lost']['median']} median; completed {result['completed']}, "
        f"orphans {len(left)}")
    if ok and not args.out:
        shutil.rmtree(base, ignore_errors=True)
    elif not ok:
        say(f"bench {args.scenario}: the runs are kept in {base}")
    if args.json:
        print(json.dumps(result), flush=True)
    return 0 if ok else 1


def _summary(run: Path) -> dict[str, Any]:
    path = run / "summary.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _pace(run: Path, wall_s: float, code: int) -> dict[str, Any]:
    s = _summary(run)
    times = s.get("time_s") or {}
    productive = times.get("productive")
    steps = s.get("steps") or 0
    return {"exit_code": code, "steps": steps, "wall_s": round(wall_s, 2),
            "startup_s": times.get("startup"),
            "steps_per_s": round(steps / productive, 2) if productive else None}


def _recovery(run: Path, code: int, wall_s: float) -> dict[str, Any]:
    s = _summary(run)
    incidents = s.get("incident_list") or []
    first = incidents[0] if incidents else {}
    return {"exit_code": code, "completed": code == 0, "wall_s": round(wall_s, 2),
            "recovered": bool(incidents) and all(i.get("outcome") == "recovered"
                                                 for i in incidents),
            "mttr_s": first.get("mttr_s"), "mttr_by_phase_s": first.get("phases_s"),
            "steps_lost": first.get("steps_lost"), "levels": first.get("levels")}


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3)}

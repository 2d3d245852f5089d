"""``nonstop chaos`` / ``nonstop bench chaos``: a seeded schedule of faults of every kind nonstop
injects on one host, thrown at one job. The job must complete with the fault-free run's weights,
bit for bit (its world size never changes here), every incident closed, and nothing of it left
running once it ends. The same seed gives the same schedule.

Kinds (one host): a rank crashed; two ranks at once; a rank crashed after its optimizer step
(dirty); a rank crashed half-way through writing its snapshot (torn); a rank crashed in the
restore of a recovery, or while leaving a failed generation; a rank exiting with an error code;
an exception in the training code; a hang; a frozen rank (SIGSTOP); NaN gradients; a bit flipped
in a parameter (silent corruption); a bit flipped in a snapshot; the node's memory (its keeper)
killed; a crash whose warm spare is killed the moment it is promoted. Faults keyed to steps fire once:
a step redone after a rollback does not fire its fault again. Faults inside a recovery fire in
the first recovery that reaches their point.

A rank whose parameters were flipped is not killed by the next two faults of the schedule (ten
steps at least): a rank that dies between a flip and the comparison that would find it takes the
evidence with it, while its gradients have already moved every replica off the fault-free run -
no comparison of replicas can see that (docs/design.md, "Silent data corruption").

Snapshots are taken every ``SNAPSHOT_EVERY`` steps (``--snapshot-every``), fewer than ``GAP``: a
fault keyed to a snapshot (torn, corrupted) fires at the first snapshot after its step, so every
one scheduled fires before the run ends - and before the next fault's step. The soak fails when
a scheduled kind did not fire (it has not shown what it claims), and when a recovery lost more
steps than it may (``steps_lost_bound``): none for any fault but a silent corruption, and for a
corruption at most the steps since the newest snapshot whose replicas agreed that the memory
still held (the same where the faults took every process that held the live state).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from nonstop.chaos import (  # noqa: F401 - the schedule and the judgment, the package's own
    FIRST, GAP, KINDS, MATCH_S, ONCE, POLICY, SNAPSHOT_EVERY, add_costs, every_process_lost,
    fired_at, is_corruption, needed, newest_certified, orphans, policy, schedule,
    steps_lost_bound, tally, ORPHAN_GRACE_S, orphans_after)

from . import common

TIMEOUT_S = 900.0


def _job(out: Path, steps: int, ranks: int, spares: int, marker: str,
         inject: str | None, snapshot_every: int | str = SNAPSHOT_EVERY) -> int:
    common.fresh(out)
    (out / "policy.yaml").write_text(policy(snapshot_every))
    flags = [f"--nproc={ranks}", f"--run-dir={out / 'run'}", f"--spares={spares}",
             f"--policy={out / 'policy.yaml'}"]
    if inject:
        flags.append(f"--inject={inject}")
    cmd = common.nonstop_cmd(*flags, str(common.JOB), "--mode", "nonstop", "--steps", str(steps),
                             "--out", str(out), "--sleep-ms", "10", "--hidden", "64")
    return common.run_child(cmd, out / "output.log", TIMEOUT_S,
                            env=dict(os.environ, NONSTOP_CHAOS_RUN=marker))




def soak(seed: int, faults: int, ranks: int, spares: int, steps: int, base: Path,
         say: Any, snapshot_every: int | str = SNAPSHOT_EVERY) -> dict[str, Any]:
    plan = schedule(seed, faults, ranks, steps)
    marker = uuid.uuid4().hex
    say(f"chaos: seed {seed}, {faults} faults over {steps} steps, {ranks} ranks + {spares} "
        f"spare(s), a snapshot every {snapshot_every} step(s); runs in {base}")
    for f in plan:
        say(f"  step {f['step']:4d}  {f['kind']:20s} {f['spec']}")
    ref_code = _job(base / "reference", steps, ranks, spares, marker, None, snapshot_every)
    t0 = time.time()
    code = _job(base / "chaos", steps, ranks, spares, marker, ";".join(f["spec"] for f in plan),
                snapshot_every)
    wall = time.time() - t0
    left = orphans_after(marker, ORPHAN_GRACE_S)
    run = base / "chaos" / "run"
    evs = list(common.events(run))
    by_kind, incidents = tally(plan, evs)
    levels: dict[str, int] = {}
    for inc in incidents:
        for lvl in inc.get("levels") or []:
            levels[lvl] = levels.get(lvl, 0) + 1
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() \
        else {}
    match = code == 0 and ref_code == 0 and common.params_equal(
        base / "reference" / "final.pt", base / "chaos" / "final.pt")
    return {
        "scenario": "chaos", "seed": seed, "faults": faults, "completed": code == 0,
        "params_match_reference": match,
        "incidents_closed": sum(1 for i in incidents if i.get("outcome") == "recovered"),
        "incidents": len(incidents), "orphans": len(left), "by_kind": by_kind,
        "unfired": sorted(k for k, e in by_kind.items() if e["fired"] < e["scheduled"]),
        "levels": levels, "steps_lost": summary.get("steps_lost"),
        "steps_lost_bound": steps_lost_bound(evs),
        "mttr_s": summary.get("mttr_s"), "sdc": summary.get("sdc"), "wall_s": round(wall, 2),
        "reference_exit_code": ref_code, "exit_code": code, "ranks": ranks, "spares": spares,
        "steps": steps, "snapshot_every": snapshot_every, "date": common.now_stamp(),
        "schedule": plan,
    }


def passed(result: dict[str, Any]) -> bool:
    """The job completed with the fault-free weights, nothing left running, every scheduled
    kind fired, and no recovery lost more steps than its bound."""
    return bool(result["completed"] and result["params_match_reference"] and not result["orphans"]
                and not result["unfired"] and result["steps_lost_bound"]["held"])


def describe(result: dict[str, Any]) -> str:
    bound = result["steps_lost_bound"]
    held = "held" if bound["held"] else "BROKEN by incident(s) " + ", ".join(
        f"{b['id']} ({b['steps_lost']} > {b['bound']})" for b in bound["broken"])
    def some(key: str) -> str:
        return ", ".join(f"{r['steps_lost']} of at most {r['bound']}"
                         for r in bound["incidents"] if r.get(key))

    corr, gone = some("corruption"), some("every_process_lost")
    text = (f"chaos: completed {result['completed']}, weights match "
            f"{result['params_match_reference']}, incidents {result['incidents_closed']}/"
            f"{result['incidents']} closed, orphans {result['orphans']}, levels "
            f"{result['levels']}, steps lost {result['steps_lost']} (bound {held}"
            + (f"; corruptions: {corr}" if corr else "")
            + (f"; every process holding the state lost: {gone}" if gone else "")
            + f"), wall {result['wall_s']} s")
    if result["unfired"]:
        text += f"; scheduled but never fired: {', '.join(result['unfired'])}"
    return text


def main(args: argparse.Namespace) -> int:
    import shutil
    import sys
    import tempfile

    from nonstop.errors import UsageError

    faults, ranks = args.faults, args.ranks or 3
    spares = 2 if args.spares_chaos is None else args.spares_chaos
    if faults < 1 or ranks < 2:
        raise UsageError("--faults must be at least 1 and --ranks at least 2")
    steps = args.steps or needed(faults) + 5
    if needed(faults) > steps:
        raise UsageError(f"{faults} faults need --steps {needed(faults)} at least")
    every: int | str = getattr(args, "chaos_snapshot_every", None) or SNAPSHOT_EVERY
    if str(every) != "auto":
        try:
            every = int(every)
        except ValueError:
            raise UsageError(f"--snapshot-every must be a number of steps or auto, not {every!r}")
        if every < 1:
            raise UsageError("--snapshot-every must be at least 1")
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="nonstop-chaos-"))
    base.mkdir(parents=True, exist_ok=True)
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else print
    result = soak(args.seed, faults, ranks, spares, steps, base, say, every)
    ok = passed(result)
    say(describe(result))
    if ok and not args.out:
        shutil.rmtree(base, ignore_errors=True)
    elif not ok:
        say(f"chaos: the runs are kept in {base}")
    common.emit(result, args.json)
    return 0 if ok else 1

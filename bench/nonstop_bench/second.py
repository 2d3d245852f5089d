"""``nonstop bench second``: a second fault inside the recovery of a first one, in each recovery
phase, with no spare, one and two. Reports the incident's MTTR (first fault -> a step completed by
every rank) from nonstop's own incident record, against the same crash with no second fault.

Systems are the phases: ``none`` (a single crash), ``assigned``, ``rendezvous``, ``restore``,
``first_step``, ``teardown``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from . import common, crash

SYSTEMS = ("none", "assigned", "rendezvous", "restore", "first_step", "teardown")
SPARES = (0, 1, 2)
TIMEOUT_S = 300.0


def _faults(phase: str, ranks: int, kill_step: int) -> str:
    victim = ranks // 2
    first = f"crash:rank={victim},step={kill_step}"
    if phase == "none":
        return first
    if phase == "teardown":  # a survivor dies while leaving the failed generation
        return f"{first};crash:rank=0,at=teardown,gen=0"
    return f"{first};crash:rank={victim},at={phase},gen=1"


def run_once(phase: str, spares: int, ranks: int, steps: int, kill_step: int,
             out: Path) -> dict[str, Any]:
    common.fresh(out)
    flags = [f"--nproc={ranks}", f"--run-dir={out / 'run'}", f"--spares={spares}",
             f"--inject={_faults(phase, ranks, kill_step)}"]
    cmd = common.nonstop_cmd(*flags, str(common.JOB), "--steps", str(steps), "--out", str(out),
                             "--mode", "nonstop")
    code = common.run_child(cmd, out / "output.log", TIMEOUT_S)
    result: dict[str, Any] = {"system": phase, "spares": spares, "exit_code": code,
                              "mttr_s": None, "lost_steps": None}
    summary = out / "run" / "summary.json"
    if summary.exists():
        incidents = json.loads(summary.read_text())["incident_list"]
        if len(incidents) == 1:
            inc = incidents[0]
            result.update(mttr_s=inc["mttr_s"], lost_steps=inc["steps_lost"],
                          phases_s=inc["phases_s"], levels=inc["levels"],
                          interrupted=[a["phase"] for a in inc.get("interrupted", [])])
    return result


def main(args: argparse.Namespace) -> int:
    phases, base, say = common.setup(args, SYSTEMS)
    say(f"bench second: {args.ranks} ranks, {args.steps} steps, crash at step {args.kill_step} "
        f"and a second fault in each recovery phase; spares {SPARES}; {args.repeat} repeats; "
        f"runs in {base}")
    ref_params = common.reference_weights(
        crash.run_once("reference", args.ranks, args.steps, args.kill_step, base / "reference"),
        base / "reference", say)
    if ref_params is None:
        return 1
    results = []
    for spares in SPARES:
        for phase in phases:
            runs = []
            for i in range(args.repeat):
                out = base / f"{phase}-s{spares}" / f"run{i}"
                r = run_once(phase, spares, args.ranks, args.steps, args.kill_step, out)
                r["params_match_reference"] = r["exit_code"] == 0 and common.params_equal(
                    ref_params, out / "final.pt")
                runs.append(r)
                mttr = "-" if r["mttr_s"] is None else f"{r['mttr_s']:.3f} s"
                say(f"  {phase:10s} spares {spares} run {i + 1}/{args.repeat}: exit "
                    f"{r['exit_code']}, MTTR {mttr}, levels {r.get('levels')}, weights match: "
                    f"{r['params_match_reference']}")
            agg = common.aggregate(f"{phase}, {spares} spare(s)", runs)
            agg["phase"], agg["spares"] = phase, spares
            results.append(agg)
    summary = {"scenario": "second", "ranks": args.ranks, "repeat": args.repeat,
               "steps": args.steps, "kill_step": args.kill_step, "date": common.now_stamp(),
               "results": results}
    say(common.table(summary))
    if not args.out:
        shutil.rmtree(base, ignore_errors=True)
    common.emit(summary, args.json)
    return 0

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
import random
import time
import uuid
from pathlib import Path
from typing import Any

from . import common

TIMEOUT_S = 900.0
GAP = 5  # steps between two scheduled faults at least: each incident settles before the next
FIRST = 15  # no fault before: the hang timeout is tuned from the steps seen by then
# steps between snapshots: fewer than GAP, so that a fault keyed to a snapshot (which fires at
# the first snapshot after its step) fires before the next fault's step, not on it
SNAPSHOT_EVERY = 4

#: kind -> spec template ({r}, {r2}: distinct ranks; {s}: the step)
KINDS: dict[str, str] = {
    "crash": "crash:rank={r},step={s}",
    "crash_two": "crash:rank={r},step={s};crash:rank={r2},step={s}",
    "crash_dirty": "crash:rank={r},step={s},at=optimizer",
    "crash_torn_snapshot": "crash:rank={r},step={s},at=snapshot",
    "crash_in_restore": "crash:rank={r},at=restore",
    "crash_in_teardown": "crash:rank={r},at=teardown",
    "exit": "exit:rank={r},step={s},code=3",
    "exception": "exception:rank={r},step={s}",
    "hang": "hang:rank={r},step={s}",
    "stop": "stop:rank={r},step={s}",
    "nan": "nan:rank={r},step={s}",
    "bitflip": "bitflip:rank={r},step={s}",
    "corrupt_snapshot": "corrupt:rank={r},step={s}",
    "keeper_crash": "keeper_crash:rank={r},step={s}",
    # a crash, then the warm spare that takes the rank dies at its promotion
    "spare_killed_at_promotion": "crash:rank={r},step={s};crash:rank={r},at=promoted",
}
ONCE = ("crash_in_restore", "crash_in_teardown")  # keyed to the first recovery: one each at most
# Injected faults are not failing hardware, and the soak tests recovery, not the rules that give
# up: the same node is never isolated for its faults, and no level runs out of budget.
POLICY = """rules:
  isolate: {times: 1000000}
recover:
  levels:
    step_retry: {budget: 1000000}
    in_process: {budget: 1000000}
    rank_replacement: {budget: 1000000}
    job_restart: {budget: 1000000}
"""


def needed(faults: int) -> int:
    """The fewest steps a schedule of ``faults`` fits in."""
    return FIRST + faults * GAP + GAP


def schedule(seed: int, faults: int, ranks: int, steps: int) -> list[dict[str, Any]]:
    """``faults`` faults (kind, step, spec) drawn with ``seed``: every kind in turn before any
    repeats, at distinct steps ``GAP`` apart."""
    rng = random.Random(seed)
    slots = list(range(FIRST, steps - GAP, GAP))
    if faults > len(slots):
        raise ValueError(f"{faults} faults need {needed(faults)} steps at least")
    steps_at = sorted(rng.sample(slots, faults))
    kinds: list[str] = []
    while len(kinds) < faults:
        batch = [k for k in KINDS if k not in ONCE or k not in kinds]
        rng.shuffle(batch)
        kinds += batch
    out = []
    spared: list[int] = []  # a rank flipped lately: not killed before its flip is checked
    for kind, step in zip(kinds[:faults], steps_at):
        choices = [r for r in range(ranks) if r not in spared[-1:]] if spared else list(range(ranks))
        r = rng.choice(choices)
        others = [x for x in choices if x != r]
        r2 = rng.choice(others) if others else (r + 1) % ranks
        out.append({"kind": kind, "step": step, "spec": KINDS[kind].format(r=r, r2=r2, s=step)})
        if kind == "bitflip":
            spared += [r, r]  # the next two faults spare it
        elif spared:
            spared.pop()
    return out


def policy(snapshot_every: int | str = SNAPSHOT_EVERY) -> str:
    """The soak's policy: ``POLICY``, with the snapshot interval (``auto``: the default's)."""
    if str(snapshot_every) == "auto":
        return POLICY
    return POLICY + f"state:\n  snapshot: {{every_steps: {int(snapshot_every)}}}\n"


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


def orphans(marker: str) -> list[int]:
    """Processes of the job still alive (they carry the run's marker in their environment)."""
    found = []
    needle = f"NONSTOP_CHAOS_RUN={marker}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(pid))
        except OSError:
            continue
    return found


def fired_at(events: list[dict[str, Any]]) -> dict[int, float]:
    """Injected fault index -> when it fired (its first firing)."""
    out: dict[int, float] = {}
    for e in events:
        if e.get("type") == "rank_inject" and e.get("index") is not None:
            out.setdefault(int(e["index"]), float(e["t"]))
    return out


MATCH_S = 10.0  # an incident opened this long after a fault at most is taken for its own


def add_costs(by_kind: dict[str, dict[str, Any]], moments: list[tuple[str, float]],
              incidents: list[dict[str, Any]]) -> None:
    """What each kind of fault cost, from the incidents: each fault (kind, when it fired) takes
    the first incident not yet taken that opened from just before it to ``MATCH_S`` after;
    without one it either joined an incident in progress (a fault inside a recovery) or cost no
    incident at all (``none``: etcd restarted, a spare killed...). Approximate where faults of
    two kinds strike within moments of each other."""
    incs = sorted(incidents, key=lambda i: i.get("t_fault") or 0.0)
    taken: set[int] = set()
    mttrs: dict[str, list[float]] = {}
    for kind, t in sorted(moments, key=lambda m: m[1]):
        e = by_kind[kind]
        for key in ("incidents", "joined", "none", "steps_lost"):
            e.setdefault(key, 0)
        e.setdefault("levels", {})
        match = next((k for k, inc in enumerate(incs) if k not in taken
                      and t - 0.5 <= (inc.get("t_fault") or 0.0) <= t + MATCH_S), None)
        if match is None:
            inside = any((inc.get("t_fault") or 0.0) - 0.5 <= t
                         <= (inc.get("t_fault") or 0.0) + (inc.get("mttr_s") or 0.0) for inc in incs)
            e["joined" if inside else "none"] += 1
            continue
        taken.add(match)
        inc = incs[match]
        e["incidents"] += 1
        e["steps_lost"] += inc.get("steps_lost") or 0
        for lvl in inc.get("levels") or []:
            e["levels"][lvl] = e["levels"].get(lvl, 0) + 1
        if inc.get("mttr_s") is not None:
            mttrs.setdefault(kind, []).append(float(inc["mttr_s"]))
    for kind, values in mttrs.items():
        values.sort()
        by_kind[kind]["mttr_s"] = {"median": round(values[len(values) // 2], 3),
                                   "max": round(values[-1], 3),
                                   # each one: soaks run in parts add up
                                   "all": [round(v, 3) for v in values]}


def is_corruption(inc: dict[str, Any], events: list[dict[str, Any]]) -> bool:
    """Whether a silent corruption was found in the incident: an ``sdc`` fault of it, or live
    states that differed when one of its generations formed."""
    if any(e.get("type") == "fault" and e.get("kind") == "sdc" and e.get("incident") == inc["id"]
           for e in events):
        return True
    first, last = inc.get("gen_from", 0) + 1, inc.get("gen_to")
    return any(e.get("type") == "restore" and first <= e.get("gen", -1) <= (last or first)
               and any(s.get("cause") == "sdc" for s in e.get("skipped") or ())
               for e in events)


def newest_certified(events: list[dict[str, Any]], t_fault: float) -> int | None:
    """The newest snapshot whose replicas agreed that the node's memory still held when a fault
    struck at ``t_fault``: each rank reports its newest (``certified``, when committed) as it
    leaves a generation or ends; a memory lost after it (its keeper killed) took it along."""
    losses = [e["t"] for e in events if e.get("type") == "node_memory_lost" and e["t"] <= t_fault]
    best = None
    for e in events:
        if e.get("type") not in ("rank_left", "rank_done"):
            continue
        sdc = e.get("sdc") or {}
        step, when = sdc.get("certified"), sdc.get("certified_t")
        if step is None or when is None or when > t_fault:
            continue
        if any(when < t <= t_fault for t in losses):
            continue
        best = step if best is None else max(best, step)
    return best


def every_process_lost(inc: dict[str, Any], events: list[dict[str, Any]]) -> bool:
    """Whether the faults of an incident took every process that held the live state (each
    rank of the generation it began in holds another process in the one it ended with), none
    of them ended by a job restart: no live state was left to resume from."""
    held = {e["gen"]: e.get("ranks") or {} for e in events if e.get("type") == "generation"}
    before, after = held.get(inc.get("gen_from")), held.get(inc.get("gen_to"))
    if not before or not after or "job restart" in (inc.get("levels") or ()):
        return False
    return all(after.get(r) != w for r, w in before.items())


def steps_lost_bound(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Each incident's steps lost against what it may lose: nothing - but for a silent
    corruption, and for faults that took every process holding the live state (a crash, then
    the last survivors in its recovery), the steps since the newest certified snapshot the
    memory held (all of them, none held)."""
    rows, broken = [], []
    for inc in (e for e in events if e.get("type") == "incident"):
        lost = inc.get("steps_lost") or 0
        row: dict[str, Any] = {"id": inc["id"], "steps_lost": lost, "bound": 0,
                               "corruption": is_corruption(inc, events),
                               "every_process_lost": every_process_lost(inc, events)}
        if row["corruption"] or row["every_process_lost"]:
            # as the incident was found (its first fault): its ``t_fault`` may be a fault's
            # injection before it (a keeper killed just before a flip)
            found = [e["t"] for e in events if e.get("type") == "fault"
                     and e.get("incident") == inc["id"]]
            certified = newest_certified(events, min(found, default=inc.get("t_fault") or 0.0))
            row["certified"] = certified
            row["bound"] = max(0, (inc.get("step_before") or 0) - (certified or 0))
        rows.append(row)
        if lost > row["bound"]:
            broken.append({**row, "faults": inc.get("faults")})
    return {"held": not broken, "broken": broken, "incidents": rows}


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
    left = []
    deadline = time.time() + 10
    while time.time() < deadline:
        left = orphans(marker)
        if not left:
            break
        time.sleep(0.2)
    run = base / "chaos" / "run"
    evs = list(common.events(run))
    fired = fired_at(evs)
    incidents = [e for e in evs if e.get("type") == "incident"]
    by_kind: dict[str, dict[str, Any]] = {}
    index = 0  # the injected faults in order: a spec may hold two
    moments = []
    for f in plan:
        n = len(f["spec"].split(";"))
        entry = by_kind.setdefault(f["kind"], {"scheduled": 0, "fired": 0})
        entry["scheduled"] += 1
        if all(i in fired for i in range(index, index + n)):
            entry["fired"] += 1
            moments.append((f["kind"], fired[index]))
        index += n
    add_costs(by_kind, moments, incidents)
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

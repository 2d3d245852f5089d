"""``nonstop chaos SCRIPT``: a seeded schedule of faults thrown at a job of your own, on one host,
and what a chaos run is judged by.

The schedule (``schedule``) draws faults of the kinds nonstop injects inside a job - a rank
crashed, two at once, a crash after the optimizer step or in a recovery, an error exit, a hang, a
frozen rank, the node's memory killed, a warm spare killed as it is promoted; NaN gradients, a
flipped bit, a torn or corrupted snapshot on request - every kind in turn before any repeats, at
steps ``GAP`` apart from step ``FIRST`` on. The job runs under ``nonstop run`` with the faults
injected (``--inject``) and a policy that never gives up on injected faults; it passes when it
completes, every incident closed, nothing of it left running, every scheduled fault fired, no
recovery lost more steps than it may (``steps_lost_bound``) and - with ``--compare FILE`` - the
file the script writes at its end equals, tensor for tensor and bit for bit, the one a fault-free
run of the same script wrote.

The comparison harness beside the package (its soak, ``bench/``) runs the same schedule at
nonstop's own example job, and across test hosts with faults of hosts, etcd and the controller.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from .errors import UsageError

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


def schedule(seed: int, faults: int, ranks: int, steps: int,
             kinds: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """``faults`` faults (kind, step, spec) drawn with ``seed`` from ``kinds`` (default: every
    one of ``KINDS``): every kind in turn before any repeats, at distinct steps ``GAP`` apart."""
    rng = random.Random(seed)
    slots = list(range(FIRST, steps - GAP, GAP))
    if faults > len(slots):
        raise ValueError(f"{faults} faults need {needed(faults)} steps at least")
    steps_at = sorted(rng.sample(slots, faults))
    pool = tuple(KINDS) if kinds is None else kinds
    drawn: list[str] = []
    while len(drawn) < faults:
        batch = [k for k in pool if k not in ONCE or k not in drawn]
        if not batch:  # only kinds keyed to the first recovery, each drawn once already
            raise ValueError(f"{faults} faults cannot be drawn from {', '.join(pool)} (each of "
                             "them at most once)")
        rng.shuffle(batch)
        drawn += batch
    out = []
    spared: list[int] = []  # a rank flipped lately: not killed before its flip is checked
    for kind, step in zip(drawn[:faults], steps_at):
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


ORPHAN_GRACE_S = 10.0  # a process of an ended job still alive after this long is left behind


def orphans_after(marker: str, grace_s: float) -> list[int]:
    """``orphans`` once ``grace_s`` has passed with some still there (a launcher's children
    follow it within moments)."""
    deadline = time.time() + grace_s
    while True:
        left = orphans(marker)
        if not left or time.time() >= deadline:
            return left
        time.sleep(0.2)


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


# == a job of your own ===========================================================================
#: the kinds drawn by default for a script of the user's own: every fault of the infrastructure
#: that any wrapped script recovers from (a NaN needs a loss that goes through its gradients, a
#: flipped bit twin replicas to be found, a snapshot fault snapshots: asked for with --kinds)
OWN_KINDS = ("crash", "crash_two", "crash_dirty", "crash_in_restore", "crash_in_teardown", "exit",
             "hang", "stop", "keeper_crash", "spare_killed_at_promotion")
OUT = "{out}"  # in the script's arguments: the run's own directory (each run has its own)
RUN_TIMEOUT_S = 3600.0  # one run of the job at most


def own(args: Any) -> int:
    """``nonstop chaos [--nproc N] --steps S [...] SCRIPT [ARGS]``: the exit code (0: passed)."""
    script = Path(args.script)
    if not script.is_file():
        raise UsageError(f"no such script: {args.script}")
    if args.steps is None:
        raise UsageError("--steps: the steps your script runs is needed to place the faults")
    ranks = args.nproc or 2
    if ranks < 2 or args.faults < 1:
        raise UsageError("--nproc must be at least 2 and --faults at least 1")
    if needed(args.faults) > args.steps:
        raise UsageError(f"{args.faults} faults need a job of {needed(args.faults)} steps at "
                         f"least (--steps {args.steps})")
    kinds = _kinds(args.kinds, ranks)
    if args.compare and not any(OUT in a for a in args.script_args):
        raise UsageError(f"--compare {args.compare}: give the script somewhere to write it, "
                         f"with {OUT} in its arguments (each run's own directory)")
    spares = 2 if args.spares_chaos is None else args.spares_chaos
    base = Path(args.out) if args.out else Path(
        os.environ.get("TMPDIR", "/tmp")) / f"nonstop-chaos-{uuid.uuid4().hex[:8]}"
    base.mkdir(parents=True, exist_ok=True)
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else print
    try:
        plan = schedule(args.seed, args.faults, ranks, args.steps, kinds)
    except ValueError as exc:
        raise UsageError(f"--faults {args.faults}: {exc}") from None
    say(f"chaos: seed {args.seed}, {args.faults} fault(s) over {args.steps} steps of "
        f"{script.name}, {ranks} ranks + {spares} spare(s); runs in {base}")
    for f in plan:
        say(f"  step {f['step']:5d}  {f['kind']:26s} {f['spec']}")
    marker = uuid.uuid4().hex
    reference = None
    if args.compare:
        say("chaos: the fault-free run first (--compare)")
        reference = run_job(base / "reference", script, args.script_args, ranks, spares, None,
                             marker)
    t0 = time.time()
    code = run_job(base / "chaos", script, args.script_args, ranks, spares,
                    ";".join(f["spec"] for f in plan), marker)
    result = judge(plan, base / "chaos" / "run", code, marker, time.time() - t0)
    if args.compare:
        result["reference_exit_code"] = reference
        result["compared"] = same_tensors(base / "reference" / args.compare,
                                          base / "chaos" / args.compare)
    ok = passed_own(result)
    say(describe_own(result))
    if not ok:
        say(f"chaos: the runs are kept in {base}")
    if args.json:
        print(json.dumps(result), flush=True)
    return 0 if ok else 1


def _kinds(text: str | None, ranks: int) -> tuple[str, ...]:
    """The kinds to draw from. Two ranks crashed at once are every rank of a 2-rank job: it
    starts again from its newest snapshot, the steps since lost - not a fault the soak holds to
    losing none: drawn from 3 ranks on."""
    if not text:
        return OWN_KINDS if ranks >= 3 else tuple(k for k in OWN_KINDS if k != "crash_two")
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise UsageError(f"--kinds: unknown fault kind(s) {', '.join(unknown) or '(none)'}; "
                         f"known: {', '.join(KINDS)}")
    if "crash_two" in kinds and ranks < 3:
        raise UsageError("--kinds crash_two: two ranks crashed are every rank of a 2-rank job "
                         "(it starts over from its newest snapshot): give --nproc 3 or more")
    return kinds


def run_job(out: Path, script: Path, script_args: list[str], ranks: int, spares: int,
             inject: str | None, marker: str, chaos_policy: bool = True) -> int:
    """One run of the user's job under ``nonstop run`` (its own session, ended whole at the
    timeout): its exit code. ``chaos_policy``: the soak's (no injected fault is given up on),
    else the default policy."""
    out.mkdir(parents=True, exist_ok=True)
    flags = [f"--nproc={ranks}", f"--spares={spares}", f"--run-dir={out / 'run'}", "--no-live"]
    if chaos_policy:
        (out / "policy.yaml").write_text(policy())
        flags.append(f"--policy={out / 'policy.yaml'}")
    if inject:
        flags.append(f"--inject={inject}")
    argv = [a.replace(OUT, str(out)) for a in script_args]
    cmd = [sys.executable, "-m", "nonstop", "run", *flags, str(script), *argv]
    with open(out / "output.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env=dict(os.environ, NONSTOP_CHAOS_RUN=marker))
        try:
            return proc.wait(timeout=RUN_TIMEOUT_S)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            raise


def judge(plan: list[dict[str, Any]], run: Path, code: int, marker: str,
          wall_s: float) -> dict[str, Any]:
    """A chaos run, judged from its events: which scheduled faults fired, what each kind cost,
    the incidents, the steps-lost bound, what is left running."""
    left = orphans_after(marker, ORPHAN_GRACE_S)
    path = run / "events.jsonl"
    evs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] \
        if path.exists() else []
    by_kind, incidents = tally(plan, evs)
    summary = json.loads((run / "summary.json").read_text()) \
        if (run / "summary.json").exists() else {}
    return {"scenario": "chaos", "exit_code": code, "completed": code == 0,
            "incidents": len(incidents),
            "incidents_closed": sum(1 for i in incidents if i.get("outcome") == "recovered"),
            "orphans": len(left), "by_kind": by_kind,
            "unfired": sorted(k for k, e in by_kind.items() if e["fired"] < e["scheduled"]),
            "steps_lost": summary.get("steps_lost"), "steps_lost_bound": steps_lost_bound(evs),
            "mttr_s": summary.get("mttr_s"), "wall_s": round(wall_s, 2), "schedule": plan}


def tally(plan: list[dict[str, Any]], evs: list[dict[str, Any]]
          ) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Each scheduled kind's count, how many fired and what they cost (``add_costs``), and the
    run's incidents, from its events."""
    fired = fired_at(evs)
    incidents = [e for e in evs if e.get("type") == "incident"]
    by_kind: dict[str, dict[str, Any]] = {}
    index, moments = 0, []  # the injected faults in order: a spec may hold two
    for f in plan:
        n = len(f["spec"].split(";"))
        entry = by_kind.setdefault(f["kind"], {"scheduled": 0, "fired": 0})
        entry["scheduled"] += 1
        if all(i in fired for i in range(index, index + n)):
            entry["fired"] += 1
            moments.append((f["kind"], fired[index]))
        index += n
    add_costs(by_kind, moments, incidents)
    return by_kind, incidents


def same_tensors(a: Path, b: Path) -> bool:
    """Two files of tensors (``torch.save``: a tensor, or dicts and lists of them) equal, bit
    for bit."""
    import torch

    if not a.is_file() or not b.is_file():
        return False

    def flat(x: Any, at: str = "") -> dict[str, Any]:
        if isinstance(x, dict):
            return {k: v for key, val in x.items() for k, v in flat(val, f"{at}/{key}").items()}
        if isinstance(x, (list, tuple)):
            return {k: v for i, val in enumerate(x) for k, v in flat(val, f"{at}/{i}").items()}
        return {at: x}

    x, y = (flat(torch.load(p, map_location="cpu", weights_only=True)) for p in (a, b))
    if x.keys() != y.keys():
        return False
    for k in x:
        u, v = x[k], y[k]
        if isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor):
            if u.dtype != v.dtype or u.shape != v.shape or not torch.equal(
                    u.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)):
                return False
        elif u != v:
            return False
    return True


def passed_own(result: dict[str, Any]) -> bool:
    return bool(result["completed"] and not result["orphans"] and not result["unfired"]
                and result["incidents_closed"] == result["incidents"]
                and result["steps_lost_bound"]["held"] and result.get("compared", True))


def describe_own(result: dict[str, Any]) -> str:
    bound = result["steps_lost_bound"]
    held = "held" if bound["held"] else "BROKEN by incident(s) " + ", ".join(
        f"{b['id']} ({b['steps_lost']} > {b['bound']})" for b in bound["broken"])
    text = (f"chaos: completed {result['completed']}, incidents {result['incidents_closed']}/"
            f"{result['incidents']} closed, orphans {result['orphans']}, steps lost "
            f"{result['steps_lost']} (bound {held}), wall {result['wall_s']} s")
    if "compared" in result:
        text += f", the file it wrote equals the fault-free run's: {result['compared']}"
    if result["unfired"]:
        text += (f"; scheduled but never fired: {', '.join(result['unfired'])} (did the job run "
                 "its --steps?)")
    return text

"""The goodput account: every second of a run's wall time in exactly one category.

| category | the time |
|---|---|
| startup | from launch until the first generation formed on every rank (or the first fault) |
| productive | rank 0 inside steps that advanced the job (a step done for the first time) |
| recomputed | rank 0 inside steps done again after a rollback (the work a fault undid) |
| recovery | inside an incident, by phase (detect ... first_step); ``unrecovered``: an incident that never closed |
| snapshot | rank 0 between steps on snapshots, replica digests, checkpoint hand-offs and replay checks |
| checkpoint | after the last step: waiting for the final checkpoint and the processes to end |
| idle | the rest: between steps outside nonstop (data loading, the user's own code), or nothing running |

Rank 0 stands for the job: in data parallel training every rank steps in lockstep. Its progress
samples (``progress.jsonl``) carry the seconds it spent inside steps and stalled between them
since its process started; each sample's increase is spread over the time since the sample
before and counted only where no incident, start-up or end was under way.

``goodput`` = productive ÷ wall. The categories add up to the wall time.
"""

from __future__ import annotations

from typing import Any, Iterable

from .incidents import PHASES

CATEGORIES = ("startup", "productive", "recomputed", "recovery", "snapshot", "checkpoint", "idle")


def _overlap(a: float, b: float, windows: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, e) - max(a, s)) for s, e in windows)


def _inside(t: float, windows: list[tuple[float, float]]) -> bool:
    return any(s <= t <= e for s, e in windows)


def _complement(t0: float, t1: float, blocked: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, at = [], t0
    for s, e in sorted(blocked):
        s, e = max(s, t0), min(e, t1)
        if e <= at:
            continue
        if s > at:
            out.append((at, s))
        at = max(at, e)
    if at < t1:
        out.append((at, t1))
    return out


def account(t0: float, t1: float, incidents: Iterable[dict[str, Any]],
            rank0: Iterable[dict[str, Any]], t_ready: float | None,
            t_train_end: float | None = None, final_checkpoint: bool = False) -> dict[str, Any]:
    """The account of ``[t0, t1]``. ``incidents``: records with ``id``, ``t_fault``, ``mttr_s``
    (None: not closed, it runs to ``t1``) and ``phases_s``; ``rank0``: rank 0's progress
    samples; ``t_ready``: when the first generation formed; ``t_train_end``: when training
    completed (the rest is the end's wait, ``checkpoint`` when a final checkpoint was written)."""
    wall = max(0.0, t1 - t0)
    recovery = {p: 0.0 for p in PHASES}
    spans: list[tuple[float, float, dict[str, Any]]] = []
    for inc in sorted(incidents, key=lambda i: i["t_fault"]):
        start = max(t0, inc["t_fault"])
        end = t1 if inc.get("mttr_s") is None else min(t1, inc["t_fault"] + inc["mttr_s"])
        if spans:  # incidents do not overlap; should one seem to, it starts where the last ended
            start = max(start, spans[-1][1])
        if end > start:
            spans.append((start, end, inc))
    by_incident = []
    for start, end, inc in spans:
        length = end - start
        if inc.get("mttr_s") is None:
            recovery["unrecovered"] = recovery.get("unrecovered", 0.0) + length
            phases = {"unrecovered": length}
        else:  # its phases, scaled to the part of it inside the window
            given = {p: float(v) for p, v in (inc.get("phases_s") or {}).items() if v}
            total = sum(given.values())
            phases = ({p: v * length / total for p, v in given.items()} if total > 0
                      else {"detect": length})
            for p, v in phases.items():
                recovery[p] = recovery.get(p, 0.0) + v
        by_incident.append({"id": inc.get("id"), "t_fault": inc["t_fault"],
                            "recovery_s": length, "phases_s": phases, "recomputed_s": 0.0})
    first_fault = spans[0][0] if spans else t1
    ready = t1 if t_ready is None else max(t0, min(t_ready, t1))
    startup_end = min(ready, first_fault)
    last_end = spans[-1][1] if spans else t0
    finish_start = t1 if t_train_end is None else max(min(t_train_end, t1), last_end, startup_end)
    blocked = [(t0, startup_end), (finish_start, t1)] + [(s, e) for s, e, _ in spans]
    running = _complement(t0, t1, blocked)
    run_total = sum(e - s for s, e in running)

    productive = recomputed = snapshot = 0.0
    last: dict[int, dict[str, Any]] = {}  # wid -> its previous sample
    hwm: int | None = None  # the newest step the job had reached
    for s in sorted(rank0, key=lambda r: r["t"]):
        prev = last.get(s["wid"])
        last[s["wid"]] = s
        busy = (s.get("busy") or 0.0) - ((prev or {}).get("busy") or 0.0)
        stall = (s.get("stall") or 0.0) - ((prev or {}).get("stall") or 0.0)
        if busy < 0 or stall < 0:
            busy, stall = max(0.0, s.get("busy") or 0.0), max(0.0, s.get("stall") or 0.0)
        if prev is not None and prev.get("gen") == s.get("gen"):
            a, steps = prev["t"], s["step"] - prev["step"]
        else:
            a, steps = s["t"] - busy - stall, 1
        if steps <= 0:
            continue
        b = s["t"]
        f = _overlap(a, b, running) / (b - a) if b > a else float(_inside(b, running))
        first = s["step"] - steps
        redo = 0 if hwm is None else max(0, min(s["step"], hwm) - first)
        hwm = s["step"] if hwm is None else max(hwm, s["step"])
        share = redo / steps
        productive += f * busy * (1 - share)
        again = f * busy * share
        recomputed += again
        snapshot += f * stall
        if again > 0:  # the incident whose rollback it redoes: the last one closed before
            cause = [x for (st, en, _), x in zip(spans, by_incident) if en <= b]
            if cause:
                cause[-1]["recomputed_s"] += again
    used = productive + recomputed + snapshot
    if used > run_total > 0:  # a sample spread over a window it partly missed: scale to fit
        k = run_total / used
        productive, recomputed, snapshot = productive * k, recomputed * k, snapshot * k
        for x in by_incident:
            x["recomputed_s"] *= k
    elif run_total <= 0:
        productive = recomputed = snapshot = 0.0
        for x in by_incident:
            x["recomputed_s"] = 0.0
    idle = max(0.0, run_total - productive - recomputed - snapshot)
    finish = t1 - finish_start
    cats = {"startup": startup_end - t0, "productive": productive, "recomputed": recomputed,
            "recovery": {p: round(v, 6) for p, v in recovery.items()},
            "snapshot": snapshot, "checkpoint": finish if final_checkpoint else 0.0,
            "idle": idle + (0.0 if final_checkpoint else finish)}
    out = {k: (v if isinstance(v, dict) else round(v, 6)) for k, v in cats.items()}
    for x in by_incident:
        x["phases_s"] = {p: round(v, 6) for p, v in x["phases_s"].items()}
        x["recovery_s"] = round(x["recovery_s"], 6)
        x["recomputed_s"] = round(x["recomputed_s"], 6)
        x["total_s"] = round(x["recovery_s"] + x["recomputed_s"], 6)
    return {"wall_s": round(wall, 6), "categories": out,
            "goodput": round(productive / wall, 4) if wall > 0 else None,
            "by_incident": by_incident}


def total(categories: dict[str, Any]) -> float:
    """The seconds the categories hold (their recovery summed): the wall time."""
    return sum(sum(v.values()) if isinstance(v, dict) else v for v in categories.values())


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two accounts of consecutive windows (the controllers of one job, one after the other)
    as one: every category added, the recovery phases too."""
    out: dict[str, Any] = {}
    for key in dict.fromkeys([*a, *b]):
        x, y = a.get(key, 0.0), b.get(key, 0.0)
        if isinstance(x, dict) or isinstance(y, dict):
            x, y = x or {}, y or {}
            out[key] = {p: round(x.get(p, 0.0) + y.get(p, 0.0), 6) for p in dict.fromkeys([*x, *y])}
        else:
            out[key] = round(x + y, 6)
    return out

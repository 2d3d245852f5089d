"""What the picture of a run shows (``timeline.py`` draws it): the last attempt of a run directory
loaded (``events.jsonl``, ``progress.jsonl``, ``summary.json``) and planned into lanes, steps,
faults, recovery phases, generations and the goodput account. Plain Python: no matplotlib."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import events as event_log
from .incidents import PHASES
from .progress import FILENAME as PROGRESS_FILE

SYMPTOMS = ("peer",)  # fault kinds that are a sign of another fault, drawn hollow


class NoPicture(Exception):
    """The run directory holds nothing a picture can be drawn from (the reason, one line)."""


# ---------------------------------------------------------------- loading


@dataclass
class Run:
    """What the picture needs from a run directory: the last attempt's events and samples."""

    name: str
    t0: float
    t_end: float
    attempt: int
    attempts: int
    start: dict[str, Any]  # the attempt's run_start event (world, spares, policy)
    events: list[dict[str, Any]]
    samples: list[dict[str, Any]]
    has_progress: bool
    summary: dict[str, Any] | None  # the attempt's own summary, None when it has none


def load(run_dir: str | Path) -> Run:
    """The last attempt of ``run_dir``; NoPicture when there is no event log to draw from."""
    root = Path(run_dir)
    log = root / event_log.FILENAME
    if not log.is_file():
        raise NoPicture(f"no {event_log.FILENAME} in {root}")
    try:
        every = list(event_log.read(log))
    except OSError as exc:
        raise NoPicture(f"cannot read {log}: {exc}") from None
    starts = [i for i, ev in enumerate(every) if ev.get("type") == "run_start"]
    evs = every[starts[-1]:] if starts else every
    evs = [ev for ev in evs if isinstance(ev.get("t"), (int, float))]
    if not evs:
        raise NoPicture(f"{log} holds no events")
    start = evs[0] if evs[0].get("type") == "run_start" else {}
    t0 = evs[0]["t"]
    samples, has_progress = _samples(root / PROGRESS_FILE, t0)
    ends = [ev["t"] for ev in evs if ev.get("type") == "run_end"]
    t_end = ends[-1] if ends else max([ev["t"] for ev in evs] + [s["t"] for s in samples])
    summary = _summary(root / "summary.json", len(starts) or 1)
    return Run(name=root.resolve().name, t0=t0, t_end=max(t_end, t0 + 1e-3),
               attempt=start.get("attempt", len(starts) or 1), attempts=len(starts) or 1,
               start=start, events=evs, samples=samples, has_progress=has_progress,
               summary=summary)


def _samples(path: Path, t0: float) -> tuple[list[dict[str, Any]], bool]:
    """The progress samples taken since ``t0`` (the file is appended to by every attempt),
    skipping a torn or malformed line; and whether the file exists at all."""
    from . import progress

    if not path.is_file():
        return [], False
    try:
        out = [r for r in progress.read(path, t_from=t0) if isinstance(r.get("rank"), int)]
    except OSError:
        return [], False
    return out, True


def _summary(path: Path, attempt: int) -> dict[str, Any] | None:
    """summary.json when it is this attempt's (an attempt killed before its end has none: the
    file is then an earlier attempt's and says nothing of this one)."""
    try:
        summary = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(summary, dict) or summary.get("attempt", 1) != attempt:
        return None
    return summary


# ---------------------------------------------------------------- planning


@dataclass
class Mark:
    """A fault, a new process or a node event at ``x`` seconds, on a rank's lane (``rank``) or
    on the job row (``rank`` None)."""

    x: float
    rank: int | None
    kind: str
    text: str = ""


@dataclass
class Drawing:
    """Everything the picture shows, in seconds since the run started: what ``render`` draws
    and what a test checks."""

    title: str
    subtitle: str
    x_end: float
    lanes: list[int]  # ranks, top to bottom
    nodes: dict[int, int]  # rank -> node
    segments: dict[int, list[tuple[float, float, int]]]  # rank -> (start, end, generation)
    spans: list[tuple[str, float, float, int]]  # (phase, start, end, incident)
    incidents: list[tuple[float, str]]  # (x, label) above the shading
    generations: list[tuple[float, int, str]]  # (x, gen, label)
    faults: list[Mark]
    members: list[Mark]
    nodes_events: list[Mark]
    account: dict[str, float]  # the goodput account, flattened: category or phase -> seconds
    wall_s: float | None
    notes: list[str] = field(default_factory=list)


def plan(run: Run) -> Drawing:
    """What to draw for ``run``."""
    nodes = _rank_nodes(run)
    segments = _segments(run)
    faults = _faults(run, nodes)
    members = _members(run)
    ranks = set(nodes) | set(segments) | {m.rank for m in faults + members if m.rank is not None}
    if not ranks and isinstance(run.start.get("world"), int):
        ranks = set(range(run.start["world"]))
    for r in ranks:
        nodes.setdefault(r, 0)
    lanes = sorted(ranks, key=lambda r: (nodes[r], r))
    spans, incidents = _spans(run)
    notes = []
    if not run.has_progress:
        notes.append(f"no {PROGRESS_FILE}: no steps drawn (faults, recovery and generations only)")
    elif not run.samples:
        notes.append("no step was recorded (a plain script, or a run that stopped before its "
                     "first step)")
    title, subtitle = _titles(run, len(lanes), len(set(nodes.values())))
    account, wall = _account(run.summary)
    return Drawing(title=title, subtitle=subtitle, x_end=run.t_end - run.t0, lanes=lanes,
                nodes=nodes, segments=segments, spans=spans, incidents=incidents,
                generations=_generations(run), faults=faults, members=members,
                nodes_events=_node_events(run), account=account, wall_s=wall, notes=notes)


def _rank_nodes(run: Run) -> dict[int, int]:
    """rank -> the node of the process that held it first in this attempt (lanes are grouped
    by it); a rank that moved to another node later shows it by its new-process marker."""
    wid_node: dict[int, int] = {}
    for ev in run.events:
        if ev.get("type") in ("spawn", "replace") and isinstance(ev.get("wid"), int) \
                and isinstance(ev.get("node"), int):
            wid_node.setdefault(ev["wid"], ev["node"])
    for s in run.samples:
        if isinstance(s.get("wid"), int) and isinstance(s.get("node"), int):
            wid_node.setdefault(s["wid"], s["node"])
    out: dict[int, int] = {}
    for ev in run.events:
        if ev.get("type") == "generation":
            for rank, wid in _ranks(ev).items():
                if wid in wid_node:
                    out.setdefault(rank, wid_node[wid])
    for s in run.samples:
        if isinstance(s.get("node"), int):
            out.setdefault(s["rank"], s["node"])
    return out


def _ranks(gen_event: dict[str, Any]) -> dict[int, int]:
    """A generation event's ranks (JSON keys are strings) as rank -> worker id."""
    ranks = gen_event.get("ranks")
    out = {}
    for key, wid in (ranks.items() if isinstance(ranks, dict) else ()):
        if str(key).isdigit() and isinstance(wid, int):
            out[int(key)] = wid
    return out


def _segments(run: Run) -> dict[int, list[tuple[float, float, int]]]:
    """Each rank's stepping: one bar per run of consecutive samples of the same process and
    generation, from the start of its first step (its time minus ``step_s``) to its last sample."""
    by_proc: dict[tuple[int, Any, Any], list[dict[str, Any]]] = {}
    for s in run.samples:
        wid, gen = (v if isinstance(v, int) else None for v in (s.get("wid"), s.get("gen")))
        by_proc.setdefault((s["rank"], wid, gen), []).append(s)
    out: dict[int, list[tuple[float, float, int]]] = {}
    for (rank, _wid, gen), group in by_proc.items():
        group.sort(key=lambda s: s["t"])
        first = group[0]
        lead = first.get("step_s") if isinstance(first.get("step_s"), (int, float)) else 0.0
        start = max(first["t"] - max(lead, 0.0), run.t0)
        out.setdefault(rank, []).append((start - run.t0, group[-1]["t"] - run.t0,
                                         gen if isinstance(gen, int) else 0))
    for segs in out.values():
        segs.sort()
    return out


def _faults(run: Run, nodes: dict[int, int]) -> list[Mark]:
    """Every fault where it happened: the first fault of an incident at the incident's
    ``t_fault`` (the injection, the first sign, a hang's last progress), the others when they
    were detected; on the failed rank's lane, a node's lanes, or the job row."""
    t_fault = {ev.get("id"): ev["t_fault"] for ev in run.events
               if ev.get("type") == "incident" and isinstance(ev.get("id"), int)
               and isinstance(ev.get("t_fault"), (int, float))}
    frozen: list[int] = []
    placed: set[Any] = set()
    out = []
    for ev in run.events:
        kind = ev.get("type")
        if kind == "hang_detected":
            named = ev.get("frozen") if isinstance(ev.get("frozen"), dict) else {}
            frozen = [int(r) for r in named if str(r).isdigit()]
            continue
        if kind != "fault":
            continue
        fkind = str(ev.get("kind", "fault"))
        t, inc = ev["t"], ev.get("incident") if isinstance(ev.get("incident"), int) else None
        if fkind not in SYMPTOMS and inc in t_fault and inc not in placed:
            placed.add(inc)
            t = min(t, t_fault[inc])
        if fkind in SYMPTOMS:
            fkind = f"{fkind} (symptom)"
        for rank in _fault_ranks(ev, frozen, nodes):
            out.append(Mark(t - run.t0, rank, fkind, str(ev.get("kind", ""))))
    return out


def _fault_ranks(ev: dict[str, Any], frozen: list[int], nodes: dict[int, int]) -> list[Any]:
    """The lanes a fault is marked on: its rank, a hang's frozen ranks, its node's ranks, or
    none of them (``[None]``: the job row)."""
    if isinstance(ev.get("rank"), int):
        return [ev["rank"]]
    if ev.get("kind") == "hang" and frozen:
        return list(frozen)
    if isinstance(ev.get("node"), int):
        held = [r for r, n in nodes.items() if n == ev["node"]]
        if held:
            return held
    return [None]


def _members(run: Run) -> list[Mark]:
    """A new process on a rank: where a generation gives the rank another worker than the
    generation before it (a warm spare, a cold replacement, every rank of a job restart)."""
    how: dict[tuple[int, Any], str] = {}
    for ev in run.events:
        if ev.get("type") == "replace" and isinstance(ev.get("rank"), int) \
                and isinstance(ev.get("wid"), int):
            how[(ev["rank"], ev.get("wid"))] = "warm spare" if ev.get("warm") else "cold"
    out, before = [], None
    for ev in run.events:
        if ev.get("type") != "generation":
            continue
        ranks = _ranks(ev)
        if before is not None:
            for rank, wid in sorted(ranks.items()):
                if before.get(rank) != wid:
                    out.append(Mark(ev["t"] - run.t0, rank, how.get((rank, wid), "cold"),
                                    f"worker {wid}"))
        before = ranks
    return out


def _spans(run: Run) -> tuple[list[tuple[str, float, float, int]], list[tuple[float, str]]]:
    """Each closed incident's phases, consecutive from its fault, and its label."""
    spans, labels = [], []
    for ev in run.events:
        if ev.get("type") != "incident" or not isinstance(ev.get("t_fault"), (int, float)):
            continue
        t = ev["t_fault"] - run.t0
        start = t
        phases = ev.get("phases_s") if isinstance(ev.get("phases_s"), dict) else {}
        for name in list(PHASES) + [p for p in phases if p not in PHASES]:
            secs = phases.get(name) or 0.0
            if isinstance(secs, (int, float)) and secs > 0:
                spans.append((name, t, t + secs, ev.get("id")))
                t += secs
        mttr = ev.get("mttr_s")
        label = f"#{ev.get('id')}" + (f" {mttr:.2f} s" if isinstance(mttr, (int, float)) else "")
        labels.append(((start + t) / 2, label))
    return spans, labels


def _generations(run: Run) -> list[tuple[float, int, str]]:
    """Each generation published: when, its number, and its label (with the step it resumed
    from, when a ``restore`` event says)."""
    resumed = {ev.get("gen"): ev.get("step") for ev in run.events
               if ev.get("type") == "restore" and isinstance(ev.get("step"), int)}
    out = []
    for ev in run.events:
        if ev.get("type") == "generation" and isinstance(ev.get("gen"), int):
            gen = ev["gen"]
            label = f"g{gen}" + (f" @{resumed[gen]}" if gen in resumed and gen > 0 else "")
            out.append((ev["t"] - run.t0, gen, label))
    return out


def _node_events(run: Run) -> list[Mark]:
    """Hosts that joined (a spare node) or were given up, on the job row."""
    out = []
    for ev in run.events:
        if ev.get("type") in ("node_joined", "node_lost"):
            sign = "+" if ev["type"] == "node_joined" else "-"
            out.append(Mark(ev["t"] - run.t0, None, ev["type"], f"{sign}n{ev.get('node')}"))
    return out


def _account(summary: dict[str, Any] | None) -> tuple[dict[str, float], float | None]:
    """The goodput account flattened in a fixed order (recovery by phase), and the wall time."""
    if not summary or not isinstance(summary.get("time_s"), dict):
        return {}, None
    cats = summary["time_s"]
    recovery = cats.get("recovery") if isinstance(cats.get("recovery"), dict) else {}
    out: dict[str, float] = {}
    for name in ("startup", "productive", "recomputed"):
        out[name] = _seconds(cats.get(name))
    for phase, secs in recovery.items():
        out[str(phase)] = _seconds(secs)
    for name in ("snapshot", "checkpoint", "idle"):
        out[name] = _seconds(cats.get(name))
    wall = summary.get("wall_s")
    return out, float(wall) if isinstance(wall, (int, float)) else sum(out.values())


def _seconds(value: Any) -> float:
    """A number of seconds from the summary; anything else (missing, malformed) is none."""
    return float(value) if isinstance(value, (int, float)) and value > 0 else 0.0


def _titles(run: Run, ranks: int, nodes: int) -> tuple[str, str]:
    """The title (the run) and the subtitle (its summary: incidents, MTTR, goodput, wall)."""
    title = f"nonstop run {run.name}"
    if run.attempts > 1:
        title += f" (attempt {run.attempt} of {run.attempts})"
    shape = f"{ranks} rank{'s' if ranks != 1 else ''}"
    if nodes > 1:
        shape += f" on {nodes} nodes"
    if isinstance(run.start.get("spares"), int):
        shape += f", {run.start['spares']} spare{'s' if run.start['spares'] != 1 else ''}"
    mttrs = sorted(ev["mttr_s"] for ev in run.events
                   if ev.get("type") == "incident" and isinstance(ev.get("mttr_s"), (int, float)))
    incidents = sum(1 for ev in run.events if ev.get("type") == "incident")
    summary = run.summary or {}
    parts = [shape, f"{summary.get('incidents', incidents)} incident(s)"]
    median = summary["mttr_s"].get("median") if isinstance(summary.get("mttr_s"), dict) else \
        (_median(mttrs) if mttrs else None)
    if isinstance(median, (int, float)):
        parts.append(f"MTTR median {median:.2f} s")
    goodput = summary.get("goodput")
    parts.append("goodput " + (f"{goodput:.1%}" if isinstance(goodput, (int, float))
                               else "unknown"))
    wall = summary.get("wall_s")
    parts.append(f"wall {wall if isinstance(wall, (int, float)) else run.t_end - run.t0:.1f} s")
    if "exit_code" in summary:
        parts.append(f"exit {summary['exit_code']}")
    elif not any(ev.get("type") == "run_end" for ev in run.events):
        parts.append("no end recorded")
    return title, " | ".join(parts)


def _median(values: list[float]) -> float:
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2

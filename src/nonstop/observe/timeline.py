"""The picture of a run: ``<run-dir>/timeline.png``, drawn by ``nonstop report``.

One lane per rank (grouped by node when the run has several), time in seconds since the run
started: each rank's steps as they completed (bars between consecutive progress samples of the
same process and generation, their shade alternating at each generation), generation boundaries,
faults where they happened, the recovery phases of every incident shaded across all lanes, the
processes that took a rank (a warm spare, a cold replacement, a restart), and below it the goodput
account: where the wall time went.

The data come from the run directory alone (``events.jsonl``, ``progress.jsonl``,
``summary.json``); a directory used again holds several attempts, and the last one is drawn.
Loading and planning are plain Python; matplotlib is imported only to render, so importing
this module costs nothing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import events as event_log
from .incidents import PHASES
from .progress import FILENAME as PROGRESS_FILE

FILENAME = "timeline.png"
DPI = 100
WIDTH_IN = 13.0
MAX_LANE_LABELS = 16  # more lanes than this: label every 2nd, 4th, 8th... lane
LEFT_IN, RIGHT_IN = 1.05, 2.75  # the lane labels' margin; the node labels' and legend's

PHASE_COLOURS = {"detect": "#d62728", "decide": "#ff7f0e", "teardown": "#8c564b",
                 "replace": "#e377c2", "rendezvous": "#bcbd22", "restore": "#17becf",
                 "first_step": "#9467bd"}
OTHER_PHASE_COLOUR = "#444444"  # a phase this module does not know (e.g. ``unrecovered``)
CATEGORY_COLOURS = {"productive": "#2ca02c", "recomputed": "#ffbb78", "startup": "#7f7f7f",
                    "snapshot": "#aec7e8", "checkpoint": "#c49c94", "idle": "#dddddd"}
STEP_SHADES = ("#1f5f9f", "#6fa8dc")  # alternate at each generation
FAULT_COLOUR = "#b00000"
MEMBER_COLOUR = "#006d2c"
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
class Plan:
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


def plan(run: Run) -> Plan:
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
    return Plan(title=title, subtitle=subtitle, x_end=run.t_end - run.t0, lanes=lanes,
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


# ---------------------------------------------------------------- rendering


def draw(run_dir: str | Path, out: str | Path | None = None,
         record: dict[str, Any] | None = None) -> Path:
    """Draw the last attempt of ``run_dir`` to ``out`` (default ``<run_dir>/timeline.png``) and
    return its path; ``record``, when given, is filled with what was drawn (for tests).
    NoPicture when the directory has nothing to draw; OSError when the file cannot be written."""
    path = Path(out) if out is not None else Path(run_dir) / FILENAME
    drawn = render(plan(load(run_dir)), path)
    if record is not None:
        record.update(drawn)
    return path


def label_every(lanes: int) -> int:
    """Label every n-th lane: 1 up to MAX_LANE_LABELS lanes, then 2, 4, 8... so at most
    MAX_LANE_LABELS labels show and none overlap."""
    every = 1
    while math.ceil(lanes / every) > MAX_LANE_LABELS:
        every *= 2
    return every


def _layout(lanes: int) -> dict[str, float]:
    """The figure's height and its rows, in inches: the title, the job strip, the lanes (a
    fixed lane height up to a cap, so 64 ranks still fit a screen), the goodput bar."""
    rows = {"title": 0.75, "strip": 0.7, "lanes": min(max(0.38 * lanes, 1.9), 9.6),
            "gap": 0.85, "bar": 0.32, "bottom": 0.95}
    rows["height"] = sum(rows.values())
    return rows


def render(p: Plan, path: Path) -> dict[str, Any]:
    """Draw ``p`` into a PNG at ``path``; return what was drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = _layout(len(p.lanes))
    fig = Figure(figsize=(WIDTH_IN, rows["height"]), dpi=DPI)
    FigureCanvasAgg(fig)
    axes = _axes(fig, rows)
    strip, lanes_ax, bar_ax = axes
    x_end = p.x_end * 1.01
    for ax in (strip, lanes_ax):
        ax.set_xlim(0, x_end)
    record: dict[str, Any] = {"title": p.title, "subtitle": p.subtitle}
    fig.text(0.5, 1 - 0.28 / rows["height"], p.title, ha="center", va="center",
             fontsize=13, weight="bold")
    fig.text(0.5, 1 - 0.55 / rows["height"], p.subtitle, ha="center", va="center", fontsize=10)
    record["spans"] = _draw_spans(p, strip, lanes_ax)
    record["generations"] = _draw_generations(p, strip, lanes_ax)
    record["lanes"] = _draw_lanes(p, lanes_ax)
    record["segments"] = _draw_segments(p, lanes_ax)
    record["faults"], record["members"] = _draw_marks(p, strip, lanes_ax)
    record["strip"] = _draw_strip(p, strip)
    record["legend"] = _draw_legend(p, lanes_ax, record)
    record["account"] = _draw_account(p, bar_ax)
    for note in p.notes:
        lanes_ax.text(0.5, 0.5, note, transform=lanes_ax.transAxes, ha="center", va="center",
                      fontsize=10, color="#555555",
                      bbox={"facecolor": "white", "edgecolor": "#999999", "alpha": 0.9})
    record["notes"] = list(p.notes)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    record["size_px"] = (round(WIDTH_IN * DPI), round(rows["height"] * DPI))
    record.update(_fit(fig, lanes_ax))
    return record


def _fit(fig: Any, lanes_ax: Any) -> dict[str, Any]:
    """Whether the picture reads: lane and node labels that overlap one another (pairs), and
    text or legends that run off the figure."""
    renderer = fig.canvas.get_renderer()
    labels = [t for t in lanes_ax.get_yticklabels() if t.get_visible() and t.get_text()]
    nodes = [t for t in lanes_ax.texts if t.get_text().startswith("node ")]
    overlaps = 0
    for group in (labels, nodes):
        boxes = [t.get_window_extent(renderer) for t in group]
        overlaps += sum(1 for i, a in enumerate(boxes) for b in boxes[i + 1:] if a.overlaps(b))
    width, height = fig.bbox.width, fig.bbox.height
    outside = []
    for artist in [*fig.texts, *(ax.get_legend() for ax in fig.axes), *nodes, *labels]:
        if artist is None:
            continue
        box = artist.get_window_extent(renderer)
        if box.x0 < -1 or box.y0 < -1 or box.x1 > width + 1 or box.y1 > height + 1:
            outside.append(getattr(artist, "get_text", lambda: "legend")())
    return {"label_overlaps": overlaps, "outside": outside}


def _axes(fig: Any, rows: dict[str, float]) -> tuple[Any, Any, Any]:
    """The three panels at fixed positions in inches: job strip, lanes, goodput bar."""
    h = rows["height"]
    left, width = LEFT_IN / WIDTH_IN, (WIDTH_IN - LEFT_IN - RIGHT_IN) / WIDTH_IN
    top = h - rows["title"]
    strip = fig.add_axes((left, (top - rows["strip"]) / h, width, rows["strip"] / h))
    lanes_top = top - rows["strip"]
    lanes = fig.add_axes((left, (lanes_top - rows["lanes"]) / h, width, rows["lanes"] / h),
                         sharex=strip)
    bar = fig.add_axes((left, rows["bottom"] / h, width, rows["bar"] / h))
    return strip, lanes, bar


def _draw_spans(p: Plan, strip: Any, lanes_ax: Any) -> list[tuple[str, float, float]]:
    """The recovery phases shaded across the strip and every lane."""
    out = []
    for phase, x0, x1, _inc in p.spans:
        colour = PHASE_COLOURS.get(phase, OTHER_PHASE_COLOUR)
        for ax in (strip, lanes_ax):
            ax.axvspan(x0, x1, color=colour, alpha=0.4, linewidth=0, zorder=1)
        out.append((phase, x0, x1))
    return out


def _draw_generations(p: Plan, strip: Any, lanes_ax: Any) -> list[tuple[int, float]]:
    """A dashed vertical line where each generation was published."""
    for x, _gen, _label in p.generations:
        for ax in (strip, lanes_ax):
            ax.axvline(x, color="#333333", linewidth=0.8, linestyle="--", alpha=0.7, zorder=2)
    return [(gen, x) for x, gen, _label in p.generations]


def _draw_lanes(p: Plan, ax: Any) -> dict[str, Any]:
    """Lane labels (thinned out past MAX_LANE_LABELS lanes), node groups and separators."""
    n = len(p.lanes)
    ax.set_ylim(n - 0.5, -0.5)
    every = label_every(n)
    shown = [(i, f"rank {r}") for i, r in enumerate(p.lanes) if i % every == 0]
    ax.set_yticks([i for i, _ in shown], [text for _, text in shown], fontsize=8)
    ax.set_yticks(range(n), minor=True)
    ax.tick_params(axis="y", which="minor", length=2)
    ax.set_xlabel("seconds since the run started", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", color="#eeeeee", linewidth=0.6, zorder=0)
    node_labels = []
    groups = _node_groups(p)
    if len(groups) > 1:
        keep = label_every(len(groups))
        for k, (node, first, last) in enumerate(groups):
            if first > 0:
                ax.axhline(first - 0.5, color="#555555", linewidth=0.8, zorder=2)
            if k % keep == 0:
                ax.text(1.005, (first + last) / 2, f"node {node}", fontsize=8, va="center",
                        transform=ax.get_yaxis_transform())
                node_labels.append(f"node {node}")
    return {"count": n, "ranks": list(p.lanes), "labels": [t for _, t in shown],
            "every": every, "nodes": node_labels}


def _node_groups(p: Plan) -> list[tuple[int, int, int]]:
    """(node, first lane, last lane) for each run of lanes on one node."""
    groups: list[tuple[int, int, int]] = []
    for i, rank in enumerate(p.lanes):
        node = p.nodes.get(rank, 0)
        if groups and groups[-1][0] == node:
            groups[-1] = (node, groups[-1][1], i)
        else:
            groups.append((node, i, i))
    return groups


def _draw_segments(p: Plan, ax: Any) -> dict[int, list[tuple[float, float, int]]]:
    """Each rank's steps, its shade alternating with the generation."""
    for i, rank in enumerate(p.lanes):
        segs = p.segments.get(rank, [])
        for parity in (0, 1):
            ranges = [(x0, max(x1 - x0, p.x_end * 1e-4)) for x0, x1, gen in segs
                      if gen % 2 == parity]
            if ranges:
                ax.broken_barh(ranges, (i - 0.33, 0.66), facecolors=STEP_SHADES[parity],
                               linewidth=0, zorder=3)
    return {rank: list(p.segments.get(rank, [])) for rank in p.lanes}


def _draw_marks(p: Plan, strip: Any, lanes_ax: Any) -> tuple[list[tuple[Any, float, str]],
                                                           list[tuple[int, float, str]]]:
    """Faults (a cross; hollow for a symptom) and new processes (a triangle in the lower half of
    the lane, so a fault at the same moment still shows: filled for a warm spare, hollow for a
    cold one), on their lanes or the job row."""
    lane_of = {rank: i for i, rank in enumerate(p.lanes)}
    faults = []
    few = len(p.lanes) <= MAX_LANE_LABELS and len(p.faults) <= 12
    for m in p.faults:
        symptom = m.kind.endswith("(symptom)")
        ax, y = (strip, 0) if m.rank is None else (lanes_ax, lane_of[m.rank])
        if symptom:
            ax.scatter([m.x], [y], s=34, marker="o", facecolors="none", edgecolors="#555555",
                       linewidths=1.1, zorder=5)
        else:
            ax.scatter([m.x], [y], s=80, marker="X", color=FAULT_COLOUR, edgecolors="white",
                       linewidths=0.8, zorder=6)
            if few:
                ax.annotate(m.text, (m.x, y), xytext=(6, 4), textcoords="offset points",
                            fontsize=7, color=FAULT_COLOUR, zorder=7)
        faults.append(("job" if m.rank is None else m.rank, m.x, m.kind))
    members = []
    for m in p.members:
        warm = m.kind == "warm spare"
        lanes_ax.scatter([m.x], [lane_of[m.rank] + 0.2], s=45, marker=">", linewidths=1.2,
                         facecolors=MEMBER_COLOUR if warm else "white", edgecolors=MEMBER_COLOUR,
                         zorder=6)
        members.append((m.rank, m.x, m.kind))
    return faults, members


def _draw_strip(p: Plan, ax: Any) -> dict[str, list[str]]:
    """The strip above the lanes: generation labels, incident labels (MTTR), and the job row
    (faults of no one rank, nodes that joined or were lost); labels that would overlap are
    left out (their lines and shading still show)."""
    ax.set_ylim(-0.5, 2.5)
    ax.set_yticks([0, 1, 2], ["job", "incident", "generation"], fontsize=8)
    ax.tick_params(axis="x", labelbottom=False, length=0)
    ax.tick_params(axis="y", length=0)
    gens = _thin([(x, label) for x, _g, label in p.generations], p.x_end)
    for x, label in gens:
        ax.text(x, 2, " " + label, fontsize=7, va="center", ha="left", zorder=7)
    incs = _thin(p.incidents, p.x_end, centred=True)
    for x, label in incs:
        ax.text(x, 1, label, fontsize=7, va="center", ha="center", zorder=7,
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.75, "pad": 0.5})
    for m in p.nodes_events:
        ax.scatter([m.x], [0], s=40, marker="s", color="#333333", zorder=6)
        ax.annotate(m.text, (m.x, 0), xytext=(5, 2), textcoords="offset points", fontsize=7)
    return {"generations": [t for _, t in gens], "incidents": [t for _, t in incs],
            "nodes": [m.text for m in p.nodes_events]}


def _thin(labels: list[tuple[float, str]], x_end: float,
          centred: bool = False) -> list[tuple[float, str]]:
    """The labels that fit on one row without overlapping, left to right (about 6 pixels a
    character at 7 points on the lanes' width)."""
    px_per_s = (WIDTH_IN - LEFT_IN - RIGHT_IN) * DPI / max(x_end * 1.01, 1e-9)
    kept, right = [], -math.inf
    for x, text in sorted(labels):
        width = (len(text) + 1) * 6.0 / px_per_s
        left = x - width / 2 if centred else x
        if left > right:
            kept.append((x, text))
            right = left + width
    return kept


def _draw_legend(p: Plan, ax: Any, drawn: dict[str, Any]) -> list[str]:
    """The legend, beside the lanes: only what the picture holds, and every recovery phase
    when it holds an incident."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = []
    gens = {g for segs in drawn["segments"].values() for _a, _b, g in segs}
    if any(g % 2 == 0 for g in gens):
        handles.append(Patch(color=STEP_SHADES[0], label="steps: generation 0, 2, 4..."))
    if any(g % 2 for g in gens):
        handles.append(Patch(color=STEP_SHADES[1], label="steps: generation 1, 3, 5..."))
    if drawn["generations"]:
        handles.append(Line2D([], [], color="#333333", linestyle="--", linewidth=0.8,
                              label="new generation"))
    kinds = {k for _r, _x, k in drawn["faults"]}
    if any(not k.endswith("(symptom)") for k in kinds):
        handles.append(Line2D([], [], marker="X", linestyle="", color=FAULT_COLOUR,
                              markeredgecolor="white", markersize=9, label="fault"))
    if any(k.endswith("(symptom)") for k in kinds):
        handles.append(Line2D([], [], marker="o", linestyle="", markerfacecolor="none",
                              markeredgecolor="#555555", label="symptom (a peer's fault)"))
    hows = {k for _r, _x, k in drawn["members"]}
    if "warm spare" in hows:
        handles.append(Line2D([], [], marker=">", linestyle="", color=MEMBER_COLOUR,
                              label="new process: warm spare"))
    if hows - {"warm spare"}:
        handles.append(Line2D([], [], marker=">", linestyle="", markerfacecolor="white",
                              markeredgecolor=MEMBER_COLOUR, label="new process: cold"))
    if p.spans:
        phases = list(PHASES) + sorted({s[0] for s in p.spans} - set(PHASES))
        for phase in phases:
            handles.append(Patch(color=PHASE_COLOURS.get(phase, OTHER_PHASE_COLOUR), alpha=0.4,
                                 label=f"recovery: {phase}"))
    if not handles:
        return []
    legend = ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.075, 1.0),
                       fontsize=8, frameon=False, borderaxespad=0)
    return [t.get_text() for t in legend.get_texts()]


def _draw_account(p: Plan, ax: Any) -> dict[str, Any]:
    """The goodput account as one stacked bar (share of the wall time, not in time order),
    recovery by phase in the shading's colours, with its own legend below."""
    ax.set_yticks([])
    ax.set_xlim(0, 100)
    ax.tick_params(axis="x", labelsize=8)
    total = sum(p.account.values())
    if not p.account or total <= 0:
        ax.text(0.5, 0.5, "no goodput account (no summary.json for this attempt)", fontsize=9,
                ha="center", va="center", transform=ax.transAxes, color="#555555")
        ax.set_xticks([])
        return {"parts": {}, "legend": []}
    wall = p.wall_s or total
    left, parts, handles = 0.0, {}, []
    from matplotlib.patches import Patch

    for name, secs in p.account.items():
        share = 100.0 * secs / wall
        if share <= 0:
            continue
        colour = CATEGORY_COLOURS.get(name) or PHASE_COLOURS.get(name, OTHER_PHASE_COLOUR)
        ax.barh([0], [share], left=left, height=1.0, color=colour, linewidth=0)
        if share >= 7:
            ax.text(left + share / 2, 0, f"{name} {share:.0f}%", ha="center", va="center",
                    fontsize=7, color="white" if name in ("productive", "startup") else "black")
        parts[name] = share
        handles.append(Patch(color=colour, label=f"{name} {secs:.2f} s"))
        left += share
    ax.set_ylim(-0.5, 0.5)
    ax.set_title(f"the goodput account: where the {wall:.1f} s of wall time went (% of it, not "
                 "in time order)", fontsize=9, loc="left")
    legend = ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.75),
                       ncol=min(len(handles), 6), fontsize=7, frameon=False)
    return {"parts": parts, "legend": [t.get_text() for t in legend.get_texts()]}

"""The picture of a run: ``<run-dir>/timeline.png``, drawn by ``nonstop report``.

One lane per rank (grouped by node when the run has several), time in seconds since the run
started: each rank's steps as they completed (bars between consecutive progress samples of the
same process and generation, their shade alternating at each generation), generation boundaries,
faults where they happened, the recovery phases of every incident shaded across all lanes, the
processes that took a rank (a warm spare, a cold replacement, a restart), and below it the goodput
account: where the wall time went.

The data come from the run directory alone (``events.jsonl``, ``progress.jsonl``,
``summary.json``); a directory used again holds several attempts, and the last one is drawn.
Loading and planning are plain Python (``timeline_plan.py``); matplotlib is imported only to
render, so importing this module costs nothing.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .incidents import PHASES
from .timeline_plan import (  # noqa: F401 - NoPicture, Run, Mark: the callers' names
    Mark, NoPicture, Drawing, Run, load, plan)

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


def render(p: Drawing, path: Path) -> dict[str, Any]:
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


def _draw_spans(p: Drawing, strip: Any, lanes_ax: Any) -> list[tuple[str, float, float]]:
    """The recovery phases shaded across the strip and every lane."""
    out = []
    for phase, x0, x1, _inc in p.spans:
        colour = PHASE_COLOURS.get(phase, OTHER_PHASE_COLOUR)
        for ax in (strip, lanes_ax):
            ax.axvspan(x0, x1, color=colour, alpha=0.4, linewidth=0, zorder=1)
        out.append((phase, x0, x1))
    return out


def _draw_generations(p: Drawing, strip: Any, lanes_ax: Any) -> list[tuple[int, float]]:
    """A dashed vertical line where each generation was published."""
    for x, _gen, _label in p.generations:
        for ax in (strip, lanes_ax):
            ax.axvline(x, color="#333333", linewidth=0.8, linestyle="--", alpha=0.7, zorder=2)
    return [(gen, x) for x, gen, _label in p.generations]


def _draw_lanes(p: Drawing, ax: Any) -> dict[str, Any]:
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


def _node_groups(p: Drawing) -> list[tuple[int, int, int]]:
    """(node, first lane, last lane) for each run of lanes on one node."""
    groups: list[tuple[int, int, int]] = []
    for i, rank in enumerate(p.lanes):
        node = p.nodes.get(rank, 0)
        if groups and groups[-1][0] == node:
            groups[-1] = (node, groups[-1][1], i)
        else:
            groups.append((node, i, i))
    return groups


def _draw_segments(p: Drawing, ax: Any) -> dict[int, list[tuple[float, float, int]]]:
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


def _draw_marks(p: Drawing, strip: Any, lanes_ax: Any) -> tuple[list[tuple[Any, float, str]],
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


def _draw_strip(p: Drawing, ax: Any) -> dict[str, list[str]]:
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


def _draw_legend(p: Drawing, ax: Any, drawn: dict[str, Any]) -> list[str]:
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


def _draw_account(p: Drawing, ax: Any) -> dict[str, Any]:
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

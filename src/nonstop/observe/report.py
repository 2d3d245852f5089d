"""``nonstop report RUN_DIR``: the summary of a finished run, from its summary.json, after one
line per attempt when the run directory holds several (a job started again with the same
``--run-dir``: its event log is the whole history); then the picture of the run,
``RUN_DIR/timeline.png`` (timeline.py), and with ``--html`` one self-contained page,
``RUN_DIR/report.html``: the picture, the incidents, the goodput account and the policy."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

from ..errors import UsageError

HTML_FILE = "report.html"


def show(run_dir: str, html_page: bool = False, picture: bool = True) -> int:
    from . import events
    from .display import Display, print_history

    path = Path(run_dir) / "summary.json"
    log = Path(run_dir) / events.FILENAME
    try:
        history = events.attempts(log) if log.is_file() else []
    except OSError as exc:
        raise UsageError(f"cannot read {log}: {exc}") from None
    if not path.is_file() and not history:
        raise UsageError(f"no run at {run_dir} (no summary.json)")
    display = Display()
    if len(history) > 1 or (history and not history[-1]["ended"]):
        print_history(display.console, history)
    if path.is_file():
        try:
            summary = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UsageError(f"cannot read {path}: {exc}") from None
        if history and not history[-1]["ended"]:
            display.console.print(f"summary.json is attempt {summary.get('attempt', 1)}'s, the "
                                  "last one that ended:")
        try:
            if not isinstance(summary, dict):
                raise TypeError(f"a JSON {type(summary).__name__}, not an object")
            display.summary(summary)
        except (AttributeError, TypeError, KeyError, ValueError, IndexError) as exc:
            raise UsageError(f"{path} is not a summary nonstop wrote ({exc})") from None
        if summary.get("diagnosis"):
            print(f"diagnosis: {summary['diagnosis']}")
    png, why = _picture(run_dir) if picture or html_page else (None, None)
    if html_page:
        page = Path(run_dir) / HTML_FILE
        try:
            page.write_text(render_html(run_dir, png, why))
        except OSError as exc:
            raise UsageError(f"cannot write {page}: {exc}") from None
        print(f"report: {page}")
    return 0


def _picture(run_dir: str) -> tuple[Path | None, str | None]:
    """Draw ``RUN_DIR/timeline.png``, saying where (or, on one line, why there is none)."""
    from . import timeline

    try:
        png = timeline.draw(run_dir)
    except timeline.NoPicture as exc:
        print(f"timeline: no picture: {exc}")
        return None, str(exc)
    except OSError as exc:
        raise UsageError(f"cannot write {Path(run_dir) / timeline.FILENAME}: {exc}") from None
    print(f"timeline: {png}")
    return png, None


# ---------------------------------------------------------------- the page

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; margin-bottom: 0.2em; } h2 { font-size: 1.1em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th { background: #f2f2f2; } td.text { text-align: left; }
img { max-width: 100%; border: 1px solid #ddd; }
pre { background: #f6f6f6; padding: 0.8em; font-size: 0.85em; overflow-x: auto; }
.note { color: #666; }
"""


def render_html(run_dir: str, png: Path | None, why: str | None = None) -> str:
    """The report as one HTML page that needs nothing else: the picture inline (base64), the
    summary, the incidents, the goodput account and the policy in force."""
    from . import timeline

    try:
        run: Any = timeline.load(run_dir)
        drawn: Any = timeline.plan(run)
        title, subtitle = drawn.title, drawn.subtitle
    except timeline.NoPicture:
        run, title, subtitle = None, f"nonstop run {Path(run_dir).resolve().name}", ""
    summary = _summary(run_dir, run)
    parts = [f"<h1>{_e(title)}</h1>", f"<p>{_e(subtitle)}</p>"]
    if summary.get("diagnosis"):
        parts.append(f"<p>diagnosis: {_e(summary['diagnosis'])}</p>")
    if png is not None:
        data = base64.b64encode(png.read_bytes()).decode("ascii")
        parts.append(f'<img alt="timeline of the run" src="data:image/png;base64,{data}">')
    else:
        parts.append(f'<p class="note">no picture: {_e(why or "not drawn")}</p>')
    incidents = summary.get("incident_list")
    if incidents is None and run is not None:
        incidents = [ev for ev in run.events if ev.get("type") == "incident"]
    parts += ["<h2>Incidents</h2>", _incident_table(incidents or [])]
    parts += ["<h2>Goodput account</h2>", _account_table(summary)]
    policy = run.start.get("policy") if run is not None else None
    parts += ["<h2>Policy in force</h2>", _policy(policy)]
    body = "\n".join(parts)
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(title)}</title><style>{_STYLE}</style></head>\n<body>\n{body}\n"
            "</body></html>\n")


def _e(value: Any) -> str:
    return html.escape(str(value))


def _summary(run_dir: str, run: Any) -> dict[str, Any]:
    """summary.json when it is the drawn attempt's, else nothing (its killed attempt has none)."""
    if run is not None:
        return run.summary or {}
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return summary if isinstance(summary, dict) else {}


def _incident_table(incidents: list[dict[str, Any]]) -> str:
    """One row per incident: its faults, the levels that recovered it, MTTR and its phases."""
    from .display import _lost
    from .incidents import PHASES

    if not incidents:
        return '<p class="note">no incident</p>'
    head = ["#", "fault", "recovery", "MTTR s", *PHASES, "steps lost", "outcome"]
    rows = ["<tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr>"]
    for inc in incidents:
        if not isinstance(inc, dict):
            continue
        phases = inc.get("phases_s") if isinstance(inc.get("phases_s"), dict) else {}
        cells = [_e(inc.get("id", "")), _text("; ".join(map(str, inc.get("faults") or []))),
                 _text(", ".join(map(str, inc.get("levels") or []))), _num(inc.get("mttr_s")),
                 *[_num(phases.get(p) or 0) for p in PHASES], _e(_lost(inc)),
                 _text(inc.get("outcome", ""))]
        rows.append('<tr class="incident">' + "".join(
            c if c.startswith("<td") else f"<td>{c}</td>" for c in cells) + "</tr>")
    return "<table>\n" + "\n".join(rows) + "\n</table>"


def _num(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) else "-"


def _text(value: Any) -> str:
    return f'<td class="text">{_e(value)}</td>'


def _account_table(summary: dict[str, Any]) -> str:
    """The goodput account: each category's seconds and share of the wall time."""
    cats = summary.get("time_s")
    if not isinstance(cats, dict):
        return '<p class="note">not known (no summary for this attempt)</p>'
    wall = summary.get("wall_s") if isinstance(summary.get("wall_s"), (int, float)) else 0.0
    rows = ["<tr><th>time</th><th>seconds</th><th>share</th></tr>"]
    for name, secs in cats.items():
        if isinstance(secs, dict):
            rows.append(_account_row(name, sum(v for v in secs.values()
                                               if isinstance(v, (int, float))), wall))
            rows += [_account_row(f"recovery: {p}", v, wall) for p, v in secs.items()]
        else:
            rows.append(_account_row(name, secs, wall))
    rows.append(_account_row("wall", wall, wall))
    goodput = summary.get("goodput")
    line = "goodput: " + (f"{goodput:.1%}" if isinstance(goodput, (int, float)) else "unknown")
    return f"<p>{_e(line)}</p>\n<table>\n" + "\n".join(rows) + "\n</table>"


def _account_row(name: str, secs: Any, wall: float) -> str:
    secs = float(secs) if isinstance(secs, (int, float)) else 0.0
    share = f"{secs / wall:.1%}" if wall else "-"
    return f'<tr><td class="text">{_e(name)}</td><td>{secs:.3f}</td><td>{share}</td></tr>'


def _policy(policy: Any) -> str:
    """The policy the attempt ran under (from its run_start event), as YAML."""
    if not isinstance(policy, dict):
        return '<p class="note">not recorded in the event log</p>'
    from ..policy.text import dump

    return f"<pre>{_e(dump(policy))}</pre>"

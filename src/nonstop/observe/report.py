"""``nonstop report RUN_DIR``: the summary of a finished run, from its summary.json, after one
line per attempt when the run directory holds several (a job started again with the same
``--run-dir``: its event log is the whole history)."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UsageError


def show(run_dir: str) -> int:
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
    if not path.is_file():
        return 0
    try:
        summary = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from None
    if history and not history[-1]["ended"]:
        display.console.print(f"summary.json is attempt {summary.get('attempt', 1)}'s, the last "
                              "one that ended:")
    display.summary(summary)
    if summary.get("diagnosis"):
        print(f"diagnosis: {summary['diagnosis']}")
    return 0

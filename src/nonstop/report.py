"""``nonstop report RUN_DIR``: the summary of a finished run, from its summary.json."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import UsageError


def show(run_dir: str) -> int:
    path = Path(run_dir) / "summary.json"
    if not path.is_file():
        raise UsageError(f"no run at {run_dir} (no summary.json)")
    try:
        summary = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from None
    from .display import Display

    Display().summary(summary)
    if summary.get("diagnosis"):
        print(f"diagnosis: {summary['diagnosis']}")
    return 0

"""The run's event log: one JSON object per line in ``<run-dir>/events.jsonl``.

Every fault, decision and recovery phase is written here with its timestamp (seconds since the
epoch, one clock for every process on the machine), so any incident can be replayed afterwards.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Iterator

FILENAME = "events.jsonl"


class EventLog:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / FILENAME
        self._fh = open(self.path, "w", buffering=1)
        self._lock = threading.Lock()

    def write(self, event_type: str, /, **fields: Any) -> dict[str, Any]:
        record = {"t": fields.pop("t", None) or time.time(), "type": event_type, **fields}
        line = json.dumps(record, default=str, separators=(",", ":"))
        with self._lock:
            self._fh.write(line + "\n")
        return record

    def close(self) -> None:
        with self._lock:
            self._fh.close()


def read(path: str | Path) -> Iterator[dict[str, Any]]:
    p = Path(path)
    if p.is_dir():
        p = p / FILENAME
    with open(p) as fh:
        for line in fh:
            line = line.strip()
            if line:
                yield json.loads(line)

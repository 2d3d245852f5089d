"""The run's event log: one JSON object per line in ``<run-dir>/events.jsonl``.

Every fault, decision and recovery phase is written here with its timestamp (seconds since the
epoch, one clock for every process on the machine), so any incident can be replayed afterwards.

A job started again with the same run directory appends to the same log: each attempt begins with
a ``run_start`` carrying its ``attempt`` number, so the file is the job's whole history.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from ..protocol import fastjson
from . import event_types

FILENAME = "events.jsonl"
# events whose `step` (or `step_before`) is a step the run had reached
_STEP_EVENTS = ("rank_first_step", "rank_done", "rank_left", "training_complete", "checkpoint",
                "restore")


FLUSH_S = 0.05  # a write this long after the last flush flushes itself


class EventLog:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / FILENAME
        self.previous = attempts(self.path) if self.path.exists() else []  # earlier attempts
        self.attempt = len(self.previous) + 1
        torn = self.path.exists() and _ends_mid_line(self.path)
        # buffered: the controller's loop flushes once per turn (a recovery of thousands of
        # ranks writes thousands of events in one turn); a write long after the last flush
        # flushes itself
        self._fh = open(self.path, "ab", buffering=1 << 16)  # (the JSON is made as bytes)
        if torn:  # a launcher killed mid-line: start ours on a line of its own
            self._fh.write(b"\n")
        self._lock = threading.Lock()
        self._flushed = time.monotonic()
        self.listeners: list[Any] = []  # called with every record written (the metrics)

    def write(self, event_type: str, /, **fields: Any) -> dict[str, Any]:
        return self.write_record(event_type, fields)

    def write_record(self, event_type: str, fields: dict[str, Any]) -> dict[str, Any]:
        """``write`` with the fields as a dict (a rank's event, as it came: not copied twice;
        its own ``type`` is replaced). A type ``event_types`` does not list is refused."""
        if event_type not in event_types.ALL:
            raise ValueError(f"unknown event type {event_type!r}: add it to "
                             "observe/event_types.py and docs/events.md")
        t = fields.get("t") or time.time()
        # (t and type first, then the fields in their order: one copy, in C)
        record = {"t": t, "type": event_type, **fields}
        record["t"], record["type"] = t, event_type  # (a rank's event names its own type)
        line = fastjson.dumps(record, default=str)
        with self._lock:
            self._fh.write(line + b"\n")
            if time.monotonic() - self._flushed >= FLUSH_S:
                self._flush()
        for listener in self.listeners:
            try:
                listener(record)
            except Exception:  # noqa: BLE001 - a metric must never stop the job
                pass
        return record

    def deadline(self, what: str, limit_s: float | None, /, **fields: Any) -> dict[str, Any]:
        """A deadline fired: one ``deadline`` event whatever waited (docs/events.md, Deadlines)."""
        return self.write("deadline", what=what,
                          limit_s=None if limit_s is None else round(limit_s, 3), **fields)

    def flush(self) -> None:
        """What was written is in the file (the controller's loop calls this every turn)."""
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        self._flushed = time.monotonic()
        try:
            self._fh.flush()
        except (OSError, ValueError):  # a full disk, or closed: the job goes on without it
            pass

    def close(self) -> None:
        with self._lock:
            self._flush()
            self._fh.close()


def read(path: str | Path) -> Iterator[dict[str, Any]]:
    """Every event of a log (a run directory or the file), skipping a line left torn by a
    launcher that was killed while writing it."""
    p = Path(path)
    if p.is_dir():
        p = p / FILENAME
    with open(p) as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def _ends_mid_line(path: Path) -> bool:
    with open(path, "rb") as fh:
        fh.seek(0, 2)
        if fh.tell() == 0:
            return False
        fh.seek(-1, 2)
        return fh.read(1) != b"\n"


def attempts(path: str | Path) -> list[dict[str, Any]]:
    """The attempts a log holds, oldest first: one per ``run_start``. Each says when it started
    and ended, its exit code and diagnosis (None when its launcher was killed before writing
    ``run_end``), and ``steps``, the newest step it reached: its summary's, else the newest step
    its events name (a lower bound), None where its ranks ran no steps nonstop could see."""
    out: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    for ev in read(path):
        kind = ev.get("type")
        if kind == "run_start":
            cur = {"attempt": len(out) + 1, "t_start": ev.get("t"), "t_end": ev.get("t"),
                   "exit_code": None, "diagnosis": None, "ended": False, "steps": None,
                   "_seen": 0, "_plain": not ev.get("managed", True), "_no_steps": False}
            out.append(cur)
            continue
        if cur is None:
            continue
        cur["t_end"] = ev.get("t", cur["t_end"])
        if kind == "run_end":
            cur.update(ended=True, exit_code=ev.get("exit_code"), diagnosis=ev.get("diagnosis"),
                       steps=ev.get("steps"), summary=ev)
        elif kind == "stepped_down":  # a controller across hosts left office to a successor
            cur["stepped_down"] = ev.get("why")
        elif kind == "rank_no_steps":
            cur["_no_steps"] = True
        elif kind == "rank_wrapped":
            cur["_plain"] = False
        elif kind in _STEP_EVENTS and isinstance(ev.get("step"), int):
            cur["_seen"] = max(cur["_seen"], ev["step"])
        elif kind == "incident" and isinstance(ev.get("step_before"), int):
            cur["_seen"] = max(cur["_seen"], ev["step_before"])
    from .progress import FILENAME as PROGRESS_FILENAME

    progressed = _progress_steps(Path(path).with_name(PROGRESS_FILENAME), out)
    for a, best in zip(out, progressed):
        seen, plain, no_steps = a.pop("_seen"), a.pop("_plain"), a.pop("_no_steps")
        if not a["ended"]:
            a["steps"] = None if plain or no_steps else max(seen, best)
    return out


def _progress_steps(path: Path, spans: list[dict[str, Any]]) -> list[int]:
    """The newest step the progress log beside an event log shows within each attempt's time
    (an attempt that ended without its summary - its controller killed, or stepped down - got
    at least that far)."""
    best = [0] * len(spans)
    if not spans or not path.exists() or all(a["ended"] for a in spans):
        return best
    for rec in read(path):
        t, step = rec.get("t"), rec.get("step")
        if not isinstance(t, (int, float)) or not isinstance(step, int):
            continue
        for i, a in enumerate(spans):
            if not a["ended"] and (a["t_start"] or 0) <= t <= (a["t_end"] or 0) + 5.0:
                best[i] = max(best[i], step)
    return best


def mark_logs(run_dir: str | Path, attempt: int) -> None:
    """A new attempt in a run directory: the processes' logs are appended to, so each existing
    one gets a line saying where the earlier attempts' output ends."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    for log in sorted((Path(run_dir) / "logs").glob("*.log")):
        try:
            with open(log, "a") as fh:
                fh.write(f"==== nonstop: attempt {attempt} of this run directory starts ({stamp})"
                         " ====\n")
        except OSError:
            pass

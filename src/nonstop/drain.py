"""``nonstop drain RUN_DIR --rank R | --node N``: a planned migration of a running job's ranks to
warm spares, asked from outside the job (a request in its run directory, taken by its controller)
and followed in its event log until it is done or refused."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .controller import requests
from .errors import UsageError
from .pids import pid_alive
from .protocol.requests import DrainRequest


def drain(run_dir: str, ranks: tuple[int, ...], node: int | None, why: str,
          timeout_s: float) -> int:
    """0: drained; 1: refused, or abandoned (a fault came first), or no answer in time."""
    root = Path(run_dir)
    log = root / "events.jsonl"
    if not log.is_file():
        raise UsageError(f"{run_dir}: not a run directory (no events.jsonl)")
    start = _last_start(log)
    if start is None or start.get("ended"):
        raise UsageError(f"the job of {run_dir} is not running (its run has ended)")
    pid = start.get("pid")
    if pid is not None and not pid_alive(int(pid)):
        raise UsageError(f"the job of {run_dir} is not running (its launcher, pid {pid}, is gone)")
    offset = log.stat().st_size
    requests.send(root, DrainRequest(ranks=list(ranks), node=node, why=why))
    what = f"node {node}" if node is not None else "rank " + ", ".join(map(str, ranks))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for ev in _new_events(log, offset):
            offset = ev.pop("_end")
            kind = ev.get("type")
            if kind == "drain_refused":
                print(f"nonstop: cannot drain {ev['asked']}: {ev['why']}", file=sys.stderr)
                return 1
            if kind == "drain_done":
                print(f"nonstop: drained {what} (generation {ev['gen']}): training paused "
                      f"{ev['pause_s']:.3f} s")
                return 0
            if kind == "fault" and ev.get("kind") != "peer":
                print(f"nonstop: the drain of {what} was abandoned: a fault came first "
                      f"({ev.get('kind')}: {ev.get('message', '')[:200]})", file=sys.stderr)
                return 1
            if kind in ("run_end", "request_refused"):
                print(f"nonstop: the drain of {what} did not happen ({kind})", file=sys.stderr)
                return 1
        time.sleep(0.05)
    print(f"nonstop: no answer from the job of {run_dir} within {timeout_s:g} s", file=sys.stderr)
    return 1


def _last_start(log: Path) -> dict | None:
    start = None
    for line in log.read_text().splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("type") == "run_start":
            start = ev
        elif ev.get("type") == "run_end" and start is not None:
            start = dict(start, ended=True)
    return start


def _new_events(log: Path, offset: int) -> list[dict]:
    """Whole lines written after ``offset``; each with ``_end``, the offset after it."""
    with open(log, "rb") as f:
        f.seek(offset)
        data = f.read()
    out, pos = [], offset
    for line in data.split(b"\n")[:-1]:  # the last piece is not a whole line yet
        pos += len(line) + 1
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        ev["_end"] = pos
        out.append(ev)
    return out

"""The ranks' steps as they completed: ``<run-dir>/progress.jsonl``, for the goodput account
and the timeline picture.

The controller reads every rank's newest progress record ten times a second; this log keeps a
sample of them - rank 0's every change (its cumulative seconds in steps and in stalls are what
the goodput account splits), the other ranks' at most every ``every_s`` - and always the last
step a rank completed before it stopped stepping, so a lane ends where the rank really stopped.

A line: ``t`` (when the rank completed ``step``, its own clock), ``wid``, ``rank``, ``node``,
``gen``, ``step``, ``busy`` (seconds inside completed steps over the process's life), ``stall``
(seconds between steps on snapshots, digests and checkpoint hand-offs), ``step_s`` (its last
step, stall included).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

from ..protocol import fastjson
from ..protocol.last_step import LastStep
from ..protocol.progress import Progress

FILENAME = "progress.jsonl"
EVERY_S = 0.5  # a rank other than 0 is sampled at most this often while it steps
EVERY_PER_RANK_S = 0.25e-3  # ...in a big job less often: 16,384 ranks every 4 s (sample_every)
FLUSH_S = 1.0  # the file is written at least this often


def sample_every(ranks: int) -> float:
    """How often a rank other than 0 is sampled in a job of ``ranks``."""
    return max(EVERY_S, EVERY_PER_RANK_S * ranks)


class ProgressLog:
    def __init__(self, run_dir: Any = None, every_s: float = EVERY_S):
        self.every_s = every_s
        self.rank0: list[dict[str, Any]] = []  # rank 0's samples, for the live goodput account
        self._last: dict[int, dict[str, Any]] = {}  # wid -> its last sample written
        self._pending: dict[int, dict[str, Any]] = {}  # wid -> a newer one not yet written
        self._buf: list[str] = []
        self._flushed = time.monotonic()
        self._fh = None
        if run_dir is not None:
            try:
                self._fh = open(Path(run_dir) / FILENAME, "a")
            except OSError:
                self._fh = None

    def take(self, wid: int, rank: int, node: int, rec: Progress | LastStep) -> None:
        """A rank's newest progress record, or the last step its agent read once it was gone
        (the same record may come again)."""
        if rec.step is None or rec.t is None:
            return
        sample = {"t": rec.t, "wid": wid, "rank": rank, "node": node, "gen": rec.gen,
                  "step": rec.step, "busy": rec.busy, "stall": rec.stall,
                  "step_s": rec.step_s if isinstance(rec, Progress) else None}
        last, pending = self._last.get(wid), self._pending.get(wid)
        newest = pending or last
        if newest is not None and (newest["gen"], newest["step"]) == (sample["gen"], sample["step"]):
            if pending is not None:  # it stopped stepping: its last step goes on record
                self._write(pending)
            return
        if rank == 0 or last is None or last["gen"] != sample["gen"] \
                or sample["t"] - last["t"] >= self.every_s:
            if pending is not None and pending["gen"] != sample["gen"]:
                self._write(pending)  # the last step of the generation it left
            self._write(sample)
        else:
            self._pending[wid] = sample
        if time.monotonic() - self._flushed >= FLUSH_S:
            self.flush()

    def _write(self, sample: dict[str, Any]) -> None:
        wid = sample["wid"]
        self._pending.pop(wid, None)
        self._last[wid] = sample
        if sample["rank"] == 0:
            self.rank0.append(sample)
        self._buf.append(fastjson.dumps(sample).decode("utf-8", "surrogatepass"))

    def flush(self) -> None:
        self._flushed = time.monotonic()
        if self._fh is None or not self._buf:
            self._buf.clear()
            return
        try:
            self._fh.write("\n".join(self._buf) + "\n")
            self._fh.flush()
        except OSError:
            pass
        self._buf.clear()

    def close(self) -> None:
        for sample in list(self._pending.values()):
            self._write(sample)
        self.flush()
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError:
                pass
            self._fh = None


def read(path: str | Path, t_from: float | None = None, t_to: float | None = None
         ) -> Iterator[dict[str, Any]]:
    """The samples of a log (a run directory or the file), optionally of one time window (an
    attempt's); a torn line is skipped."""
    p = Path(path)
    if p.is_dir():
        p = p / FILENAME
    if not p.is_file():
        return
    with open(p) as fh:
        for line in fh:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(rec, dict):
                continue
            t = rec.get("t")
            if not isinstance(t, (int, float)):
                continue
            if (t_from is not None and t < t_from) or (t_to is not None and t > t_to):
                continue
            yield rec

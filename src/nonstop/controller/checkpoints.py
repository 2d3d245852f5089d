"""The disk checkpoints as the controller sees them: parts reported by the keepers' writers, made
complete by a manifest; or failed, and written again after a back-off; or given up. And what the
console, the event log and the summary say of them.

Any error of the file system counts alike (no space, a quota, no permission, read-only, I/O):
each failed attempt is one ``checkpoint_failed`` event with the detail; the console says a cause
once (then at the 10th, 100th... attempt it failed, at a give-up, and when checkpoints go through
again). The newest complete checkpoint is never at stake (retention deletes only once
a newer one is complete), and a step given up leaves no temporary directory behind.

One step at a time is written again: the newest that failed. A newer step that fails while one
waits for its retry takes its place (the older would be worth nothing once the newer is written),
at the same time and for no extra attempt: the disk had no time to change. Once training is over, a failed checkpoint gets one more attempt, soon, not
the rest of its back-off: the run's end does not wait on a disk that refuses it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import time
from pathlib import Path
from typing import Any, Callable

from ..protocol import keeper_messages as km
from ..protocol.records import plain
from ..state import checkpoint, disk_failure

MANIFEST_PART = -1  # the part to write again when only the step's manifest failed
MAX_BACKOFF_S = 60.0
END_RETRY_S = 1.0  # once training is over, a failed checkpoint is written again once, this soon


class CheckpointsFailing(Exception):
    """``state.checkpoint.on_failure: fail`` and checkpoints cannot be written: the job gives up.
    Its text is the one-line diagnosis."""


@dataclasses.dataclass
class SaveRetry:
    """What to do about one failed attempt."""

    attempt: int  # failed attempts in a row, this one included
    retry_in: float | None  # seconds to the next attempt; None: the step is given up
    dropped: list[int]  # older steps no longer worth writing


class Failures:
    """The retry schedule and the counts, without processes or clocks of its own."""

    def __init__(self, retries: int, backoff_s: float, on_failure: str = "warn",
                 max_consecutive: int = 1):
        self.retries, self.backoff_s = retries, backoff_s
        self.on_failure, self.max_consecutive = on_failure, max_consecutive
        self.target: int | None = None  # the step to write again...
        self.parts: set[int] = set()  # ...these parts of it...
        self.due_at: float | None = None  # ...then (None: not scheduled)
        self.attempts = 0  # failed attempts since a checkpoint was last written
        self.retrying = True  # off once one was given up, until one is written again
        self.finishing = False
        self.end_retried: int | None = None  # the step given its one retry at the end
        self.written: set[int] = set()
        self.lost: set[int] = set()  # steps that failed and will not be written
        self.failed_attempts = 0
        self.given_up = 0
        self.consecutive = 0  # checkpoints given up in a row
        self.causes: collections.Counter[str] = collections.Counter()
        self.last_cause: str | None = None
        self.fatal: str | None = None  # the diagnosis, once on_failure says the job must end

    def failed(self, step: int, part: int, cause: str, now: float, retryable: bool = True,
               where: str | None = None) -> SaveRetry | None:
        """A part of ``step`` (``MANIFEST_PART``: its manifest) was not written, for ``cause``
        (``where``: the same, with the path). None: nothing new to say (a step already settled,
        or another part of the attempt already reported)."""
        if step in self.written or step in self.lost:
            return None
        if self.target is not None and step < self.target:
            self.lost.add(step)  # a newer step is being written again: this one never will be
            return None
        if step == self.target and self.due_at is not None:
            self.parts.add(part)
            return None
        self.failed_attempts += 1
        self.causes[cause] += 1
        self.last_cause = where or cause
        dropped = []
        if self.target is not None and step > self.target:
            dropped.append(self.target)
            self.lost.add(self.target)
            if self.due_at is not None and retryable:
                # The disk had no time to change since: the newer step waits in its place, and
                # costs no attempt (checkpoints queued behind a slow writer fail all at once).
                self.target, self.parts = step, {part}
                return SaveRetry(self.attempts, round(max(0.0, self.due_at - now), 3), dropped)
        self.target, self.parts = step, {part}
        self.attempts += 1
        retry_in = self._retry_in(step) if retryable else None
        if retry_in is None:
            self._give_up(step, where or cause)
        else:
            self.due_at = now + retry_in
        return SaveRetry(self.attempts, retry_in, dropped)

    def _retry_in(self, step: int) -> float | None:
        if not self.retrying or self.attempts > self.retries:
            return None
        delay = min(MAX_BACKOFF_S, self.backoff_s * 2 ** (self.attempts - 1))
        if self.finishing:
            if self.end_retried == step:
                return None
            self.end_retried = step
            delay = min(delay, END_RETRY_S)
        return delay

    def _give_up(self, step: int, cause: str) -> None:
        self.lost.add(step)
        self.target, self.parts, self.due_at = None, set(), None
        self.given_up += 1
        self.consecutive += 1
        self.retrying = False
        if self.on_failure == "fail" and self.consecutive >= self.max_consecutive \
                and not self.fatal:
            what = (f"{self.attempts} attempt(s) in a row failed, the last for step {step}"
                    if self.consecutive == 1 else
                    f"{self.consecutive} checkpoints in a row failed, the last of step {step}")
            self.fatal = (f"checkpoints cannot be written: {cause}; {what} "
                          "(state.checkpoint.on_failure: fail)")

    def written_step(self, step: int) -> list[int]:
        """``step`` is complete on disk; returns the older steps no longer worth writing."""
        self.written.add(step)
        self.lost.discard(step)
        dropped = []
        if self.target is not None and self.target <= step:
            if self.target < step:
                dropped.append(self.target)
                self.lost.add(self.target)
            self.target, self.parts, self.due_at = None, set(), None
        self.attempts = self.consecutive = 0
        self.retrying = True
        return dropped

    def due(self, now: float) -> tuple[int, set[int]] | None:
        """The step and parts to write again now, if their time has come."""
        if self.target is None or self.due_at is None or now < self.due_at:
            return None
        self.due_at = None
        return self.target, set(self.parts)

    def finish(self, now: float) -> None:
        """Training is over: what is still to be written again is, at once or not at all."""
        if self.finishing:
            return
        self.finishing = True
        if self.due_at is not None:
            self.end_retried = self.target
            self.due_at = min(self.due_at, now + END_RETRY_S)

    def settled(self, step: int | None) -> bool:
        return step is None or step in self.written or step in self.lost

    def summary(self) -> dict[str, Any]:
        lost = self.lost | ({self.target} if self.target is not None else set())
        return {"failed": len(lost), "failed_attempts": self.failed_attempts,
                "given_up": self.given_up, "causes": dict(self.causes),
                "last_error": self.last_cause}


def cause_text(message: str | None, errno: str | None, path: str | None,
               root: Any = None) -> tuple[str, str]:
    """(the cause, the cause with where): ``No space left on device``, ``... (/ckpt)``. Where is
    the checkpoint directory, not the file deep in a temporary one that is gone by now."""
    message = message or "unknown error"
    where = root or path
    return message, f"{message} ({where})" if errno and where else message


class DiskCheckpoints:
    """The bookkeeping of one job's disk checkpoints. ``call(node, request)`` asks a node's
    keeper (None: it is gone), ``keeper_log(node)`` is where its traceback goes."""

    def __init__(self, cfg: Any, log: Any, display: Any,
                 call: Callable[[int, km.Request], km.Answer | None],
                 keeper_log: Callable[[int], Path | None]):
        self.root = Path(cfg.dir) if cfg.dir else None
        self.keep = cfg.keep
        self.log, self.display = log, display
        self._call, self._keeper_log = call, keeper_log
        self.pending: dict[int, dict[str, Any]] = {}  # step -> parts written so far
        self.completed: list[int] = []  # steps made complete in this run
        self.failures = Failures(cfg.retries, cfg.retry_backoff_s, cfg.on_failure,
                                 cfg.max_consecutive_failures)
        # (step, rank) -> the node and the part that failed there
        self.failed_parts: dict[tuple[int, int], tuple[int, km.DiskPart]] = {}
        self._said: dict[str, int] = {}  # a failure's cause -> attempts failed so since said
        self._fatal_raised = False
        self.waiting = False  # inside a wait: a give-up is raised in the controller's loop only
        self._warming = False

    def expect_dtensors(self) -> None:
        """The job's state is sharded over a mesh: each manifest gets DCP's metadata of the
        whole, made with torch. torch loads now, on a thread, not in the controller's loop at
        the first checkpoint (seconds, on a busy host); a job of plain tensors never loads it."""
        if self.root is not None and not self._warming:
            self._warming = True
            checkpoint.warm_in_background()

    # == parts and manifests ======================================================================
    def part_done(self, job: km.DiskPart, part: km.PartWritten, node: int) -> None:
        step = job.step
        entry = self.pending.setdefault(step, {"parts": {}, "world": job.world,
                                               "sharded": job.sharded, "reason": job.reason,
                                               "sources": {}, "root": job.root})
        entry["parts"][job.rank] = plain(part)  # as the manifest holds it
        entry["sources"][str(job.rank)] = f"{job.holder} on node {node}"
        needed = entry["world"] if entry["sharded"] else 1
        if len(entry["parts"]) >= needed:
            self._finalize(step)  # even one given up meanwhile: a complete checkpoint is no waste
        elif step in self.failures.lost:  # given up, and its other parts never will come
            self._abandon(step)

    def _finalize(self, step: int) -> None:
        entry = self.pending[step]
        root = Path(entry["root"])
        t0 = time.time()
        try:
            checkpoint.finalize(root, step, entry["parts"], world=entry["world"],
                                sharded=entry["sharded"],
                                extra={"reason": entry["reason"], "sources": entry["sources"]})
        except FileExistsError:  # that step is on disk already (a periodic one, then an emergency)
            del self.pending[step]
            checkpoint.clean_temp(root, below_step=step + 1)
            self.completed.append(step)
            self._written(step)
            return
        except (OSError, ValueError, checkpoint.CorruptCheckpoint) as exc:
            self._manifest_failed(step, exc)  # the parts stay: only the manifest is retried
            return
        del self.pending[step]
        try:  # only now that a newer one is complete may an older one go
            removed = checkpoint.retain(root, self.keep)
            checkpoint.clean_temp(root, below_step=step)
        except OSError as exc:
            removed = []
            self.log.write("checkpoint_retention_failed", step=step, error=str(exc))
        self.completed.append(step)
        self._written(step)
        parts = entry["parts"].values()
        self.log.write("checkpoint", step=step, reason=entry["reason"], dir=str(root),
                       parts=len(entry["parts"]), bytes=sum(p.get("bytes", 0) for p in parts),
                       write_s=round(max(p.get("seconds", 0.0) for p in parts), 6),
                       finalize_s=round(time.time() - t0, 6), sources=entry["sources"],
                       removed=removed)

    def settled(self, step: int | None) -> bool:
        """Whether the checkpoint of ``step`` is complete or given up (None: nothing awaited).
        Asked only once the ranks are done: from then on a failed write gets a short effort."""
        self.failures.finish(time.time())
        return step is None or step in self.completed or self.failures.settled(step)

    # == failures =================================================================================
    def part_failed(self, node: int, ev: km.PartFailed) -> None:
        job = ev.job
        step, rank = job.step, job.rank
        self._keep_traceback(node, step, rank, ev.traceback)
        short, full = cause_text(ev.message or ev.error, ev.errno, ev.path, job.root)
        self.failed_parts[(step, rank)] = (node, job)
        self._attempt_failed(step, rank, short, full, retryable=ev.retryable,
                             detail={"rank": rank, "node": node, "reason": job.reason,
                                     "errno": ev.errno, "path": ev.path, "error": ev.error,
                                     "need": ev.need})

    def _manifest_failed(self, step: int, exc: BaseException) -> None:
        root = self.pending[step]["root"]
        cause = disk_failure.failure_cause(exc, Path(root))
        short, full = cause_text(cause["message"], cause["errno"], cause["path"], root)
        self._attempt_failed(step, MANIFEST_PART, short, full,
                             retryable=isinstance(exc, OSError),
                             detail={"part": "manifest", "errno": cause["errno"],
                                     "path": cause["path"],
                                     "error": f"{type(exc).__name__}: {exc}"[:2000]})

    def _attempt_failed(self, step: int, part: int, short: str, full: str, retryable: bool,
                        detail: dict[str, Any]) -> None:
        verdict = self.failures.failed(step, part, short, time.time(), retryable, full)
        outcome = ("reported" if verdict is None else
                   "given up" if verdict.retry_in is None else "retrying")
        self.log.write("checkpoint_failed", step=step, message=short, outcome=outcome,
                       attempt=verdict.attempt if verdict else self.failures.attempts,
                       retry_in_s=verdict.retry_in if verdict else None, **detail)
        if verdict is None:
            if self.failures.settled(step):  # a late part of a step settled: leave nothing
                self._abandon(step)
            return
        for old in verdict.dropped:
            self._abandon(old, f"superseded by step {step}")
        line = f"checkpoint of step {step} not written: {full}; "
        if verdict.retry_in is not None:
            # the same cause again (a disk that stays full): said once, then counted - said
            # again at the 10th, 100th... attempt, and when a checkpoint goes through again
            n = self._said[short] = self._said.get(short, 0) + 1
            if n > 1 and not math.log10(n).is_integer():
                return
            line += f"retrying in {verdict.retry_in:.2g} s"
            if n > 1:
                line += f" ({n} attempts have failed so)"
        else:
            self._abandon(step, "given up")
            newest = self._newest_complete()
            line += (f"given up after {verdict.attempt} failed attempts in a row"
                     if verdict.attempt > 1 else "given up")
            line += (f" (newest complete: step {newest})" if newest is not None else
                     " (no complete checkpoint)")
        self.display.info(line)

    def _abandon(self, step: int, why: str | None = None) -> None:
        """No more attempts at ``step``: free what is kept for it, remove what it left on disk."""
        self.pending.pop(step, None)
        for key in [k for k in self.failed_parts if k[0] == step]:
            node, job = self.failed_parts.pop(key)
            self._call(node, km.Forget(holder=job.holder, step=step))
        if self.root is not None:
            with contextlib.suppress(OSError):
                checkpoint.clean_temp(self.root, step=step)
        if why is not None:
            self.log.write("checkpoint_abandoned", step=step, why=why)

    def unwritable(self, step: int, why: str) -> None:
        """The checkpoint of ``step`` can no longer be written (a part's node lost its memory):
        given up now, said once."""
        if self.failures.settled(step):
            return
        self.failures.lost.add(step)
        self._abandon(step, why)
        self.log.write("checkpoint_failed", step=step, message=why, outcome="given up",
                       attempt=self.failures.attempts, retry_in_s=None)
        newest = self._newest_complete()
        self.display.info(f"checkpoint of step {step} not written: {why}; given up"
                          + (f" (newest complete: step {newest})" if newest is not None else
                             " (no complete checkpoint)"))

    def _written(self, step: int) -> None:
        if self._said:
            causes = ", ".join(f"{c}: {n} attempt(s)" for c, n in self._said.items())
            self.display.info(f"checkpoint of step {step} written: checkpoints go through "
                              f"again (failed before: {causes})")
            self._said.clear()
        for key in [k for k in self.failed_parts if k[0] == step]:
            del self.failed_parts[key]
        for old in self.failures.written_step(step):
            self._abandon(old, f"step {step} is complete")

    def retry_due(self) -> None:
        """Write again what is due."""
        due = self.failures.due(time.time())
        if due is None:
            return
        step, parts = due
        for part in sorted(parts):
            if part == MANIFEST_PART:
                if step in self.pending:
                    self._finalize(step)
                continue
            node, job = self.failed_parts[(step, part)]
            if self._call(node, km.Persist(part=job, again=True)) is None:
                self.part_failed(node, km.PartFailed(
                    job=job, retryable=False, error=f"the node memory of node {node} is gone"))

    def check_fatal(self) -> None:
        """Raise CheckpointsFailing once, when the policy says the job must end for them."""
        if self.failures.fatal and not self._fatal_raised and not self.waiting:
            self._fatal_raised = True
            raise CheckpointsFailing(self.failures.fatal)

    def _keep_traceback(self, node: int | None, step: Any, rank: Any, text: str | None) -> None:
        """Into the keeper's log file only: the console has its one line."""
        path = self._keeper_log(node) if node is not None else None
        if not text or path is None:
            return
        with contextlib.suppress(OSError), open(path, "a") as fh:
            fh.write(f"checkpoint of step {step}, part {rank}, not written:\n{text}\n")

    def _newest_complete(self) -> int | None:
        if self.root is None:
            return None
        try:
            steps = checkpoint.complete_steps(self.root)
        except OSError:
            return None
        return steps[0] if steps else None

    def clean_up(self) -> None:
        """Every process has ended, so nothing is being written: no temporary directory stays
        (a write cut short by the end, or by giving up)."""
        if self.root is not None:
            with contextlib.suppress(OSError):
                checkpoint.clean_temp(self.root)

    def summary(self) -> dict[str, Any] | None:
        if self.root is None:
            return None
        return {"written": len(self.completed), **self.failures.summary(),
                "newest_complete": self._newest_complete()}

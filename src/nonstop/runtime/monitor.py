"""Background threads of a rank process: the abort watcher and the progress publisher.

The training loop only stores a few numbers per step; these threads do the store round trips, so
progress reporting costs the step path next to nothing and an abort reaches a rank blocked anywhere.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

import nonstop.protocol as protocol
from ..protocol import events, last_step, progress
from ..protocol.progress import SnapshotNumbers

if TYPE_CHECKING:
    from .pg import GenerationGroup

PUBLISH_INTERVAL_S = 0.05  # progress is published at most this often...
HEARTBEAT_S = 0.2  # ...and at least this often: a silent rank is frozen
TRAFFIC_EVERY_S = 0.1  # the group's sockets are read at most this often
# ...and, once a rank has stepped, only in a step that has run this long (and twice its last
# step's time): a step that long may be a slow link, which its moving data tells from a hang
LONG_STEP_S = 0.25
_TORCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__import__("torch").__file__))) + \
    os.sep + "torch" + os.sep
_RUNTIME_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class DeviceValue:
    """A number on the GPU (a loss), readable from another thread without waiting for the GPU:
    copied to the host behind the step's work, read once that copy has ended. The publisher
    must never wait on the GPU: a step stuck in an NCCL collective (a frozen peer) would stop
    its heartbeats, and the rank would be taken for frozen itself."""

    __slots__ = ("_host", "_ready")

    def __init__(self, value: Any):
        import torch

        self._host = value.detach().to("cpu", non_blocking=True)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def get(self) -> float | None:
        """The number, or None while it is still on its way (or the GPU failed)."""
        try:
            return float(self._host) if self._ready.query() else None
        except Exception:  # noqa: BLE001 - a broken CUDA context: no loss to show
            return None


def _readable(loss: Any) -> Any:
    """What the publisher may read of a reported loss: a GPU tensor becomes a DeviceValue."""
    if getattr(loss, "is_cuda", False):
        try:
            return DeviceValue(loss)
        except Exception:  # noqa: BLE001 - the step's own CUDA calls will report it
            return None
    return loss


def _loss_value(loss: Any) -> float | str | None:
    """A reported loss as the progress record holds it: a number, or "nan"/"inf"/"-inf" (JSON
    has no NaN), or None (none reported, or one that cannot be read)."""
    if loss is None:
        return None
    if isinstance(loss, DeviceValue):
        loss = loss.get()
    try:
        value = float(loss)
    except Exception:  # noqa: BLE001 - a loss we cannot read is not worth a crash
        return None
    return value if math.isfinite(value) else str(value)


class Runtime(Protocol):
    """What the monitor needs of its rank's runtime (``worker.WorkerRuntime``)."""

    worker_id: int

    @property
    def store(self) -> Any:
        """This thread's connection to the agent's store."""

    def reconnect(self, exc: BaseException) -> None:
        """This thread's store connection failed: a new one."""

    def emit(self, event: events.RankEvent) -> None:
        """Report an event to the controller."""


class Monitor:
    def __init__(self, rt: Runtime):
        self._rt = rt
        self._lock = threading.Lock()
        self._gen: int | None = None
        self._group: "GenerationGroup | None" = None
        self._aborted: set[int] = set()
        self.regroup: int | None = None  # the generation to leave at the next step boundary
        self._changed = threading.Event()
        # progress, written by the main thread
        self._progress: dict[str, Any] | None = None
        self._first_step: events.FirstStep | None = None
        self._last_publish = 0.0
        self._wake = threading.Event()
        self._started = False
        self._main_ident = threading.main_thread().ident
        self._max_step_s = 0.0  # slowest step since the last publish
        self._compute: float | None = None  # forward time per step, smoothed
        self._paused: str | None = None
        # Progress outside ctx.steps (see mark()): written by the main thread.
        self.in_steps = False  # inside a ctx.steps loop: its steps are the progress
        self.steps_seen = False  # a ctx.steps loop has started in this process
        self.stepless = False  # this process's training function runs without ctx.steps
        self._stepped_gen: int | None = None  # the generation whose first progress was published
        self._mark_gen: int | None = None
        self._marks = 0  # report/progress() marks outside ctx.steps in _mark_gen
        self._t_mark: float | None = None  # monotonic time of the previous progress mark
        self._life: tuple[int, float] | None = None  # (gen, time) of the last sign of life
        # (gen, bytes, when): what the group had moved at the last look
        self._traffic: tuple[int, int, float] | None = None
        self._t_traffic = 0.0
        # the last step completed, where the agent reads it once this process is gone
        self._last_step = last_step.Writer(os.environ.get(last_step.ENV))

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        # Each thread opens its store connection before we return, so no socket of ours appears
        # while a generation's group is being formed (an abort then shuts every new socket).
        ready = [threading.Event(), threading.Event()]
        threading.Thread(target=self._watch_aborts, args=(ready[0],), name="nonstop-abort-watcher",
                         daemon=True).start()
        threading.Thread(target=self._publish, args=(ready[1],), name="nonstop-progress",
                         daemon=True).start()
        for event in ready:
            event.wait(60)

    # -- generation ---------------------------------------------------------------------------
    def begin(self, gen: int, group: "GenerationGroup") -> None:
        self.start()
        with self._lock:
            self._gen, self._group = gen, group
        self._changed.set()

    def end(self) -> None:
        with self._lock:
            gen, self._gen, self._group = self._gen, None, None
        self._changed.set()
        if gen is not None:  # wake the watcher, blocked on this generation's key
            self._rt.store.set(protocol.abort_key(gen, self._rt.worker_id), protocol.SELF_WAKE)

    def aborted(self, gen: int) -> bool:
        with self._lock:
            return gen in self._aborted

    def void_step(self) -> bool:
        """Whether the step that just ended on the CPU cannot count: its generation's NCCL
        communicators were aborted, and an aborted NCCL collective returns no error."""
        group = self._group
        return group is not None and group.nccl and self.current_aborted()

    def current_aborted(self) -> bool:
        """Whether the generation this rank is in has been aborted (cheap: no store access)."""
        gen = self._gen
        return gen is not None and gen in self._aborted

    def _watch_aborts(self, ready: threading.Event) -> None:
        self._rt.store  # noqa: B018 - open this thread's own connection now
        ready.set()
        while True:
            with self._lock:
                gen = self._gen
            if gen is None or self.aborted(gen):
                self._changed.wait(60)
                self._changed.clear()
                continue
            key = protocol.abort_key(gen, self._rt.worker_id)
            try:
                self._rt.store.wait([key], datetime.timedelta(hours=1))
                value = self._rt.store.get(key)
            except Exception as exc:  # noqa: BLE001
                if "timeout" not in str(exc).lower():
                    self._rt.reconnect(exc)
                continue
            if value == protocol.REGROUP:
                value = self._await_abort(gen, key)
            with self._lock:
                if self._gen != gen or value != protocol.ABORT:
                    continue
                self._aborted.add(gen)
                group = self._group
            if group is not None:
                group.abort()

    REGROUP_POLL_S = 0.01

    def _await_abort(self, gen: int, key: str) -> bytes | None:
        """Asked to leave ``gen`` at the next step boundary: the training loop does (see
        ``regroup_due``); should the controller find that too slow, the key turns to abort."""
        self.regroup = gen
        while True:
            with self._lock:
                if self._gen != gen:
                    return None
            value = self._rt.store.get(key)
            if value != protocol.REGROUP:
                return value
            time.sleep(self.REGROUP_POLL_S)

    def regroup_due(self) -> bool:
        """Whether this rank should leave its generation now, at a step boundary (cheap)."""
        return self.regroup is not None and self.regroup == self._gen

    # -- progress -----------------------------------------------------------------------------
    def record_step(self, gen: int, rank: int, step: int, busy: float, step_s: float,
                    compute_s: float, loss: Any = None, first: bool = False,
                    stall: float = 0.0) -> None:
        """Called by the training loop after each step: stores numbers, wakes the publisher only
        when it is due (or for a generation's first step, published at once)."""
        now = time.time()
        group = self._group
        if group is not None and group.nccl:
            group.mark_step(step)
        self._max_step_s = max(self._max_step_s, step_s)
        self._compute = compute_s if self._compute is None else 0.8 * self._compute + 0.2 * compute_s
        self._progress = {"gen": gen, "rank": rank, "step": step, "t": now, "loss": _readable(loss),
                          "busy": busy, "stall": stall, "step_s": step_s}
        self._last_step.write(gen, step, now, busy, stall)
        if first:
            self._stepped_gen = gen
            self._first_step = events.FirstStep(gen=gen, rank=rank, step=step, t=now)
            self._wake.set()
        elif now - self._last_publish >= PUBLISH_INTERVAL_S:
            self._wake.set()

    def mark(self, source: str, step: int) -> None:
        """Progress seen outside a ctx.steps loop: a reported loss ("report"), ``ctx.progress()``
        ("progress") or an optimizer step of a registered optimizer ("optimizer").

        Until the process is known to run without ctx.steps a mark is only a sign of life (it
        keeps a rank that has not completed a step from being taken for hung): a loss reported
        before the loop starts is no evidence. The evidence is an optimizer step outside the loop,
        a second report or progress() outside it in one generation, or the function returning
        without it (``returned``). From then on marks are this rank's steps: the first one of a
        generation is published at once, and the gaps between them tune the hang timeout."""
        gen = self._gen
        if self.in_steps or gen is None:
            return
        now = time.time()
        self._life = (gen, now)
        if self._mark_gen != gen:
            self._mark_gen, self._marks, self._t_mark = gen, 0, None
        self._marks += 1
        evidence = source == "optimizer" or self._marks >= 2
        if evidence and not self.stepless and not self.steps_seen:
            self._no_steps(source)
        if not self.stepless:
            return
        mono = time.monotonic()
        if self._t_mark is not None:
            self._max_step_s = max(self._max_step_s, mono - self._t_mark)
        self._t_mark = mono
        rt = self._rt
        self._progress = {"gen": gen, "rank": rt.rank, "step": step, "t": now,
                          "loss": _readable(rt.last_loss)}
        self._last_step.write(gen, step, now, math.nan, math.nan)
        if self._stepped_gen != gen:
            self._stepped_gen = gen
            self._first_step = events.FirstStep(gen=gen, rank=rt.rank, step=step, t=now,
                                                steps=False, via=source)
            self._wake.set()
        elif now - self._last_publish >= PUBLISH_INTERVAL_S:
            self._wake.set()

    def returned(self) -> None:
        """The training function returned: without having started ctx.steps, that settles it."""
        if not self.steps_seen and not self.stepless:
            self._no_steps("returned")

    def _no_steps(self, via: str) -> None:
        self.stepless = True
        rt = self._rt
        rt.emit(events.NoSteps(gen=self._gen, rank=rt.rank, via=via, registered=rt.registered,
                               function=getattr(rt, "function_name", None),
                               faults=[f.describe() for f in rt.injector.need_steps(rt.registered)]))

    def pause(self, label: str | None) -> None:
        """Mark the rank as busy with something long that is not a step (None: done)."""
        self._paused = label
        self._wake.set()

    def _where(self) -> tuple[str, str]:
        """Where the main thread is: "torch" (inside torch: a collective, a kernel), "nonstop"
        (waiting in the runtime), or "python" (the user's own code); and file:line."""
        frame = sys._current_frames().get(self._main_ident)
        if frame is None:
            return "", ""
        path = frame.f_code.co_filename
        location = f"{os.path.basename(path)}:{frame.f_lineno} in {frame.f_code.co_name}"
        if path.startswith(_TORCH_DIR):
            return "torch", location
        if path.startswith(_RUNTIME_DIR):
            return "nonstop", location
        return "python", location

    def _publish(self, ready: threading.Event) -> None:
        rt = self._rt
        rt.store  # noqa: B018 - open this thread's own connection now
        ready.set()
        pid = os.getpid()
        place, since = "", time.time()
        while True:
            self._wake.wait(HEARTBEAT_S)
            self._wake.clear()
            first, self._first_step = self._first_step, None
            if first is not None:
                rt.emit(first)
            now = time.time()
            where, location = self._where()
            if location != place:
                place, since = location, now
            max_step_s, self._max_step_s = self._max_step_s, 0.0
            if now - self._t_traffic >= TRAFFIC_EVERY_S:
                self._t_traffic = now
                self._sample_traffic(now)
            life = self._life
            snaps = rt.snapshots
            snap = SnapshotNumbers(every=snaps.every, cost_s=snaps.cost_s, step_s=snaps.step_s,
                                   last=snaps.last_step, repl_s=snaps.repl_s) \
                if snaps is not None and snaps.taken else None
            steps = dict(self._progress or {})
            steps["loss"] = _loss_value(steps.get("loss"))
            record = progress.Progress(
                hb=now, pid=pid, where=where, loc=location, same_s=round(now - since, 3),
                paused=self._paused, max_step_s=max_step_s, compute_s=self._compute,
                life_gen=life[0] if life is not None else None,
                t_life=life[1] if life is not None else None, snap=snap, **steps)
            self._last_publish = now
            try:
                rt.store.set(protocol.progress_key(rt.worker_id),
                             protocol.dumps(progress.encode(record)))
            except Exception as exc:  # noqa: BLE001
                rt.reconnect(exc)
                time.sleep(HEARTBEAT_S)

    def _sample_traffic(self, now: float) -> None:
        """A sign of life from the collectives themselves: the generation's group moved data
        since the last look (the kernel's counters of gloo's connections; a heartbeat or a store
        round trip never touches them; NCCL's traffic is not on them). Read only while it is
        needed - before the generation's first step, in a function without ctx.steps, or in a
        step that runs long (a link that slowed, or a hang: only the first moves data) - since a
        large group has a socket per peer."""
        with self._lock:
            gen, group = self._gen, self._group
        if gen is None or group is None:
            return
        since = 0.0  # the look before must be from this wait: a step's own traffic is no sign
        if self._stepped_gen == gen and not self.stepless:
            last_step = self._progress
            if last_step is None or last_step["gen"] != gen:
                return
            since = last_step["t"]
            if now - since < max(LONG_STEP_S, 2 * (last_step["step_s"] or 0.0)):
                return
        moved = group.traffic()
        if moved is None:
            return
        last = self._traffic
        self._traffic = (gen, moved, now)
        if last is not None and last[0] == gen and last[2] >= since and moved != last[1]:
            self._life = (gen, now)

"""The controller's table of worker processes: their records, the warm spare pool, mailboxes,
kills, and what the workers report (events, progress), through the job's mail (``mail.py``)."""

from __future__ import annotations

import dataclasses
import signal
import time
from typing import Any, Callable, Iterator, Mapping

from .. import protocol
from ..agent.agent import Proc
from .ports import Processes
from ..observe.events import EventLog
from ..protocol import progress
from ..protocol.last_step import LastStep
from ..protocol.progress import Progress
from ..protocol import events
from .observations import RankSeen

DUMP_GRACE_S = 0.3  # between asking a stuck process for its stacks and killing it


# the fields of a worker that what the state machine sees of it is made of (controller._seen)
SEEN_FIELDS = frozenset({"node", "dead", "joining", "entered", "left", "done", "retry_step",
                         "retry_loss", "warm_gen", "hb", "where", "loc", "same_s"})

_CHANGES = [0]  # Worker.changes()


@dataclasses.dataclass
class Worker:
    """What the controller knows of one process (a rank, or a warm spare)."""

    wid: int
    spare: bool
    node: int = 0  # the node (on one machine: the agent group) the process runs on
    seq: int = 0  # next mailbox slot
    rank: int | None = None
    ready: bool = False
    dead: bool = False
    killed: bool = False  # ended by nonstop: its exit is not a new fault
    wrapped: bool = False
    joining: int = -1  # newest generation it started to join
    entered: int = -1
    left: int = -1
    done: int = -1
    step: int | None = None
    step_gen: int = -1
    t_step: float = 0.0
    loss: float | None = None
    busy: float = 0.0
    first_gen: int = -1  # newest generation in which it completed a step
    t_first: float = 0.0
    first_step: int | None = None  # the step its first step of that generation completed
    entered_ev: events.EnteredGeneration | None = None
    exit_report: events.Exiting | None = None  # its last words
    hb: float = 0.0  # the last heartbeat of its background thread
    where: str = ""  # its main thread: "torch", "nonstop", "python"
    loc: str = ""  # file:line in function
    same_s: float = 0.0  # how long its main thread had been at loc
    paused: str | None = None  # busy with something long that is not a step
    compute_s: float | None = None  # forward time per step, smoothed
    retry_step: int | None = None  # the step it asks to retry (non-finite gradients)
    retry_loss: Any = None
    warm_gen: int = -1  # the generation it was already running for when published
    # a process of a sharded job set aside by a scale-in: it built its part at its position in a
    # replica group, (position, the group's size), and can take only a rank at that position
    home: tuple[int, int] | None = None
    # what the state machine last saw of it (controller._seen), and under which (rank, gen,
    # stopped while forming): a write to a field it is made of (SEEN_FIELDS) drops it, so a
    # job of 16,384 ranks rebuilds only the records that changed since the last look
    seen: Any = dataclasses.field(default=None, repr=False, compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in SEEN_FIELDS:
            object.__setattr__(self, "seen", None)
            _CHANGES[0] += 1

    @staticmethod
    def changes() -> int:
        """How many times a field the machine sees of any worker was written (in this process):
        the same count twice, and no worker's view changed in between."""
        return _CHANGES[0]

    def take_event(self, ev: events.RankEvent) -> None:
        """What its own event says of it: the record only (what it means for the job is the
        controller's). Events about a generation are taken only for its current one."""
        match ev:
            case events.Ready():
                self.ready = True
            case events.Wrapped():
                self.wrapped = True
            case events.Joining(gen=gen):
                self.joining = max(self.joining, gen)
            case events.Exiting():
                self.exit_report = ev
            case events.EnteredGeneration(gen=gen):
                self.entered, self.entered_ev, self.joining = gen, ev, max(self.joining, gen)
                self.step, self.step_gen, self.t_step = ev.step, gen, ev.t
            case events.FirstStep(gen=gen):
                self.step, self.step_gen, self.t_step = ev.step, gen, ev.t
                self.first_gen, self.t_first, self.first_step = gen, ev.t, ev.step
            case events.LeftGeneration(gen=gen, step=step):
                self.left = gen
                # it may have completed a step it had not published yet
                if self.step_gen != gen or step > (self.step or 0):
                    self.step, self.step_gen = step, gen
            case events.NanFound():
                self.retry_step, self.retry_loss = ev.step, ev.output
            case events.Done(gen=gen):
                self.done, self.busy, self.step = gen, ev.busy, ev.step

    def take_progress(self, rec: Progress | LastStep, gen: int) -> int:
        """A progress record it published (or the last step its agent read once it was gone);
        returns the step it reports for ``gen`` (else 0)."""
        # (written past __setattr__: none of these is in what the machine sees, and 16,384 ranks
        # report every second)
        d = self.__dict__
        step = rec.step if rec.gen == gen else None
        if step is not None and rec.t is not None and \
                (self.step_gen != gen or step >= (self.step or 0)):
            d["step"], d["step_gen"], d["t_step"] = step, gen, rec.t
        if isinstance(rec, Progress):
            d["loss"] = rec.loss if isinstance(rec.loss, (int, float)) else None
        if rec.busy is not None:
            d["busy"] = rec.busy
        return step or 0

    def take_liveness(self, hb: float, where: str, loc: str, same_s: float,
                      paused: str | None) -> None:
        """Its heartbeat and where its main thread is; what the machine saw of it is dropped
        only when that changed."""
        d = self.__dict__
        if (bool(hb), where, loc, same_s) != (bool(self.hb), self.where, self.loc, self.same_s):
            d["seen"] = None
            _CHANGES[0] += 1
        d["hb"], d["where"], d["loc"], d["same_s"], d["paused"] = hb, where, loc, same_s, paused


class WorkerTable:
    def __init__(self, agent: Processes, mail: Any, log: EventLog, spare_mode: str,
                 keeper_of: Any = None):
        self.agent, self.mail, self.log = agent, mail, log
        self.keeper_of = keeper_of  # node -> the name of its keeper (its memory), if any
        self.spare_mode = spare_mode  # "script": spares run the script up to nonstop.wrap
        self.workers: dict[int, Worker] = {}
        self.spare_failures = 0  # spares lost in a row
        self._pending_kills: list[tuple[float, int]] = []
        self.refused: list[str] = []  # events refused since the controller last looked
        self._refused_from: set[int | None] = set()  # processes whose events were refused
        self._hints: dict[str, int] = {}  # where some_rank last found a rank, by what it asks
        self._progress: dict[int, tuple[Any, Progress]] = {}  # wid -> its newest record, decoded
        self._view: tuple[Any, dict[int, int], tuple[RankSeen, ...]] | None = None  # ranks_seen

    def ranks_seen(self, plan: Mapping[int, int], gen: int,
                   rendezvous: bool) -> tuple[RankSeen, ...]:
        """Every rank of ``plan`` as the state machine sees it in generation ``gen``. The same
        workers, plan and generation as at the last look: the same view (several looks a
        recovery, each 10 ms at 16,384 ranks); else a worker's record is made again only if it
        changed. Not kept while a generation forms (``rendezvous``): whether a joining rank's
        process is stopped is the kernel's, asked at each look."""
        key = (Worker.changes(), gen)
        view = self._view
        if view is not None and not rendezvous and view[0] == key and view[1] == plan:
            return view[2]
        ranks = []
        workers, stopped = self.workers, self.agent.stopped
        for rank, wid in sorted(plan.items()):
            w = workers[wid]
            # whether the kernel has it stopped is asked only while it forms a group
            st = rendezvous and not w.dead and w.joining >= gen > w.entered and stopped(wid)
            warm = w.warm_gen == gen
            cached = w.seen
            if cached is not None and cached[0] == (rank, warm, st):
                ranks.append(cached[1])
                continue
            # (by position: a view of 16,384 ranks is made whole after a teardown)
            r = RankSeen(rank, wid, w.node, w.dead, w.joining, w.entered, w.left, w.done,
                         w.retry_step, w.retry_loss, warm, st,
                         w.same_s if w.hb and w.where == "python" else 0.0, w.loc)
            w.__dict__["seen"] = ((rank, warm, st), r)  # (past __setattr__: not a change)
            ranks.append(r)
        seen = tuple(ranks)
        self._view = None if rendezvous else (key, dict(plan), seen)
        return seen

    def some_rank(self, what: str, plan: Mapping[int, int], pred: Callable[[Worker], bool]) -> bool:
        """Whether ``pred`` holds for some rank of the plan, looked for from the rank where the
        last look for ``what`` found one: asked after every batch of events while thousands of
        ranks report one by one, this stays about one test per rank in all, not one per rank
        per batch."""
        wids = list(plan.values())
        if not wids:
            return False
        start = self._hints.get(what, 0) % len(wids)
        for i in range(len(wids)):
            k = (start + i) % len(wids)
            if pred(self.workers[wids[k]]):
                self._hints[what] = k
                return True
        return False

    def new(self, spare: bool, node: int = 0) -> Worker:
        w = Worker(wid=self.agent.new_wid(), spare=spare, node=node)
        self.workers[w.wid] = w
        return w

    def spawn(self, w: Worker) -> Proc:
        # a rank's process runs the script once its rank is known (see bootstrap)
        mode = self.spare_mode if w.spare else "rank"
        proc = self.agent.spawn(w.wid, spare=w.spare, spare_mode=mode, node=w.node,
                                keeper=self.keeper_of(w.node) if self.keeper_of else None)
        self.log.write("spawn", wid=w.wid, pid=proc.pid, spare=w.spare, rank=w.rank, node=w.node,
                       mode=mode)
        return proc

    def status(self, plan: dict[int, int]) -> dict[str, Any]:
        """The ranks and spares as the live display shows them."""
        spares = self.spares()
        return {"ranks": [{"rank": r, "wid": wid, "step": self.workers[wid].step,
                           "loss": self.workers[wid].loss, "alive": not self.workers[wid].dead}
                          for r, wid in sorted(plan.items())],
                "spares": len(spares), "spares_ready": sum(w.ready for w in spares)}

    def spares(self, node: int | None = None) -> list[Worker]:
        return [w for w in self.workers.values()
                if w.spare and not w.dead and (node is None or w.node == node)]

    def refill(self, targets: dict[int, int], failure_budget: int) -> None:
        """Start spares until each node has its target number (nodes not listed get none)."""
        have: dict[int, int] = {}  # counted once, not once per node (a job of 2,048 nodes)
        for w in self.spares():
            have[w.node] = have.get(w.node, 0) + 1
        for node, target in sorted(targets.items()):
            while have.get(node, 0) < target and self.spare_failures <= failure_budget:
                w = self.new(spare=True, node=node)
                self.spawn(w)
                if w.spare and not w.dead:
                    have[node] = have.get(node, 0) + 1

    def take_spare(self, node: int, only: bool = False, avoid: set[int] | None = None,
                   rank: int | None = None) -> Worker | None:
        """A spare for rank ``rank`` that goes to ``node``: one on that node, else (unless
        ``only``) one on another node not in ``avoid``; ready ones first, oldest first. A spare
        that holds a part of a sharded job (``home``) is taken only for a rank at its position,
        and before the others there (its part is already built)."""
        def fits(w: Worker) -> bool:
            return w.home is None or (rank is not None and rank % w.home[1] == w.home[0])

        def key(w: Worker) -> tuple:
            return (w.home is None, not w.ready, w.wid)

        mine = sorted((w for w in self.spares(node) if fits(w)), key=key)
        if mine or only:
            return mine[0] if mine else None
        others = sorted((w for w in self.spares() if w.node not in (avoid or set()) and fits(w)),
                        key=key)
        return others[0] if others else None

    def send(self, w: Worker, msg: protocol.Mail) -> None:
        self.send_record(w, protocol.mail_record(msg))

    def send_record(self, w: Worker, rec: dict[str, Any]) -> None:
        """A message already made a record (``protocol.mail_record``)."""
        self.mail.send(w.wid, w.seq, rec)
        w.seq += 1

    def kill(self, w: Worker, why: str, dump: bool = False) -> None:
        """End a worker. With ``dump``, it first writes every thread's Python stack to its log
        (where was it stuck?) and is SIGKILLed a moment later; its rank moves on at once."""
        if w.dead:
            return
        w.dead = w.killed = True
        if dump:
            self.agent.signal(w.wid, signal.SIGUSR1)
            self._pending_kills.append((time.time() + DUMP_GRACE_S, w.wid))
        else:
            self.agent.signal(w.wid, signal.SIGKILL)
        self.log.write("kill", wid=w.wid, rank=w.rank, reason=why,
                       stacks=str(self.agent.procs[w.wid].log_path) if dump else None)

    def kill_due(self, now: float) -> None:
        due = [wid for t, wid in self._pending_kills if t <= now]
        self._pending_kills = [k for k in self._pending_kills if k[0] > now]
        for wid in due:
            self.agent.signal(wid, signal.SIGKILL)

    def read_events(self) -> Iterator[events.RankEvent]:
        """The workers' new events, in the order they were written, decoded; those of a process
        of this job that are ``logged`` are written to the event log as they came (a replayed
        one is in the log of the controller before). One that is not a rank event as this
        version of nonstop writes it (a process of another version, a bug) is refused here:
        logged (``event_refused``), said once per process (``refused``), and passed over - what
        it would have told is then waited for until its deadline, as if it had been lost."""
        for raw in self.mail.events():
            try:
                ev = events.decode(raw)
            except events.BadEvent as exc:
                self._refuse(raw, str(exc))
                continue
            if ev.logged and not ev.replay and ev.wid in self.workers:
                self.log.write_record("rank_" + ev.type, raw)
            yield ev

    def _refuse(self, raw: Any, why: str, what: str = "an event") -> None:
        wid = raw.get("wid") if isinstance(raw, dict) else None
        wid = wid if type(wid) is int else None
        self.log.write("event_refused", wid=wid, error=why, event=raw)
        if wid not in self._refused_from:
            self._refused_from.add(wid)
            self.refused.append(f"worker {wid}: {what} was refused ({why}); its later "
                                "refusals are only logged" if wid is not None else
                                f"{what} was refused ({why})")

    def read_progress(self, ranks: list[Worker]) -> list[tuple[Worker, Progress]]:
        """The ranks' newest progress records, decoded; one that is not a progress record as this
        version of nonstop writes it is refused as an event is (``read_events``)."""
        recs = self.mail.progress([w.wid for w in ranks])
        out = []
        decoded = self._progress
        for w in ranks:
            raw = recs.get(w.wid)
            if raw is None:
                continue
            last = decoded.get(w.wid)
            if last is not None and last[0] is raw:  # the same record again (across hosts, a
                out.append((w, last[1]))  # rank's newest is kept until its host sends another)
                continue
            try:
                rec = progress.decode(raw)
            except progress.BadProgress as exc:
                self._refuse({"wid": w.wid, "progress": raw}, str(exc), "a progress record")
                continue
            decoded[w.wid] = (raw, rec)
            out.append((w, rec))
        return out

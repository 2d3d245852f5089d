"""The rank process's link to the launcher: its worker id, mailbox, events and progress.

One ``WorkerRuntime`` exists per process started by ``nonstop run``. It outlives generations: the
training function is entered and left many times, the runtime stays.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from typing import Any, Callable

import nonstop.inject as inject
import nonstop.protocol as protocol
from ..protocol import events, rank_policy

_RUNTIME: "WorkerRuntime | None" = None
RELEASE_RETRY_S = 5.0  # a group kept busy is tried again after this, doubling each time
RELEASE_RETRY_BUDGET_S = 0.05  # ...for this long (a step's pause, at most)
IDLE_S = 0.2  # a spare waiting for a rank looks for new sharding decisions to make this often

_DIST_ERROR_MARKERS = ("gloo", "nccl", "connection", "socket", "timed out", "timeout",
                       "process group", "processgroup", "store", "peer")


def is_collective_error(exc: BaseException) -> bool:
    """Whether an exception looks like a failed collective (a peer died or was aborted), as
    opposed to an error in the user's own code."""
    import torch.distributed as dist

    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    text = f"{type(exc).__name__} {exc}".lower()
    return isinstance(exc, (RuntimeError, ConnectionError, OSError)) and any(
        m in text for m in _DIST_ERROR_MARKERS)


def current() -> "WorkerRuntime | None":
    """The runtime of this process, or None when not started by ``nonstop run``."""
    global _RUNTIME
    if _RUNTIME is None and os.environ.get(protocol.ENV_STORE) and os.environ.get(protocol.ENV_WORKER_ID):
        _RUNTIME = WorkerRuntime.from_env()
    return _RUNTIME


def _connect(host: str, port: int, timeout_s: float):
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=False, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeout_s))


class WorkerRuntime:
    def __init__(self, host: str, port: int, worker_id: int):
        self.host, self.port, self.worker_id = host, port, worker_id
        self._local = threading.local()
        self.job: dict[str, Any] = protocol.loads(self.store.get(protocol.JOB_KEY))
        self.policy = rank_policy.read(self.job["policy"])  # validated by the launcher
        self._seq = 0  # next mailbox message to read
        self._ev_seq = 0  # next event to write
        self._ev_lock = threading.Lock()  # events come from several threads, in one sequence
        self.assignment: protocol.Assign | None = None  # the newest assignment
        self.assignment_consumed = False  # whether a generation was entered with it
        self.entries = 0  # times this process entered the training function
        self.ever_entered = False
        # its state was brought to a step by a restore that a second fault then cut short: it
        # holds that step, clean, though it never entered a generation (a replacement)
        self.holds_state = False
        self.rank = 0  # the rank of the newest assignment
        self.held: tuple[int, int] | None = None  # (rank, world) of the last generation entered
        self.last_loss: Any = None  # the last loss reported by the training function
        self.wrapped = False
        self.busy = 0.0  # seconds spent inside completed steps, over this process's life
        self.stall = 0.0  # seconds spent between steps on snapshots, digests and checkpoints
        self.closed_groups: list[Any] = []  # groups left but not yet destroyed (pg.close)
        self._next_release = 0.0  # when a group kept busy is tried again
        self.faults = inject.from_env(os.environ.get(protocol.ENV_INJECT))
        self.flips: dict[int, int] = {}  # step -> injected bit flips that struck it here
        self.injector = inject.Injector(self.faults, self._claim_fault, self._announce_fault)
        self.registered = False  # whether the wrapped function registered a nonstop.State
        self.said_not_kept = False  # a State nothing keeps was made (and the controller told)
        self.job_mesh: Any = None  # a sharded job's lasting mesh (mesh.JobMesh), once declared
        # DTensor's sharding decisions (runtime/propagation.py): a first generation's rank
        # records those it makes first; a warm spare makes its host's ranks' ahead
        self.recorder: Any = None
        self.warmth: Any = None
        # the script was taken for a plain one (no nonstop import found in it or its modules):
        # its assignment went to the script itself, so a nonstop.wrap it reaches has none
        self.entered_plain = False
        self.node_memory: Any = None  # this node's memory (its keeper), when snapshots are on
        self.snapshots: Any = None
        keeper = os.environ.get(protocol.ENV_KEEPER)
        if keeper and self.policy.state.snapshot.enabled:
            from ..state.memory import NodeMemory
            from ..state.snapshot import Snapshots

            self.node_memory = NodeMemory(keeper)
            self.snapshots = Snapshots(self.policy.state, self.node_memory,
                                       sdc=self.policy.detect.sdc)
        self._snapshot_error: str | None = None
        from .monitor import Monitor

        self.monitor = Monitor(self)
        self.monitor.start()

    @classmethod
    def from_env(cls) -> "WorkerRuntime":
        host, _, port = os.environ[protocol.ENV_STORE].rpartition(":")
        return cls(host, int(port), int(os.environ[protocol.ENV_WORKER_ID]))

    # -- store access: one client per thread (a client serialises its operations) --------------
    @property
    def store(self):
        client = getattr(self._local, "store", None)
        if client is None:
            client = _connect(self.host, self.port, 60.0)
            self._local.store = client
        return client

    def emit(self, event: events.RankEvent) -> None:
        """Report ``event`` to the controller: its ``wid`` is this process's, its ``t`` now
        unless it says when."""
        rec = events.encode(event)
        rec["wid"] = self.worker_id
        if not event.t:
            rec["t"] = time.time()
        store = self.store
        with self._ev_lock:  # the number is taken only once the event is written: no gaps
            store.set(protocol.event_key(self.worker_id, self._ev_seq), protocol.dumps(rec))
            self._ev_seq += 1
        store.add(protocol.EVENT_COUNT_KEY, 1)

    # -- mailbox --------------------------------------------------------------------------------
    def poll_message(self) -> protocol.Mail | None:
        """The newest unread message if one is waiting (older unread ones are superseded)."""
        store = self.store
        msg = None
        while store.check([protocol.mailbox_key(self.worker_id, self._seq)]):
            msg = protocol.mail_from(protocol.loads(
                store.get(protocol.mailbox_key(self.worker_id, self._seq))))
            self._seq += 1
        if isinstance(msg, protocol.Assign):
            self.assignment, self.assignment_consumed = msg, False
            if msg.claimed:
                self._adopt_claims(msg.claimed)
        return msg

    def wait_message(self, idle: Callable[[], None] | None = None) -> protocol.Mail:
        """Block until the controller sends the next message (the launcher kills us if it dies).
        ``idle``: called about every ``IDLE_S`` while none comes."""
        wait = datetime.timedelta(seconds=IDLE_S) if idle is not None else \
            datetime.timedelta(hours=1)
        while True:
            key = protocol.mailbox_key(self.worker_id, self._seq)
            try:
                self.store.wait([key], wait)
            except Exception as exc:  # noqa: BLE001
                if "timeout" not in str(exc).lower():
                    self.reconnect(exc)
                elif idle is not None:
                    idle()
                continue
            msg = self.poll_message()
            if msg is not None:
                return msg

    def reconnect(self, exc: BaseException) -> None:
        """This thread's store connection failed: say so once, then open a new one."""
        print(f"nonstop: store connection lost ({type(exc).__name__}: {exc}); reconnecting",
              file=sys.stderr, flush=True)
        self._local.store = None
        time.sleep(0.05)

    def next_assignment(self) -> protocol.Mail:
        """The assignment to enter next: an unconsumed one, else the next message. A warm
        spare of a mesh job makes its host's ranks' sharding decisions meanwhile."""
        if self.assignment is not None and not self.assignment_consumed:
            newer = self.poll_message()
            if newer is None or isinstance(newer, protocol.Assign):
                return self.assignment
            return newer
        if self.warmth is None and self.job_mesh is not None and not self.ever_entered:
            from . import propagation

            if propagation.supported():
                self.warmth = propagation.Warmth()
        return self.wait_message(self._prewarm if self.warmth is not None and
                                 not self.ever_entered else None)

    def _prewarm(self) -> None:
        """While a spare waits: the records published since it last looked, decided."""
        t0 = time.monotonic()
        refused = len(self.warmth.refused)
        mail = protocol.mailbox_key(self.worker_id, self._seq)
        try:
            made = self.warmth.take(self.store, lambda: bool(self.store.check([mail])))
        except Exception:  # noqa: BLE001 - the store away: its wait says so; tried next time
            return
        if made or len(self.warmth.refused) > refused:
            self.emit(events.Prewarmed(records=len(self.warmth.read), decided=self.warmth.decided,
                                       took_s=round(time.monotonic() - t0, 4),
                                       refused=self.warmth.refused[refused:]))

    def before_build(self, rank: int, gen: int) -> None:
        """This process is about to run the mesh's build function (once in its life): a spare
        that made decisions ahead sees their meshes from ``rank``; a rank of the first
        generation records the decisions it makes first."""
        if self.warmth is not None and self.warmth.decided:
            self.warmth.adopt(rank)
        elif gen == 0:
            from . import propagation

            if propagation.supported():
                self.recorder = propagation.Recorder()

    def release_closed_groups(self, budget_s: float | None = None) -> None:
        """Destroy the groups of earlier generations: called once a later one has run a step,
        and again later for any still busy (``retry_closed_groups``)."""
        groups, self.closed_groups = self.closed_groups, []
        for group in groups:
            if not group.release(budget_s):
                self.closed_groups.append(group)
                self.emit(events.GroupKept(gen=group.gen, times=group.undrained))
        self._next_release = time.monotonic() + RELEASE_RETRY_S * (
            2 ** min(6, max((g.undrained for g in self.closed_groups), default=0)))

    def retry_closed_groups(self) -> None:
        """Between steps: a group kept because a worker was busy is tried again, now and then
        (backing off), briefly each time."""
        if self.closed_groups and time.monotonic() >= self._next_release:
            self.release_closed_groups(RELEASE_RETRY_BUDGET_S)

    # -- state: restore at entry, snapshots after steps ------------------------------------------
    def restore(self, state: Any, rank: int, world: int, gen: int, has_state: bool,
                reshard_from: int = 0, initial: bool = False,
                worlds: dict[int, int] | None = None, not_after: int | None = None) -> Any:
        """Bring this rank to the step every rank agrees on, from the cheapest source; sharded
        state last trained at another world size is merged from every old shard."""
        from ..state import regrid, reshard
        from ..state.plan import route
        from ..state.restore import NoConsistentState, Where, restore

        snaps = self.snapshots if self.registered else None
        waited: float | None = None
        if snaps is not None:  # a snapshot still in flight is committed (or given up)
            t0 = time.monotonic()
            departing = snaps.departing()
            snaps.settle()
            waited = time.monotonic() - t0 if departing else None
        root = snaps.root if snaps is not None else None
        schedule = snaps.schedule() if snaps is not None else None
        agreed = lambda: self.injector.in_recovery("restore", rank, gen)  # noqa: E731

        def from_twins() -> Any:
            """Not every part of this world is anywhere (a mesh with twins - HSDP, a pipeline -
            that shrank, then lost a rank with no copy of its part at the new size): each
            rank's part from an old rank of another world size that held the same one, in node
            memory. Collective; None when that cannot be done either."""
            other = any(w != world for w in (worlds or {}).values())
            if not other or not_after is not None or state.twins is None \
                    or state.twins_at is None or snaps is None:
                return None
            try:
                return reshard.reshard(state, rank, world, worlds or {}, None, where, schedule,
                                       agreed=agreed, load=regrid.twin_loader(rank))
            except NoConsistentState:
                return None

        def fresh() -> Any:
            """Nothing of this world anywhere: an old world's parts, or a checkpoint of another
            size."""
            other = from_twins()
            if other is not None:
                return other
            return regrid.resume(state, rank, world, root, schedule) if root is not None else None

        where = Where(memory=self.node_memory if snaps is not None else None,
                      checkpoint_root=root, sharded=state.sharded, twins=state.twins,
                      world=world, worlds=dict(worlds or {}),
                      not_after=not_after,
                      compare=snaps is not None and snaps.digests is not None,
                      on_fresh=fresh if state.meshed else None)
        way = route(world=world, sharded=state.sharded, meshed=state.meshed,
                    twins=state.twins is not None, reshard_from=reshard_from, initial=initial,
                    disk_world=lambda: reshard.disk_world(root, world))
        resharded = way.resharded(world)
        if resharded:
            held = self.held
            zero = not way.regrid  # ZeRO-1's own shard, live, where this process held it
            live = (held[0], state.step, held[1]) if (has_state and not state.dirty
                                                      and held is not None and zero) else None
            resumed = reshard.reshard(state, rank, world, worlds or {}, live, where, schedule,
                                      prefer=way.old_world, agreed=agreed,
                                      load=regrid.load_boxes if way.regrid else None)
        else:
            def loaded(step: int) -> None:
                self.holds_state = True  # (should a second fault cut the restore short)
                self.injector.in_recovery("restored", rank, gen)

            try:
                resumed = restore(state, rank, world, has_state, where, schedule, agreed=agreed,
                                  loaded=loaded)
            except NoConsistentState:  # (alike on every rank: the same offers)
                resumed = from_twins() if state.meshed else None
                if resumed is None:
                    raise
            resharded = "old_world" in resumed.agreed  # read from another size
        self.held = (rank, world)
        if waited is not None:  # the restore waited this long for a departure snapshot
            resumed.phases["departure"] = round(waited, 6)
        if snaps is not None:
            snaps.adopt(resumed.agreed["schedules"], resumed.step, resumed.agreed["disk"])
            if resharded or (state.sharded and resumed.step == 0 and snaps.last_step != 0):
                # the shards of this world (after a reshard: every rank's alike until its first
                # step), so that a failure before the next snapshot can roll back to them
                snaps.take(state, rank, world, gen)
        return resumed

    # -- the policy's replay checks (state/replay.py) -------------------------------------------
    def before_step(self, state: Any, rank: int, world: int, step: int) -> float:
        """The top of a step: the state it starts from copied, when it is to be replayed.
        Returns the seconds it took."""
        replay = self._replay()
        return replay.before(state, step, rank, world) if replay is not None else 0.0

    def step_begins(self, state: Any, step: int) -> float:
        """A step is about to run: its outputs traced afresh, a replayed one's parameters
        digested. Returns the seconds it took."""
        replay = self._replay()
        if replay is not None:
            return replay.started(state, step)
        if self.snapshots is not None and self.snapshots.digests is not None and self.registered:
            self.snapshots.digests.trace.begin(step)
        return 0.0

    def replayed_step(self, state: Any, rank: int, world: int, gen: int, step: int,
                      step_s: float) -> tuple[bool, float]:
        """A step completed: whether it runs again (a replay check; its state set back), and
        the seconds the check added."""
        replay = self._replay()
        if replay is None:
            return False, 0.0
        again, spent = replay.after(state, step, step_s, world)
        if not again:
            self._report_replayed(rank, gen)
        return again, spent

    def _replay(self) -> Any:
        snaps = self.snapshots
        return snaps.replay if snaps is not None and self.registered else None

    def _report_replayed(self, rank: int, gen: int) -> None:
        """Rank 0 reports a replay that agreed (every rank holds the same evidence)."""
        digests = self.snapshots.digests if self.snapshots is not None else None
        found = digests.replayed if digests is not None else None
        if found is None:
            return
        digests.replayed = None
        if rank == 0:
            self.emit(events.SdcReplayed(gen=gen, rank=rank, step=found.step,
                                         evidence=found.evidence, digests=found.digests,
                                         scheduled=found.scheduled, struck=found.struck))

    def after_step(self, state: Any, rank: int, world: int, gen: int, step_s: float,
                   first: bool) -> float:
        """A step completed: take a snapshot if one is due. Returns the seconds it took."""
        if self.recorder is not None:
            try:
                if self.recorder.stepped(self.store):
                    self.recorder = None
            except Exception:  # noqa: BLE001 - only a spare's warm-up is lost
                self.recorder.stop()
                self.recorder = None
        snaps = self.snapshots
        if snaps is None or not self.registered:
            return 0.0
        spent, changed = snaps.after_step(state, rank, world, gen, step_s, first, self.injector)
        if changed and rank == 0:
            self.emit(events.SnapshotInterval(gen=gen, step=state.step, **snaps.stats()))
        self._report_replayed(rank, gen)
        found = snaps.digests.mismatch if snaps.digests is not None else None
        if found is not None:  # the policy only reports it: training goes on
            snaps.digests.mismatch = None
            self.emit(events.SdcMismatch(gen=gen, rank=rank, step=found.step,
                                         suspects=found.suspects, digests=found.digests))
        if snaps.error != self._snapshot_error:
            self._snapshot_error = snaps.error
            if snaps.error:
                self.emit(events.SnapshotFailed(gen=gen, rank=rank, step=state.step,
                                                error=snaps.error))
        return spent

    def before_regroup(self, state: Any, rank: int, world: int, gen: int,
                       mid_step: bool = False) -> None:
        """Leaving at a step boundary for a world of another size. A mesh that changes size
        only by new processes (sharded along the dimension that changes) keeps this step in
        its node's memory first: the new processes cut their shards from it, and lose none.
        ``mid_step``: this rank was already in the next step when a peer left at the boundary
        (its state is still the boundary's, its FSDP2 modules mid-step: set back to rest)."""
        from ..state import shards

        snaps = self.snapshots
        mesh = self.job_mesh
        if snaps is None or not self.registered or mesh is None or state.dirty or \
                (mesh.regrid_unit(state.twins) or 0) <= 0 or snaps.last_step == state.step:
            return
        if mid_step:
            shards.settle(state)
        snaps.take(state, rank, world, gen)
        snaps.settle()

    def departure(self, state: Any, rank: int, world: int, has_state: bool) -> int | None:
        """The step this rank keeps in its node's memory as it leaves a failed generation (a
        departure snapshot), or None. Only a clean state newer than its last snapshot, of a part
        that at most one other rank of that world holds: lose that one (the fault being
        recovered from), and this process is the last copy of the step - a second fault during
        the recovery then went back to the last periodic snapshot. A part held three times or
        more (data parallel over three ranks, three replica groups) outlives a second fault in
        a live process: no copy is made."""
        snaps = self.snapshots
        held = has_state or self.ever_entered or self.holds_state  # not a spare's built state
        if snaps is None or not self.registered or not held or state.dirty or state.step <= 0 \
                or state.step == snaps.last_step:
            return None
        if not state.sharded:
            holders = world
        elif state.twins is not None and 0 <= rank < len(state.twins):
            holders = state.twins.count(state.twins[rank])
        else:
            holders = 1  # (no twin: the step is lost with this process alone)
        return state.step if holders <= 2 else None

    def depart(self, state: Any, rank: int, world: int, gen: int) -> None:
        """Start the departure snapshot ``departure`` chose (its thread writes it while the rank
        waits for its next assignment)."""
        from ..state import shards

        if state.meshed:  # FSDP2 left mid-step: at rest first, its sharded parameters in place
            shards.settle(state)
        try:
            self.snapshots.depart(state, rank, world, gen)
        except Exception as exc:  # noqa: BLE001 - only the second fault's cover is lost
            self.snapshots.error = (f"departure snapshot of step {state.step}: "
                                    f"{type(exc).__name__}: {exc}")

    def steps_done(self, state: Any, rank: int, world: int, gen: int) -> None:
        """The training loop ended: the last step goes to disk if checkpoints are on."""
        if self.snapshots is not None and self.registered:
            self.snapshots.finish(state, rank, world, gen)

    # -- faults ---------------------------------------------------------------------------------
    def _claim_fault(self, index: int, fault: inject.FaultSpec) -> bool:
        return self.store.add(protocol.inject_key(index), 1) <= fault.times

    def _announce_fault(self, fault: inject.FaultSpec, step: int, index: int | None = None) -> None:
        gen = self.assignment.gen if self.assignment is not None else None
        self.emit(events.FaultFired(fault=fault.describe(), kind=fault.kind, rank=fault.rank,
                                    step=step, gen=gen, pid=os.getpid(), index=index))

    def _adopt_claims(self, claimed: dict[str, int]) -> None:
        """Faults already fired elsewhere in the job (another host's store counted them): count
        them here too, so a rank that moved does not fire them again."""
        store = self.store
        for index, times in claimed.items():
            have = store.add(protocol.inject_key(int(index)), 0)
            if have < times:
                store.add(protocol.inject_key(int(index)), times - have)

    def group_store(self, msg: protocol.Assign) -> tuple[str, int]:
        """Where a generation's group forms: the store named in its assignment (across hosts, a
        store on the host of its rank 0), else this host's store."""
        if msg.pg_addr:
            return msg.pg_addr, int(msg.pg_port or 0)
        return self.host, self.port

    # -- environment ----------------------------------------------------------------------------
    def apply_env(self, msg: protocol.Assign) -> None:
        """Export the torchrun environment of an assignment so scripts that read it see the truth."""
        env = os.environ
        rank, world = str(msg.rank), str(msg.world)
        group = str(msg.group_rank)
        local_rank = rank if msg.local_rank is None else str(msg.local_rank)
        local_world = world if msg.local_world is None else str(msg.local_world)
        env.update({
            "RANK": rank, "LOCAL_RANK": local_rank, "WORLD_SIZE": world,
            "LOCAL_WORLD_SIZE": local_world, "GROUP_RANK": group,
            "NODE_RANK": group, "ROLE_RANK": rank, "ROLE_WORLD_SIZE": world, "ROLE_NAME": "default",
            "MASTER_ADDR": msg.master_addr or self.host,
            "MASTER_PORT": str(msg.port or self.port),
            "TORCHELASTIC_RESTART_COUNT": str(msg.gen), "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RUN_ID": str(self.job.get("run_id", "nonstop")),
            protocol.ENV_GENERATION: str(msg.gen),
            protocol.ENV_ENTRIES: str(self.entries),
            protocol.ENV_REPLACEMENTS: str(msg.replacements),
        })

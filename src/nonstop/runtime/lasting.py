"""Process groups that outlive their generations.

nonstop forms a new process group every generation; a ``DeviceMesh`` (and the DTensors and
FSDP2 state bound to it) built on one generation's groups would be dead in the next. A *lasting*
group is one ``ProcessGroup`` object per mesh dimension that forwards every collective to the
group of the current generation, put inside it as the generation forms (``runtime/mesh.py``,
``JobMesh.form``), and registered in torch.distributed's registry under its own name so that
its collectives, ``get_process_group_ranks`` and DTensor's functional collectives find it.

With gloo, a wait on a lasting group's work is abortable: it waits in slices and ends once its
generation is aborted (gloo can leave a collective waiting on a connection already closed, where
shutting the generation's sockets reaches nothing). And while a ``nonstop.Mesh``'s build function
runs, a collective on a lasting group is refused (``BuildCommunicated``): a replacement runs the
build alone while its peers wait for it in the restore.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from ..errors import ScriptSetupError
from ..torch_internals import get as torch_private

# the collectives a lasting group forwards (those torch.distributed, DTensor and FSDP2 call)
FORWARDED = ("allgather", "allgather_coalesced", "allgather_into_tensor_coalesced",
             "_allgather_base", "all_gather_single", "all_gather_single_coalesced", "allreduce",
             "allreduce_coalesced", "broadcast", "reduce_scatter", "reduce_scatter_single",
             "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced",
             "_reduce_scatter_base", "barrier", "alltoall_base", "alltoall", "all_to_all_single",
             "send", "recv", "recv_anysource", "gather", "scatter", "reduce", "monitored_barrier",
             "_start_coalescing", "_end_coalescing", "_get_backend", "_get_backend_name",
             "_wait_for_pending_works", "_get_sequence_number_for_group")


_lasting_type: Any = None


def lasting_group_type() -> Any:
    """The class of a lasting group (made on first use: importing this module imports no torch)."""
    global _lasting_type
    if _lasting_type is not None:
        return _lasting_type
    import torch.distributed as dist

    class LastingGroup(dist.ProcessGroup):
        """A process group that outlives generations: each collective goes to ``inner``, the
        group of the current generation (None between generations: a collective then fails at
        once, as on a destroyed group)."""

        def __init__(self, rank: int, size: int, name: str):
            super().__init__(rank, size)
            self.inner: Any = None
            self._name = name
            # whether the generation inside was aborted; gloo's work then waits abortably
            self.aborted: Callable[[], bool] = never
            self.abandoned: list = []  # works the rank gave up waiting for (see AbortableWork)
            self.gloo = False

        @property
        def group_name(self) -> str:  # torch's own is fixed at construction, in C++
            return self._name

        def _set_group_name(self, name: str) -> None:
            self._name = name

        def size(self) -> int:
            """The current generation's size (a replica dimension with groups away is smaller
            than the mesh: FSDP2 divides the reduced gradients by it)."""
            return super().size() if self.inner is None else self.inner.size()

        def rank(self) -> int:
            return super().rank() if self.inner is None else self.inner.rank()

        def getBackendName(self) -> str:  # noqa: N802 - torch's name
            return "gloo" if self.inner is None else self.inner._get_backend_name()

        @property
        def _device_types(self) -> Any:
            return self._current()._device_types

        def _current(self) -> Any:
            inner = self.inner
            if inner is None:
                raise RuntimeError(f"the process group {self._name!r} has no generation: the "
                                   "previous one ended and the next has not formed")
            return inner

    def forward(op: str) -> Callable[..., Any]:
        if op in RETURNS_WORK:
            def call(self: Any, *args: Any, **kwargs: Any) -> Any:
                if _building[0] and op in COMMUNICATING:
                    raise BuildCommunicated(op)
                if self.aborted():  # posted after the abort: it would find its peers gone
                    raise RuntimeError(f"{self._name}: {op} after its generation was aborted")
                work = getattr(self._current(), op)(*args, **kwargs)
                if self.gloo and isinstance(work, dist.Work):
                    return abortable_work_type()(work, self.aborted, self.abandoned,
                                                 self._name, op)
                return work
        else:
            def call(self: Any, *args: Any, **kwargs: Any) -> Any:
                return getattr(self._current(), op)(*args, **kwargs)

        call.__name__ = op
        return call

    for op in FORWARDED:
        setattr(LastingGroup, op, forward(op))
    _lasting_type = LastingGroup
    return LastingGroup


def never() -> bool:
    return False


_abortable_type: Any = None
POLL_S = 0.05  # how often a gloo wait looks whether its generation was aborted
# operations whose gloo work waits whatever timeout it is given (gloo's reduce-scatter is a
# "coalesced" work that waits for its parts in turn): waited for on a helper thread. Any other
# found to return from a sliced wait without being complete is added as it is seen.
WAIT_IGNORES_TIMEOUT = {"_reduce_scatter_base", "reduce_scatter_single", "reduce_scatter",
                        "reduce_scatter_tensor_coalesced", "allgather_into_tensor_coalesced",
                        "all_gather_single_coalesced", "reduce_scatter_single_coalesced",
                        "_end_coalescing"}
# gloo's send and receive: a wait that times out closes the connection to the peer ("Application
# timeout caused pair closure"), which a slice must never do. Waited for on a helper thread too.
POINT_TO_POINT = {"send", "recv", "recv_anysource"}


class _Waiter:
    """A thread that waits for the works a caller cannot wait for in slices, one at a time. A
    work given up on (its generation aborted) keeps its thread blocked; the next wait starts
    another (one thread left behind per such abort, until gloo's timeout ends the work)."""

    _current: "_Waiter | None" = None

    def __init__(self) -> None:
        import queue
        import threading

        self._queue: Any = queue.SimpleQueue()
        threading.Thread(target=self._run, name="nonstop-gloo-wait", daemon=True).start()

    @classmethod
    def submit(cls, work: Any) -> tuple["_Waiter", Any, list]:
        """Wait for ``work`` on the current waiter: (the waiter, an event set once the wait
        returned, a list that then holds its exception if it raised)."""
        import threading

        if cls._current is None:
            cls._current = cls()
        waiter, done, box = cls._current, threading.Event(), []
        waiter._queue.put((work, done, box))
        return waiter, done, box

    @classmethod
    def abandon(cls, waiter: "_Waiter") -> None:
        if cls._current is waiter:
            cls._current = None

    def _run(self) -> None:
        while True:
            work, done, box = self._queue.get()
            try:
                work.wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                box.append(exc)
            done.set()


def abortable_work_type() -> Any:
    """The class of a gloo collective's work on a lasting group (made on first use)."""
    global _abortable_type
    if _abortable_type is not None:
        return _abortable_type
    import datetime
    import time

    import torch.distributed as dist

    poll = datetime.timedelta(seconds=POLL_S)

    class AbortableWork(dist.Work):
        """A gloo collective's work whose ``wait`` ends when the generation is aborted.

        An abort shuts the generation's sockets, which fails a collective blocked on them. But
        gloo leaves a send whose receiver died (or left) before asking for it waiting for the
        group's collective timeout, and nothing a shut socket wakes: a survivor of the fault
        would never leave its generation, and be killed and replaced at the teardown deadline.
        Waited for in slices (or on a helper thread, for a work that ignores the timeout it is
        given), the work looks at the abort in between and the rank leaves; the work it gave up
        on is noted in ``abandoned``, as a callable that says whether it has ended since (its
        generation's groups are kept until then: destroying a group joins the worker thread
        still blocked in it)."""

        def __init__(self, inner: Any, aborted: Callable[[], bool], abandoned: list,
                     name: str, op: str):
            super().__init__()
            self._inner, self._aborted, self._abandoned = inner, aborted, abandoned
            self._name, self._op = name, op

        def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
            limit = timeout.total_seconds()
            deadline = time.monotonic() + limit if limit > 0 else None
            if self._op in WAIT_IGNORES_TIMEOUT or self._op in POINT_TO_POINT:
                return self._wait_aside(deadline, limit)
            while True:
                try:
                    done = self._inner.wait(poll)
                except RuntimeError:
                    if self._inner.is_completed():  # failed, or ended as the slice did: its
                        return self._inner.wait(poll)  # own outcome (no slice timeout now)
                else:
                    if not self._inner.is_completed():  # it waited whatever it was told
                        WAIT_IGNORES_TIMEOUT.add(self._op)
                    return done
                self._check(deadline, limit, self._inner.is_completed)

        def _wait_aside(self, deadline: float | None, limit: float) -> bool:
            waiter, done, box = _Waiter.submit(self._inner)
            while not done.wait(POLL_S):
                try:
                    self._check(deadline, limit, done.is_set)
                except RuntimeError:
                    _Waiter.abandon(waiter)  # its thread stays blocked on this work
                    raise
            if box:
                raise box[0]
            return True

        def _check(self, deadline: float | None, limit: float, ended: Callable[[], bool]) -> None:
            if self._aborted():
                self._abandoned.append(ended)
                raise RuntimeError(f"{self._name}: generation aborted while a collective "
                                   "waited")
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"{self._name}: collective timed out after {limit} s")

        def is_completed(self) -> bool:
            return self._inner.is_completed()

        def is_success(self) -> bool:
            return self._inner.is_success()

        def exception(self) -> Any:
            return self._inner.exception()

        def result(self) -> Any:
            return self._inner.result()

        def source_rank(self) -> int:
            return self._inner.source_rank()

        def synchronize(self) -> None:
            self._inner.synchronize()

        def get_future(self) -> Any:
            return self._inner.get_future()

    _abortable_type = AbortableWork
    return AbortableWork


# those of them that send or wait for data: refused while the build function runs (below)
COMMUNICATING = frozenset(FORWARDED) - {"_start_coalescing", "_end_coalescing", "_get_backend",
                                        "_get_backend_name", "_wait_for_pending_works",
                                        "_get_sequence_number_for_group"}
# those that hand back a work to wait for (a coalesced batch's end too): abortable with gloo
RETURNS_WORK = COMMUNICATING | {"_end_coalescing"}
_building = [False]


class BuildCommunicated(ScriptSetupError):
    """The build function of a ``nonstop.Mesh`` made a collective on the mesh."""

    def __init__(self, op: str):
        super().__init__(
            f"the build function of nonstop.Mesh communicated on the mesh ({op}): a replacement "
            "runs it alone while its peers wait for it in the restore, so it must not. "
            "parallelize_module and distribute_tensor send rank 0's weights to the other ranks "
            "unless given src_data_rank=None: pass it (each rank then keeps its part of the "
            "weights it built itself, the same on every rank when the model is made from one "
            "seed); nonstop restores the trained state afterwards")


@contextlib.contextmanager
def building() -> Iterator[None]:
    """While a ``Mesh``'s build function runs: a collective on a lasting group raises
    ``BuildCommunicated`` at once, in every generation (the first generation's ranks could
    meet there, but a replacement's peers never would: it is said before a fault needs it)."""
    _building[0] = True
    try:
        yield
    finally:
        _building[0] = False


def in_build() -> bool:
    """Whether a ``Mesh``'s build function is running (the State it makes is the one kept)."""
    return _building[0]


def register(pg: Any, name: str, ranks: list[int], inner: Any = None) -> None:
    """Make ``pg`` known to torch.distributed under ``name`` (the group of global ``ranks``), as
    ``new_group`` would: its collectives, ``get_process_group_ranks`` and DTensor's functional
    collectives (which find a group by name) then take it. Done again every generation: a
    generation's teardown forgets every group. Its backend is said as ``inner``'s (the group of
    this generation inside it: ``gloo``, or ``cpu:gloo,cuda:nccl`` on GPUs)."""
    mapping = {g: i for i, g in enumerate(ranks)}
    world = torch_private("c10d.world")
    backend = world.pg_map.get(inner, ("gloo", None))[0] if inner is not None else "gloo"
    world.pg_map[pg] = (backend, None)
    world.pg_names[pg] = name
    world.pg_backend_config[pg] = world.pg_backend_config.get(inner, "cpu:gloo")
    world.pg_group_ranks[pg] = mapping
    tag = f"ptd:{name}"
    world.tags_to_pg.setdefault(tag, []).append(pg)
    world.pg_to_tag[pg] = tag
    torch_private("c10d.register_process_group")(name, pg)

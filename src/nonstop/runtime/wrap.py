"""The wrapper around the user's training function: leave, tear down, re-form, re-enter.

Under ``nonstop run`` the wrapped function is entered once per generation. When any rank fails,
every healthy rank leaves it, tears the group down, waits for the next generation's assignment and
re-enters; the objects in ``State`` stay in memory. Outside ``nonstop run`` (plain ``python`` or
torchrun) the function simply runs once, so the same script works everywhere.
"""

from __future__ import annotations

import functools
import gc
import os
import sys
import time
import traceback
from typing import Any, Callable, TypeVar

import nonstop.protocol as protocol
from ..protocol import events
from . import nccl
from .context import Context
from . import lasting
from .mesh import JobMesh, Mesh
from ..decide.cuda import of_exception
from ..errors import ScriptSetupError
from ..state import shards
from ..state.digest import SilentCorruption
from .registered import NonFiniteGradients, Regroup, State, _StepOnly
from .worker import is_collective_error

F = TypeVar("F", bound=Callable[..., Any])


def wrap(state: State | Mesh | Callable[..., Any] | None = None, *,
         backend: str = "gloo") -> Any:
    """Make a training function restartable in-process.

    Use as ``@nonstop.wrap(state)`` or ``@nonstop.wrap``; the function takes a ``Context`` first.
    Build the model, optimizer and data pipeline *outside* it (they survive restarts); create what
    depends on the process group (DDP) *inside* it. A sharded or model-parallel job gives a
    ``nonstop.Mesh`` instead of a ``State``: its build function shards the model over the mesh
    once, and returns the state.
    """
    if callable(state) and not isinstance(state, (State, Mesh)):
        return wrap(None, backend=backend)(state)
    if state is not None and not isinstance(state, (State, Mesh)):
        raise TypeError("nonstop.wrap(state): state must be a nonstop.State or a nonstop.Mesh")

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            from . import worker

            rt = worker.current()
            if rt is None:
                return _run_standalone(fn, state, backend, args, kwargs)
            return _run_managed(rt, fn, state, backend, args, kwargs)

        return call  # type: ignore[return-value]

    return decorate


def _run_standalone(fn: Callable[..., Any], state: State | Mesh | None, backend: str,
                    args: tuple, kwargs: dict) -> Any:
    import torch.distributed as dist

    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    device_mesh = None
    if isinstance(state, Mesh):  # plain python or torchrun: torch's own mesh, built once
        from torch.distributed.device_mesh import init_device_mesh

        device_mesh = init_device_mesh(state.device_type, state.sizes(dist.get_world_size()),
                                       mesh_dim_names=state.dims)
        state = _built(state.build(device_mesh))
    ctx = Context(dist.get_rank(), dist.get_world_size(), 0, 1, 0, state or _StepOnly(),
                  mesh=device_mesh)
    return fn(ctx, *args, **kwargs)


def _built(state: Any) -> State:
    """The state a mesh's build function returned: sharded (each rank's differs: it is restored
    only from copies of its own shard)."""
    if not isinstance(state, State):
        raise TypeError(f"nonstop.Mesh: its build function returned a {type(state).__name__}, "
                        "not the nonstop.State of what to keep")
    state.sharded = state.meshed = True
    return state


def raised_by_nonstop(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by nonstop's own state code (a snapshot, a digest, a restore:
    ``nonstop/state``), not by the training code: the innermost frame of its traceback that is
    neither PyTorch's nor the standard library's is nonstop's. An error there is a bug in
    nonstop (or a kind of state it does not handle yet), never the user's to fix."""
    import sysconfig

    import torch

    state_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "state")
    skip = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
            os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep)
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = os.path.abspath(frame.filename)
        if path.startswith(skip):
            continue
        return path.startswith(state_dir + os.sep)
    return False


def failure_reason(exc: BaseException, phase: str, aborted: bool, cuda_oom: bool) -> str:
    """What a failure that made this rank leave its generation was (pure, but for reading the
    traceback): the ``reason`` of its ``rank_left``. An error in nonstop's own state code while
    the generation formed is nonstop's (``internal``: it stops the job with that said), not a
    peer's: taken for one, it was retried in place, failing alike each time."""
    from ..state.restore import NoConsistentState

    if isinstance(exc, Regroup):
        return "regroup"  # the peers still in a step leave as this group ends
    if isinstance(exc, SilentCorruption):  # every rank found the same: any one's report
        return "sdc"
    if aborted:
        return "abort"
    if isinstance(exc, NoConsistentState):
        return "no_state"
    if isinstance(exc, ScriptSetupError):
        return "setup"
    if cuda_oom:  # out of memory: this process tries again, its caches freed
        return "cuda_oom"
    if is_collective_error(exc):
        return "peer"
    if raised_by_nonstop(exc):
        return "internal"
    return "peer" if phase == "rendezvous" else "exception"


def _user_traceback(exc: BaseException) -> str:
    """The traceback without nonstop's own frames above the user's function."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _run_managed(rt: Any, fn: Callable[..., Any], state: State | None, backend: str,
                 args: tuple, kwargs: dict) -> Any:
    from .pg import GenerationGroup

    job = rt.job
    if rt.entered_plain:
        _reached_unseen(rt)
    if isinstance(state, Mesh) and rt.job_mesh is None:
        rt.job_mesh = JobMesh(state)
    tracked = state if isinstance(state, State) else _StepOnly()
    _attach(rt, tracked)
    rt.function_name = getattr(fn, "__qualname__", None) or repr(fn)
    rt.registered = state is not None
    if not rt.wrapped:
        rt.wrapped = True
        rt.emit(events.Wrapped(pid=os.getpid()))
    while True:
        if rt.assignment is None:
            if nccl.uses_nccl(backend):  # a warm spare: NCCL's environment and CUDA, now
                _warm_gpu()
            rt.emit(events.Ready(pid=os.getpid(), mode="script"))
            if rt.node_memory is not None and state is not None:  # a warm spare
                rt.node_memory.prepare(until=lambda: rt.assignment is not None)
        msg = rt.next_assignment()
        if isinstance(msg, protocol.Exit):
            _retire()
        if not isinstance(msg, protocol.Assign):
            continue
        rt.assignment_consumed = True
        gen, rank, world = msg.gen, msg.rank, msg.world
        rt.rank = rank
        rt.apply_env(msg)
        rt.injector.in_recovery("assigned", rank, gen)
        if not rt.ever_entered and not msg.initial:  # a spare (or new process) taking a place
            rt.injector.in_recovery("promoted", rank, gen)
        t_assigned = time.time()
        has_state = rt.ever_entered or msg.initial or rt.holds_state
        if state is None:  # nothing registered: nothing to agree on, every entry starts over
            tracked.step, tracked.dirty, has_state = 0, False, True
        group = GenerationGroup(*rt.group_store(msg), gen, rank, world, backend,
                                protocol.pg_prefix(gen), job["rendezvous_timeout_s"],
                                job["collective_timeout_s"],
                                escalate=functools.partial(_abort_hung, rt, gen, rank),
                                abort_s=rt.policy.recover.timeouts.abort_s)
        if rt.snapshots is not None:
            rt.snapshots.may_commit = group.may_commit
        # Everything alive now (torch, the model, the script's setup) is moved out of the
        # collector's sight: the collection at teardown then only walks this generation's objects.
        gc.freeze()
        rt.emit(events.Joining(gen=gen, rank=rank))
        rt.monitor.begin(gen, group)
        outcome = _enter(rt, group, fn, tracked, has_state, msg, t_assigned, args, kwargs)
        if rt.job_mesh is not None and rt.job_mesh.state is not None:
            tracked = rt.job_mesh.state  # built by the mesh's function, in the first generation
        while isinstance(outcome, _Retry):
            verdict = _report_retry(rt, tracked, gen, rank, outcome)
            if verdict is None:
                outcome = _Failure({"reason": "abort", "t_caught": time.time(), "phase": "retry",
                                    "error": "the step retry was called off"})
                break
            outcome = _enter(rt, group, fn, tracked, has_state, msg, t_assigned, args, kwargs,
                             rejoin=verdict)
        if isinstance(outcome, _Failure):
            if group.untrusted(tracked.step):
                # NCCL: an aborted collective returns without an error; this step's results
                # were still on their way when it was aborted, so they count for nothing
                tracked.dirty = True
            rt.injector.in_recovery("teardown", rank, gen)
            if rt.monitor.regroup == gen:  # a peer left for a larger world before this rank
                rt.before_regroup(tracked, rank, world, gen, mid_step=True)
            if rt.job_mesh is not None:
                rt.job_mesh.leave()
            # Torn down only now, outside the except block: while an exception is being handled
            # it keeps the failed frames (and DDP, and the group) alive.
            rt.monitor.end()
            t_destroy = group.close()
            rt.closed_groups.append(group)
            departure = rt.departure(tracked, rank, world, has_state) \
                if outcome.detail["reason"] != "sdc" else None  # (the state a check refused)
            rt.emit(events.LeftGeneration(gen=gen, rank=rank, step=tracked.step,
                                          dirty=tracked.dirty, destroy_s=t_destroy,
                                          collected=group.collected,
                                          sockets_shut=group.sockets_shut, departure=departure,
                                          **outcome.detail))
            if departure is not None:  # once left: the copy is off the teardown's path
                rt.depart(tracked, rank, world, gen)
            continue
        result = outcome
        rt.monitor.returned()
        # faults keyed to steps the run never reached: said at the end (only a loop of
        # ctx.steps moves the step index, so only then is it known how far it got)
        unfired = [f.describe() for f in rt.injector.unreached(rank, tracked.step)] \
            if rt.monitor.steps_seen else []
        rt.emit(events.Done(gen=gen, rank=rank, step=tracked.step, busy=rt.busy, unfired=unfired,
                            steps=rt.monitor.steps_seen, sdc=rt.snapshots.digests.stats()
                            if rt.snapshots is not None and rt.snapshots.digests is not None
                            else None, final_persist=rt.snapshots.final_persist
                            if rt.snapshots is not None else None))
        verdict = rt.wait_message()
        if isinstance(verdict, protocol.Complete):
            rt.monitor.end()
            rt.release_closed_groups()
            return result
        rt.monitor.end()
        if rt.job_mesh is not None:
            rt.job_mesh.leave()
        group.close()
        rt.closed_groups.append(group)
        rt.emit(events.LeftGeneration(gen=gen, rank=rank, reason="reassigned", step=tracked.step,
                                      dirty=tracked.dirty, t_caught=time.time()))
        if isinstance(verdict, protocol.Exit):
            _retire()


def _attach(rt: Any, tracked: State) -> None:
    """Connect the state's hooks to this process's runtime and policy."""
    tracked.check_finite = rt.policy.detect.nan.enabled

    def optimizer_stepped() -> None:
        rt.injector.check("optimizer", rt.rank, tracked.step)
        rt.monitor.mark("optimizer", tracked.step)  # progress, for a loop without ctx.steps

    tracked._on_optimizer_step = optimizer_stepped
    if rt.injector.has_forward:
        tracked._forward_fault = lambda step: rt.injector.forward(rt.rank, step)
    if rt.injector.has_point("commit"):
        tracked._on_commit = lambda: rt.injector.check("commit", rt.rank, tracked.step)
    if rt.node_memory is not None:
        tracked._keep_before_step = lambda: _keep_before_step(rt, tracked)
    digests = rt.snapshots.digests if rt.snapshots is not None else None
    if digests is not None:  # each step's forward outputs: what a replay of it is compared with
        tracked._on_output = digests.trace.output
    if tracked.check_finite and tracked.verdict is None:
        from .verdict import install

        tracked.verdict = install(tracked._objects)


def _keep_before_step(rt: Any, tracked: State) -> bool:
    """A sharded step's commit failed on this rank (a peer left as the ranks agreed to take the
    step): keep the state before the step in this process, where a restore offers it (``kept``),
    so that the rank may take the step on its own verdict. Once per step (a second optimizer of
    the step finds it kept). False when no copy could be made: the step is then not taken."""
    memory, held = rt.node_memory, rt.held
    if memory is None or held is None:
        return False
    rank, world = held
    step = tracked.step
    kept = memory.kept
    if kept is not None and kept[:3] == (step, rank, world):
        return True
    gen = rt.assignment.gen if rt.assignment is not None else -1
    try:
        memory.keep(tracked, step, rank, world, True, gen)
    except Exception:  # noqa: BLE001 - no copy: the failure is raised, the step not taken
        return False
    return True


def _report_retry(rt: Any, tracked: State, gen: int, rank: int, retry: "_Retry") -> Any:
    """Every rank saw the same non-finite gradients (they were reduced together): report, and
    let the controller say retry (same generation, no teardown) or call it off. Returns the
    retry message, or None when called off (a new assignment is then waiting)."""
    rt.emit(events.NanFound(gen=gen, rank=rank, step=retry.step, output=retry.loss))
    verdict = rt.wait_message()
    if isinstance(verdict, protocol.Exit):
        _retire()
    if not isinstance(verdict, protocol.Retry):
        return None
    tracked.zero_grads()
    tracked.dirty = False
    if verdict.skip:
        tracked.step = retry.step + 1  # the batch is skipped: the data order moves on
    return verdict


class _Failure:
    def __init__(self, detail: dict[str, Any]):
        self.detail = detail  # the fields of its LeftGeneration event that say why


class _Retry:
    def __init__(self, step: int, loss: Any):
        self.step, self.loss = step, loss


def _enter(rt: Any, group: Any, fn: Callable[..., Any], tracked: State, has_state: bool,
           msg: dict[str, Any], t_assigned: float, args: tuple, kwargs: dict,
           rejoin: Any = None) -> Any:
    """Join one generation, agree on the state, run the function. Returns its result, a
    ``_Retry`` (the step's gradients were not finite: nothing applied, group intact), or a
    ``_Failure`` describing why this rank left (the group already aborted, not yet closed).
    ``rejoin``: re-enter a generation already joined, to retry a step."""
    gen, rank, world = msg.gen, msg.rank, msg.world
    phase = "train" if rejoin else "rendezvous"
    t_pg: float | None = None
    try:
        if rejoin:
            digests = rt.snapshots.digests if rt.snapshots is not None else None
            if digests is not None:  # before DDP, built again, copies rank 0's parameters to all
                digests.check(tracked.modules(), tracked.step, world, tracked.twins,
                              tracked.meshed)
            ctx = _context(rt, tracked, msg, None)
            return fn(ctx, *args, **kwargs)
        for left in rt.closed_groups:  # an NCCL group whose abort still ran when it was left
            left.settle()
        if rt.store.check([protocol.abort_key(gen, rt.worker_id)]):
            raise RuntimeError(f"generation {gen} was aborted before this rank joined")
        group.open(joined_store=lambda: rt.injector.in_recovery("rendezvous", rank, gen))
        if rt.job_mesh is not None:  # (the mesh's groups form in the rendezvous phase)
            # (a mesh resharded at each size is laid out over this world, else the full one's)
            group.extend(lambda: rt.job_mesh.form(gen, rank, world,
                                                  world if msg.regrid else msg.full_world,
                                                  aborted=lambda: group.aborted,
                                                  abandoned=group.abandoned))
            if rt.job_mesh.state is None:  # the script shards its model: once per process
                rt.before_build(rank, gen)
                phase = "build"
                with lasting.building():
                    built = _built(rt.job_mesh.spec.build(rt.job_mesh.device_mesh))
                wrong = rt.job_mesh.misbuilt(built)
                if wrong is not None:
                    raise ScriptSetupError(wrong)
                tracked = rt.job_mesh.state = built
                _attach(rt, tracked)
                phase = "rendezvous"
            tracked.twins = rt.job_mesh.twins(tracked)  # of this generation's world
            tracked.twins_at = rt.job_mesh.twins_at
            if rt.job_mesh.spec.stages is not None:
                tracked.stage_twins = rt.job_mesh.twins_at
            if gen == 0:  # every rank built its state from the script: copies must agree
                rt.job_mesh.check_twins(tracked)
        elif rt.ever_entered and (unmanaged := shards.unmanaged_mesh(tracked)) is not None:
            raise unmanaged
        if rt.ever_entered:  # FSDP2 left mid-step by the failed generation: back to rest
            shards.settle(tracked)
        if group.nccl and isinstance(tracked, State):  # a spare's model on another GPU
            import torch

            tracked.to_device(torch.device("cuda", torch.cuda.current_device()))
        t_pg = time.time()
        phase = "restore"
        resumed = rt.restore(tracked, rank, world, gen, has_state, msg.reshard_from, msg.initial,
                             {int(g): w for g, w in msg.worlds.items()}, msg.not_after)
        t_restored = time.time()
        rt.entries += 1
        rt.ever_entered = True
        os.environ[protocol.ENV_ENTRIES] = str(rt.entries)
        rt.emit(events.EnteredGeneration(
            gen=gen, rank=rank, step=resumed.step, source=resumed.source, holder=resumed.holder,
            receivers=list(resumed.receivers),
            sources={str(r): s for r, s in resumed.sources.items()}, skipped=resumed.skipped,
            nbytes=resumed.nbytes, restore_s=round(resumed.seconds, 6),
            restore_phases=resumed.phases, sharded=tracked.sharded, nccl=group.nccl,
            agreement=tracked.agreement(),
            replica_group=rt.job_mesh.replica_group(tracked.twins)
            if rt.job_mesh is not None else None,
            regrid_unit=rt.job_mesh.regrid_unit(tracked.twins) if rt.job_mesh is not None else None,
            t_assigned=t_assigned, t_pg=t_pg, t_restored=t_restored,
            fds=len(os.listdir("/proc/self/fd")), threads=len(os.listdir("/proc/self/task")),
            rss_mb=_rss_mb()))
        ctx = _context(rt, tracked, msg, resumed)
        phase = "train"
        return fn(ctx, *args, **kwargs)
    except NonFiniteGradients as exc:
        finite = tracked.forward_finite()
        _release_frames(exc)
        return _Retry(exc.step, None if finite is None else (1.0 if finite else "nan"))
    except (KeyboardInterrupt, SystemExit):
        group.abort()
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure leads to the next generation
        t_caught = time.time()
        if phase == "train" and rt.entries > 1 and shards.applied_twice(exc):
            # the script shards its model in the wrapped function, which runs again in every
            # survivor after a recovery: it cannot (FSDP2 takes a module once per process), and
            # a retry would meet the same - the script must change
            exc = ScriptSetupError("the training function ran again after a recovery and "
                                   "sharded its model a second time (FSDP2 shards a module once "
                                   f"per process): {shards.MESH_ADVICE}")
        if phase == "build":
            _build_failed(rt, group, exc, gen, rank, tracked.step)
        cuda = of_exception(exc)
        if cuda is not None and cuda.sticky:
            _poisoned(rt, group, exc, cuda, gen, rank, phase, tracked.step)
        group.abort()  # first: release the peers blocked on us
        reason = failure_reason(exc, phase, rt.monitor.aborted(gen), cuda is not None)
        detail = {"reason": reason, "t_caught": t_caught, "phase": phase,
                  "error": f"{type(exc).__name__}: {exc}"[:2000]}
        if phase == "restore":
            detail["t_pg"] = t_pg
        if reason in ("exception", "cuda_oom", "internal"):
            detail["traceback"] = _user_traceback(exc)[-20000:]
        if isinstance(exc, SilentCorruption):
            detail.update(sdc_step=exc.step, suspects=exc.suspects, digests=exc.digests,
                          twins=None if exc.twins is None else list(exc.twins),
                          sdc_evidence=exc.replay, sdc_scheduled=exc.scheduled)
        if cuda is not None:
            detail["cuda"] = cuda
        if rt.snapshots is not None and rt.snapshots.digests is not None:
            detail["sdc"] = rt.snapshots.digests.stats()
        _release_frames(exc)
        if reason == "cuda_oom":
            _free_device_memory()
        return _Failure(detail)


def _context(rt: Any, tracked: State, msg: dict[str, Any], resumed: Any) -> Context:
    rt.monitor.in_steps = False  # a loop left by a failure may not have said so yet
    if rt.snapshots is not None and rt.snapshots.replay is not None:
        rt.snapshots.replay.reset()  # (a replay under way when the step failed is not resumed)
    if tracked.verdict is not None:
        tracked.verdict.begin(msg.world)
    policy = rt.policy
    rules = None
    if policy.detect.loss_rules:
        from ..decide.detect import LossRules

        rules = LossRules(policy.detect.loss_rules)
    return Context(msg.rank, msg.world, msg.gen, rt.entries, msg.replacements,
                   tracked, rt, resumed, loss_rules=rules, full_world_size=msg.full_world,
                   scale_lr=policy.recover.levels.scale_in.batch == "scale_lr",
                   mesh=rt.job_mesh.device_mesh if rt.job_mesh is not None else None)


def _rss_mb() -> float:
    """This process's resident memory, in MiB (what the leak tests watch across generations)."""
    with open("/proc/self/statm") as f:
        return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


def _release_frames(exc: BaseException | None) -> None:
    """Drop what a failure's traceback keeps alive (the training function's frame, its DDP, the
    old group), here and now. An exception raised in a comm hook crossed C++ on its way up, and
    C++ may hold the exception object and release it later from one of the group's own threads:
    were the frames still attached, the group would be destroyed in that thread, which holds the
    GIL and waits to join itself."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


def _warm_gpu() -> None:
    """A warm spare of an NCCL job, before it is promoted: NCCL's environment set, and CUDA's
    driver and this process's context on its current GPU made (a script that built its model
    on the GPU has made it already), so that promotion pays for neither."""
    import torch

    nccl.prepare()
    if torch.cuda.is_available():
        torch.cuda.init()
        torch.empty(0, device="cuda")  # the context of the current device


def _free_device_memory() -> None:
    """After running out of GPU memory: what the failed step held (its frames are released
    already) goes back to the device, so the retry starts from the allocator's floor."""
    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _poisoned(rt: Any, group: Any, exc: BaseException, cuda: Any, gen: int, rank: int,
              phase: str, step: int) -> None:
    """A sticky CUDA error: this process's CUDA context is unusable (every later CUDA call fails
    the same way), so it cannot restart in place. Its group's sockets are shut (its gloo peers
    are released; pure socket calls), nothing else of CUDA or NCCL is touched (an abort could hang
    on a broken context), its last words name the error, and it ends: the controller gives its
    rank a new process and the survivors restart in place."""
    group.abort(device=False)
    print(f"nonstop: rank {rank}: {cuda.name} ({cuda.text}): this process's CUDA context is "
          f"unusable; it ends and its rank gets a new process", file=sys.stderr, flush=True)
    try:
        rt.emit(events.Exiting(code=protocol.EXIT_CUDA, assigned=True,
                               error=f"{type(exc).__name__}: {exc}"[:2000],
                               traceback=_user_traceback(exc)[-20000:], cuda=cuda,
                               gen=gen, rank=rank, phase=phase, step=step))
    finally:
        _exit(protocol.EXIT_CUDA)


def _reached_unseen(rt: Any) -> None:
    """The script reached ``nonstop.wrap``, but nothing in its source or its own modules imports
    nonstop (it came in another way: ``runpy``, ``importlib``, an installed package), so the job
    runs as a plain script's, and no generation will be assigned to this function. Waiting would
    hang: the process ends as a script failing before its training function does (the job stops
    at once, exit code 2), saying what to change."""
    a = rt.assignment
    error = ("the script reached nonstop.wrap, but neither it nor a module of its own that it "
             "imports imports nonstop, so nonstop run took it for a plain script: add "
             "'import nonstop' to the script")
    print(f"nonstop: {error}", file=sys.stderr, flush=True)
    try:
        rt.emit(events.Exiting(code=1, error=error, traceback=None, import_error=True,
                               assigned=True, gen=a.gen if a else None,
                               rank=a.rank if a else None))
    finally:
        _exit(1)


def _build_failed(rt: Any, group: Any, exc: BaseException, gen: int, rank: int,
                  step: int) -> None:
    """The mesh's build function (the script's own code) raised: the model may be half
    sharded (``fully_shard`` takes a module once), so this process cannot build it again. It
    ends as a script that fails before its training function does: the first time in the job,
    the job stops with the traceback (every attempt would fail the same way); later (a
    replacement's), its rank gets a new process."""
    group.abort()
    error = (str(exc) if isinstance(exc, ScriptSetupError) else
             f"nonstop.Mesh's build function raised {type(exc).__name__}: {exc}")[:2000]
    try:
        rt.emit(events.Exiting(code=1, error=error, traceback=_user_traceback(exc)[-20000:],
                               import_error=True, assigned=True, gen=gen, rank=rank,
                               phase="build", step=step))
    finally:
        _exit(1)


def _abort_hung(rt: Any, gen: int, rank: int, why: str) -> None:
    """This rank's NCCL communicators would not abort (or would not finish being created) in
    time: it cannot leave its generation, so it ends, and its rank gets a new process."""
    print(f"nonstop: rank {rank}: {why}; this process ends and its rank gets a new one",
          file=sys.stderr, flush=True)
    try:
        rt.emit(events.Exiting(code=protocol.EXIT_ABORT_HUNG, error=why, assigned=True,
                               abort_hung=True, gen=gen, rank=rank))
    finally:
        _exit(protocol.EXIT_ABORT_HUNG)


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _retire() -> None:
    """Leave quietly: the job is over and this process holds nothing anyone needs."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

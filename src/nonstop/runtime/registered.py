"""Registered training state: what survives a restart in memory and what a replacement receives.

A step is committed when the loop body returns (``Context.steps``). An optimizer step inside a step
that then fails leaves the rank *dirty*: its parameters are neither at the start nor at the end of
the step, so it must receive state from a clean peer.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from ..torch_internals import get as torch_private


class NonFiniteGradients(BaseException):
    """Raised from ``optimizer.step()`` when a gradient is NaN or Inf: the step is not applied.

    A BaseException so that a user's ``except Exception`` does not swallow it: nonstop catches it
    around the training function and retries (or skips) the step on every rank at once.
    """

    def __init__(self, step: int):
        super().__init__(f"non-finite gradients at step {step}")
        self.step = step


class Regroup(BaseException):
    """Raised at a step boundary when the controller asked the ranks to leave their generation
    (the world grows): not a failure, nothing is lost. A BaseException, like
    ``NonFiniteGradients``, so that the script's ``except Exception`` lets it through."""

    def __init__(self, gen: int):
        super().__init__(f"generation {gen} ends at a step boundary: the world grows")
        self.gen = gen


class State:
    """Objects that don't depend on the process group, kept across generations.

    Each object must have ``state_dict()`` and ``load_state_dict()`` (modules, optimizers, LR
    schedulers, grad scalers, ``nonstop.RNGState()``...), or be a ``dict`` (updated in place) or a
    tensor (copied in place).

    ``sharded=True`` says the state differs from rank to rank (an optimizer sharded across the
    data-parallel ranks, ZeRO-style): a rank's state then only ever comes from its own snapshots
    (its node's memory, the replica on its buddy node, its part of a disk checkpoint), and after a
    failure every rank resumes from the newest step every shard has.

    Example::

        state = nonstop.State(model=model, optimizer=opt, scheduler=sched)
    """

    def __init__(self, sharded: bool = False, **objects: Any):
        import torch

        if not isinstance(sharded, bool):
            raise TypeError("nonstop.State(sharded=...) takes True or False; 'sharded' is not a "
                            "name an object can be registered under")
        if not objects:
            raise ValueError("nonstop.State needs at least one object, e.g. State(model=model)")
        for name, obj in objects.items():
            if not (isinstance(obj, (dict, torch.Tensor))
                    or (callable(getattr(obj, "state_dict", None))
                        and callable(getattr(obj, "load_state_dict", None)))):
                raise TypeError(f"nonstop.State: {name!r} ({type(obj).__name__}) has no "
                                "state_dict()/load_state_dict() and is not a dict or tensor")
        self._init_counters()
        self.sharded = sharded
        self._objects = dict(objects)
        for obj in objects.values():
            if isinstance(obj, torch.optim.Optimizer):
                obj.register_step_pre_hook(self._before_optimizer_step)
                obj.register_step_post_hook(self._optimizer_stepped)
            elif isinstance(obj, torch.nn.Module):
                obj.register_forward_pre_hook(self._before_forward)
                obj.register_forward_hook(self._after_forward)
        _not_kept(list(objects))

    def _init_counters(self) -> None:
        self._objects: dict[str, Any] = {}
        self.sharded = False
        # sharded state over a mesh: for each rank, which shard it holds (ranks with the same
        # one - HSDP's twins across replica groups - are each other's copies); None: none are
        self.twins: tuple[int, ...] | None = None
        # built by a nonstop.Mesh: its shards keep their mesh coordinates (a world that changes
        # by whole replica groups is no reshard: every rank keeps its shard)
        self.meshed = False
        # a pipeline's mesh: the twins of a job of another size (world -> which stage each of
        # its ranks held), to read a checkpoint written at that size; None: not a pipeline
        self.stage_twins: Callable[[int], tuple[int, ...] | None] | None = None
        # any mesh's: the twins of a job of another size (world -> which part each of its ranks
        # held), to take a part from an old rank that held it
        self.twins_at: Callable[[int], tuple[int, ...] | None] | None = None
        self.step = 0  # steps completed
        self.dirty = False  # an optimizer stepped inside a step that has not completed
        self.check_finite = False  # set by the runtime from the policy
        self.compute_s = 0.0  # forward time of the registered modules in the current step
        self._on_optimizer_step: Callable[[], None] | None = None
        self._on_commit: Callable[[], None] | None = None  # a fault point, before the commit
        # a sharded step's commit failed on this rank: keep the state before the step (True:
        # kept, the step may be taken on this rank's own verdict); set by the runtime
        self._keep_before_step: Callable[[], bool] | None = None
        self._forward_fault: Callable[[int], tuple[float, bool]] | None = None
        # each forward output, with the step it belongs to: the step's trace (detect.sdc: what
        # a replay of the step is compared with); set by the runtime
        self._on_output: Callable[[int, Any], None] | None = None
        self._rank = 0
        self._t_forward = 0.0
        self._poison = False
        self._last_output: Any = None
        # whether this step's earlier forward outputs (micro-batches, accumulation) were all
        # finite: a 0-d flag per device, folded as each next output comes, never read until a
        # step goes bad (no host sync) - the last output alone said "finite" for a pipeline stage
        # whose first micro-batch had turned NaN
        self._finite_before: dict[Any, Any] = {}
        self._fresh = True  # the next forward is its step's first: start over
        self._prune: set[int] = set()  # optimizers to keep only this rank's shard of, at next step
        self._sharded_opts: dict[int, bool] = {}  # optimizer -> whether its parameters are DTensors
        # FSDP2's reductions carry the NaN verdict (runtime/verdict.py); set by the runtime
        self.verdict: Any = None
        # a staged snapshot's copy may still be reading the state on the GPU: what updates it in
        # place waits for it there first (``fence``; nothing waits on the host)
        self._fence: Callable[[], None] | None = None

    # -- hooks (cheap: they run at every step) ------------------------------------------------
    def _before_forward(self, module: Any, args: Any) -> None:
        self._t_forward = time.perf_counter()
        if self._forward_fault is not None:
            delay, self._poison = self._forward_fault(self.step)
            if delay:
                time.sleep(delay)  # an injected straggler: slow compute, inside the forward pass

    def _after_forward(self, module: Any, args: Any, output: Any) -> Any:
        self.compute_s += time.perf_counter() - self._t_forward
        poisoned = self._poison
        if poisoned:
            self._poison = False
            output = _poisoned(output)
        if self._fresh:
            self._fresh, self._finite_before = False, {}
        elif self._last_output is not None:  # another forward of the same step: one pass over
            self._fold(self._last_output)  # the one before, on its device (none with one forward)
        self._last_output = _detached(output)  # a view, no copy: checked only if a step goes bad
        if self._on_output is not None:
            self._on_output(self.step, self._last_output)
        return output if poisoned else None

    def _fold(self, out: Any) -> None:
        import torch

        if isinstance(out, torch.Tensor) and out.is_floating_point():
            ok = torch.isfinite(out).all()
            before = self._finite_before.get(out.device)
            self._finite_before[out.device] = ok if before is None else before & ok

    def begin_step(self) -> None:
        """A step begins (``ctx.steps``): its forward time and outputs are counted afresh - one
        redone after a failed generation too."""
        self.compute_s = 0.0
        self._fresh = True

    def forward_finite(self) -> bool | None:
        """Whether every forward output of this rank's step was finite (None: unknown): each
        micro-batch's, not only the last. Costs a pass over the last output, so it is only
        asked when gradients turned out non-finite; the step's outputs are then forgotten (it
        is redone, or the generation ends)."""
        if self._last_output is not None:
            self._fold(self._last_output)
        flags = list(self._finite_before.values())
        self._last_output, self._finite_before, self._fresh = None, {}, True
        if not flags:
            return None
        return all(bool(f) for f in flags)

    def fence(self) -> None:
        """Before the state is changed in place: a snapshot's copy from the GPU under way has
        read it first (the GPU waits, not the host)."""
        if self._fence is not None:
            self._fence()

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.fence()
        sharded = self._sharded_optimizer(optimizer)
        if sharded and self._on_commit is not None:
            self._on_commit()
        # a sharded job's ranks agree on every step before taking it (``_agreement``)
        how = self._agreement(sharded)
        keep = self._keep_before_step if sharded and self.twins is not None else None
        finite = self.verdict.take(self.step) if how == "reduction" else None
        if finite is None and (self.check_finite or how == "commit"):
            finite = _grads_finite(optimizer, sharded, keep)  # (the commit, where sharded)
        if self.check_finite and finite is False:
            raise NonFiniteGradients(self.step)
        if id(optimizer) in self._prune:  # after a reshard: this rank's parameters only
            self._prune.discard(id(optimizer))
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        optimizer.state.pop(p, None)

    def agreement(self) -> str | None:
        """How the ranks agree to take a step in this generation (``EnteredGeneration``)."""
        import torch

        return self._agreement(any(self._sharded_optimizer(o) for o in self._objects.values()
                                   if isinstance(o, torch.optim.Optimizer)))

    def _agreement(self, sharded: bool) -> str | None:
        """"commit": one flag all-reduced after every gradient reduction - NaN check or not
        where a shard has a twin (a survivor whose commit failed keeps the state before the
        step, so that the twins' copies meet at one step); "reduction": the NaN verdict carried
        by FSDP2's reductions (runtime/verdict.py) - with no twin, a snapshot is the only other
        copy and the commit would serve the verdict alone; None: nothing to agree on."""
        if not sharded:
            return None
        if self.twins is not None and self._keep_before_step is not None:
            return "commit"
        if not self.check_finite:
            return None
        return "reduction" if self.twins is None and self.verdict is not None else "commit"

    def _sharded_optimizer(self, optimizer: Any) -> bool:
        """Whether ``optimizer``'s parameters are this rank's own: DTensors, or any state built
        over a mesh (a pipeline's stage is plain tensors; a NaN in one stage's gradients must stop
        every stage's step). Decided at its first step: an optimizer is built on the parameters
        it keeps."""
        known = self._sharded_opts.get(id(optimizer))
        if known is None:
            from ..state import shards

            known = self._sharded_opts[id(optimizer)] = (self.meshed
                                                         or shards.sharded_object(optimizer))
        return known

    def prune_unowned(self) -> None:
        """After sharded state was merged from every shard (another world size): at each
        optimizer's next step, drop the state of the parameters that get no gradient on this rank
        (another rank owns them now)."""
        import torch

        self._prune = {id(o) for o in self._objects.values() if isinstance(o, torch.optim.Optimizer)}

    def _optimizer_stepped(self, *_: Any) -> None:
        self.dirty = True
        self._fresh = True  # the next forward is the next step's (with ctx.steps or without)
        if self._on_optimizer_step is not None:
            self._on_optimizer_step()

    def zero_grads(self) -> None:
        """Drop the gradients of every registered optimizer (a step is being retried)."""
        import torch

        for obj in self._objects.values():
            if isinstance(obj, torch.optim.Optimizer):
                obj.zero_grad(set_to_none=True)
        if self.verdict is not None:
            self.verdict.forget()

    # -- state ----------------------------------------------------------------------------------
    def objects(self) -> dict[str, Any]:
        return dict(self._objects)

    def modules(self) -> list[Any]:
        """The registered modules: their parameters are what the replicas must agree on."""
        import torch

        return [o for o in self._objects.values() if isinstance(o, torch.nn.Module)]

    def to_device(self, device: Any) -> int:
        """Move what this state holds on another GPU to ``device``, in place: a warm spare built
        its model on the GPU current when its script ran, and the rank it takes may use another.
        Modules keep their parameter objects (their data moves), so optimizers still hold
        them; optimizer state moves tensor by tensor (a step counter on the host stays there).
        Returns how many tensors moved (0 on one GPU, or on the host)."""
        import torch

        def stray(t: Any) -> bool:
            return isinstance(t, torch.Tensor) and t.is_cuda and t.device != device

        moved = 0
        for obj in self._objects.values():
            if isinstance(obj, torch.nn.Module):
                n = sum(stray(t) for t in (*obj.parameters(), *obj.buffers()))
                if n:
                    obj.to(device)
                    moved += n
            elif isinstance(obj, torch.optim.Optimizer):
                for per_param in obj.state.values():
                    for key, value in per_param.items():
                        if stray(value):
                            per_param[key] = value.to(device)
                            moved += 1
            elif stray(obj):
                with torch.no_grad():
                    obj.data = obj.data.to(device)
                moved += 1
        return moved

    def flip_bit(self, seed: int) -> str:
        """Fault injection (``bitflip``): one bit of one parameter flips, in place. Returns
        where."""
        import random

        import torch

        from ..state import shards

        params = [(f"{i}.{n}", shards.local(p.detach())) for i, m in enumerate(self.modules())
                  for n, p in m.named_parameters()]  # a shard: this rank's part of it
        params = [(n, p) for n, p in params if p.numel() and p.element_size() in (2, 4, 8)]
        if not params:
            raise RuntimeError("bitflip: no parameter of a registered module to flip a bit of")
        pick = random.Random(seed)
        name, p = params[pick.randrange(len(params))]
        words = {2: torch.int16, 4: torch.int32, 8: torch.int64}[p.element_size()]
        self.fence()
        flat = p.view(words).view(-1)
        mantissa = {2: 7, 4: 23, 8: 52}[p.element_size()]  # bf16's (fp16 has 10)
        index, bit = pick.randrange(flat.numel()), pick.randrange(mantissa)
        with torch.no_grad():  # a mantissa bit: the value changes a little, nothing overflows
            flat[index] ^= 1 << bit
        return f"{name}[{index}] bit {bit}"

    def copies_on_load(self, name: str) -> bool:
        """Whether loading the object copies the tensors it is given (a module copies into its
        parameters; an optimizer, a dict or a tensor may keep them): only then may the tensors
        loaded into it live in memory that will be written again."""
        import torch

        return isinstance(self._objects.get(name), torch.nn.Module)

    def state_dict(self) -> dict[str, Any]:
        """Every object's state dict, by name. A sharded module's or optimizer's DTensors are
        given as this rank's local tensors (no copy), their paths under ``shards.KEY``."""
        import torch

        from ..state import shards

        out: dict[str, Any] = {}
        paths: dict[str, list[list[Any]]] = {}
        for name, obj in self._objects.items():
            if isinstance(obj, torch.Tensor):
                out[name] = shards.local(obj.detach())
            elif isinstance(obj, dict):
                out[name] = dict(obj)
            elif shards.sharded_object(obj):
                out[name], paths[name] = shards.localize(obj.state_dict())
            else:
                out[name] = obj.state_dict()
        if paths:
            out[shards.KEY] = paths
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        import torch

        from ..state import shards

        missing = set(self._objects) - set(sd)
        if missing:
            raise KeyError(f"state is missing {sorted(missing)}")
        paths = shards.check_paths(sd[shards.KEY]) if shards.KEY in sd else {}
        for name in paths:
            if name not in self._objects:
                raise shards.ShardMismatch(f"{shards.KEY}: {name!r} is not a registered object")
        in_place = {name for name, obj in self._objects.items()
                    if isinstance(obj, torch.nn.Module) and shards.sharded_object(obj)}
        parts = {name: sd[name] if name in in_place else
                 shards.globalize(name, obj, sd[name], paths.get(name, []))
                 for name, obj in self._objects.items()}
        self.fence()
        for name, obj in self._objects.items():
            if name in in_place:
                shards.load_in_place(name, obj, parts[name], paths.get(name, []))
            elif isinstance(obj, torch.Tensor):
                with torch.no_grad():
                    shards.local(obj).copy_(parts[name])
            elif isinstance(obj, dict):
                obj.clear()
                obj.update(parts[name])
            else:
                obj.load_state_dict(parts[name])

    def __getitem__(self, name: str) -> Any:
        """The object registered as ``name`` (``state["optimizer"]``)."""
        return self._objects[name]


class RNGState:
    """The random number generators of this process (Python's, NumPy's if loaded, torch's CPU and
    CUDA ones), as an object to register: ``State(model=m, optimizer=o, rng=nonstop.RNGState())``.
    Snapshots and checkpoints then carry them, so dropout and data shuffling replay exactly after
    a restore. (A peer's live state carries the peer's generators: seed per rank with
    ``ctx.steps(reseed=...)`` where that matters.)"""

    def state_dict(self) -> dict[str, Any]:
        import random
        import sys

        import torch

        out: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if "numpy" in sys.modules:
            out["numpy"] = sys.modules["numpy"].random.get_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = torch.cuda.get_rng_state_all()
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        import random
        import sys

        import torch

        random.setstate(_as_rng_tuple(sd["python"]))
        torch.set_rng_state(sd["torch"].clone())
        if "numpy" in sd and "numpy" in sys.modules:
            sys.modules["numpy"].random.set_state(_as_rng_tuple(sd["numpy"]))
        if "cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([t.clone() for t in sd["cuda"]])


def _as_rng_tuple(value: Any) -> Any:
    """A generator state back as the nested tuples ``setstate`` wants (it may come back as lists)."""
    if isinstance(value, list):
        return tuple(_as_rng_tuple(v) for v in value)
    return value


class _StepOnly(State):
    """The step counter of a function wrapped with no registered state."""

    def __init__(self) -> None:  # noqa: D107 - no objects to check
        self._init_counters()


def _not_kept(names: list[str]) -> None:
    """Under ``nonstop run``, a State made once the training function was wrapped (inside it,
    most often), other than the one a ``Mesh``'s build function returns, is kept by nothing:
    the rank says so, once per process."""
    from . import lasting, worker

    rt = worker.current()
    if rt is None or not rt.wrapped or lasting.in_build() or rt.said_not_kept:
        return
    from ..protocol import events

    rt.said_not_kept = True
    a = rt.assignment
    rt.emit(events.StateNotKept(gen=a.gen if a is not None else None, rank=rt.rank,
                                function=rt.function_name, names=names))


def _grads_finite(optimizer: Any, sharded: bool,
                  keep_before_step: Callable[[], bool] | None = None) -> bool:
    """Whether every gradient of ``optimizer`` is finite; ``sharded`` (its parameters are
    DTensors): each rank reads its own shards, and the verdict is all-reduced - the step's
    commit, the last collective of a step.

    A commit that fails on this rank (a peer left as the ranks agreed) leaves it unsure whether
    others took the step: one that completed it did (every rank had reduced its gradients, and
    the verdict was finite). So this rank takes the step too, on its own verdict, after keeping
    the state before it (``keep_before_step``): a restore then finds every shard at the newer
    step (nothing lost), or goes back to the kept one where some shard never reached it.
    Without a copy kept, or with a verdict of its own that is not finite, the failure is raised
    and the step not taken."""
    import torch

    grads = [p.grad for group in optimizer.param_groups for p in group["params"]
             if p.grad is not None]
    if sharded:
        from ..state import shards

        grads = [t for t in (shards.local(g) for g in grads) if t.numel()]
    if grads:
        norms = torch_private("foreach_norm")(grads)  # one pass; a NaN or Inf anywhere: a non-finite norm
        finite = bool(torch.isfinite(torch.stack([n.float() for n in norms])).all())
    else:
        finite = True
    if sharded:  # each rank sees its shard only: every rank must take the same decision
        import torch.distributed as dist

        flag = torch.tensor([0.0 if finite else 1.0])
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        except Exception as exc:
            from .worker import is_collective_error

            # only a finite verdict of its own is taken: gradients this rank finds non-finite
            # as its peers fail may be an aborted reduction's (a GPU's), not the model's
            if keep_before_step is None or not finite or not is_collective_error(exc) \
                    or not keep_before_step():
                raise
            return True
        finite = not flag.item()
    return finite


def _detached(output: Any) -> Any:
    import torch

    if isinstance(output, torch.Tensor):
        return output.detach()
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0].detach()
    return None


def _poisoned(output: Any) -> Any:
    import torch

    if isinstance(output, torch.Tensor):
        return output * float("nan")
    if isinstance(output, (tuple, list)):
        return type(output)(_poisoned(o) for o in output)
    return output

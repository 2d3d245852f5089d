"""Registered training state: what survives a restart in memory and what a replacement receives.

A step is committed when the loop body returns (``Context.steps``). An optimizer step inside a step
that then fails leaves the rank *dirty*: its parameters are neither at the start nor at the end of
the step, so it must receive state from a clean peer.
"""

from __future__ import annotations

from typing import Any, Callable


class State:
    """Objects that don't depend on the process group, kept across generations.

    Each object must have ``state_dict()`` and ``load_state_dict()`` (modules, optimizers, LR
    schedulers, grad scalers...), or be a ``dict`` (updated in place) or a tensor (copied in place).

    Example::

        state = nonstop.State(model=model, optimizer=opt, scheduler=sched)
    """

    def __init__(self, **objects: Any):
        import torch

        if not objects:
            raise ValueError("nonstop.State needs at least one object, e.g. State(model=model)")
        for name, obj in objects.items():
            if not (isinstance(obj, (dict, torch.Tensor))
                    or (callable(getattr(obj, "state_dict", None))
                        and callable(getattr(obj, "load_state_dict", None)))):
                raise TypeError(f"nonstop.State: {name!r} ({type(obj).__name__}) has no "
                                "state_dict()/load_state_dict() and is not a dict or tensor")
        self._objects = dict(objects)
        self.step = 0  # steps completed
        self.dirty = False  # an optimizer stepped inside a step that has not completed
        self._on_optimizer_step: Callable[[], None] | None = None
        for obj in objects.values():
            if isinstance(obj, torch.optim.Optimizer):
                obj.register_step_post_hook(self._optimizer_stepped)

    def _optimizer_stepped(self, *_: Any) -> None:
        self.dirty = True
        if self._on_optimizer_step is not None:
            self._on_optimizer_step()

    def objects(self) -> dict[str, Any]:
        return dict(self._objects)

    def state_dict(self) -> dict[str, Any]:
        import torch

        out: dict[str, Any] = {}
        for name, obj in self._objects.items():
            if isinstance(obj, torch.Tensor):
                out[name] = obj.detach()
            elif isinstance(obj, dict):
                out[name] = dict(obj)
            else:
                out[name] = obj.state_dict()
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        import torch

        missing = set(self._objects) - set(sd)
        if missing:
            raise KeyError(f"state is missing {sorted(missing)}")
        for name, obj in self._objects.items():
            if isinstance(obj, torch.Tensor):
                with torch.no_grad():
                    obj.copy_(sd[name])
            elif isinstance(obj, dict):
                obj.clear()
                obj.update(sd[name])
            else:
                obj.load_state_dict(sd[name])


class _StepOnly(State):
    """The step counter of a function wrapped with no registered state."""

    def __init__(self) -> None:  # noqa: D107 - no objects to check
        self._objects = {}
        self.step = 0
        self.dirty = False
        self._on_optimizer_step = None

"""A sharded step's NaN verdict carried by FSDP2's own gradient reduction, where no commit is
needed for anything else.

The ranks of a sharded job must take the same decision on a step: each sees only its shards of
the gradients, so a NaN in one rank's shard would stop that rank's step alone. nonstop's commit
all-reduces one flag after every gradient reduction for that. On gloo that collective is one
network round trip a step (0.5-0.7 ms on loopback: 1-2% of a 40 ms step, as much as every
other cost of nonstop together).

A job with no twin - plain FSDP2 over every rank - needs the commit for the verdict only (its
other use, letting survivors keep the state before a step whose commit failed, serves a twin's
copy; docs/design.md, "A step's commit"). There the verdict rides in the reduce-scatter that
FSDP2 makes anyway: before a unit's gradients are reduced, a rank that finds any of them not
finite makes one element of every rank's part of the unit's input NaN, so every rank's output
of that reduction holds a NaN (a sum with a NaN is a NaN, and every rank's part of a unit is the
same padded size, never empty).
Each rank then checks the outputs it received, and all reach the same verdict with no message
of their own. The checks are sums (finite exactly when every element is), and the NaN goes into
one element of each rank's part, times 1 or NaN: no bit changes on a finite step, and a GPU
is never waited for.

Installed when the rank's state is built, on every FSDP2 unit of the registered modules, when
the structure allows it on every rank alike: each of the optimizers' parameters is a unit's, on
a one-dimensional mesh (no tensor parallel, no HSDP all-reduce whose outputs the check would
not see), in float32 or bfloat16 (a reduced float32 gradient stays finite in either). The
reduction's own communication (the default, or one the script set) is wrapped, not replaced.
"""

from __future__ import annotations

import functools
from typing import Any

from ..torch_internals import get as torch_private

_EXACT = ("float32", "bfloat16")  # parameter dtypes a finite reduced float32 gradient stays finite in


class ReducedVerdict:
    """The flags of the gradient reductions of one rank since its last optimizer step."""

    def __init__(self) -> None:
        self._flags: list[Any] = []  # per reduction: the sum of its output (0-dim)
        self._sizes: set[int] = set()  # the sizes of the groups they were reduced over
        self._world = 0
        self._taken: tuple[int, bool] | None = None  # (step, verdict) of the step's first optimizer

    def begin(self, world: int) -> None:
        """A (re)entry into a generation of ``world`` ranks: what an earlier attempt of a step
        reduced is forgotten."""
        self._world = world
        self.forget()

    def forget(self) -> None:
        self._flags.clear()
        self._sizes.clear()
        self._taken = None

    def take(self, step: int) -> bool | None:
        """Whether every gradient reduced since the last step was finite on every rank; None
        when no reduction over every rank carried the verdict (the step must commit). The
        same answer on every rank: they made the same reductions. A second optimizer of the
        same ``step`` gets the first one's verdict."""
        import torch

        flags, sizes = self._flags, self._sizes
        if not flags and self._taken is not None and self._taken[0] == step:
            return self._taken[1]
        try:
            if not flags or sizes != {self._world}:
                return None
            finite = bool(torch.isfinite(torch.stack(flags)).all())
        finally:
            self.forget()
        self._taken = (step, finite)
        return finite

    def note(self, output: Any, group: Any) -> None:
        self._flags.append(output.sum())  # finite exactly when every element is (see above)
        self._sizes.add(group.size())


def install(objects: dict[str, Any]) -> ReducedVerdict | None:
    """A verdict carried by the reductions of the FSDP2 units of ``objects`` (a State's), or
    None when the structure does not allow it (see the module's docstring)."""
    import torch

    from torch.distributed.fsdp import FSDPModule
    groups = []
    for obj in objects.values():
        if isinstance(obj, torch.nn.Module):
            for m in obj.modules():
                if isinstance(m, FSDPModule):
                    groups += getattr(m._get_fsdp_state(), "_fsdp_param_groups", None) or []
    if not groups:
        return None
    FSDPMeshInfo = torch_private("fsdp.FSDPMeshInfo")  # noqa: N806 - torch's classes
    HSDPMeshInfo = torch_private("fsdp.HSDPMeshInfo")  # noqa: N806
    owned: set[int] = set()
    for g in groups:
        info = getattr(g, "mesh_info", None)
        if not isinstance(info, FSDPMeshInfo) or isinstance(info, HSDPMeshInfo) \
                or not hasattr(g, "_reduce_scatter_comm"):
            return None
        for fp in g.fsdp_params:
            param = fp.sharded_param
            if param.device_mesh.ndim != 1 or str(param.dtype).split(".")[-1] not in _EXACT:
                return None
            owned.add(id(param))
    params = [p for obj in objects.values() if isinstance(obj, torch.optim.Optimizer)
              for group in obj.param_groups for p in group["params"]]
    if not params or any(id(p) not in owned for p in params):
        return None
    verdict = ReducedVerdict()
    checking = _checking_class()
    for g in groups:
        if not isinstance(g._reduce_scatter_comm, checking):
            g._reduce_scatter_comm = checking(g._reduce_scatter_comm, verdict)
        else:  # a state built again over the same modules: its verdict is the new one
            g._reduce_scatter_comm.verdict = verdict
    return verdict


@functools.cache
def _checking_class() -> type:
    """The reduce-scatter that carries the verdict (a subclass of FSDP2's interface, made when
    first installed: torch's FSDP2 is not imported with nonstop)."""
    ReduceScatter = torch_private("fsdp.ReduceScatter")  # noqa: N806 - torch's class

    class CheckingReduceScatter(ReduceScatter):
        """FSDP2's reduce-scatter of one unit, with a NaN anywhere spread to every rank's part
        (before) and each rank's part checked (after)."""

        def __init__(self, inner: Any, verdict: ReducedVerdict) -> None:
            self.inner = inner
            self.verdict = verdict

        def allocate(self, size: Any, *, dtype: Any, device: Any) -> Any:
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, op: Any,
                     async_op: bool = False) -> Any:
            import torch

            # a sum is finite exactly when every element is (short of overflowing float32's
            # range): one pass, several times cheaper than isfinite().all() on a CPU
            finite = torch.isfinite(input_tensor.sum())
            # the first element of each rank's part times 1 (every bit kept) or NaN: each rank's
            # output then holds a NaN; no wait on a device, no pass over the rest
            heads = input_tensor.view(group.size(), -1)[:, 0]
            heads.mul_(torch.where(finite, 1.0, float("nan")).to(input_tensor.dtype))
            work = self.inner(output_tensor, input_tensor, group, op, async_op)
            if async_op and work is not None:
                work.wait()
            self.verdict.note(output_tensor, group)
            return work

    return CheckingReduceScatter

"""Bit-for-bit reproducible DDP across restarts.

DDP reduces gradients in flat buckets and re-buckets them after its first iteration (by the order
gradients became ready). A ring allreduce sums each element in an order that depends on its place
in the bucket, so the first step after any restart (a DDP object built anew) rounds differently
from an uninterrupted run. ``reproducible(ddp)`` reduces each gradient on its own, so the result
no longer depends on the bucket layout.
"""

from __future__ import annotations

import datetime
from typing import Any

_WAIT_SLICE = datetime.timedelta(seconds=0.05)  # how often a reduction's wait looks at the abort


def _per_gradient_allreduce(process_group, bucket):  # no annotations: DDP inspects them
    import torch
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    grads = bucket.gradients()
    aborted = _abort_flag()
    works = []
    for g in grads:
        if aborted():  # an operation posted on an aborted group may never be released
            raise RuntimeError("gloo: the generation was aborted during the gradient reduction")
        works.append(dist.all_reduce(g, group=group, async_op=True))
    on_cpu = bool(grads) and grads[0].device.type == "cpu"
    for w in works:
        if on_cpu:
            _wait(w, aborted)
        else:  # NCCL: a wait orders the stream, it does not block
            w.wait()
    buffer = bucket.buffer()
    # gradients() are views into the buffer unless DDP had to copy them out
    for g, view in zip(grads, _views(buffer, grads)):
        if g.data_ptr() != view.data_ptr():
            view.copy_(g.reshape(-1))
    buffer.div_(world)
    fut = torch.futures.Future()
    fut.set_result(buffer)
    return fut


def _wait(work, aborted) -> None:
    """Wait for one gloo operation, and leave once the generation is aborted. Shutting the
    group's sockets releases most operations at once, but not all: gloo's ring may wait for a
    send that the vanished peer never asks for, until the group's timeout (minutes)."""
    while True:
        try:
            work.wait(_WAIT_SLICE)
            return
        except RuntimeError:
            if work.is_completed():  # it failed: its own error
                raise
            if aborted():
                raise RuntimeError("gloo: the generation was aborted during the gradient "
                                   "reduction") from None


def _abort_flag():
    from .runtime import worker

    rt = worker._RUNTIME
    if rt is None:
        return lambda: False
    return rt.monitor.current_aborted


def _views(buffer: Any, grads: list) -> list:
    out, offset = [], 0
    for g in grads:
        n = g.numel()
        out.append(buffer[offset:offset + n])
        offset += n
    return out


def reproducible(ddp: Any, process_group: Any = None) -> Any:
    """Register a comm hook on ``ddp`` that makes its reduction independent of bucket layout.

    Costs one allreduce per parameter instead of one per bucket: negligible for small models,
    measurable for models with hundreds of parameter tensors. Returns ``ddp``.
    """
    ddp.register_comm_hook(process_group, _per_gradient_allreduce)
    return ddp

"""Bit-for-bit reproducible DDP across restarts.

DDP reduces gradients in flat buckets and re-buckets them after its first iteration (by the order
gradients became ready). A ring allreduce sums each element in an order that depends on its place
in the buffer reduced, so the first step after any restart (a DDP object built anew) rounds
differently from an uninterrupted run. ``reproducible(ddp)`` reduces the gradients in buckets of
its own, fixed by the order of the model's parameters and a size (never by DDP's layout): the
same buffers in every process, every iteration, before and after any restart.

DDP hands its buckets to the hook as they become ready; the hook keeps them until the iteration's
last one, then reduces every gradient in the fixed buckets and writes the results into DDP's
buffers, which DDP copies into ``.grad`` when the backward pass ends. The price against DDP's own
reduction: the reductions wait for the end of the backward pass (no overlap with it) and each
gradient is copied twice more.
"""

from __future__ import annotations

import datetime
from typing import Any

_WAIT_SLICE = datetime.timedelta(seconds=0.05)  # how often a reduction's wait looks at the abort
BUCKET_MB = 25.0  # DDP's own default bucket size


class _FixedBuckets:
    """The hook's state: where each parameter sits in the model's order, and this iteration's
    buckets so far."""

    def __init__(self, ddp: Any, process_group: Any, bucket_mb: float):
        self.group = process_group
        self.cap = max(1, int(bucket_mb * 1024 * 1024))
        self.index = {id(p): i for i, p in enumerate(ddp.module.parameters())}
        self.pending: list[tuple[Any, list, list]] = []


def _fixed_bucket_allreduce(state, bucket):  # no annotations: DDP inspects them
    import torch

    buffer = bucket.buffer()
    if bucket.index() == 0:  # DDP launches its buckets in order: an iteration begins
        state.pending = []  # (what an aborted iteration left is dropped)
    state.pending.append((buffer, bucket.gradients(), bucket.parameters()))
    if bucket.is_last():
        pending, state.pending = state.pending, []
        _reduce(state, pending)
    fut = torch.futures.Future()
    fut.set_result(buffer)  # the same tensor: reduced in place by the last bucket's call
    return fut


def _reduce(state: _FixedBuckets, pending: list[tuple[Any, list, list]]) -> None:
    """Every gradient of the iteration, reduced in the fixed buckets, averaged, written into the
    DDP buffer it came in."""
    import torch
    import torch.distributed as dist

    group = state.group if state.group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    entries = []  # (the parameter's place in the model, its gradient, its slice of DDP's buffer)
    for buffer, grads, params in pending:
        for g, view, p in zip(grads, _views(buffer, grads), params):
            entries.append((state.index.get(id(p), len(state.index) + len(entries)), g, view))
    entries.sort(key=lambda e: e[0])
    buckets: list[list] = [[]]
    size = 0
    for e in entries:
        n = e[1].numel() * e[1].element_size()
        if buckets[-1] and size + n > state.cap:
            buckets.append([])
            size = 0
        buckets[-1].append(e)
        size += n
    aborted = _abort_flag()
    flats, works = [], []
    for b in buckets:
        if not b:
            continue
        if aborted():  # an operation posted on an aborted group may never be released
            raise RuntimeError("gloo: the generation was aborted during the gradient reduction")
        flat = torch.cat([g.reshape(-1) for _, g, _ in b])
        flats.append((flat, b))
        works.append(dist.all_reduce(flat, group=group, async_op=True))
    on_cpu = bool(flats) and flats[0][0].device.type == "cpu"
    for w in works:
        if on_cpu:
            _wait(w, aborted)
        else:  # NCCL: a wait orders the stream, it does not block
            w.wait()
    for flat, b in flats:
        flat.div_(world)
        offset = 0
        for _, g, view in b:
            n = g.numel()
            view.copy_(flat[offset:offset + n])
            offset += n


def _wait(work, aborted) -> None:
    """Wait for one gloo operation, and leave once the generation is aborted. Shutting the
    group's sockets releases most operations at once, but not all: gloo's ring may wait for a
    send that the vanished peer never asks for, until the group's timeout (minutes)."""
    while True:
        try:
            work.wait(_WAIT_SLICE)
            return
        except RuntimeError:
            # The slice ran out ("Operation timed out!"), or the operation failed. One that
            # completed in between (a slice's end and this look) may well have succeeded: its own
            # result decides, not the slice's timeout (taken for a peer's failure, it made a
            # fault of a healthy step about once a run at 8 ranks on 2 cores).
            if work.is_completed():
                work.wait()  # raises the operation's own error, if it failed
                return
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


def reproducible(ddp: Any, process_group: Any = None, bucket_mb: float = BUCKET_MB) -> Any:
    """Register a comm hook on ``ddp`` that makes its reduction independent of DDP's bucket
    layout: gradients are reduced in buckets of ``bucket_mb`` fixed by the order of the model's
    parameters. Returns ``ddp``."""
    ddp.register_comm_hook(_FixedBuckets(ddp, process_group, bucket_mb), _fixed_bucket_allreduce)
    return ddp

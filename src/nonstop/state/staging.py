"""The device copy of a snapshot: a pinned host mirror of a state's GPU tensors, filled on a side
stream while training goes on, and the pinned bounce buffers a restore takes back to the GPU."""

from __future__ import annotations

import time
from collections import OrderedDict
from itertools import chain
from typing import Any, Iterable

from . import shards

CHUNK = 64 << 20  # bytes of each of the two bounce buffers of a restore
_POLL_S = (0.00005, 0.001)  # an event is polled, first often, then every millisecond
RESTORE_S = 60.0  # a restore's copies may take this long, plus a second per GB


def device_of(tensors: Iterable[Any]) -> Any:
    """The CUDA device a state's tensors live on, or None: none on CUDA, some on another
    accelerator, or on several CUDA devices (those take the synchronous path)."""
    found = None
    for t in tensors:
        d = t.device
        if d.type == "cpu":
            continue
        if d.type != "cuda" or (found is not None and d != found):
            return None
        found = d
    return found


def late_ptrs(state: Any) -> set[int]:
    """Where the tensors live that only a registered optimizer's step writes (its parameters and
    its state): their copy may still be under way until that optimizer's next step."""
    import torch

    objects = state.objects() if callable(getattr(state, "objects", None)) else {}
    out: set[int] = set()
    for obj in objects.values():
        if not isinstance(obj, torch.optim.Optimizer):
            continue
        for group in obj.param_groups:
            out.update(p.data_ptr() for p in group["params"])
        for entry in obj.state.values():
            if isinstance(entry, dict):
                out.update(t.data_ptr() for t in entry.values() if isinstance(t, torch.Tensor))
    out.discard(0)
    return out


def wait_event(event: Any, deadline: float, what: str, most: float = _POLL_S[1]) -> None:
    """Until ``event`` has happened; TimeoutError at ``deadline`` (time.monotonic()). Polled,
    at most ``most`` seconds apart: an event's own wait cannot be given a deadline."""
    delay = min(_POLL_S[0], most)
    while not event.query():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not done by its deadline")
        time.sleep(delay)
        delay = min(most, delay * 2)


class Staging:
    """One rank's host mirror of its state, laid out as the snapshot's data, kept while the
    layout stays the same. ``device``: the CUDA device; None: the same path for CPU state,
    copied at once (it runs where there is no GPU)."""

    def __init__(self, device: Any = None):
        self.device = device
        self.mirror: Any = None  # uint8, pinned on a GPU machine: the copy's DMA goes straight in
        self.allocations = 0
        self.pending: Any = None  # the event of the copy under way, until it is known done
        self._specs: list[Any] | None = None
        self._views: list[Any] = []  # each tensor's place in the mirror, as that tensor
        self._stream: Any = None
        self._start: Any = None
        self._early: Any = None
        self._done: Any = None

    def _ensure(self, specs: list[Any], nbytes: int) -> bool:
        import torch

        if self.mirror is not None and self.mirror.numel() == nbytes and self._specs == specs:
            return False
        self.mirror = None  # before the new one: both may not fit
        mirror = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device is not None)
        pos = 0
        for _, _, off, n in specs:  # the alignment gaps: zeros, as a snapshot writes them
            if off > pos:
                mirror[pos:off].zero_()
            pos = off + n
        if nbytes > pos:
            mirror[pos:].zero_()
        self.mirror, self._specs = mirror, list(specs)
        self._views = [mirror[off:off + n].view(dtype).view(shape) if n else None
                       for dtype, shape, off, n in specs]
        self.allocations += 1
        return True

    def stage(self, tensors: list[Any], specs: list[Any], nbytes: int,
              late: set[int] | frozenset[int] = frozenset()) -> bool:
        """Start copying ``tensors`` (placed as ``specs``) into the mirror. Returns whether the
        mirror was allocated now (a cost paid once per layout).

        Host tensors are copied now: the step may change them next. Device tensors go on a side
        stream, behind everything queued so far; the current stream then waits (on the GPU) for
        those in ``late`` only at ``fence``, for every other one at once (a buffer that the next
        forward pass updates, a tensor registered by itself: small, and written by anything)."""
        import torch

        fresh = self._ensure(specs, nbytes)
        self.pending = None
        early, later = [], []
        for t, dst in zip(tensors, self._views):
            if dst is None:
                continue
            if t.device.type == "cpu":
                dst.copy_(t.detach())
            else:
                (later if t.data_ptr() in late else early).append((dst, t.detach()))
        if not early and not later:
            return fresh
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
            self._start = torch.cuda.Event(enable_timing=True)
            self._early = torch.cuda.Event()
            self._done = torch.cuda.Event(enable_timing=True)
        side, current = self._stream, torch.cuda.current_stream(self.device)
        side.wait_stream(current)  # the step's last update lands before it is read
        with torch.cuda.stream(side):
            self._start.record(side)
            for group, event in ((early, self._early), (later, self._done)):
                for dst, t in group:
                    dst.copy_(t, non_blocking=True)
                    t.record_stream(side)  # its memory is not reused while the copy reads it
                event.record(side)
        current.wait_event(self._early)
        self.pending = self._done
        return fresh

    def fence(self) -> None:
        """Before an in-place update of the state (an optimizer's step): the update waits, on the
        GPU, until the copy under way has read what it overwrites. Nothing waits on the host."""
        event = self.pending
        if event is not None:
            import torch

            torch.cuda.current_stream(self.device).wait_event(event)

    def wait(self, deadline: float) -> None:
        """Until the copy under way has landed in the mirror (TimeoutError at ``deadline``)."""
        event = self.pending
        if event is None:
            return
        wait_event(event, deadline, "the copy of the state from the GPU")
        if self.pending is event:
            self.pending = None

    def copy_seconds(self) -> float | None:
        """The last device copy's own time on the GPU, first byte to last (once it is done)."""
        if self._start is None or not self._done.query():
            return None
        return self._start.elapsed_time(self._done) / 1000


class Bounce:
    """Two pinned buffers that a restore's bytes pass through on their way to a GPU: while the
    DMA empties one, the host fills the other. ``device`` None: the same copy on the host."""

    def __init__(self, device: Any = None, chunk: int = CHUNK):
        self.device = device
        self.chunk = chunk
        self._bufs: list[Any] = []
        self._events: list[Any] = []
        self._stream: Any = None

    def _ensure(self, size: int) -> None:
        import torch

        if self._bufs and self._bufs[0].numel() >= size:
            return
        self._bufs = []
        pinned = self.device is not None
        self._bufs = [torch.empty(size, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)]
        if pinned and self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
            self._events = [torch.cuda.Event(), torch.cuda.Event()]

    def copy(self, pairs: list[tuple[Any, Any]], deadline: float | None = None) -> int:
        """Copy each (host source, destination) pair, alike in bytes, the destination contiguous;
        returns the bytes copied. The GPU's copies are waited for once, at the end (and a buffer
        before it is filled again)."""
        import torch

        pieces = [(_bytes(src), _bytes(dst, into=True)) for src, dst in pairs]
        pieces = [(s, d) for s, d in pieces if s.numel()]
        total = sum(s.numel() for s, _ in pieces)
        if not total:
            return 0
        if deadline is None:
            deadline = time.monotonic() + RESTORE_S + total / 1e9
        size = min(self.chunk, total)
        self._ensure(size)
        cuda = self.device is not None
        side = self._stream
        if cuda:
            side.wait_stream(torch.cuda.current_stream(self.device))  # the tensors are free
        busy = [False, False]
        k, fill, queued = 0, 0, []

        def flush() -> None:
            nonlocal k, fill, queued
            buf = self._bufs[k]
            if cuda:
                with torch.cuda.stream(side):
                    for dst, off, n in queued:
                        dst.copy_(buf[off:off + n], non_blocking=True)
                    self._events[k].record(side)
                busy[k] = True
            else:
                for dst, off, n in queued:
                    dst.copy_(buf[off:off + n])
            k, fill, queued = 1 - k, 0, []

        with torch.no_grad():
            for src, dst in pieces:
                pos, n = 0, src.numel()
                while pos < n:
                    if fill == 0 and busy[k]:  # its last DMA must have read it
                        wait_event(self._events[k], deadline, "a restore's copy to the GPU")
                        busy[k] = False
                    take = min(n - pos, size - fill)
                    self._bufs[k][fill:fill + take].copy_(src[pos:pos + take])
                    queued.append((dst[pos:pos + take], fill, take))
                    fill, pos = fill + take, pos + take
                    if fill == size:
                        flush()
            if queued:
                flush()
            for i in (0, 1):
                if busy[i]:
                    wait_event(self._events[i], deadline, "a restore's copy to the GPU")
        return total


def _bytes(t: Any, into: bool = False) -> Any:
    """A flat uint8 view of a tensor's bytes; of a contiguous copy of a source that is not
    contiguous (a destination must be: its copy would receive the bytes)."""
    import torch

    t = t.detach()
    if not t.is_contiguous():
        if into:
            raise ValueError("a restore copies into contiguous tensors only")
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


_bounces: dict[Any, Bounce] = {}  # per device: kept for the next restore (pinning costs time)


def bounce(device: Any) -> Bounce:
    found = _bounces.get(device)
    if found is None:
        found = _bounces[device] = Bounce(device)
    return found


# == a restore's tensors to the GPU ===============================================================
def to_device(state: Any, sd: dict[str, Any], device_type: str = "cuda") -> dict[str, Any]:
    """``sd`` (host tensors, e.g. viewing a snapshot) with every tensor that will be loaded into
    device memory already there, moved through the bounce buffers: into the very tensor it will
    be loaded into when that has its shape and dtype (the load then copies nothing: a tensor
    copied onto itself is left alone), else into new device memory (an optimizer's state that a
    new process does not have yet). Anything else is left to the objects' own loading, as
    before. ``device_type`` "cpu" runs the same mapping on the host (tests)."""
    import torch

    if device_type == "cuda" and not torch.cuda.is_initialized():
        return sd  # nothing of this process is on a GPU
    objects = state.objects() if callable(getattr(state, "objects", None)) else None
    if not objects or not isinstance(sd, dict):
        return sd
    pairs: list[tuple[Any, Any]] = []
    out = dict(sd)
    for name, obj in objects.items():
        part = sd.get(name)
        if isinstance(obj, torch.nn.Module) and isinstance(part, dict):
            live = obj.state_dict()
            moved = {}
            for key, value in part.items():
                # a sharded module's copy holds local shards: each goes into its DTensor's local
                # tensor (any op on the DTensor itself would be a collective of its mesh)
                dst = shards.local(live.get(key))
                if _fits(value, dst, device_type):
                    pairs.append((value, dst))
                    moved[key] = dst
            if moved:
                out[name] = _with(part, moved)
        elif isinstance(obj, torch.optim.Optimizer) and isinstance(part, dict):
            out[name] = _optimizer_part(obj, part, pairs, device_type)
        elif isinstance(obj, torch.Tensor) and _fits(part, obj, device_type):
            pairs.append((part, obj))
            out[name] = obj.detach()
    if not pairs:
        return sd
    by_device: dict[Any, list[tuple[Any, Any]]] = {}
    for src, dst in pairs:
        by_device.setdefault(dst.device if device_type != "cpu" else None, []).append((src, dst))
    for device, group in by_device.items():
        bounce(device).copy(group)
    return out


def _fits(src: Any, dst: Any, device_type: str) -> bool:
    """Whether host tensor ``src`` can be copied straight into ``dst`` on the device."""
    import torch

    return (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)
            and src.device.type == "cpu" and dst.device.type == device_type
            and src.dtype == dst.dtype and src.shape == dst.shape and dst.is_contiguous()
            and src.layout is torch.strided and dst.layout is torch.strided
            and not (device_type == "cpu" and dst.data_ptr() == src.data_ptr()))


def _with(part: Any, moved: dict[Any, Any]) -> Any:
    """``part`` with some values replaced; its type and attributes (a module's ``_metadata``,
    which its loading reads) kept."""
    out = type(part)() if type(part) in (dict, OrderedDict) else {}
    for key, value in part.items():
        out[key] = moved.get(key, value)
    if getattr(part, "__dict__", None):
        out.__dict__.update(part.__dict__)
    return out


def _optimizer_part(opt: Any, part: dict[str, Any], pairs: list[tuple[Any, Any]],
                    device_type: str) -> dict[str, Any]:
    """An optimizer's state dict with the state of its device parameters moved to them, as its
    own loading would move it (saved and live parameters matched in order, group by group;
    floating state in its parameter's dtype; ``step`` left to it)."""
    import torch

    saved, state = part.get("param_groups"), part.get("state")
    groups = opt.param_groups
    if not (isinstance(saved, list) and isinstance(state, dict) and len(saved) == len(groups)):
        return part  # its loading refuses it, with its own message
    try:
        if any(len(s["params"]) != len(g["params"]) for s, g in zip(saved, groups)):
            return part
        id_map = dict(zip(chain.from_iterable(s["params"] for s in saved),
                          chain.from_iterable(g["params"] for g in groups)))
    except (KeyError, TypeError):
        return part
    new_state = {}
    for pid, entry in state.items():
        param = id_map.get(pid) if isinstance(pid, int) else None
        if param is None or param.device.type != device_type or not isinstance(entry, dict):
            new_state[pid] = entry
            continue
        live = opt.state.get(param, {})
        moved = {}
        for key, value in entry.items():
            if key == "step" or not isinstance(value, torch.Tensor) or value.device.type != "cpu":
                continue
            if param.is_floating_point() and value.dtype != param.dtype:
                continue  # its loading casts it
            dst = shards.local(live.get(key))
            if not _fits(value, dst, device_type):
                if value.layout is not torch.strided:
                    continue
                dst = torch.empty(value.shape, dtype=value.dtype, device=param.device)
            pairs.append((value, dst))
            moved[key] = dst
        new_state[pid] = _with(entry, moved) if moved else entry
    return {**part, "state": new_state}

"""``nonstop bench state --device cuda``: snapshots and restores of state on a GPU against the
device's own copy bandwidth, and what a snapshot costs a training step there. One process."""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any

from nonstop.protocol.keeper_messages import Allocated
from nonstop.state import shm

REPEATS = 3  # the best of this many copies is a bandwidth
BLOCKS = 6  # the training steps alternate: a block without snapshots, one with a snapshot each
TUNE_STEPS = 6  # steps snapshotted every step before the interval is chosen (as a generation's)
TARGET_RATIO = 0.8  # of the device's own copy bandwidth
TARGET_OVERHEAD_PCT = 1.0
INPUTS = 32
_DEADLINE_S = 60.0  # any one wait of the bench for the GPU


class LocalMemory:
    """A node's memory without a keeper, in this process: two memfd slots per holder, written
    alternately, as a keeper gives them out (the bench measures the rank's side only)."""

    def __init__(self) -> None:
        self.slots: list[shm.Slot | None] = [None, None]
        self.seq = 0
        self.committed: int | None = None

    def twin(self) -> "LocalMemory":
        return self

    def alloc(self, holder: str, size: int) -> tuple[int, int, shm.Slot, Allocated]:
        i = self.seq % 2
        slot, fresh = self.slots[i], False
        if slot is None or slot.size < size:
            fd = shm.create(f"bench-{i}", size)
            try:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError:
                    pass
                slot = self.slots[i] = shm.Slot(fd, populate=True)
            finally:
                os.close(fd)
            fresh = True
        self.seq += 1
        return i, self.seq, slot, Allocated(slot=i, seq=self.seq, size=slot.size, repl_s=None,
                                            fresh=fresh)

    def commit(self, holder: str, slot: int, persist: Any = None) -> None:
        self.committed = slot

    def reset(self) -> None:
        pass

    def buffer(self, nbytes: int) -> Any:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8)

    def newest(self) -> tuple[shm.Slot, shm.SlotInfo | None]:
        slot = self.slots[self.committed] if self.committed is not None else None
        if slot is None:
            raise RuntimeError("nothing was committed")
        return slot, slot.info()


class _Clock:
    """Seconds of GPU work (CUDA events on the current stream), or of the host's on a CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def sync(self) -> None:
        if self.cuda:
            import torch

            from nonstop.state.staging import wait_event

            ev = torch.cuda.Event()
            ev.record()
            wait_event(ev, time.monotonic() + _DEADLINE_S, "the bench's GPU work", most=2e-5)

    def time(self, fn: Any) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        import torch

        from nonstop.state.staging import wait_event

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        wait_event(end, time.monotonic() + _DEADLINE_S, "a copy timed by the bench")
        return start.elapsed_time(end) / 1000


def _gbps(nbytes: int, seconds: float | None) -> float | None:
    return round(nbytes / seconds / 1e9, 2) if seconds else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def model_of(hidden: int, layers: int, device: Any) -> Any:
    import torch

    parts = [torch.nn.Linear(INPUTS, hidden), torch.nn.Tanh()]
    for _ in range(layers):
        parts += [torch.nn.Linear(hidden, hidden), torch.nn.Tanh()]
    return torch.nn.Sequential(*parts, torch.nn.Linear(hidden, 1)).to(device)


def run(hidden: int, layers: int, device: str = "cuda", steps: int = 30, warmup: int = 5,
        batch: int | None = None, say: Any = print, budget_s: float = 75.0) -> dict[str, Any]:
    """Every measurement of the device phase; ``device`` "cpu" runs the same code on the host
    (a test of the bench without a GPU: its numbers mean nothing there)."""
    import torch
    import torch.nn.functional as F

    from nonstop.runtime.registered import State
    from nonstop.state import packing, restore, staging
    from nonstop.protocol.rank_policy import RankCheckpoint, RankSnapshot, RankState
    from nonstop.state.snapshot import Snapshots

    t_begin = time.monotonic()
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda and dev.index is None:  # as its tensors name it: one Staging for bench and Snapshots
        dev = torch.device("cuda", torch.cuda.current_device())
    clock = _Clock(cuda)
    name = torch.cuda.get_device_name(dev) if cuda else "cpu"
    torch.manual_seed(0)
    model = model_of(hidden, layers, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = State(model=model, optimizer=opt)
    data: dict[str, Any] = {}

    def feed(n: int) -> None:
        g = torch.Generator(device=dev).manual_seed(1)
        data["x"] = torch.randn(n, INPUTS, device=dev, generator=g)
        data["y"] = data["x"].sum(dim=1, keepdim=True).sin()

    def train_step() -> None:
        loss = F.mse_loss(model(data["x"]), data["y"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    feed(batch or 4096)
    for _ in range(2):  # the optimizer's state exists from here on
        train_step()
    clock.sync()
    lay = packing.layout(state.state_dict(), {"step": 0})
    nbytes = lay.nbytes
    say(f"  device {name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
        f"{nbytes / 1e9:.2f} GB of state in {len(lay.tensors)} tensors")
    stg = staging.Staging(dev if cuda else None)
    late = staging.late_ptrs(state)

    def stage() -> None:
        stg.stage(lay.tensors, lay.specs, nbytes, late)

    stage()  # the pinned mirror, allocated once
    stg.wait(time.monotonic() + _DEADLINE_S)

    # (a) the device's own copy bandwidth, one large contiguous copy each way, pinned host memory
    flat = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    host = stg.mirror
    d2h = min(clock.time(lambda: host.copy_(flat, non_blocking=True)) for _ in range(REPEATS))
    h2d = min(clock.time(lambda: flat.copy_(host, non_blocking=True)) for _ in range(REPEATS))
    del flat
    stage()  # the mirror holds the state again
    stg.wait(time.monotonic() + _DEADLINE_S)

    # (b) a snapshot's copy: device tensors -> the pinned mirror, on the side stream
    snap_device, snap_host = [], []
    for _ in range(REPEATS):
        clock.sync()
        t0 = time.perf_counter()
        stage()
        stg.wait(time.monotonic() + _DEADLINE_S)
        snap_host.append(time.perf_counter() - t0)
        snap_device.append(stg.copy_seconds() if cuda else snap_host[-1])
    clock.sync()
    t0 = time.perf_counter()
    pageable = [t.detach().cpu() for t in lay.tensors]  # what a snapshot did before: .cpu()
    snap_pageable = time.perf_counter() - t0
    del pageable

    # (c) the real snapshot (staged, written and committed by its thread), then restores from it
    policy = RankState(RankSnapshot(enabled=True, every_steps="auto", max_overhead_pct=1.0),
                       RankCheckpoint(dir=None, every_steps=1_000_000, at_end=False))
    memory = LocalMemory()
    snaps = Snapshots(policy, memory)
    snaps.staged = None if cuda else True
    snaps._staging = stg  # the mirror already pinned
    reference = [t.detach().clone() for t in lay.tensors]
    state.step = 1
    t0 = time.perf_counter()
    snaps.take(state, 0, 1, 0)
    settled = snaps.settle(_DEADLINE_S)
    first_write_s = time.perf_counter() - t0
    if not settled or snaps.last_step != 1:
        raise RuntimeError(f"the bench's snapshot was not committed: {snaps.error}")
    slot, info = memory.newest()
    verified = info is not None and slot.verify(info)
    meta, raw = slot.read(info)
    sd = packing.unpack(meta, raw)

    restore_s = []
    for _ in range(REPEATS):
        clock.sync()
        t0 = time.perf_counter()
        staging.to_device(state, sd, dev.type)  # into the live tensors: the same values again
        restore_s.append(time.perf_counter() - t0)
    own = packing.unpack(meta, raw.clone())  # what the state may keep: not the slot's memory
    clock.sync()
    t0 = time.perf_counter()
    state.load_state_dict(own)  # what a restore did before: pageable copies by the objects
    clock.sync()
    restore_pageable = time.perf_counter() - t0

    with torch.no_grad():  # bitwise: into zeroed tensors, by the restore's own path
        for t in packing.layout(state.state_dict()).tensors:
            t.zero_()
    restore._load(state, sd, restore.Where(memory=memory))
    clock.sync()
    now = packing.layout(state.state_dict()).tensors
    bitwise = bool(verified and len(now) == len(reference) and all(
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b.to(a.device))
        for a, b in zip(now, reference)))
    del reference, sd, raw, own
    say(f"  copies: memcpy d2h {_gbps(nbytes, d2h)} GB/s, snapshot "
        f"{_gbps(nbytes, min(snap_device))} GB/s; memcpy h2d {_gbps(nbytes, h2d)} GB/s, restore "
        f"{_gbps(nbytes, min(restore_s))} GB/s; bitwise {bitwise}")

    # (d) training steps without snapshots and with a staged one after every step
    for _ in range(warmup):
        train_step()
    clock.sync()
    if batch is None and cuda:  # a step long enough for the copy to hide behind (4x, 0.1 s)
        t0 = time.perf_counter()
        train_step()
        clock.sync()
        step_s = time.perf_counter() - t0
        want = max(4 * d2h, 0.1)
        if step_s < want:
            size = int(data["x"].shape[0]) * 2 ** math.ceil(math.log2(want / step_s))
            feed(min(65536, size))
            for _ in range(2):
                train_step()
            clock.sync()
    batch = int(data["x"].shape[0])

    def staged_snapshot() -> None:  # the step's part of a staged snapshot, as Snapshots takes it
        lay_now = packing.layout(state.state_dict(), {"step": state.step})
        stg.stage(lay_now.tensors, lay_now.specs, lay_now.nbytes, staging.late_ptrs(state))
        state._fence = stg.fence

    without: list[float] = []
    with_: list[float] = []
    per_block = max(1, math.ceil(steps / BLOCKS))
    for _ in range(BLOCKS):
        for snapshotting, into in ((False, without), (True, with_)):
            state._fence = None
            for _ in range(per_block):
                t0 = time.perf_counter()
                if snapshotting:
                    staged_snapshot()
                train_step()
                clock.sync()
                into.append(time.perf_counter() - t0)
    state._fence = None
    stg.wait(time.monotonic() + _DEADLINE_S)
    step_without, step_with = statistics.median(without), statistics.median(with_)
    overhead = round((step_with - step_without) / step_without * 100, 2)
    say(f"  steps (batch {batch}): {step_without * 1e3:.2f} ms without, {step_with * 1e3:.2f} ms "
        f"with a snapshot every step: {overhead}%")

    # (e) the real Snapshots at the interval it chooses: every step first, then tuned
    interval = step_interval = overhead_interval = None
    if time.monotonic() - t_begin < budget_s - 10:
        snaps.every, snaps.anchor = 1, state.step
        tuned: list[float] = []
        total = None
        i = 0
        while total is None or i < total:
            i += 1
            t0 = time.perf_counter()
            train_step()
            clock.sync()
            state.step += 1
            if state.step - snaps.anchor >= snaps.every:
                snaps.anchor = state.step
                snaps.take(state, 0, 1, 0)
            took = time.perf_counter() - t0
            if total is not None:
                tuned.append(took)
            elif i == TUNE_STEPS:
                snaps.settle(_DEADLINE_S)
                snaps.every = interval = snaps._interval(snaps.cost_s or 0.0, step_without, 0.0,
                                                         0.0, snaps.write_s or 0.0)
                snaps.anchor = state.step
                left = budget_s - (time.monotonic() - t_begin)
                fits = max(1, int(left / step_without / 2) // interval) * interval
                total = i + min(max(steps, interval * math.ceil(steps / interval)), fits)
        snaps.settle(_DEADLINE_S)
        if tuned:
            step_interval = statistics.mean(tuned)
            overhead_interval = round((step_interval - statistics.mean(without))
                                      / statistics.mean(without) * 100, 2)
        say(f"  the interval Snapshots chooses: every {interval} steps (snapshot {snaps.cost_s} s "
            f"on the step, written in {snaps.write_s} s): {overhead_interval}% over "
            f"{len(tuned)} steps")
    state._fence = None
    snapshot_gbps, restore_gbps = _gbps(nbytes, min(snap_device)), _gbps(nbytes, min(restore_s))
    d2h_gbps, h2d_gbps = _gbps(nbytes, d2h), _gbps(nbytes, h2d)
    # (from the seconds, not the rounded GB/s: a small model's copies on a loaded host round to 0)
    snapshot_ratio, restore_ratio = _ratio(d2h, min(snap_device)), _ratio(h2d, min(restore_s))
    return {
        "name": name, "bytes": nbytes, "tensors": len(lay.tensors),
        "params": sum(p.numel() for p in model.parameters()),
        "memcpy_d2h_gbps": d2h_gbps, "snapshot_gbps": snapshot_gbps,
        "snapshot_host_gbps": _gbps(nbytes, min(snap_host)),
        "snapshot_vs_memcpy": snapshot_ratio,
        "snapshot_pageable_gbps": _gbps(nbytes, snap_pageable),
        "memcpy_h2d_gbps": h2d_gbps, "restore_gbps": restore_gbps,
        "restore_vs_memcpy": restore_ratio,
        "restore_pageable_gbps": _gbps(nbytes, restore_pageable),
        "first_snapshot_written_s": round(first_write_s, 4),
        "bitwise": bitwise, "batch": batch, "steps_each": len(without),
        "step_s_without": round(step_without, 6), "step_s_with": round(step_with, 6),
        "overhead_pct": overhead,
        "interval_steps": interval, "snapshot_cost_s": snaps.cost_s, "write_s": snaps.write_s,
        "step_s_interval": round(step_interval, 6) if step_interval else None,
        "overhead_interval_pct": overhead_interval,
        "seconds": round(time.monotonic() - t_begin, 1),
        "targets": {
            "snapshot_ge_80pct_of_memcpy": snapshot_ratio is not None
            and snapshot_ratio >= TARGET_RATIO,
            "restore_ge_80pct_of_memcpy": restore_ratio is not None
            and restore_ratio >= TARGET_RATIO,
            "overhead_le_1pct": overhead <= TARGET_OVERHEAD_PCT,
            "overhead_at_interval_le_1pct": overhead_interval is not None
            and overhead_interval <= TARGET_OVERHEAD_PCT,
            "bitwise": bitwise}}

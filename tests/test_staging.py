"""Staged snapshots (state on a GPU; without one, the same thread, commit and deadlines on host
tensors) count only once committed; restores come back through pinned bounce buffers, bitwise."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch

import nonstop
from nonstop.state import packing, restore, shm, staging
from nonstop.state.memory import NodeMemory, own
from nonstop.protocol import keeper_messages as km
from nonstop.protocol.rank_policy import RankCheckpoint, RankSnapshot, RankState
from nonstop.state.snapshot import Snapshots

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CFG = RankState(RankSnapshot(enabled=True, every_steps=1, max_overhead_pct=1.0),
                RankCheckpoint(dir=None, every_steps=1000, at_end=False))


class _Memory:
    """A node's memory in this process: two slots per holder, as a keeper gives them out.
    ``gate``: every alloc waits for it (a keeper holding the slot back); ``fail``: raised."""

    def __init__(self, gate: threading.Event | None = None, fail: Exception | None = None):
        self.gate, self.fail = gate, fail
        self.slots: dict[int, shm.Slot] = {}
        self.allocs = 0
        self.commits: list[int] = []  # the steps committed, in order
        self.resets = 0

    def twin(self):
        return self

    def alloc(self, holder, size):
        if self.gate is not None and not self.gate.wait(20):
            raise TimeoutError("the test's gate never opened")
        if self.fail is not None:
            raise self.fail
        i = self.allocs % 2
        self.allocs += 1
        fd = shm.create("test", size)
        try:
            self.slots[i] = shm.Slot(fd)
        finally:
            os.close(fd)
        return i, self.allocs, self.slots[i], km.Allocated(slot=i, seq=self.allocs, size=size,
                                                            repl_s=None, fresh=False)

    def commit(self, holder, slot, persist=None):
        info = self.slots[slot].info()
        self.commits.append(info.step if info is not None else -1)

    def reset(self):
        self.resets += 1

    def read(self, step):
        for slot in self.slots.values():
            info = slot.info()
            if info is not None and info.step == step and slot.verify(info):
                meta, data = slot.read(info)
                return packing.unpack(meta, data)
        raise AssertionError(f"no good snapshot of step {step}")


def _state(device="cpu", hidden=8):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, hidden), torch.nn.BatchNorm1d(hidden),
                                torch.nn.Linear(hidden, 1)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = nonstop.State(model=model, optimizer=opt, extras={"epoch": 3})
    _train(model, opt, device)
    return state, model, opt


def _train(model, opt, device="cpu"):
    x = torch.randn(16, 5, device=device)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _snapshots(memory, staged=True):
    snaps = Snapshots(CFG, memory)
    snaps.staged = staged
    return snaps


def _copy(sd):
    return packing.unpack(*packing.pack(sd))


def _equal(a, b) -> bool:
    ta, tb = packing.layout(a).tensors, packing.layout(b).tensors
    return len(ta) == len(tb) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.cpu(), y.cpu())
        for x, y in zip(ta, tb))


# == the background write: commit, deadlines, failures ==========================================
def test_a_staged_snapshot_counts_only_once_committed():
    gate = threading.Event()
    memory = _Memory(gate)
    state, model, opt = _state()
    snaps = _snapshots(memory)
    state.step = 4
    expected = _copy(state.state_dict())
    spent = snaps.take(state, rank=0, world=1, gen=0)
    assert spent > 0
    _train(model, opt)  # the step goes on at once, and changes the state in place
    time.sleep(0.1)
    assert (snaps.last_step, snaps.taken, memory.commits) == (None, 0, [])  # not written yet
    gate.set()
    assert snaps.settle(10)
    assert (snaps.last_step, snaps.taken, memory.commits) == (4, 1, [4])
    assert snaps.error is None and snaps.write_s is not None
    assert _equal(memory.read(4), expected)  # the state as it was at the snapshot, not after


def test_a_snapshot_due_while_one_is_written_waits_for_it_and_commits_in_order():
    gate = threading.Event()
    memory = _Memory(gate)
    state, model, opt = _state()
    snaps = _snapshots(memory)
    state.step = 1
    snaps.take(state, 0, 1, 0)
    _train(model, opt)
    state.step = 2
    # the gate opens 0.3 s from here, however long the step took on a loaded machine
    threading.Timer(0.3, gate.set).start()
    t0 = time.monotonic()
    snaps.take(state, 0, 1, 0)  # the one before holds the mirror: this one waits for it
    assert time.monotonic() - t0 >= 0.2
    assert memory.commits[:1] == [1]  # the first was committed before the second started
    second = _copy(state.state_dict())
    assert snaps.settle(10)
    assert memory.commits == [1, 2] and snaps.last_step == 2 and snaps.skipped == 0
    assert _equal(memory.read(2), second)


def test_a_snapshot_due_while_one_is_stuck_is_skipped_and_counted():
    gate = threading.Event()
    memory = _Memory(gate)
    state, _, _ = _state()
    snaps = _snapshots(memory)
    snaps.in_flight_s = 0.2
    state.step = 1
    snaps.take(state, 0, 1, 0)
    state.step = 2
    t0 = time.monotonic()
    assert snaps.take(state, 0, 1, 0) == 0.0
    assert time.monotonic() - t0 < 2
    assert snaps.skipped == 1 and "skipped" in snaps.error and snaps.last_step is None
    gate.set()
    assert snaps.settle(10)
    assert memory.commits == [1] and snaps.last_step == 1


def test_settle_gives_up_at_its_deadline_and_the_snapshot_given_up_is_never_committed():
    gate = threading.Event()
    memory = _Memory(gate)
    state, _, _ = _state()
    snaps = _snapshots(memory)
    state.step = 7
    snaps.take(state, 0, 1, 0)
    t0 = time.monotonic()
    assert snaps.settle(0.3) is False
    assert 0.25 <= time.monotonic() - t0 < 2
    assert "given up" in snaps.error and snaps.last_step is None
    gate.set()  # the write finishes after all: it must not count
    job = snaps._job
    job.thread.join(10)
    assert not job.thread.is_alive()
    assert memory.commits == [] and snaps.last_step is None and snaps.taken == 0
    assert memory.resets == 1  # its connection given up: the keeper frees the slot
    assert all(slot.info() is None for slot in memory.slots.values())  # nothing valid left
    assert snaps.settle(1) is True


def test_a_failed_background_write_is_recorded_not_raised():
    memory = _Memory(fail=ConnectionResetError("the keeper went away"))
    state, _, _ = _state()
    snaps = _snapshots(memory)
    state.step = 3
    snaps.take(state, 0, 1, 0)  # returns: the failure happens in the thread
    assert snaps.settle(10)
    assert snaps.error == "ConnectionResetError: the keeper went away"
    assert snaps.last_step is None and snaps.taken == 0 and memory.resets == 1
    memory.fail = None  # the next one goes through and clears it
    state.step = 4
    snaps.take(state, 0, 1, 0)
    assert snaps.settle(10) and snaps.error is None and snaps.last_step == 4


def test_the_schedule_and_the_end_settle_the_snapshot_in_flight():
    gate = threading.Event()
    memory = _Memory(gate)
    state, _, _ = _state()
    snaps = _snapshots(memory)
    state.step = 5
    snaps.take(state, 0, 1, 0)
    threading.Timer(0.2, gate.set).start()
    schedule = snaps.schedule()  # a new generation's agreement: only committed snapshots
    assert snaps.last_step == 5 and memory.commits == [5]
    assert set(schedule) >= {"every", "cost_s", "write_s"}
    state.step = 6
    snaps.take(state, 0, 1, 0)
    snaps.finish(state, 0, 1, 0)
    assert memory.commits == [5, 6] and snaps._job is None


def test_host_state_keeps_the_synchronous_path():
    memory = _Memory()
    state, _, _ = _state()
    snaps = _snapshots(memory, staged=None)  # the default: staged only for state on a GPU
    state.step = 2
    snaps.take(state, 0, 1, 0)
    assert snaps.last_step == 2 and memory.commits == [2]  # done before take returned
    assert snaps._staging is None and snaps._job is None


def test_a_staged_snapshot_is_due_only_once_the_one_before_is_written():
    snaps = Snapshots(dataclasses.replace(
        CFG, snapshot=dataclasses.replace(CFG.snapshot, every_steps="auto")), None)
    step_s = 0.1
    assert snaps._interval(0.0005, step_s, 0.0) == 1  # 0.5 ms on the step: every step...
    assert snaps._interval(0.0005, step_s, 0.0, 0.0, 0.35) == 4  # ...unless still being written


def test_the_optimizer_step_waits_for_the_copy_first():
    state, model, opt = _state()
    calls = []
    state._fence = lambda: calls.append(state.step)
    _train(model, opt)
    assert calls == [0]
    state.load_state_dict(state.state_dict())
    assert calls == [0, 0]


# == restores through the bounce buffers =========================================================
@pytest.mark.parametrize("chunk", [7, 1000, 1 << 20])
def test_the_bounce_copy_is_bitwise_for_odd_sizes_and_dtypes(chunk):
    g = torch.Generator().manual_seed(1)
    srcs = [torch.randn(n, generator=g).to(dtype) for n, dtype in
            [(0, torch.float32), (1, torch.float64), (7, torch.float16), (999, torch.bfloat16),
             (1001, torch.float32), (5003, torch.float64)]]
    srcs += [torch.randint(-128, 127, (13,), dtype=torch.int8, generator=g),
             torch.rand(33, generator=g) > 0.5, torch.randn(9, 3, generator=g)[:, 1],
             torch.complex(torch.randn(17, generator=g), torch.randn(17, generator=g)),
             torch.tensor(3.5)]
    dsts = [torch.zeros_like(s).contiguous() for s in srcs]
    moved = staging.Bounce(None, chunk=chunk).copy(list(zip(srcs, dsts)))
    assert moved == sum(s.numel() * s.element_size() for s in srcs)
    for s, d in zip(srcs, dsts):
        assert d.dtype == s.dtype and torch.equal(d.view(-1).view(torch.uint8),
                                                  s.contiguous().view(-1).view(torch.uint8))


def test_a_restore_maps_each_tensor_onto_what_it_is_loaded_into():
    """The device path's mapping, on the host: modules' tensors straight into the live ones,
    an optimizer's state into its own (or new memory for a new process's empty one)."""
    state, model, opt = _state()
    saved = _copy(state.state_dict())
    fresh, model2, opt2 = _state()  # a survivor, whose tensors are overwritten in place
    with torch.no_grad():
        for t in packing.layout(fresh.state_dict()).tensors:
            t.zero_()
    weight = model2[0].weight
    moved = staging.to_device(fresh, saved, device_type="cpu")
    assert moved["model"]["0.weight"] is not saved["model"]["0.weight"]
    assert moved["model"]["0.weight"].data_ptr() == weight.data_ptr()
    assert moved["model"]._metadata == saved["model"]._metadata
    fresh.load_state_dict(moved)
    assert model2[0].weight is weight and _equal(fresh.state_dict(), saved)

    torch.manual_seed(5)  # a new process: its optimizer has no state yet
    model3 = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8),
                                 torch.nn.Linear(8, 1))
    new = nonstop.State(model=model3, optimizer=torch.optim.AdamW(model3.parameters()),
                        extras={})
    new.load_state_dict(staging.to_device(new, saved, device_type="cpu"))
    assert _equal(new.state_dict(), saved)


@pytest.fixture
def keeper():
    procs = []
    name = f"nonstop-test-{uuid.uuid4().hex[:8]}-n0"
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "nonstop.keeper", name, "--parent", str(os.getpid())],
        start_new_session=True, env=dict(os.environ, NONSTOP_KEEPER_TOKEN=uuid.uuid4().hex)))
    deadline = time.time() + 15
    while True:
        try:
            memory = NodeMemory(name, timeout_s=30)
            memory.listing()
            break
        except (FileNotFoundError, ConnectionRefusedError):
            assert time.time() < deadline, "keeper did not start"
            time.sleep(0.02)
    yield memory
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)


def _through_the_keeper(memory, device, staged):
    """A snapshot taken by the real Snapshots into a real keeper, then the optimizer's step at
    once (in place), then a restore from that snapshot into zeroed state: bit for bit the
    state at the snapshot."""
    state, model, opt = _state(device, hidden=512 if device == "cuda" else 8)
    snaps = _snapshots(memory, staged)
    state.step = 9
    expected = _copy(state.state_dict())
    snaps.take(state, rank=0, world=1, gen=0)
    _train(model, opt, device)  # must not reach the snapshot: it waits for the copy
    assert snaps.settle(30) and snaps.error is None and snaps.last_step == 9
    assert memory.steps(own(0)) == [9]
    after = _copy(state.state_dict())
    assert not _equal(after, expected)
    with torch.no_grad():
        for t in packing.layout(state.state_dict()).tensors:
            t.zero_()
    where = restore.Where(memory=memory)
    assert restore._load_local("memory", 9, state, 0, where) > 0
    assert _equal(state.state_dict(), expected)
    if device == "cuda":
        assert all(t.is_cuda for t in model.parameters())
        assert all(t.is_cuda for st in opt.state.values() for k, t in st.items() if k != "step")
    return snaps


@pytest.mark.integration
def test_a_staged_snapshot_goes_through_a_real_keeper_and_back_bit_for_bit(keeper):
    snaps = _through_the_keeper(keeper, "cpu", staged=True)
    assert snaps._wmem is not keeper  # the writing thread's own connection


# == on a GPU =====================================================================================
@cuda
def test_cuda_state_is_staged_and_restored_bit_for_bit_through_a_real_keeper(keeper):
    snaps = _through_the_keeper(keeper, "cuda", staged=None)
    assert snaps._staging is not None and snaps._staging.device.type == "cuda"
    assert snaps._staging.mirror.is_pinned()


@cuda
def test_the_next_optimizer_step_never_overwrites_what_the_copy_has_not_read():
    """Large tensors, an update queued right behind the snapshot: without the fence the update
    would win the race for most of them."""
    memory = _Memory()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8 << 20, device="cuda")) for _ in range(8)]
    opt = torch.optim.SGD(params, lr=1.0)
    state = nonstop.State(opt=opt, **{f"p{i}": p for i, p in enumerate(params)})
    for p in params:
        p.grad = torch.ones_like(p)
    snaps = _snapshots(memory, staged=None)
    state.step = 1
    expected = [p.detach().cpu() for p in params]
    snaps.take(state, 0, 1, 0)
    opt.step()  # queued at once on the current stream
    assert snaps.settle(30) and snaps.last_step == 1
    sd = memory.read(1)
    assert all(torch.equal(sd[f"p{i}"], expected[i]) for i in range(len(params)))
    assert all(torch.equal(p.detach().cpu(), e - 1) for p, e in zip(params, expected))


@cuda
def test_the_bounce_copy_to_the_gpu_is_bitwise_for_odd_sizes():
    g = torch.Generator().manual_seed(2)
    srcs = [torch.randn(n, generator=g).to(dtype) for n, dtype in
            [(1, torch.float32), (999, torch.bfloat16), (3 << 20, torch.float32),
             (5003, torch.float64)]] + [torch.rand(33, generator=g) > 0.5]
    dsts = [torch.empty(s.shape, dtype=s.dtype, device="cuda") for s in srcs]
    staging.Bounce(torch.device("cuda"), chunk=1 << 20).copy(list(zip(srcs, dsts)))
    assert all(torch.equal(d.cpu(), s) for s, d in zip(srcs, dsts))


# == the bench =====================================================================================
def test_the_device_bench_runs_its_whole_path_on_the_host():
    from nonstop_bench import state_device

    r = state_device.run(32, 1, device="cpu", steps=6, warmup=1, batch=16, say=lambda m: None)
    assert r["bitwise"] is True and r["targets"]["bitwise"] is True
    assert r["bytes"] > 0 and r["tensors"] > 6 and r["steps_each"] == 6
    for key in ("memcpy_d2h_gbps", "snapshot_gbps", "snapshot_vs_memcpy", "memcpy_h2d_gbps",
                "restore_gbps", "restore_vs_memcpy", "step_s_without", "step_s_with",
                "overhead_pct", "interval_steps"):
        assert r[key] is not None, key
    assert set(r["targets"]) == {"snapshot_ge_80pct_of_memcpy", "restore_ge_80pct_of_memcpy",
                                 "overhead_le_1pct", "overhead_at_interval_le_1pct", "bitwise"}


@pytest.mark.integration
@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_bench_state_device_cuda_is_refused_without_cuda():
    from conftest import nonstop_cmd
    from test_cli import assert_one_line_error

    t0 = time.monotonic()
    proc = subprocess.run(nonstop_cmd("bench", "state", "--device", "cuda"), capture_output=True,
                          text=True, timeout=60)
    assert_one_line_error(proc, "--device cuda: no CUDA device here")
    assert proc.stdout == "" and time.monotonic() - t0 < 30
    proc = subprocess.run(nonstop_cmd("bench", "state", "--phases", "device"),
                          capture_output=True, text=True, timeout=60)
    assert_one_line_error(proc, "give --device cuda")


@pytest.mark.parametrize("staged", [True, False])
def test_a_snapshot_read_past_an_nccl_abort_is_never_committed(staged):
    """An aborted NCCL collective returns no error: a snapshot whose copy may have read its
    output is dropped (the guard is the generation's ``GenerationGroup.may_commit``)."""
    memory = _Memory()
    state, model, opt = _state()
    snaps = _snapshots(memory, staged=staged)
    trusted = {"step": 4}
    snaps.may_commit = lambda step: step <= trusted["step"]
    state.step = 4
    snaps.take(state, rank=0, world=1, gen=0)
    assert snaps.settle(10) and memory.commits == [4]
    state.step = 5
    snaps.take(state, rank=0, world=1, gen=0)
    assert snaps.settle(10)
    assert memory.commits == [4] and snaps.last_step == 4 and "dropped" in snaps.error
    assert memory.resets >= 1

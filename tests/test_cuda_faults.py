"""CUDA errors and NCCL bookkeeping without a GPU: which errors poison a process and how the
ladder answers them, what nonstop sets for NCCL, and the bounded abort with its escalation."""

from __future__ import annotations

import threading
import time

import pytest

from nonstop import inject
from nonstop.decide import cuda
from nonstop.protocol.cuda import CudaFault
from nonstop.decide.faults import Attribution, exit_fault
from nonstop.protocol.events import Exiting
from nonstop.decide.ladder import Counters, LadderView, Level, decide, charge
from nonstop.policy import Policy
from nonstop.runtime import nccl
from nonstop.runtime.pg import GenerationGroup

ASSERT = ("CUDA error: device-side assert triggered\nSearch for `cudaErrorAssert' in "
          "https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more "
          "information.\nCUDA kernel errors might be asynchronously reported at some other API call")
OOM = ("CUDA out of memory. Tried to allocate 32768.00 GiB. GPU 0 has a total capacity of 139.80 "
       "GiB of which 139.29 GiB is free.")


@pytest.mark.parametrize("type_name,message,kind,name", [
    ("AcceleratorError", ASSERT, "cuda_assert", "cudaErrorAssert"),
    # older PyTorch: no name in the message, the runtime's text only
    ("RuntimeError", "CUDA error: device-side assert triggered\nCUDA kernel errors might be",
     "cuda_assert", "cudaErrorAssert"),
    ("RuntimeError", "CUDA error: an illegal memory access was encountered", "cuda_error",
     "cudaErrorIllegalAddress"),
    ("AcceleratorError", "CUDA error: unspecified launch failure", "cuda_error",
     "cudaErrorLaunchFailure"),
    ("RuntimeError", "CUDA error: uncorrectable ECC error encountered", "gpu_hardware",
     "cudaErrorECCUncorrectable"),
    # NCCL quotes the CUDA runtime's text in its own error
    ("DistBackendError", "NCCL error in: ProcessGroupNCCL.cpp:1234, unhandled cuda error, NCCL "
     "version 2.28.9\nLast error:\nCuda failure 'an illegal memory access was encountered'",
     "cuda_error", "cudaErrorIllegalAddress"),
    ("OutOfMemoryError", OOM, "cuda_oom", "cudaErrorMemoryAllocation"),
    ("RuntimeError", OOM, "cuda_oom", "cudaErrorMemoryAllocation"),
])
def test_cuda_errors_are_told_from_their_type_and_text(type_name, message, kind, name):
    found = cuda.classify(type_name, message)
    assert found is not None and (found.kind, found.name) == (kind, name)
    assert found.sticky is (kind != "cuda_oom")
    assert CudaFault.from_record(found.record()) == found


@pytest.mark.parametrize("type_name,message", [
    ("RuntimeError", "CUDA error: invalid argument"),  # the script's own mistake: an exception
    ("ValueError", "expected a tensor on cuda:0"),
    ("RuntimeError", "Connection closed by peer"),
])
def test_other_errors_are_not_cuda_faults(type_name, message):
    assert cuda.classify(type_name, message) is None


def test_a_cuda_error_is_found_behind_the_exception_that_wraps_it():
    try:
        try:
            raise RuntimeError(ASSERT)
        except RuntimeError as inner:
            raise ValueError("the step failed") from inner
    except ValueError as outer:
        found = cuda.of_exception(outer)
    assert found is not None and found.name == "cudaErrorAssert"


@pytest.mark.parametrize("rec", [
    None, {}, {"kind": "cuda_assert", "name": "x"},
    {"kind": "nope", "name": "cudaErrorAssert", "text": "t"},
    {"kind": "cuda_assert", "name": 7, "text": "t"},
    {"kind": "cuda_assert", "name": "cudaErrorAssert", "text": "t", "extra": 1},
])
def test_a_malformed_cuda_record_is_refused(rec):
    with pytest.raises(ValueError):
        CudaFault.from_record(rec)


def test_a_rank_that_ended_on_a_sticky_error_is_a_fault_named_by_the_error():
    found = cuda.classify("AcceleratorError", ASSERT)
    f = exit_fault(Exiting(code=86, error="AcceleratorError: ...", assigned=True, cuda=found,
                           traceback="tb"), 86, 1, before_any_step=False)
    assert (f.kind, f.fault_code, f.attribution) == ("cuda_assert", "cudaErrorAssert",
                                                      Attribution.USER)
    assert "cudaErrorAssert (device-side assert triggered)" in f.describe()
    hw = exit_fault(Exiting(code=86, error="", assigned=True, cuda=cuda.classify(
        "RuntimeError", "uncorrectable ECC error encountered")), 86, 2, before_any_step=False)
    assert (hw.kind, hw.attribution) == ("gpu_hardware", Attribution.INFRA)
    hung = exit_fault(Exiting(code=87, error="the abort did not return", assigned=True,
                              abort_hung=True), 87, 0, False)
    assert (hung.kind, hung.attribution) == ("abort_timeout", Attribution.INFRA)


VIEW = LadderView(world=4, node_of={r: 0 for r in range(4)}, ready_spares={0: 1})


def _fault(kind: str, rank: int = 1):
    from nonstop.decide.ladder import Fault

    return Fault(kind, rank=rank, message="cudaErrorX (x)", tag="cudaErrorX")


@pytest.mark.parametrize("kind", ["cuda_assert", "cuda_error", "gpu_hardware", "abort_timeout"])
def test_a_poisoned_rank_gets_a_new_process_even_if_it_still_runs(kind):
    d = decide([_fault(kind)], set(), VIEW, Policy(), Counters())
    assert d.level is Level.REPLACE_RANK and d.replace == frozenset({1})


def test_out_of_memory_is_retried_in_place_once_then_in_a_new_process_then_given_up():
    policy, counters = Policy(), Counters()
    levels = []
    for _ in range(policy.rules.user_error_retries + 1):
        d = decide([_fault("cuda_oom")], set(), VIEW, policy, counters)
        levels.append(d.level)
        counters = charge(d, [_fault("cuda_oom")], counters)
    assert levels[0] is Level.IN_PROCESS
    assert levels[1] is Level.REPLACE_RANK
    assert levels[-1] is Level.FAIL


def test_a_device_assert_every_attempt_ends_the_job_with_the_error_named():
    policy, counters = Policy(), Counters()
    for _ in range(policy.rules.user_error_retries):
        d = decide([_fault("cuda_assert")], set(), VIEW, policy, counters)
        assert d.level is Level.REPLACE_RANK
        counters = charge(d, [_fault("cuda_assert")], counters)
    d = decide([_fault("cuda_assert")], set(), VIEW, policy, counters)
    assert d.level is Level.FAIL and "cudaErrorX" in d.diagnosis


def test_gpu_hardware_faults_repeated_on_a_node_isolate_it():
    policy, counters = Policy(), Counters()
    view = LadderView(world=4, node_of={0: 0, 1: 0, 2: 1, 3: 1}, spare_nodes=1, slots=2)
    for i in range(policy.rules.isolate.times):
        d = decide([_fault("gpu_hardware")], set(), view, policy, counters, now=float(i))
        counters = charge(d, [_fault("gpu_hardware")], counters, now=float(i))
    assert d.level is Level.REPLACE_NODE and d.isolate == frozenset({0})


@pytest.mark.parametrize("kind", ["cuda_assert", "cuda_oom"])
def test_injected_cuda_faults_raise_what_pytorch_raises_on_a_gpu(kind):
    f = inject.parse_one(f"{kind}:rank=0,step=3")
    with pytest.raises(Exception) as raised:
        inject.fire(f)
    found = cuda.of_exception(raised.value)
    assert found is not None and found.kind == kind


def test_nccl_environment_defaults_leave_what_the_user_set():
    env = nccl.environment({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, pid=42, host="h")
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in env  # the user's choice stays
    assert env["TORCH_NCCL_RETHROW_CUDA_ERRORS"] == "0"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    assert "TORCH_NCCL_ENABLE_MONITORING" not in env  # its watchdog waits for it (see nccl.py)
    assert env["NCCL_NVLS_ENABLE"] == "0"
    assert "NCCL_HOSTID" not in env
    shared = nccl.environment({nccl.ENV_SHARE_GPU: "1"}, pid=42, host="h")
    assert shared["NCCL_HOSTID"] == "h-nonstop-42"
    assert nccl.environment(dict(nccl.ENV_DEFAULTS), 1, "h") == {}


def test_a_rank_takes_the_gpu_of_its_local_rank():
    assert [nccl.device_index(r, 4) for r in range(6)] == [0, 1, 2, 3, 0, 1]
    with pytest.raises(RuntimeError, match="no CUDA device"):
        nccl.device_index(0, 0)


class _Backend:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def _group_start(self):
        self.log.append("start")

    def _group_end(self):
        self.log.append("end")

    def abort(self):
        self.log.append(self.name)


def test_grouped_every_communicator_is_aborted_inside_one_nccl_group_call():
    log: list[str] = []
    nccl.abort_all([_Backend(log, "world"), _Backend(log, "dp"), _Backend(log, "tp")], "grouped")
    assert log == ["start", "world", "dp", "tp", "end"]
    nccl.abort_all([])  # nothing to abort: nothing happens


def test_the_abort_can_go_one_by_one_or_in_threads_and_says_where_it_is():
    log: list[str] = []
    stages: list[str] = []
    names = ("world", "dp", "tp")
    nccl.abort_all([_Backend(log, n) for n in names], "each", stages.append)
    assert log == list(names) and stages[-1] == "aborting communicator 3 of 3"
    log.clear()
    nccl.abort_all([_Backend(log, n) for n in names], "threads", stages.append)
    assert sorted(log) == sorted(names) and stages[-1].startswith("3 of 3 communicators aborted")
    failing = _Backend(log, "pp")
    failing.abort = lambda: (_ for _ in ()).throw(RuntimeError("NCCL error: already aborted"))
    log.clear()
    with pytest.raises(RuntimeError, match="already aborted"):  # the others aborted all the same
        nccl.abort_all([_Backend(log, "world"), failing, _Backend(log, "tp")], "threads")
    assert sorted(log) == ["tp", "world"]
    assert nccl.abort_mode({}) == "threads" and nccl.abort_mode({nccl.ENV_ABORT: "Grouped"}) == \
        "grouped" and nccl.abort_mode({nccl.ENV_ABORT: "bogus"}) == "threads"


def _blocked_abort(release: threading.Event):
    return lambda: release.wait(30)


def test_an_abort_that_returns_in_time_is_timed_and_not_escalated():
    calls: list[str] = []
    a = nccl.CommAbort(calls.append, deadline_s=5.0, abort=lambda: time.sleep(0.05))
    assert a.wait()  # not started: nothing to wait for
    a.start()
    a.start()  # the same abort
    assert a.wait() and a.done and not a.escalated and calls == []
    assert 0.04 <= a.seconds < 5.0


def test_an_abort_that_raises_has_still_let_go():
    a = nccl.CommAbort(lambda why: None, deadline_s=5.0,
                   abort=lambda: (_ for _ in ()).throw(RuntimeError("NCCL said no")))
    a.start()
    assert a.wait() and a.error == "RuntimeError: NCCL said no"


def test_an_abort_that_does_not_return_escalates_once_even_with_nobody_waiting():
    release, calls = threading.Event(), []
    a = nccl.CommAbort(calls.append, deadline_s=0.2, abort=_blocked_abort(release))
    a.start()
    deadline = time.monotonic() + 5
    while not calls and time.monotonic() < deadline:  # its own timer escalates
        time.sleep(0.01)
    assert len(calls) == 1 and "did not return within 0.2 s" in calls[0]
    assert not a.wait() and len(calls) == 1  # once
    release.set()


def test_a_group_left_during_its_nccl_abort_is_destroyed_only_once_the_abort_ended():
    release, calls = threading.Event(), []
    g = GenerationGroup("127.0.0.1", 1, 3, 0, 2, "nccl", "g/3/pg", 5.0, 5.0,
                        escalate=calls.append, abort_s=0.3)
    assert g.nccl and g.backend == "cpu:gloo,cuda:nccl"
    g.nccl_abort = nccl.CommAbort(calls.append, 0.3, abort=_blocked_abort(release))
    g._started, g._group_fds = True, {}  # formed (no socket of its own: nothing to shut)
    g.abort()
    assert g.nccl_abort.started
    t0 = time.monotonic()
    g.close()  # the rank leaves at once...
    assert time.monotonic() - t0 < 0.1 and g._deferred
    with pytest.raises(RuntimeError, match="did not return"):
        g.settle()  # ...and the next group may not form while the abort hangs: escalated
    assert calls and "did not return within 0.3 s" in calls[0]
    release.set()


def test_after_an_nccl_abort_a_step_counts_only_if_its_gpu_work_had_ended():
    g = GenerationGroup("127.0.0.1", 1, 0, 0, 2, "nccl", "g/0/pg", 5.0, 5.0,
                        escalate=lambda why: None)
    assert not g.untrusted(10)  # no abort: the rank's own state is good
    g.nccl_abort = nccl.CommAbort(lambda why: None, 5.0, abort=lambda: None)
    g._started, g._group_fds = True, {}
    g.trusted_step = 10  # as if the event after step 10 had completed when the abort began
    g.nccl_abort.start()
    assert not g.untrusted(10) and g.untrusted(11)
    gloo = GenerationGroup("127.0.0.1", 1, 0, 0, 2, "gloo", "g/0/pg", 5.0, 5.0)
    assert gloo.nccl_abort is None and not gloo.untrusted(11)


def test_a_group_left_after_its_nccl_abort_ended_is_destroyed_before_the_next_forms():
    calls: list[str] = []
    g = GenerationGroup("127.0.0.1", 1, 3, 0, 2, "nccl", "g/3/pg", 5.0, 5.0,
                        escalate=calls.append, abort_s=2.0)
    g.nccl_abort = nccl.CommAbort(calls.append, 2.0, abort=lambda: None)
    g._started, g._group_fds = True, {}
    g.abort()
    assert g.nccl_abort.wait()
    g.close()
    assert g._deferred  # not on the teardown's path: PyTorch's watchdog may still be busy
    g.settle()
    assert not g._deferred and calls == []
    g.settle()  # once only


def test_an_nccl_generation_gets_its_abort_on_top_of_the_teardown():
    from nonstop.controller.machine import teardown_allowance

    policy = Policy()
    gloo = teardown_allowance((), 0.1, policy)
    nccl_job = teardown_allowance((), 0.1, policy, abort_s=policy.timeouts.abort_s)
    assert gloo == pytest.approx(policy.timeouts.teardown_s + 0.2)
    assert nccl_job == pytest.approx(gloo + policy.timeouts.abort_s)


def test_a_snapshot_may_be_committed_only_of_a_step_whose_gpu_work_ended_before_the_abort():
    g = GenerationGroup("127.0.0.1", 1, 0, 0, 2, "nccl", "g/0/pg", 5.0, 5.0,
                        escalate=lambda why: None)
    assert g.may_commit(12)  # no abort
    g.nccl_abort = nccl.CommAbort(lambda why: None, 5.0, abort=lambda: None)
    g._started, g._group_fds = True, {}
    g.trusted_step = 10
    g.nccl_abort.start()
    assert g.may_commit(10) and g.may_commit(9) and not g.may_commit(11)
    g.trusted_step = None  # no step's end was known
    assert not g.may_commit(1)


def test_moving_host_state_to_a_gpu_moves_nothing():
    import torch

    import nonstop

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = nonstop.State(model=model, optimizer=opt, extra=torch.zeros(2))
    before = [p.data_ptr() for p in model.parameters()]
    assert state.to_device(torch.device("cuda", 0)) == 0  # only tensors on another GPU move
    assert [p.data_ptr() for p in model.parameters()] == before

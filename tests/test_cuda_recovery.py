"""CUDA faults with real processes (gloo on CPU: the rank raises what PyTorch raises on a GPU, and
nonstop reads nothing else): a device-side assert ends its process, whose rank a warm spare takes
while the others restart in place; out of memory is retried in the same processes. Both end with
the fault-free weights. tests/test_gpu.py and ``nonstop bench gpu`` do the same on a real GPU."""

from __future__ import annotations

import pytest

from conftest import bitwise_equal, rank_wids, train
from nonstop import protocol

pytestmark = pytest.mark.integration

ARGS = ("--steps", "40", "--sleep-ms", "10")  # the same job as test_sdc: one reference for both


def test_a_device_side_assert_gets_its_rank_a_new_process_and_loses_nothing(tmp_path, reference):
    run, out = train(tmp_path, "--spares=1", "--inject=cuda_assert:rank=1,step=12", args=ARGS)
    (ended,) = [e for e in run.of("exit") if e.get("rank") == 1 and e["code"] != 0]
    assert ended["code"] == protocol.EXIT_CUDA and not ended["killed"]
    (fault,) = [f for f in run.of("fault") if f["kind"] != "peer"]
    assert (fault["kind"], fault["code"], fault["attribution"]) == ("cuda_assert",
                                                                    "cudaErrorAssert", "user")
    (d,) = run.of("decision")
    assert d["level"] == "rank replacement" and d["replace"] == [1]
    held = rank_wids(run)
    assert len(held[1]) == 2 and len(held[0]) == 1 and len(held[2]) == 1
    assert "cudaErrorAssert (device-side assert triggered)" in run.stderr + run.stdout
    assert bitwise_equal(out, reference(3, *ARGS))


def test_out_of_gpu_memory_is_retried_in_the_same_processes(tmp_path, reference):
    run, out = train(tmp_path, "--spares=1", "--inject=cuda_oom:rank=0,step=12", args=ARGS)
    (fault,) = [f for f in run.of("fault") if f["kind"] != "peer"]
    assert (fault["kind"], fault["code"]) == ("cuda_oom", "cudaErrorMemoryAllocation")
    (d,) = run.of("decision")
    assert d["level"] == "in-process restart"
    assert all(len(w) == 1 for w in rank_wids(run).values())
    (left,) = [e for e in run.of("rank_left") if e["rank"] == 0]
    assert left["reason"] == "cuda_oom" and left["cuda"]["name"] == "cudaErrorMemoryAllocation"
    assert bitwise_equal(out, reference(3, *ARGS))

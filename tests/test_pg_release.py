"""A kept group of an ended generation is destroyed without ever hanging its rank: drained first
(real gloo, two real processes), or kept for good when it cannot drain in time."""

from __future__ import annotations

import pytest

import re
import sys

import torch.distributed as dist

from conftest import ROOT, rank_processes

pytestmark = pytest.mark.integration  # starts processes

SCRIPT = ROOT / "tests" / "scripts" / "kept_group.py"
LASTING = ROOT / "tests" / "scripts" / "lasting_abort.py"


def _run(mode: str, script=SCRIPT) -> list[str]:
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    return [stdout + stderr for stdout, stderr in rank_processes(
        lambda r: [sys.executable, str(script), str(r), str(store.port), mode])]


def _released(text: str, word: str = "released") -> tuple[float, int]:
    m = re.search(word + r" ([\d.]+) kept (\d+)", text)
    assert m, text
    return float(m.group(1)), int(m.group(2))


def test_a_kept_group_is_drained_then_destroyed_at_once():
    for text in _run("drain"):
        assert "workers 2" in text  # gloo's two worker threads, told by name
        seconds, kept = _released(text)
        assert seconds < 0.4 and kept == 0, text


def test_a_group_that_cannot_drain_is_kept_and_the_rank_goes_on():
    rank0, rank1 = _run("stuck")
    seconds, kept = _released(rank0)
    assert 0.4 <= seconds < 2.0 and kept == 1, rank0
    assert "still busy" in rank0
    assert "released" not in rank1


def test_a_group_with_one_worker_still_busy_is_kept_then_destroyed_once_it_is_idle():
    """One worker idle takes every probe; the other is still in the ended generation (and needs
    the GIL to leave it): destroying the group now would join it with the GIL held, forever."""
    rank0, _ = _run("busy")
    seconds, kept = _released(rank0)
    assert seconds < 1.0 and kept == 1 and "still busy" in rank0, rank0
    seconds, kept = _released(rank0, "again")
    assert seconds < 0.4 and kept == 0, rank0


@pytest.mark.parametrize("how", ["all_gather", "reduce_scatter", "functional"])
def test_a_wait_on_a_mesh_group_ends_when_its_generation_is_aborted(how):
    """gloo can leave a collective waiting on a connection already closed, where shutting the
    generation's sockets reaches nothing: a survivor would stay in its generation until the
    teardown deadline kills it. A collective on a mesh's lasting group waits in slices and ends
    when the generation is aborted; one posted after the abort is refused at once."""
    rank0, rank1 = _run(how, LASTING)
    assert "sum 2.0" in rank0 and "sum 2.0" in rank1
    m = re.search(r"released ([\d.]+): (.*)", rank0)
    assert m, rank0
    assert 0.3 <= float(m.group(1)) < 1.0 and "generation aborted" in m.group(2), rank0
    assert "abandoned 1" in rank0  # its groups are kept until that work ends
    m = re.search(r"refused ([\d.]+): (.*)", rank0)
    assert m and float(m.group(1)) < 0.1 and "after its generation was aborted" in m.group(2), rank0

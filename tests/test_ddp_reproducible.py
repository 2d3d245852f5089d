"""nonstop.reproducible: the same averaged gradients whatever DDP's bucket layout (its initial one,
its rebuilt one, another bucket size), bit for bit, in a real gloo group of 3 processes."""

from __future__ import annotations

import pytest

import sys
from pathlib import Path

import torch

from conftest import SCRIPTS, rank_processes

pytestmark = pytest.mark.integration  # starts processes

WORLD = 3  # with 2, a + b is the same sum in either order: the layout shows from 3 ranks on


def _run(tmp_path: Path) -> dict:
    """The ranks' averaged gradients under each layout (rank 0 saves them)."""
    rank_processes(lambda r: [sys.executable, str(SCRIPTS / "ddp_layouts.py"), str(r), str(WORLD),
                              str(tmp_path / "store"), str(tmp_path)], ranks=WORLD, timeout=120)
    return torch.load(tmp_path / "grads.pt")


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(-1).view(torch.int32), b[k].view(-1).view(torch.int32)) for k in a)


def test_the_reduction_does_not_depend_on_the_bucket_layout(tmp_path):
    r = _run(tmp_path)
    for kind in ("repro-", "repro_small-"):  # one fixed bucket; several
        repro = [v for k, v in r.items() if k.startswith(kind)]
        assert len(repro) == 4 and all(_same(repro[0], v) for v in repro[1:]), kind
    # DDP's own reduction does depend on it (what makes the test able to fail)
    plain = [v for k, v in r.items() if k.startswith("plain")]
    assert not all(_same(plain[0], v) for v in plain[1:])
    # and both average the same gradients: equal up to rounding
    for k in repro[0]:
        assert torch.allclose(repro[0][k], plain[0][k], rtol=1e-5, atol=1e-6)

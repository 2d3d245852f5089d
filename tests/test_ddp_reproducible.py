"""nonstop.reproducible: the same averaged gradients whatever DDP's bucket layout (its initial one,
its rebuilt one, another bucket size), bit for bit, in a real gloo group of 3 processes."""

from __future__ import annotations

import pytest

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from conftest import SCRIPTS

pytestmark = pytest.mark.integration  # starts processes

WORLD = 3  # with 2, a + b is the same sum in either order: the layout shows from 3 ranks on


#: the ranks' parent: a fresh interpreter that imports torch once and forks them. (Forked from
#: the test's own process, a pytest worker with threads of its own, a rank once hung at its start
#: holding a lock a thread had at the fork.)
DRIVER = """
import os, sys
sys.path.insert(0, sys.argv[1])
import ddp_layouts
world, store, out = int(sys.argv[2]), sys.argv[3], sys.argv[4]
pids = []
for r in range(world):
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            ddp_layouts.main(r, world, store, out)
            code = 0
        finally:
            os._exit(code)
    pids.append(pid)
codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
print(codes)
sys.exit(0 if codes == [0] * world else 1)
"""


def _run(tmp_path: Path) -> dict:
    """The ranks' averaged gradients under each layout (rank 0 saves them)."""
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(SCRIPTS), str(WORLD),
                             str(tmp_path / "store"), str(tmp_path)], start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and its ranks
        out, _ = proc.communicate()
    assert proc.returncode == 0, out[-3000:]
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

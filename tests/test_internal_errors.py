"""An error raised inside nonstop's own state code is nonstop's, never blamed on the training
code: told from the traceback (``runtime/wrap.py: raised_by_nonstop``), a fault of its own kind
(``internal``, attribution ``nonstop``) that stops the job with a diagnosis that says so."""

from __future__ import annotations

import pytest
import torch
from conftest import SCRIPTS, run_nonstop

from nonstop.runtime.wrap import raised_by_nonstop
from nonstop.state.digest import digest


def _caught(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return exc
    raise AssertionError("nothing raised")


def test_an_error_is_told_nonstops_by_the_innermost_frame_outside_torch():
    # raised in nonstop's state code itself, and in PyTorch called from it
    assert raised_by_nonstop(_caught(lambda: digest([object()])))
    assert raised_by_nonstop(_caught(lambda: digest([torch.nn.Linear(2, 2).to_empty(
        device="meta")])))
    # raised in the training code, and in PyTorch called from it
    assert not raised_by_nonstop(_caught(lambda: 1 / 0))
    assert not raised_by_nonstop(_caught(lambda: torch.zeros(2).view(5)))


@pytest.mark.integration
def test_state_nonstop_cannot_keep_is_told_nonstops(tmp_path):
    """A module whose state nonstop cannot keep: its snapshot fails in nonstop's own state code.
    The job stops with that said, not with 'rank 0 raised ... giving up
    (rules.user_error_retries)' as if the script were at fault."""
    run = run_nonstop(tmp_path / "run", "--nproc=2", "--spares=0",
                      str(SCRIPTS / "unsupported_state.py"), "--steps", "20", timeout=180)
    assert run.code == 1, run.stdout[-3000:] + run.stderr[-3000:]
    faults = run.of("fault")
    assert faults and {f["kind"] for f in faults} == {"internal"}
    assert {f["attribution"] for f in faults} == {"nonstop"}
    last = run.stderr.strip().splitlines()[-1]
    assert "nonstop's own state code raised UnsupportedState" in last and "a bug in nonstop" in last
    assert "user_error_retries" not in last
    assert len(run.of("decision")) == 1  # no retry: it would fail on in the training code


@pytest.mark.integration
@pytest.mark.parametrize("unguarded", [False, True], ids=["once", "every-entry"])
def test_a_mesh_the_script_built_itself_stops_the_job_with_advice(tmp_path, unguarded):
    """An FSDP2 script that builds its mesh and shards its model inside the wrapped function
    trains, but its mesh's groups end with the first generation: after a crash the job stops at
    once (exit 2, one line) saying what to change, instead of failing in a collective on the
    dead groups and retrying. Sharding at every entry, a survivor meets FSDP2's refusal to
    shard a module twice first: that too is the setup to change, not the user's error to retry
    in place (it failed alike each time, then stopped on the user-error budget)."""
    run = run_nonstop(tmp_path / "run", "--nproc=2", "--spares=1", "--inject",
                      "crash:rank=1,step=8", str(SCRIPTS / "fsdp_naive.py"), "--steps", "16",
                      *(["--unguarded"] if unguarded else []), timeout=180)
    assert run.code == 2, run.stdout[-3000:] + run.stderr[-3000:]
    # (a survivor's collective may fail on the dead peer before it hears: a 'peer' symptom)
    assert {f["kind"] for f in run.of("fault")} - {"peer"} == {"crash", "setup"}
    last = run.stderr.strip().splitlines()[-1]
    assert "nonstop.Mesh(dims, shape, build)" in last and "Traceback" not in run.stderr
    assert len(run.of("decision")) == 2  # the replacement, then the stop


def test_an_error_in_nonstops_state_code_while_a_generation_forms_is_nonstops_not_a_peers():
    """A survivor's FSDP2 modules are set back to rest while the next generation forms: an
    error there (found on a GPU: a torch without the attribute read) failed alike on every
    in-place retry while it was taken for a peer's. A collective's error then is a peer's, and
    so is any other raised outside nonstop's own state code (as before)."""
    from nonstop.runtime.wrap import failure_reason
    from nonstop.state import shards

    class NoGroups:
        _is_root = True
        _state_ctx = type("Ctx", (), {"all_states": [object()]})()

    module = torch.nn.Linear(2, 2)
    module._get_fsdp_state = lambda: NoGroups()  # an FSDP2 state of another torch's shape
    state = type("S", (), {"objects": lambda self: {"model": module}})()
    internal = _caught(lambda: shards.settle(state))
    assert failure_reason(internal, "rendezvous", aborted=False, cuda_oom=False) == "internal"
    peer = RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer")
    assert failure_reason(peer, "rendezvous", aborted=False, cuda_oom=False) == "peer"
    assert failure_reason(_caught(lambda: 1 / 0), "rendezvous", False, False) == "peer"
    assert failure_reason(_caught(lambda: 1 / 0), "train", False, False) == "exception"
    assert failure_reason(internal, "train", aborted=True, cuda_oom=False) == "abort"

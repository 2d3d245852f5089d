"""Which runs a zygote template serves (pure decisions: no process). A template's zygote has
torch imported under the template's environment, so a run whose import-time environment differs
must start its own zygote - and be told why."""

from __future__ import annotations

import os
import sys

import pytest

from nonstop import zygote_client
from nonstop.agent import zygote
from nonstop.protocol import zygote_messages as zm


@pytest.fixture
def start_env():
    """The template's environment at its start (its imports set TORCHINDUCTOR_CACHE_DIR)."""
    return {"PATH": "/bin", "OMP_NUM_THREADS": "1"}


def refusal(msg, fds=None, uid=None, start=None, now=None):
    """Why the template refuses ``msg``, or None where it serves it (the request, read)."""
    start = start if start is not None else {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    now = now if now is not None else dict(start, TORCHINDUCTOR_CACHE_DIR="/tmp/default")
    out = zygote._refusal(msg, FDS if fds is None else fds,
                          os.getuid() if uid is None else uid, start, now)
    if isinstance(out, zm.TemplateRequest):
        assert zm.encode(out) == msg  # read as it was sent
        return None
    return out


@pytest.fixture(autouse=True)
def stamp(monkeypatch):
    monkeypatch.setattr(zygote, "_STAMP", {"code": "c0de"})


def request(environ: dict, **changes) -> dict:
    msg = {"role": "zygote", "pid": 1, "env": environ, "cwd": "/", "python": zygote_client.python_identity(),
           "nonstop": zygote_client.nonstop_dir(), "code": "c0de"}
    msg.update(changes)
    return msg


FDS = [3, 4, 5, 6]


def test_a_run_of_the_same_environment_is_served(start_env):
    assert refusal(request(dict(start_env))) is None


@pytest.mark.parametrize("key", ["PYTHONPATH", "PYTHONUNBUFFERED", "GLOO_SOCKET_IFNAME",
                                 "NCCL_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES", "NONSTOP_RUN_DIR"])
def test_what_the_zygote_applies_or_a_rank_reads_later_may_differ(start_env, key):
    assert refusal(request(dict(start_env, **{key: "x"}))) is None


@pytest.mark.parametrize("env,named", [
    ({"OMP_NUM_THREADS": "2"}, "OMP_NUM_THREADS"),
    ({"TORCH_CPP_LOG_LEVEL": "ERROR"}, "TORCH_CPP_LOG_LEVEL"),
    ({"LD_PRELOAD": "/lib/x.so"}, "LD_PRELOAD"),
    ({"PYTHONHASHSEED": "0"}, "PYTHONHASHSEED"),
])
def test_what_torch_or_the_interpreter_read_at_their_start_must_not(start_env, env, named):
    why = refusal(request(dict(start_env, **env)))
    assert why == f"the environment read at import differs: {named}"


def test_a_variable_only_the_template_had_at_its_start_counts_too(start_env):
    env = dict(start_env)
    del env["OMP_NUM_THREADS"]
    why = refusal(request(env))
    assert why == "the environment read at import differs: OMP_NUM_THREADS"


def test_a_variable_the_templates_imports_set_may_be_absent_or_as_they_set_it(start_env):
    """Importing torch sets TORCHINDUCTOR_CACHE_DIR where it is unset: a run that has it (its
    launcher imported torch in-process) or not is served, one with another value is not."""
    assert refusal(request(dict(start_env))) is None
    assert refusal(request(dict(start_env, TORCHINDUCTOR_CACHE_DIR="/tmp/default"))) is None
    assert refusal(request(dict(start_env, TORCHINDUCTOR_CACHE_DIR="/elsewhere"))) == (
        "the environment read at import differs: TORCHINDUCTOR_CACHE_DIR")


@pytest.mark.parametrize("change,said", [
    ({"python": ["/usr/bin/python3.9", "/usr"]}, "the template runs"),
    ({"nonstop": "/elsewhere/nonstop"}, "with /elsewhere/nonstop"),
    ({"code": "newer"}, "changed on disk since the template started"),
    ({"env": "OMP_NUM_THREADS=1"}, "a malformed request: TemplateRequest.env"),
    ({"env": {"OMP_NUM_THREADS": 1}}, "a malformed request: TemplateRequest.env['OMP_NUM_THREADS']"),
    ({"cwd": None}, "a malformed request: TemplateRequest.cwd"),
    ({"role": "shell"}, "a malformed request: TemplateRequest.role"),
    ({"agent": 1}, "unknown field(s) ['agent']"),
])
def test_another_interpreter_another_nonstop_or_a_malformed_request_is_refused(start_env, change,
                                                                               said):
    assert said in refusal(request(dict(start_env), **change))


def test_another_user_or_missing_descriptors_are_refused(start_env):
    assert "runs as user" in refusal(request(dict(start_env)), uid=os.getuid() + 1)
    assert refusal(request(dict(start_env)), fds=FDS[:3]) == (
        "a malformed request: 3 descriptors, not 4")
    assert refusal(None).startswith("a malformed request")


def test_a_keeper_asking_for_a_checkpoint_writer_is_served_and_refused_alike(start_env):
    assert refusal(request(dict(start_env), role="writer")) is None
    assert refusal(request(dict(start_env), role="writer"), uid=os.getuid() + 1).startswith(
        "the keeper runs as user")


def test_pythonpath_goes_where_an_interpreter_start_puts_it(monkeypatch):
    monkeypatch.setattr(sys, "path", ["/script", "/stdlib", "/already"])
    zygote._apply_start_env({"PYTHONPATH": os.pathsep.join(["/a", "/already", "", "/b"])})
    assert sys.path == ["/script", "/a", "/b", "/stdlib", "/already"]


def test_the_code_stamp_changes_with_a_file_of_the_package_not_with_its_caches(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub" / "__pycache__").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    first = zygote_client.code_stamp(str(pkg), None)
    (pkg / "sub" / "__pycache__" / "b.cpython-311.pyc").write_bytes(b"cache")
    (pkg / "notes.txt").write_text("not code")
    assert zygote_client.code_stamp(str(pkg)) == first
    (pkg / "sub" / "b.py").write_text("y = 3  # an upgrade\n")
    assert zygote_client.code_stamp(str(pkg)) != first
    # torch: its top level only (version.py and its extensions say which build it is)
    torch = tmp_path / "torch"
    (torch / "deep").mkdir(parents=True)
    (torch / "version.py").write_text("__version__ = '2.13.0'\n")
    (torch / "deep" / "x.py").write_text("1\n")
    t = zygote_client.code_stamp(str(torch))
    (torch / "deep" / "x.py").write_text("22\n")
    assert zygote_client.code_stamp(str(torch)) == t
    (torch / "version.py").write_text("__version__ = '2.14.0'\n")
    assert zygote_client.code_stamp(str(torch)) != t

"""Every input a user gives, fuzzed (hypothesis): ``--inject`` specs, rendezvous endpoints, the
job's secret (file or environment), and whole ``nonstop run`` command lines. Each is either
accepted or refused with one clear line (exit code 2 on the command line) - never a traceback,
and nothing started. (Policies are fuzzed in test_policy.py.)"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile

import pytest
from conftest import our_processes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nonstop import cli, inject
from nonstop.errors import UsageError
from nonstop.net.channel import SECRET_ENV, load_secret
from nonstop.store.etcd import parse_endpoints

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- --inject --------------------------------------------------------------------------------------
ALL_KEYS = sorted(set(inject.COMMON_KEYS).union(*(extra for _, extra in inject.KINDS.values())))
numbers = st.integers(-3, 2**70).map(str)
values = st.one_of(numbers, st.sampled_from(["all", *inject.POINTS, "", " ", "1.5", "0x10", "-0"]),
                   st.text(max_size=6))
pairs = st.tuples(st.sampled_from(ALL_KEYS) | st.text(max_size=5), st.sampled_from(["=", "", "=="]),
                  values).map("".join)
one_spec = st.one_of(
    st.text(max_size=30),
    st.tuples(st.sampled_from(sorted(inject.KINDS)) | st.text(max_size=6), st.sampled_from([":", "", "::"]),
              st.lists(pairs, max_size=5).map(",".join)).map("".join))
specs = st.lists(st.lists(one_spec, min_size=1, max_size=3).map(";".join), max_size=3)


@FAST
@given(specs, st.integers(-1, 9))
def test_fuzz_inject_specs(given_specs, world):
    try:
        faults = inject.parse(given_specs)
        inject.check_world(faults, world)
    except UsageError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    assert inject.from_env(inject.to_env(faults)) == faults  # what is accepted reaches the ranks whole


# -- rendezvous endpoints ----------------------------------------------------------------------------
host_part = st.sampled_from(["127.0.0.1", "localhost", "[::1]", "::1", "", "etcd-0", "1.2.3.4.5", "h:",
                             "\u00e9tcd", " "]) | st.text(max_size=8)
port_part = st.sampled_from(["2379", "0", "65535", "65536", "-1", "", "99999999999999999999", "2e3",
                             " 23"]) | st.text(max_size=5)
endpoint = st.tuples(st.sampled_from(["etcd://", "https://", "http://", "", "etcd:/", "ftp://"]),
                     st.lists(st.tuples(host_part, st.sampled_from([":", ""]), port_part).map("".join),
                              max_size=3).map(",".join)).map("".join)


@FAST
@given(endpoint | st.text(max_size=40))
def test_fuzz_rendezvous_endpoints(text):
    try:
        got = parse_endpoints(text)
    except ValueError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    assert got and all(isinstance(h, str) and h and 0 < p < 65536 for h, p in got), got


# -- the job's secret ------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:the job secret is only")
@FAST
@given(st.one_of(st.none(), st.text(max_size=80), st.binary(max_size=80).map(lambda b: b.decode("latin-1"))),
       st.one_of(st.none(), st.binary(max_size=80)))
def test_fuzz_the_jobs_secret(env_value, file_bytes):
    env = {} if env_value is None or "\x00" in env_value else {SECRET_ENV: env_value}
    with tempfile.TemporaryDirectory() as d:
        path = None
        if file_bytes is not None:
            path = os.path.join(d, "secret")
            with open(path, "wb") as f:
                f.write(file_bytes)
            os.chmod(path, 0o600)
        try:
            secret = load_secret(path, env=env)
        except ValueError as exc:
            assert str(exc) and "\n" not in str(exc)
            return
    assert isinstance(secret, bytes) and secret and secret == secret.strip()


# -- whole command lines -----------------------------------------------------------------------------
RUN_FLAGS = ["--nproc", "--nproc-per-node", "--nnodes", "--rdzv-endpoint", "--rdzv-id", "--node-addr",
             "--node-id", "--secret-file", "--spares", "--nodes", "--spare-nodes", "--policy",
             "--run-dir", "--inject", "--hang-timeout", "--teardown-timeout", "--max-restarts",
             "--checkpoint-dir", "--checkpoint-every", "--snapshot-every", "--etcd-cacert",
             "--etcd-cert", "--etcd-key", "--etcd-user", "--quiet", "--no-live", "--", "-x", "--nproc="]
flag_values = st.one_of(st.sampled_from(["0", "1", "2", "-1", "4", "1:2", "2:1", "auto", "etcd://127.0.0.1:1",
                                         "127.0.0.1:2379", "job", "1e9", "nan", "inf", "",
                                         "crash:rank=0,step=1", "crash:rank=9,step=1", "hang:rank=1"]),
                        specs.map(";".join), endpoint,
                        st.text(alphabet=st.characters(blacklist_characters="/\x00"), max_size=8))
# never --help (abbreviated too): it prints the help and succeeds
tokens = st.one_of(st.sampled_from(RUN_FLAGS), flag_values).filter(
    lambda t: not (t.startswith("-h") or t.startswith("--h") or t == "-"))


@pytest.fixture(scope="module")
def empty_dir():
    """The command lines run here: no file a fuzzed word could name exists (the script least)."""
    old = os.getcwd()
    with tempfile.TemporaryDirectory() as d:
        os.chdir(d)
        try:
            yield d
        finally:
            os.chdir(old)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.lists(tokens, max_size=8), st.lists(tokens, max_size=3))
def test_fuzz_run_command_lines(empty_dir, flags, script_args):
    argv = ["run", *flags, "missing_script.py", *script_args]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(argv)
        except SystemExit as exc:
            code = exc.code
    lines = [x for x in err.getvalue().splitlines() if x.strip()]
    assert code == 2, (argv, err.getvalue())
    assert len(lines) == 1 and lines[0].startswith("nonstop: error: "), (argv, err.getvalue())
    assert os.listdir(empty_dir) == [], argv  # no run directory, no checkpoint directory made


def test_nothing_was_started_by_the_fuzzed_command_lines():
    assert our_processes() == []

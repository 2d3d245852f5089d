"""Helpers for tests that start real rank processes: run nonstop, read its events, compare weights,
and make sure no process of ours outlives a test."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TRAIN = EXAMPLES / "train_ddp.py"
PLAIN = EXAMPLES / "plain_ddp.py"
SCRIPTS = Path(__file__).resolve().parent / "scripts"
# Every process this test session starts inherits this variable, even once re-parented: that is
# how a process left behind by this session is told from anyone else's.
SESSION = f"NONSTOP_TEST_SESSION={uuid.uuid4().hex}"
os.environ["NONSTOP_TEST_SESSION"] = SESSION.split("=", 1)[1]


@dataclass
class Run:
    code: int
    stdout: str
    stderr: str
    run_dir: Path
    seconds: float

    @property
    def events(self) -> list[dict]:
        path = self.run_dir / "events.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]

    @property
    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())


def nonstop_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "nonstop", *args]


def _outputs(run_dir: Path) -> tuple[Path, Path]:
    """Where a started run's stdout and stderr go: files beside its run directory (a pipe nobody
    reads while the job runs fills at 64 KiB and blocks the job mid-line)."""
    return (run_dir.parent / f"{run_dir.name}.stdout", run_dir.parent / f"{run_dir.name}.stderr")


def start(run_dir: Path, *args: str) -> subprocess.Popen:
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    out, err = _outputs(run_dir)
    with open(out, "w") as fo, open(err, "w") as fe:
        return subprocess.Popen(nonstop_cmd("run", "--no-live", f"--run-dir={run_dir}", *args),
                                stdout=fo, stderr=fe, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, run_dir: Path, t0: float, timeout: float = 180) -> Run:
    paths = _outputs(run_dir)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait(timeout=30)
        out, err = (p.read_text(errors="replace") for p in paths)
        pytest.fail(f"nonstop run did not end within {timeout} s:\n{out[-3000:]}\n{err[-3000:]}")
    out, err = (p.read_text(errors="replace") for p in paths)
    run = Run(proc.returncode, out, err, run_dir, time.time() - t0)
    if (run_dir / "summary.json").is_file():
        check_account(run.summary)
    return run


def check_account(summary: dict) -> None:
    """Every run's goodput account: each category non-negative, all adding up to the wall time."""
    from nonstop.observe import goodput

    cats = summary["time_s"]
    flat = [v for c in cats.values() for v in (c.values() if isinstance(c, dict) else [c])]
    assert all(v >= 0 for v in flat), cats
    assert abs(goodput.total(cats) - summary["wall_s"]) < 0.01, (goodput.total(cats), summary)


def run_nonstop(run_dir: Path, *args: str, timeout: float = 180) -> Run:
    t0 = time.time()
    return finish(start(run_dir, *args), run_dir, t0, timeout)


def train(tmp_path: Path, *flags: str, args: tuple = (), world: int = 3, timeout: float = 180,
          ok: bool = True, script: Path = TRAIN) -> tuple[Run, Path]:
    """Run an example training script under nonstop; its final weights are in the path."""
    out = tmp_path / "final.pt"
    run = run_nonstop(tmp_path / "run", f"--nproc={world}", *flags, str(script), *args,
                      "--save", str(out), timeout=timeout)
    if ok:
        assert run.code == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return run, out


def rank_wids(run: Run) -> dict[int, set[int]]:
    """rank -> every worker that held it."""
    held: dict[int, set[int]] = {}
    for g in run.of("generation"):
        for rank, wid in g["ranks"].items():
            held.setdefault(int(rank), set()).add(wid)
    return held


def policy_file(tmp_path: Path, text: str) -> str:
    p = tmp_path / "policy.yaml"
    p.write_text(text)
    return str(p)


def wait_for_event(run_dir: Path, predicate, timeout: float = 60) -> dict:
    return wait_for_events(run_dir, predicate, 1, timeout)[0]


def wait_for_events(run_dir: Path, predicate, n: int, timeout: float = 60) -> list[dict]:
    """The first ``n`` events of the run that match (waiting until there are as many)."""
    from nonstop_bench.common import JsonlTail

    path = run_dir / "events.jsonl"
    tail = JsonlTail(path)
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = [ev for ev in tail.records() if predicate(ev)]
        if len(found) >= n:
            return found[:n]
        time.sleep(0.05)
    lines = path.read_text().splitlines() if path.exists() else []
    outs = [p.read_text(errors="replace")[-2000:] for p in _outputs(run_dir) if p.exists()]
    pytest.fail(f"no matching event in {path} within {timeout} s; the run's story:\n"
                + "\n".join(_story(lines)) + "\nits last events:\n" + "\n".join(lines[-12:])
                + "\n" + "\n".join(outs))


# what a failed wait prints first: how the run went, without the periodic events that fill its tail
_STORY = ("spawn", "generation", "replace", "kill", "exit", "fault", "abort", "decision",
          "incident", "deadline", "scale_in", "scale_out", "scale_out_done", "regroup", "leader",
          "takeover", "give_up", "rank_first_step")


def _story(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue
        if ev.get("type") in _STORY:
            out.append(line[:300])
    return out[-80:]


def bitwise_equal(a: Path, b: Path) -> bool:
    x, y = torch.load(a), torch.load(b)
    return x.keys() == y.keys() and all(
        torch.equal(x[k].reshape(-1).view(torch.uint8), y[k].reshape(-1).view(torch.uint8)) for k in x)


# this worker's zygote templates (see zygote_template) and forker (see rank_processes):
# processes of the session, not ones left behind by a test
TEMPLATE: dict[str, int] = {}  # its name ("one": one host's, "hosts", "forker") -> its pid


def our_processes() -> list[str]:
    """Processes started by this test session (launchers, ranks, spares, bench jobs) still alive."""
    found = []
    me = os.getpid()
    templates = set(TEMPLATE.values())
    marker = SESSION.encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == me or int(pid) in templates:
            continue
        try:
            env = (Path("/proc") / pid / "environ").read_bytes()
            if marker not in env.split(b"\0"):
                continue
            cmd = (Path("/proc") / pid / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (Path("/proc") / pid / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            found.append(f"{pid}: {cmd[:200]}")
    return found


def assert_none_left(timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    left = our_processes()
    while left and time.time() < deadline:
        time.sleep(0.1)
        left = our_processes()
    assert not left, "processes left behind:\n" + "\n".join(left)


@pytest.fixture(autouse=True)
def no_process_left_behind():
    yield
    _references_ahead_done()
    assert_none_left()


@pytest.fixture
def alongside():
    """``start`` a ``nonstop run`` beside the test's own job (a fault-free reference, read with
    ``finish``). One still running when the test ends - it failed before ``finish`` - is asked
    to end (SIGTERM: it ends what it started), then its group killed, before the check for
    processes left behind."""
    procs: list[subprocess.Popen] = []

    def begin(run_dir: Path, *args: str) -> subprocess.Popen:
        procs.append(start(run_dir, *args))
        return procs[-1]

    yield begin
    for proc in procs:
        asked_to_end(proc, 30)


def asked_to_end(proc: subprocess.Popen, grace_s: float) -> None:
    """A command of ours still running (a session of its own): asked to end (SIGTERM: it ends
    what it started), its group killed if it has not within ``grace_s``."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


# references computed while a test's own job runs (``reference.ahead``): the test that started
# one ends only once it is done, so that its run is not taken for a process left behind
_AHEAD: list[threading.Thread] = []


def _references_ahead_done() -> None:
    while _AHEAD:
        _AHEAD.pop().join(timeout=600)


@pytest.fixture(scope="session")
def zygote_template():
    """One process per worker that imports torch once (``nonstop.agent.zygote --template``):
    every ``nonstop run`` of the session forks its zygote from it (``NONSTOP_ZYGOTE_TEMPLATE``)
    rather than importing torch again - 3-4 s of a small job's 4-5 s start. The zygote it forks
    enters the run's namespaces (a test host's) and serves the run as one the run started; a run
    whose import-time environment differs starts its own. ``NONSTOP_TEST_TEMPLATE=0``: none."""
    from nonstop import zygote_client

    if os.environ.get("NONSTOP_TEST_TEMPLATE", "1") == "0":
        yield None
        return
    d = Path(tempfile.mkdtemp(prefix="nst-zt-"))  # short: a socket's path has 107 bytes at most
    base = dict(os.environ)
    base.setdefault("OMP_NUM_THREADS", "1")  # what nonstop run gives its zygote
    # two environments at import: one host's, and across hosts' (which quiets torch's C++ log)
    envs = {"one": base, "hosts": dict(base, TORCH_CPP_LOG_LEVEL="ERROR")}
    log = open(d / "template.log", "ab")
    procs = {name: subprocess.Popen(
        [sys.executable, "-u", "-m", "nonstop.agent.zygote", "--template", str(d / name)],
        env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True) for name, env in envs.items()}
    TEMPLATE.update({name: p.pid for name, p in procs.items()})
    try:
        deadline = time.time() + 120
        while not all((d / n).exists() or p.poll() is not None for n, p in procs.items()) \
                and time.time() < deadline:
            time.sleep(0.05)
        paths = [str(d / n) for n in procs if (d / n).exists()]
        if paths:
            os.environ[zygote_client.TEMPLATE_ENV] = os.pathsep.join(paths)
        yield paths
    finally:
        os.environ.pop(zygote_client.TEMPLATE_ENV, None)
        for p in procs.values():
            p.kill()
            p.wait(timeout=30)
        TEMPLATE.clear()
        log.close()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(autouse=True)
def zygotes_from_the_template(request):
    """Integration tests run with this worker's zygote template (started at the first)."""
    if request.node.get_closest_marker("integration") is not None:
        request.getfixturevalue("zygote_template")
    yield


@pytest.fixture(autouse=True)
def processes_only_in_integration_tests(request, monkeypatch):
    """The fast tier (``-m "not integration"``, ``make test-fast``) starts no process: a test
    that starts one (subprocess, fork, multiprocessing) and is not marked ``integration`` fails
    here, saying so."""
    if request.node.get_closest_marker("integration") is not None:
        yield
        return
    import _posixsubprocess
    import multiprocessing.util

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} starts a process: mark it "
                             "pytest.mark.integration (the fast tier starts none)")

    monkeypatch.setattr(_posixsubprocess, "fork_exec", refuse)
    monkeypatch.setattr(subprocess, "_fork_exec", refuse)  # (bound at its import)
    monkeypatch.setattr(multiprocessing.util, "spawnv_passfds", refuse)
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse)
    yield


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Final weights of fault-free runs, cached by (world size, script arguments). With several
    workers (pytest -n), the cache is shared: each reference is computed once, by the first worker
    that needs it, while the others wait on its lock."""
    import fcntl
    import hashlib

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # shared by the workers of this run
    root = base / "references"
    root.mkdir(exist_ok=True)

    def get(world: int, *script_args: str, script: Path = TRAIN) -> Path:
        # the sleep stands in for accelerator work and changes no number: references skip it
        # (and the file that paces it)
        args = list(script_args)
        if "--sleep-ms" in args:
            i = args.index("--sleep-ms")
            args[i + 1] = "0"
        for flag in ("--slow-file", "--slow-ms"):
            if flag in args:
                i = args.index(flag)
                del args[i:i + 2]
        key = json.dumps([world, str(script), args])
        d = root / hashlib.sha256(key.encode()).hexdigest()[:16]
        d.mkdir(exist_ok=True)
        out = d / "final.pt"
        with open(d / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not out.exists():
                shutil.rmtree(d / "run", ignore_errors=True)  # what a failed attempt left
                run = run_nonstop(d / "run", f"--nproc={world}", "--quiet", str(script), *args,
                                  "--save", str(out))
                assert run.code == 0, run.stdout + run.stderr
        return out

    def ahead(world: int, *script_args: str, script: Path = TRAIN) -> None:
        """Start computing a reference in a thread, while the test's job runs (a job across test
        hosts mostly waits: for leases, for faults). ``get`` with the same arguments then waits
        for it (the lock), or computes it again if this one failed."""
        def compute() -> None:
            try:
                get(world, *script_args, script=script)
            except BaseException:  # noqa: BLE001 - the test's own call computes it again, and says
                pass

        t = threading.Thread(target=compute, name="reference-ahead", daemon=True)
        _AHEAD.append(t)
        t.start()

    get.ahead = ahead
    return get


def rank_processes(argv: Callable[[int], list[str]], ranks: int = 2,
                   timeout: float = 60) -> list[tuple[str, str]]:
    """One process per rank (``argv(rank)``), run to its end: each must exit 0. Their (stdout,
    stderr), by rank; one still running when this returns (a failure) is killed by its pid. A
    Python script's process is forked by this worker's forker (torch imported once for all of
    them: 2-4 s of CPU each, else), as ``python SCRIPT`` would run it; ``NONSTOP_TEST_FORKER=0``:
    each is a fresh interpreter."""
    outs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(ranks)]
    procs: list = []
    out = []
    try:
        for r in range(ranks):
            procs.append(_start_rank(argv(r), *outs[r]))
        for p, (fo, fe) in zip(procs, outs):
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pytest.fail(f"a rank process did not end within {timeout} s: {_read(fe)[-3000:]}")
            stdout, stderr = _read(fo), _read(fe)
            assert p.returncode == 0, stderr[-3000:]
            out.append((stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        for fo, fe in outs:
            fo.close()
            fe.close()
    return out


def _read(f) -> str:
    f.flush()
    f.seek(0)
    return f.read()


def _start_rank(argv: list[str], stdout, stderr):
    path = _forker()
    if (path is None or len(argv) < 2 or argv[0] != sys.executable or not argv[1].endswith(".py")
            or _import_env(os.environ) != FORKER["env"]):
        return subprocess.Popen(argv, stdout=stdout, stderr=stderr, text=True)
    return ForkedRank(path, argv[1:], stdout, stderr)


# what a process reads at its start or as it imports torch: the forker's children have its values
_IMPORT_ENV = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "TORCH", "PYTORCH_", "CUDA", "GLOO")


def _import_env(env) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_IMPORT_ENV) and k != "PYTHONPATH"}


# this worker's forker of rank scripts (tests/scripts/forker.py), started at its first use
FORKER: dict = {}


def _forker() -> str | None:
    """The socket of this worker's forker (started now if it is not yet), None if there is none."""
    if os.environ.get("NONSTOP_TEST_FORKER", "1") == "0":
        return None
    if "path" not in FORKER:
        d = Path(tempfile.mkdtemp(prefix="nst-fk-"))  # short: a socket's path has 107 bytes at most
        path = d / "sock"
        log = open(d / "forker.log", "ab")
        proc = subprocess.Popen([sys.executable, str(SCRIPTS / "forker.py"), str(path)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        log.close()
        FORKER.update(proc=proc, dir=d, env=_import_env(os.environ))
        TEMPLATE["forker"] = proc.pid
        deadline = time.time() + 120
        while not path.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        FORKER["path"] = str(path) if path.exists() else None
    return FORKER["path"]


@pytest.fixture(scope="session", autouse=True)
def forker_ends():
    """This worker's forker ends with the session (it also ends once its parent is gone)."""
    yield
    proc = FORKER.pop("proc", None)
    if proc is not None:
        proc.kill()
        proc.wait(timeout=30)
        TEMPLATE.pop("forker", None)
        shutil.rmtree(FORKER.pop("dir"), ignore_errors=True)
    FORKER.clear()


class ForkedRank:
    """A rank script's process forked by the forker, in the shape of ``subprocess.Popen`` as far
    as rank_processes uses it: its waiter (the process's parent) says how it ended."""

    def __init__(self, path: str, argv: list[str], stdout, stderr):
        import array
        import socket

        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(30)
        self.sock.connect(path)
        req = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
        self.sock.sendmsg([req], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                   array.array("i", [stdout.fileno(), stderr.fileno()]))])
        self.pid = json.loads(self.sock.recv(4096))["pid"]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        import select

        if self.returncode is None and select.select([self.sock], [], [], 0)[0]:
            data = self.sock.recv(4096)
            # (no answer: its waiter is gone, and the process with it or soon after)
            self.returncode = json.loads(data)["code"] if data else -9
            self.sock.close()
        return self.returncode

    def wait(self, timeout: float) -> int:
        deadline = time.time() + timeout
        while self.poll() is None:
            if time.time() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                pass


def pytest_sessionstart(session):
    """matplotlib builds its font cache at its first import on a machine, asking ``fc-list`` (a
    process): built here, before any test, a fast-tier test that draws a timeline then reads it
    and starts nothing - else whichever test imported matplotlib first failed the fast tier's
    rule on a fresh machine, depending on the order the workers took the tests in."""
    try:
        import matplotlib.font_manager  # noqa: F401 - its import builds (or reads) the cache
    except ImportError:
        pass


def pytest_collection_modifyitems(session, config, items):
    """The tests across test hosts first: the longest (30-90 s each), they start while there is
    still other work to share the two workers with, instead of one of them ending the run alone."""
    items.sort(key=lambda item: 0 if "hosts" in item.path.stem else 1)


def pytest_sessionfinish(session, exitstatus):
    """After the whole suite, no process of ours may be left: fail the run if one is."""
    deadline = time.time() + 10
    left = our_processes()
    while left and time.time() < deadline:
        time.sleep(0.2)
        left = our_processes()
    if left:
        print("\nprocesses left behind after the suite:\n" + "\n".join(left), file=sys.stderr)
        session.exitstatus = 1


@pytest.fixture
def test_hosts():
    """Factory of test hosts (network namespaces on a bridge, nonstop_bench.netns): ``hosts =
    test_hosts(3)`` returns a created TestHosts. All are destroyed at teardown, also when the
    test failed; the test is skipped where namespaces cannot be made (not root, no ``ip``)."""
    from nonstop_bench import netns

    ok, why = netns.available()
    if not ok:
        pytest.skip(why)
    made: list = []

    def make(n: int, tag: str = "nst"):
        th = netns.TestHosts(n, tag)
        made.append(th)
        return th.create()

    yield make
    errors = []
    for th in reversed(made):
        try:
            th.destroy()
        except Exception as e:  # destroy the others before reporting
            errors.append(e)
    if errors:
        raise errors[0]


def processes_below(root: int) -> set[int]:
    """Every process below ``root`` now (Linux: /proc)."""
    parent = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parent[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found, todo = set(), [root]
    while todo:
        p = todo.pop()
        kids = {c for c, pp in parent.items() if pp == p}
        todo += list(kids - found)
        found |= kids
    return found


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def still_running(pids: set[int], timeout_s: float = 30.0) -> list[int]:
    """Those of ``pids`` still running after waiting up to ``timeout_s`` for all to end."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(running(p) for p in pids):
        time.sleep(0.2)
    return sorted(p for p in pids if running(p))


def kill_left(pids: set[int]) -> None:
    """End by pid what a failed test left running (SIGKILL)."""
    for pid in pids:
        if running(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

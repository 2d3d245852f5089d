"""Rank processes forked from one that has already imported torch.

A rank process spends about a second of CPU importing torch (two with what DDP imports lazily)
before it can do anything. On one host that is paid by every rank at the start, by every cold
replacement and by every job restart; N ranks starting together on few cores pay it N times over.
The zygote pays it once per agent: it imports what a rank imports, then forks each rank or spare
on request. A child is a process of its own (its own session, its own environment, its output on
its own pipe to the agent), like one started from scratch, minus the imports: it starts in
milliseconds and shares the imported pages with its siblings until it writes them.

    python -m nonstop.agent.zygote FD      (FD: the agent's end of a socketpair)

Where many short runs follow each other on one machine (a test suite, a CI runner), even once
per run is most of a small job's start (3-4 s of 4-5 here). A **template** imports once for all
of them:

    python -m nonstop.agent.zygote --template PATH     (PATH: a Unix socket it listens on)

With ``NONSTOP_ZYGOTE_TEMPLATE=PATH[:PATH...]`` in its environment, an agent asks a template
(the first that accepts) for its zygote instead of starting one: the template forks it, and the
new zygote enters the agent's network and mount namespaces (a test host's), takes the agent's
environment, working directory and log, and serves the agent as one it had started - except
that it watches the agent through their socket (its parent is the template). The template
refuses an agent of another Python, of another copy of nonstop, of code changed on disk since
the template imported it, or whose environment differs in what is read at import (threads,
libraries, ``TORCH*``); the agent then starts its own zygote, as it does when the template is
absent or does not answer.

Requests and answers are JSON datagrams on the socketpair; the child's output pipe travels with
its request (SCM_RIGHTS). The zygote is the children's parent: it reaps them and tells the agent
how each ended. It dies with the agent, and its children with it (as ranks die with the agent
when started directly). CUDA is never initialised here: a child initialises its own.
"""

from __future__ import annotations

import array
import json
import os
import select
import signal
import socket
import struct
import sys
import time
from typing import Any

from ..pids import dying, pid_alive
from ..protocol import zygote_messages as zm

MAX_MSG = 1 << 20  # a request: an environment and a command line
PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo",
           "nonstop.runtime.bootstrap", "nonstop.runtime.worker", "nonstop.runtime.wrap",
           # what every rank imports once it runs (0.1-0.3 s of CPU each, paid again by every
           # rank forked): its snapshots, restores, monitor and groups (none reads the
           # environment at import)
           "nonstop.state.snapshot", "nonstop.state.memory", "nonstop.state.staging",
           "nonstop.state.regrid", "nonstop.state.reshard", "nonstop.runtime.monitor",
           "nonstop.runtime.pg", "nonstop.runtime.verdict", "nonstop.script_scan", "nonstop.ddp",
           "xxhash", "torch.utils.serialization",
           # the sharded layouts' (most of it came with torch._dynamo: 0.06 s more)
           "torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.device_mesh",
           "torch.distributed.tensor.parallel", "torch.distributed.pipelining")
# more modules to import once, before any fork: the script's heavy ones (comma-separated)
PRELOAD_ENV = "NONSTOP_PRELOAD"
# what a template imports besides, for the checkpoint writers it forks (torch's DCP)
WRITER_PRELOAD = ("torch.distributed.checkpoint", "nonstop.state.writer")
WRITER_NAME = "nonstop-writer"  # a template's writer in ps (its command line is the template's)
SESSION_S = 5.0  # a fork is answered once its child has its own session (at most this long)
READY_S = 120.0  # the agent waits this long for the zygote's imports before it starts ranks itself


TEMPLATE_ENV = "NONSTOP_ZYGOTE_TEMPLATE"  # the sockets of templates to fork zygotes from
TEMPLATE_S = 5.0  # the agent waits this long for the template's answer, then starts its own
# environment read once, at import or at the interpreter's start: a template's zygote serves an
# agent only where these are the same in both (what the libraries read later, such as CUDA's,
# NCCL's and gloo's, the rank reads in its own environment)
IMPORT_ENV = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "TORCH", "PYTORCH_")
APPLIED_ENV = ("PYTHONPATH", "PYTHONUNBUFFERED")  # a template's zygote applies them itself
_START_ENV: dict[str, str] = {}  # the template's environment before its imports


# == the zygote process ==========================================================================
def main() -> None:
    if sys.argv[1] == "--template":
        template_main(sys.argv[2])
        return
    fd = int(sys.argv[1])
    from ..runtime.bootstrap import die_with_parent

    die_with_parent()
    sock = socket.socket(fileno=fd)
    _preload(PRELOAD)
    _preload(_extra())
    serve(sock)


def _extra() -> list[str]:
    return [m.strip() for m in os.environ.get(PRELOAD_ENV, "").split(",") if m.strip()]


def _preload(names: Any) -> None:
    import importlib

    for name in names:
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - a child imports it again and reports what fails
            pass


def serve(sock: socket.socket) -> None:
    """Fork a child per request of the agent at ``sock``, until the agent is gone."""
    wake = _Wakeup()
    _send(sock, {"ready": os.getpid()})
    while True:
        readable = wake.wait(sock)
        _reap(sock)
        if readable:
            try:
                msg, fds = _recv(sock)
            except OSError:
                msg, fds = None, []
            if msg is None:  # the agent is gone
                os._exit(0)
            _fork(sock, msg, fds, wake.fds)


class _Wakeup:
    """A loop's wait for its socket or for a child's end (SIGCHLD, written to a pipe by the
    interpreter: none is missed between two waits)."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.fds = (self.r, self.w)  # (a child closes them)
        signal.set_wakeup_fd(self.w)
        signal.signal(signal.SIGCHLD, lambda *_: None)

    def wait(self, sock: socket.socket, timeout_s: float = 1.0) -> bool:
        """Whether ``sock`` is readable, after at most ``timeout_s`` or a child's end."""
        try:
            readable, _, _ = select.select([sock, self.r], [], [], timeout_s)
        except InterruptedError:
            readable = []
        if self.r in readable:
            try:
                os.read(self.r, 4096)
            except BlockingIOError:
                pass
        return sock in readable


# == the template ================================================================================
def template_main(path: str) -> None:
    """Import once, then fork a zygote for each agent that connects to ``path``."""
    from ..runtime.bootstrap import die_with_parent

    die_with_parent()
    # what a run gives its ranks unless set (launch.one_host.worker_env): a template started
    # from a plain shell has the runs' environment
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _START_ENV.update(os.environ)  # (importing torch sets some: TORCHINDUCTOR_CACHE_DIR)
    _STAMP["code"] = _our_code()
    _preload(PRELOAD)
    _preload(WRITER_PRELOAD)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    tmp = f"{path}.{os.getpid()}"
    listener.bind(tmp)
    os.chmod(tmp, 0o600)
    listener.listen(16)
    os.rename(tmp, path)  # there once it can fork: an agent that finds it is served at once
    wake = _Wakeup()
    ours = (listener.fileno(), *wake.fds)
    while True:
        readable = wake.wait(listener)
        while True:  # the zygotes it forked that ended (their agents gone)
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if readable:
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with conn:
                _serve_request(conn, ours)


def _serve_request(conn: socket.socket, ours: tuple[int, ...]) -> None:
    conn.settimeout(TEMPLATE_S)
    fds: list[int] = []
    try:
        raw, fds = _recv(conn)
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                  struct.calcsize("3i")))[1]
        req = _refusal(raw, fds, uid, _START_ENV, os.environ)
        if isinstance(req, str):
            _send(conn, zm.encode(zm.TemplateAnswer(error=req)))
            return
        pid = os.fork()
        if pid == 0:
            _templated(req, fds, conn, ours)  # never returns
        _send(conn, zm.encode(zm.TemplateAnswer(pid=pid)))
    except OSError:
        pass
    finally:
        for fd in fds:
            os.close(fd)


def _refusal(raw: Any, fds: list[int], uid: int, start: Any,
             now: Any) -> zm.TemplateRequest | str:
    """The request ``raw`` as a record, or why the process that sent it cannot be served by
    this template. ``start``, ``now``: the template's environment before its imports, and
    after."""
    if len(fds) != 4:
        return f"a malformed request: {len(fds)} descriptors, not 4"
    try:
        req: zm.TemplateRequest = zm.read(zm.TemplateRequest, raw)
    except zm.BadZygoteMessage as exc:
        return f"a malformed request: {exc}"
    if uid != os.getuid():
        return f"the {_ASKER[req.role]} runs as user {uid}, the template as {os.getuid()}"
    if req.python != _python() or req.nonstop != _nonstop_dir():
        return (f"the template runs {_python()} with nonstop from {_nonstop_dir()}, the "
                f"{_ASKER[req.role]} {req.python} with {req.nonstop}")
    if req.code != _STAMP.get("code"):
        return "nonstop or torch changed on disk since the template started (an upgrade, an edit)"
    env = req.env
    # the same as at the template's start, or as its imports set it (a default of torch's)
    differ = sorted(k for k in {*_import_env(env), *_import_env(start)}
                    if env.get(k) not in (start.get(k), now.get(k)))
    if differ:
        return "the environment read at import differs: " + ", ".join(differ)
    return req


_ASKER = {"zygote": "agent", "writer": "keeper"}


def _import_env(env: Any) -> list[str]:
    return [k for k in env if k.startswith(IMPORT_ENV) and k not in APPLIED_ENV]


def _apply_start_env(env: dict[str, str]) -> None:
    """What an interpreter started with ``env`` would have done with it at its start."""
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[1:1] = [p for p in path if p not in sys.path]  # after the first, as at a start
    if env.get("PYTHONUNBUFFERED"):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.reconfigure(write_through=True)  # type: ignore[union-attr]
            except (AttributeError, ValueError):
                pass


def _python() -> list[str]:
    """The interpreter and its environment (a virtual environment's python and python3 are one)."""
    return [os.path.realpath(sys.executable), sys.prefix]


def code_stamp(*roots: str | None) -> str:
    """What the code under ``roots`` is, as the file system says (each ``.py`` file's path, size
    and modification time; for a binary package, its version file and extensions): a template
    that imported older code must not serve an agent of newer code."""
    import hashlib

    h = hashlib.sha1()
    for root in roots:
        if not root:
            continue
        for d, dirs, files in os.walk(root):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__")
            if d != root and os.path.basename(root) == "torch":
                break  # torch: its top level says its version (version.py, _C)
            for name in sorted(files):
                if name.endswith((".py", ".so")):
                    try:
                        st = os.stat(os.path.join(d, name))
                    except OSError:
                        continue
                    h.update(f"{d}/{name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()


def _our_code() -> str:
    import importlib.util

    spec = importlib.util.find_spec("torch")  # (finds it without importing it)
    torch_dir = (list(spec.submodule_search_locations or [None])[0]
                 if spec is not None else None)
    return code_stamp(_nonstop_dir(), torch_dir)


_STAMP: dict[str, str] = {}  # the template's code, as it was when it imported it


def _nonstop_dir() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _templated(req: zm.TemplateRequest, fds: list[int], conn: socket.socket,
               ours: tuple[int, ...]) -> None:
    """A zygote (or a checkpoint writer) forked from the template, for the process that sent
    ``req``: in its namespaces, its environment and directory, its log; its parent is the
    template, so it leaves when the asker's end of their socket closes (the asker gone, however
    it ended)."""
    sock_fd, net_fd, mnt_fd, log_fd = fds
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        conn.close()
        for fd in ours:
            os.close(fd)
        os.setsid()
        _enter(mnt_fd, "mnt", 0x00020000)  # CLONE_NEWNS
        _enter(net_fd, "net", 0x40000000)  # CLONE_NEWNET
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        for fd in (net_fd, mnt_fd, log_fd):
            os.close(fd)
        os.environ.clear()
        os.environ.update(req.env)
        _apply_start_env(req.env)
        os.chdir(req.cwd)
        if not pid_alive(req.pid):
            os._exit(0)
        if req.role == "writer":
            from ..state import writer

            _name(WRITER_NAME)
            writer.serve(socket.socket(fileno=sock_fd))  # until the keeper is gone
            _flush()
            os._exit(0)
        _preload(_extra())
        serve(socket.socket(fileno=sock_fd))
    except BaseException:  # noqa: BLE001 - a fork never returns into the template's loop
        import traceback

        traceback.print_exc()
        _flush()
    os._exit(1)


def _enter(fd: int, kind: str, nstype: int) -> None:
    """Join the namespace ``fd`` names (another process's ``/proc/PID/ns/<kind>``) unless this
    process is in it already."""
    if os.fstat(fd).st_ino == os.stat(f"/proc/self/ns/{kind}").st_ino:
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, nstype) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns({kind}): {os.strerror(err)}")


def _fork(sock: socket.socket, msg: dict[str, Any], fds: list[int],
          ours: tuple[int, int]) -> None:
    out = fds[0] if fds else None
    began_r, began_w = os.pipe()
    try:
        pid = os.fork()
    except OSError as exc:
        _send(sock, {"id": msg["id"], "error": f"fork: {exc}"})
        pid = -1
    if pid == 0:
        os.close(began_r)
        _child(msg, out, sock, ours, began_w)  # never returns
    os.close(began_w)
    for fd in fds:
        os.close(fd)
    if pid > 0:
        # answered once the child leads a session of its own: the agent signals its group
        select.select([began_r], [], [], SESSION_S)
        _send(sock, {"id": msg["id"], "pid": pid})
    os.close(began_r)


def _child(msg: dict[str, Any], out: int | None, sock: socket.socket,
           ours: tuple[int, int], began: int) -> None:
    try:
        signal.set_wakeup_fd(-1)
        # as a fresh interpreter has them: SIGPIPE ignored (a write to a closed socket is an
        # error, not death), SIGINT a KeyboardInterrupt, the rest the system's
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _name(msg.get("name"))
        os.setsid()
        os.write(began, b"s")
        os.close(began)
        sock.close()
        for fd in ours:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        if out is not None:
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.close(out)
        os.environ.clear()
        os.environ.update(msg["env"])
        os.chdir(msg.get("cwd") or os.getcwd())
        sys.argv = list(msg["argv"])
        _reseed()
        from ..runtime import bootstrap

        bootstrap.main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        _flush()
        os._exit(code)
    except BaseException:  # noqa: BLE001 - a child never returns into the zygote's loop
        import traceback

        traceback.print_exc()
        _flush()
        os._exit(1)
    _flush()
    os._exit(0)


def _name(name: str | None) -> None:
    """The child's name in ``ps``/``top`` (its command line stays the zygote's)."""
    if not name:
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _reseed() -> None:
    """A fork shares its parent's random state: each child gets its own, as a new process would."""
    import random

    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        try:
            np.random.seed()
        except Exception:  # noqa: BLE001 - an unusual numpy: its global state stays shared
            pass


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


# == the wire ====================================================================================
def _send(sock: socket.socket, msg: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(msg).encode()
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.send(data)


def _recv(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    data, anc, _, _ = sock.recvmsg(MAX_MSG, socket.CMSG_SPACE(16 * 4))
    fds: list[int] = []
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(payload[:len(payload) - len(payload) % arr.itemsize])
            fds.extend(arr)
    if not data:
        return None, fds
    return json.loads(data), fds


# == the agent's side ============================================================================
def templates(env: Any) -> list[str]:
    """The sockets of the templates ``env`` names, in order."""
    return [p for p in env.get(TEMPLATE_ENV, "").split(os.pathsep) if p]


def from_templates(role: str, sock_fd: int, env: dict[str, str], log_fd: int
                   ) -> tuple[int | None, list[str]]:
    """A zygote (``role`` "zygote") or a checkpoint writer ("writer") forked for this process by
    the first template ``env`` names that serves it: its pid (None: none did), and why the
    others (or all) did not. It serves this process on ``sock_fd`` (this process keeps the other
    end), in this process's namespaces, ``env`` and directory, writing to ``log_fd``."""
    refused: list[str] = []
    paths = templates(env)
    if not paths:
        return None, refused
    req = zm.TemplateRequest(role=role, pid=os.getpid(), env=dict(env),  # type: ignore[arg-type]
                             cwd=os.getcwd(), python=_python(), nonstop=_nonstop_dir(),
                             code=_our_code())
    for path in paths:
        try:
            return _ask_template(path, req, sock_fd, log_fd), refused
        except OSError as exc:
            refused.append(f"zygote template {path}: {exc}")
    return None, refused


def _ask_template(path: str, req: zm.TemplateRequest, sock_fd: int, log_fd: int) -> int:
    """What the template at ``path`` forked for ``req``: its pid. OSError says why it would not
    (or did not answer)."""
    ns = [os.open(f"/proc/self/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC) for kind in ("net", "mnt")]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as c:
            c.settimeout(TEMPLATE_S)
            c.connect(path)
            _send(c, zm.encode(req), [sock_fd, *ns, log_fd])
            raw, fds = _recv(c)
    finally:
        for fd in ns:
            os.close(fd)
    for fd in fds:
        os.close(fd)
    if raw is None:
        raise OSError("the template did not answer")
    try:
        answer: zm.TemplateAnswer = zm.read(zm.TemplateAnswer, raw)
    except zm.BadZygoteMessage as exc:
        raise OSError(f"the template answered something malformed: {exc}") from None
    if answer.pid is None:
        raise OSError(answer.error or "the template forked nothing")
    return answer.pid


class NotOurChild:
    """A process this one did not fork, in the shape of ``subprocess.Popen`` as far as its
    owner uses it: ``poll`` says how it ended (subclasses), the rest follows from it."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None:
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                import subprocess

                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class TemplatedProcess(NotOurChild):
    """A process a template forked for this one (a keeper's checkpoint writer). Its parent is
    the template, which reaps it: it has ended once it is in its exit, a zombie or gone."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode = None

    def poll(self) -> int | None:
        if self.returncode is None and dying(self.pid):
            self.returncode = -signal.SIGKILL  # how it ended is the template's to know
        return self.returncode


class Zygote:
    """The agent's handle on its zygote: start it, fork children, hear how they end."""

    def __init__(self, env: dict[str, str], log_path: Any):
        import subprocess

        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(env, **{"NONSTOP_LAUNCHER_PID": str(os.getpid())})
        self._log = open(log_path, "ab", buffering=0)
        self.proc: subprocess.Popen | None = None  # the zygote, when this agent started it
        # the zygote's pid, when a template forked it
        self.templated, refused = from_templates("zygote", theirs.fileno(), env,
                                                 self._log.fileno())
        if self.templated is None:
            if refused:
                self._log.write(("\n".join(refused) + "\nstarting a zygote\n").encode())
            self.proc = subprocess.Popen(
                [sys.executable, "-u", "-m", "nonstop.agent.zygote", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
                stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        theirs.close()
        self.pid: int | None = None  # known once it is ready
        self.exits: dict[int, int] = {}  # child pid -> exit code (negative: killed by a signal)
        self.broken: str | None = None  # why it can no longer be used
        self._ids = 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def ready(self, timeout_s: float) -> bool:
        """Whether the zygote has done its imports (waiting up to ``timeout_s`` for it)."""
        if self.pid is not None:
            return True
        deadline = time.monotonic() + timeout_s
        while self.broken is None and self.pid is None:
            left = deadline - time.monotonic()
            if left <= 0 or not self._take(left):
                break
        return self.pid is not None and self.broken is None

    def spawn(self, argv: list[str], env: dict[str, str], out_fd: int, name: str = "",
              timeout_s: float = 10.0) -> int:
        """Fork a child running ``argv`` (a bootstrap command line) with ``env``, its stdout and
        stderr on ``out_fd``. Returns its pid; OSError when the zygote cannot."""
        if self.broken is not None or self.pid is None:
            raise OSError(f"no zygote: {self.broken or 'not ready'}")
        self._ids += 1
        rid = self._ids
        try:
            _send(self.sock, {"id": rid, "argv": argv, "env": env, "cwd": os.getcwd(),
                              "name": name}, [out_fd])
        except OSError as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
            raise
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.broken = "it did not answer a fork request in time"
                raise OSError(self.broken)
            reply = self._take(left, want=rid)
            if reply is None and self.broken is not None:
                raise OSError(self.broken)
            if reply is not None:
                if "error" in reply:
                    raise OSError(reply["error"])
                return int(reply["pid"])

    def drain(self) -> None:
        """Take in what the zygote said (children that ended), without waiting."""
        while self.broken is None and self._take(0.0):
            pass

    def _take(self, timeout_s: float, want: int | None = None) -> dict[str, Any] | bool | None:
        """Read one message (waiting up to ``timeout_s``). Exits are recorded; a reply to request
        ``want`` is returned; otherwise whether a message was read."""
        try:
            readable, _, _ = select.select([self.sock], [], [], max(0.0, timeout_s))
            if not readable:
                return None if want is not None else False
            msg, fds = _recv(self.sock)
        except OSError as exc:
            msg, fds = None, []
            self.broken = f"{type(exc).__name__}: {exc}"
        for fd in fds:
            os.close(fd)
        if msg is None:
            self.broken = self.broken or "the zygote ended"
            return None if want is not None else False
        if "ready" in msg:
            self.pid = int(msg["ready"])
        elif "exit" in msg:
            self.exits[int(msg["exit"])] = int(msg["code"])
        elif want is not None and msg.get("id") == want:
            return msg
        return True if want is None else None

    def close(self) -> None:
        leader = self.proc.pid if self.proc is not None else self.templated
        try:
            os.killpg(leader, signal.SIGKILL)  # type: ignore[arg-type]
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc is not None:  # (a template's zygote is the template's to reap)
            try:
                self.proc.wait(timeout=10)
            except Exception:  # noqa: BLE001 - it was SIGKILLed: it ends
                pass
        self.sock.close()
        self._log.close()


class ForkedProcess(NotOurChild):
    """What the agent keeps of a child its zygote forked (the zygote reaps it and says how it
    ended)."""

    def __init__(self, zygote: Zygote, pid: int, stdout: Any):
        self.zygote, self.pid, self.stdout = zygote, pid, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.zygote.drain()
            code = self.zygote.exits.pop(self.pid, None)
            if code is not None:
                self.returncode = code
            elif self.zygote.broken is not None and not pid_alive(self.pid):
                self.returncode = -signal.SIGKILL  # it died with the zygote: how is not known
        return self.returncode


if __name__ == "__main__":
    main()

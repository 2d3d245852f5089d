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

import os
import select
import signal
import socket
import struct
import sys
from typing import Any

from ..pids import pid_alive
from ..protocol import zygote_messages as zm
from ..zygote_client import (TEMPLATE_S, nonstop_dir, our_code, python_identity, recv,
                             send)

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
WRITER_PRELOAD = ("torch.distributed.checkpoint", "nonstop.keeper.writer")
WRITER_NAME = "nonstop-writer"  # a template's writer in ps (its command line is the template's)
SESSION_S = 5.0  # a fork is answered once its child has its own session (at most this long)
READY_S = 120.0  # the agent waits this long for the zygote's imports before it starts ranks itself


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
    send(sock, {"ready": os.getpid()})
    while True:
        readable = wake.wait(sock)
        _reap(sock)
        if readable:
            try:
                msg, fds = recv(sock)
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
    # what a run gives its ranks unless set (agent.agent.worker_env): a template started
    # from a plain shell has the runs' environment
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _START_ENV.update(os.environ)  # (importing torch sets some: TORCHINDUCTOR_CACHE_DIR)
    _STAMP["code"] = our_code()
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
        raw, fds = recv(conn)
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                  struct.calcsize("3i")))[1]
        req = _refusal(raw, fds, uid, _START_ENV, os.environ)
        if isinstance(req, str):
            send(conn, zm.encode(zm.TemplateAnswer(error=req)))
            return
        pid = os.fork()
        if pid == 0:
            _templated(req, fds, conn, ours)  # never returns
        send(conn, zm.encode(zm.TemplateAnswer(pid=pid)))
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
    if req.python != python_identity() or req.nonstop != nonstop_dir():
        return (f"the template runs {python_identity()} with nonstop from {nonstop_dir()}, the "
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


_STAMP: dict[str, str] = {}  # the template's code, as it was when it imported it


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
            from ..keeper import writer

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
        send(sock, {"id": msg["id"], "error": f"fork: {exc}"})
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
        send(sock, {"id": msg["id"], "pid": pid})
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
        send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    main()

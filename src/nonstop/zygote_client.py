"""The clients of a zygote (``agent/zygote.py``, the server: a process that has imported torch
and forks processes that need it): the agent's handle on its own zygote and on the ranks it forks,
and what any process - an agent for its zygote, a keeper for its checkpoint writer - asks a
**template** for, with the handle on what the template forked. Below both of its users: the
keeper's side of node memory reaches it without importing the agent."""

from __future__ import annotations

import array
import json
import os
import select
import signal
import socket
import sys
import time
from typing import Any

from .pids import dying, pid_alive
from .protocol import zygote_messages as zm

MAX_MSG = 1 << 20  # a request: an environment and a command line
TEMPLATE_ENV = "NONSTOP_ZYGOTE_TEMPLATE"  # the sockets of templates to fork zygotes from
TEMPLATE_S = 5.0  # the agent waits this long for the template's answer, then starts its own


# == what the code is (a template serves only the code it imported) ===========================
def python_identity() -> list[str]:
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


def our_code() -> str:
    import importlib.util

    spec = importlib.util.find_spec("torch")  # (finds it without importing it)
    torch_dir = (list(spec.submodule_search_locations or [None])[0]
                 if spec is not None else None)
    return code_stamp(nonstop_dir(), torch_dir)


def nonstop_dir() -> str:
    return os.path.dirname(os.path.abspath(__file__))


# == the wire ====================================================================================
def send(sock: socket.socket, msg: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(msg).encode()
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.send(data)


def recv(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
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
                             cwd=os.getcwd(), python=python_identity(), nonstop=nonstop_dir(),
                             code=our_code())
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
            send(c, zm.encode(req), [sock_fd, *ns, log_fd])
            raw, fds = recv(c)
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
            send(self.sock, {"id": rid, "argv": argv, "env": env, "cwd": os.getcwd(),
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
            msg, fds = recv(self.sock)
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

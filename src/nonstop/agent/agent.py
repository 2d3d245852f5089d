"""The node agent: starts, watches and ends the rank processes and warm spares of one machine.

Exits are seen the moment they happen (a pidfd per process in one selector with the output pipes).
Each process runs in its own session so that ending it by its pid also ends its children.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from .. import inject, protocol
from . import loopback
from ..protocol import last_step
from ..protocol.messages import MissedDeadline
from ..observe.console import ConsoleFilter

LATE_S = 10.0  # a process's events are read for this long after it ended
ZYGOTE_ENV = "NONSTOP_ZYGOTE"  # 0: every rank process imports torch itself (no zygote)


def worker_env(run_dir: Path, faults: list[inject.FaultSpec], pin: bool = True) -> dict[str, str]:
    """The environment every rank process of this host starts with (``pin``: one host, whose
    collectives listen on loopback)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N ranks must not each take every core
    env["PYTHONUNBUFFERED"] = "1"
    env[protocol.ENV_RUN_DIR] = str(run_dir.resolve())
    env[protocol.ENV_INJECT] = inject.to_env(faults)
    env.pop("NONSTOP_JOB_SECRET", None)  # the job's secret is the agents' alone
    env.pop("NONSTOP_ETCD_PASSWORD", None)
    if pin:
        loopback.pin(env)  # one host: the collectives' listeners stay on loopback too
    pkg_parent = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pkg_parent, env.get("PYTHONPATH")]))
    return env


@dataclasses.dataclass
class Proc:
    wid: int
    popen: subprocess.Popen
    started: float
    spare: bool
    log_path: Path
    pidfd: int | None = None
    returncode: int | None = None
    t_exit: float | None = None
    _partial: bytes = b""
    console: ConsoleFilter | None = None
    last_step_path: str | None = None  # where a rank writes its last step (protocol.last_step)
    last: last_step.LastStep | None = None  # ...read there once it exited

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.returncode is None


OutputSink = Callable[[int, str], None]


class Agent:
    def __init__(self, script: str, script_args: list[str], store_addr: str, run_dir: Path,
                 env: dict[str, str], output: OutputSink):
        self.script, self.script_args = script, script_args
        self.store_addr = store_addr
        self.run_dir = run_dir
        self.logs = run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env = env
        self.output = output
        self.procs: dict[int, Proc] = {}
        self.keeper_token = secrets.token_hex(16)  # the job's replicas carry it node to node
        self.keeper_host = "127.0.0.1"  # where keepers take replicas in (a host's address: across hosts)
        self.keeper_env: dict[str, str] = {}  # across hosts: the keepers' secret
        self._next_wid = 0
        self.zygote: Any = None  # ranks are forked from it (zygote.py), once it is ready
        self.zygote_error: str | None = None  # why ranks are started directly instead
        self.missed: list[MissedDeadline] = []  # deadlines that fired here (deadlines())
        self._sel = selectors.DefaultSelector()
        self._logs: dict[int, object] = {}
        # another thread (a host's channel to its controller) ends a wait early through this
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._sel.register(self._wake_r, selectors.EVENT_READ, ("wake", None))

    #: the nodes' health checks run in the controller here (``Watchers``), not elsewhere
    health = None

    @property
    def next_wid(self) -> int:
        """The worker id the next process started will get."""
        return self._next_wid

    def new_wid(self) -> int:
        wid = self._next_wid
        self._next_wid += 1
        return wid

    def spawn(self, wid: int, spare: bool, spare_mode: str | None = None, node: int = 0,
              keeper: str | None = None) -> Proc:
        env = dict(self.env)
        env[protocol.ENV_NODE] = str(node)
        env[protocol.ENV_STORE] = self.store_addr
        env[protocol.ENV_WORKER_ID] = str(wid)
        env[protocol.ENV_LAUNCHER_PID] = str(os.getpid())
        if keeper:
            env[protocol.ENV_KEEPER] = keeper
        if spare_mode:
            env[protocol.ENV_SPARE_MODE] = spare_mode
        path = str(self.logs / f"worker-{wid}.last")
        try:
            last_step.create(path)
            env[last_step.ENV] = path
        except OSError:
            path = None
        proc = None
        zygote = self._zygote()
        if zygote is not None:
            try:
                proc = self._fork(zygote, wid, env, f"worker-{wid}.log", spare)
            except OSError as exc:  # started the slow way from now on
                self.zygote_error = f"{type(exc).__name__}: {exc}"
        if proc is None:
            cmd = [sys.executable, "-u", "-m", "nonstop.runtime.bootstrap", self.script,
                   *self.script_args]
            proc = self._start(wid, cmd, env, f"worker-{wid}.log", spare)
        proc.last_step_path = path
        return proc

    def start_zygote(self) -> None:
        """Start the process ranks are forked from (``zygote.py``): it imports torch meanwhile."""
        if self.zygote is None and self.zygote_error is None \
                and os.environ.get(ZYGOTE_ENV, "1") != "0":
            from ..zygote_client import Zygote

            try:
                self.zygote = Zygote(self.env, self.logs / "zygote.log")
            except OSError as exc:
                self.zygote_error = f"{type(exc).__name__}: {exc}"
                return
            self._sel.register(self.zygote.fileno(), selectors.EVENT_READ, ("zygote", None))

    def _zygote(self) -> Any:
        """The zygote, once its imports are done (waited for), or None: start ranks directly."""
        self.start_zygote()
        z = self.zygote
        if z is None or self.zygote_error is not None:
            return None
        from .zygote import READY_S

        if not z.ready(READY_S):
            self.zygote_error = z.broken or f"not ready within {READY_S:g} s"
            if not z.broken:
                self.missed.append(MissedDeadline(
                    "zygote", READY_S, detail="its imports did not finish: ranks start directly"))
            return None
        return z

    def _fork(self, zygote: Any, wid: int, env: dict[str, str], log_name: str,
              spare: bool) -> Proc:
        from ..runtime import bootstrap
        from ..zygote_client import ForkedProcess

        env[protocol.ENV_LAUNCHER_PID] = str(zygote.pid)  # its parent: it dies with the zygote
        r, w = os.pipe2(os.O_CLOEXEC)
        try:
            pid = zygote.spawn([bootstrap.__file__, self.script, *self.script_args], env, w,
                               name=f"nonstop-w{wid}")
        except OSError:
            os.close(r)
            raise
        finally:
            os.close(w)
        return self._watch(wid, ForkedProcess(zygote, pid, os.fdopen(r, "rb", buffering=0)),
                           log_name, spare)

    def spawn_keeper(self, wid: int, node: int, name: str, writer: bool) -> Proc:
        """The node's memory (``nonstop.keeper``): ends with this process."""
        cmd = [sys.executable, "-u", "-m", "nonstop.keeper", name, "--node", str(node),
               "--host", self.keeper_host,
               "--parent", str(os.getpid())] + (["--writer"] if writer else [])
        env = {**self.env, **self.keeper_env}
        env["NONSTOP_KEEPER_TOKEN"] = self.keeper_token  # in the environment: only we can read it
        return self._start(wid, cmd, env, f"keeper-n{node}.log", spare=False)

    @staticmethod
    def keeper_link(node: int, name: str, deadline: float) -> Any:
        """A connection to the keeper of a node of this host (once it listens)."""
        from ..state.wire import KeeperLink

        return KeeperLink.open(name, deadline)

    def spawn_command(self, wid: int, cmd: list[str], env: dict[str, str], log_name: str) -> Proc:
        """Another process of the job on this host (the standby controller): watched like the
        others, its output forwarded, ended with them."""
        return self._start(wid, cmd, env, log_name, spare=False)

    def wake(self) -> None:
        """End the current ``poll`` early (from another thread)."""
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # full: a wake-up is already pending
            pass

    def deadlines(self) -> list[MissedDeadline]:
        """The deadlines that fired here since the last call."""
        out, self.missed = self.missed, []
        return out

    def preempted(self) -> list[tuple[int, float]]:
        """Hosts told to stop: none here (a SIGTERM ends the whole job, with its emergency save)."""
        return []

    def release(self, node: int, why: str) -> None:
        """Nothing to release: the nodes of one host are simulated."""

    def host_up(self, node: int) -> bool:
        """Whether the node is a host whose agent still answers: never here (the nodes of one
        host are simulated; none has an agent of its own to vouch for it)."""
        return False

    @staticmethod
    def failure_domain(node: int) -> str:
        """The node's failure domain: on one host each node plays a machine of its own (its
        memory killed is the node lost), so each is its own."""
        return f"node {node}"

    def host_away(self, node: int) -> bool:
        """Whether the node's host is out of reach (cut off, lost): never here - the nodes of
        one host are this process's own, so a rank that cannot be reached is the rank's fault."""
        return False

    #: whether new hosts can join the job (then a job short of places waits for one): not here
    takes_hosts = False

    def lost_nodes(self) -> set[int]:
        """Nodes gone whole (a host whose agent is gone): none on one host."""
        return set()

    def deaf(self) -> bool:
        """Whether the controller cannot prove it hears the job: on one host it always does (its
        ranks' reports never cross a network)."""
        return False

    def silent_hosts(self) -> None:
        """Hosts whose agent fell silent, and since when: none here (no host but this one)."""
        return None

    def _start(self, wid: int, cmd: list[str], env: dict[str, str], log_name: str,
               spare: bool) -> Proc:
        popen = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
        return self._watch(wid, popen, log_name, spare)

    def _watch(self, wid: int, popen: Any, log_name: str, spare: bool) -> Proc:
        proc = Proc(wid=wid, popen=popen, started=time.time(), spare=spare,
                    log_path=self.logs / log_name)
        self._logs[wid] = open(proc.log_path, "ab", buffering=0)
        os.set_blocking(popen.stdout.fileno(), False)
        self._sel.register(popen.stdout, selectors.EVENT_READ, ("out", wid))
        try:
            proc.pidfd = os.pidfd_open(popen.pid)
            self._sel.register(proc.pidfd, selectors.EVENT_READ, ("exit", wid))
        except (AttributeError, OSError):
            proc.pidfd = None  # older kernels: exits are found by polling
        self.procs[wid] = proc
        return proc

    def poll(self, timeout: float) -> list[Proc]:
        """Wait up to ``timeout`` for output or exits; return the processes that exited."""
        exited: list[Proc] = []
        events = self._sel.select(timeout)
        for key, _ in events:
            what, wid = key.data
            if what == "out":
                self._read_output(wid)
            elif what == "zygote":
                if self.zygote is not None:
                    self.zygote.drain()
                    if self.zygote.broken is not None:
                        self._sel.unregister(self.zygote.fileno())
                        self.zygote_error = self.zygote.broken
            elif what == "wake":
                try:
                    os.read(self._wake_r, 4096)
                except OSError:
                    pass
        for proc in self.procs.values():
            if proc.alive and proc.popen.poll() is not None:
                self._reap(proc)
                exited.append(proc)
        return exited

    def _read_output(self, wid: int, final: bool = False) -> None:
        proc = self.procs[wid]
        stream = proc.popen.stdout
        if stream is None or stream.closed:
            return
        while True:
            try:
                chunk = os.read(stream.fileno(), 65536)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                self._close_stream(proc)
                break
            self._logs[wid].write(chunk)
            data = proc._partial + chunk
            *lines, proc._partial = data.split(b"\n")
            for line in lines:
                self._show(proc, line.decode(errors="replace"))
        if final and proc._partial:
            self._show(proc, proc._partial.decode(errors="replace"))
            proc._partial = b""

    def _show(self, proc: Proc, line: str) -> None:
        if proc.console is None:
            proc.console = ConsoleFilter(proc.log_path.name)
        shown = proc.console.show(line)
        if shown is not None:
            self.output(proc.wid, shown)

    def _close_stream(self, proc: Proc) -> None:
        stream = proc.popen.stdout
        if stream is not None and not stream.closed:
            try:
                self._sel.unregister(stream)
            except (KeyError, ValueError):
                pass
            stream.close()

    def _reap(self, proc: Proc) -> None:
        proc.returncode = proc.popen.returncode
        proc.t_exit = time.time()
        if proc.last_step_path is not None:
            proc.last = last_step.read(proc.last_step_path)
        if proc.pidfd is not None:
            try:
                self._sel.unregister(proc.pidfd)
            except (KeyError, ValueError):
                pass
            os.close(proc.pidfd)
            proc.pidfd = None
        self._read_output(proc.wid, final=True)
        self._close_stream(proc)
        log = self._logs.pop(proc.wid, None)
        if log is not None:
            log.close()

    def signal(self, wid: int, sig: int = signal.SIGKILL) -> None:
        """Signal a process and its children (its session), unless it already exited."""
        proc = self.procs.get(wid)
        if proc is None or not proc.alive:
            return
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):  # not (yet) leading a group: itself
            proc.popen.send_signal(sig)

    def stopped(self, wid: int) -> bool:
        """Whether the process is stopped (SIGSTOP, a debugger): it will not move by itself.
        Read from the kernel, since a silent heartbeat alone cannot tell a stopped process from
        one whose main thread waits in C++ holding the GIL (as forming a gloo group does)."""
        proc = self.procs.get(wid)
        if proc is None or not proc.alive:
            return False
        try:
            stat = Path(f"/proc/{proc.pid}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")

    def alive(self) -> list[Proc]:
        return [p for p in self.procs.values() if p.alive]

    def recent_wids(self) -> list[int]:
        """The processes alive, and those that ended less than ``LATE_S`` ago (what they wrote
        just before may still be read)."""
        now = time.time()
        return [p.wid for p in self.procs.values()
                if p.t_exit is None or now - p.t_exit < LATE_S]

    def end_all(self, grace_s: float, deadline_s: float = 10.0) -> None:
        """SIGTERM every live process, SIGKILL what is left after ``grace_s``, reap them all."""
        live = self.alive()
        if not live:
            return
        for p in live:
            self.signal(p.wid, signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
        t_end = time.time() + grace_s
        while self.alive() and time.time() < t_end:
            self.poll(0.05)
        for p in self.alive():
            self.signal(p.wid, signal.SIGKILL)
        t_end = time.time() + deadline_s
        while self.alive() and time.time() < t_end:
            self.poll(0.05)

    def close(self) -> None:
        self.end_all(0.0)
        if self.zygote is not None:
            self.zygote.close()
        self._sel.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

